"""``oscar-kv eval``: run the schemes over the tasks and context lengths, write results.json/.md and plots."""

from __future__ import annotations

import json
import logging
import platform
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..activations import capture_samples, observing, run_layers
from ..artifacts import Rotations
from ..cache import CacheSettings, unprepare_model
from ..calibrate import Statistics
from ..calibration_text import split_probe
from ..calibration_settings import CalibrationSettings
from ..corpus import DEFAULT_CORPUS, STDLIB_SOURCE, CorpusError, load_calibration_text, read_text_file
from ..errors import ConfigError
from ..models import AttentionGeometry
from ..rope import DEFAULT_PAIRS, RopeUnsupported, layer_rope_tables
from . import tasks
from .generation import score_long_generation
from .report import write_report
from .schemes import STANDARD, Scheme, ablation_schemes, standard_scheme
from .served import SERVED_SCHEMES, served_answers
from .suite import SUITE_METHODS, SUITE_TASKS, answer_all, answer_served, score_outputs, suite_samples, suite_tasks

log = logging.getLogger(__name__)

TASKS = ("kl", "ppl", "niah", "niah_multikey", "attn", "longgen") + SUITE_TASKS  # suite.py: RULER + longcode
ENGINE_TASKS = ("niah", "niah_multikey") + SUITE_TASKS  # the tasks the serving engine can answer (engine_only)
# longgen decodes G tokens per scheme and length through the real cache: run when named, not by default
DEFAULT_TASKS = ("kl", "ppl", "niah", "niah_multikey", "attn")
# Calibration reads the shipped corpus from its start; evaluation text starts far past that.
EVAL_TEXT_OFFSET = 150_000


@dataclass
class EvalConfig:
    """What ``oscar-kv eval`` runs; bad tasks or context lengths raise ConfigError.  "bf16" is always among the
    methods (the reference)."""

    methods: list[str] = field(default_factory=lambda: list(STANDARD))
    tasks: list[str] = field(default_factory=lambda: list(DEFAULT_TASKS))
    context_lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    text: str | None = None
    niah_samples: int = 20
    kl_docs: int = 1
    gen_tokens: int = 1024  # longgen: greedy tokens generated after each prompt (the first from the prefill)
    ablations: bool = True
    served: bool = False  # also ask the needle prompts through the serving engine (rows bf16@engine, oscar@engine)
    # only the serving engine answers (the needle and suite tasks; rows NAME@engine): the reference path decodes one
    # token per forward through the model's own layers, the engine in CUDA graphs (a suite at 8K-32K in minutes)
    engine_only: bool = False
    suite_samples: int = 5  # prompts per suite task (RULER, longcode) and context length
    code_package: str = "asyncio"  # longcode: the standard-library package the prompts are cut from
    code_lines: int = 4  # longcode: non-blank lines the model completes
    suite_max_tokens: int | None = None  # caps every suite task's decode budget (RULER's: 30-128 tokens)
    sink_size: int = 64
    recent_size: int = 256
    page_size: int = 16
    seed: int = 0
    compare: dict[str, Rotations] = field(default_factory=dict)  # more artifacts, scored as methods of these names

    def __post_init__(self):
        bad = [t for t in self.tasks if t not in TASKS]
        if bad:
            raise ConfigError(f"unknown tasks {bad}; choose from {', '.join(TASKS)}")
        if "bf16" not in self.methods:
            self.methods = ["bf16"] + list(self.methods)
        if any(c < 64 for c in self.context_lengths):
            raise ConfigError("context lengths must be at least 64 tokens")
        if min(self.suite_samples, self.code_lines, self.suite_max_tokens or 1) < 1:
            raise ConfigError("suite_samples, code_lines and suite_max_tokens must be at least 1")
        if self.engine_only:
            self.served = True
            scored_elsewhere = [t for t in self.tasks if t not in ENGINE_TASKS]
            if scored_elsewhere:
                raise ConfigError(f"the serving engine answers {', '.join(ENGINE_TASKS[:2])} and the suite's tasks; "
                                  f"{', '.join(scored_elsewhere)} need the reference path (drop engine_only)", "tasks")
            unserved = [m for m in self.methods if m not in SERVED_SCHEMES] + list(self.compare)
            if unserved:
                raise ConfigError(f"the serving engine serves {', '.join(SERVED_SCHEMES)}, not "
                                  f"{', '.join(unserved)} (drop engine_only or those methods)", "methods")
        if "longgen" in self.tasks and self.gen_tokens < 2:
            raise ConfigError("gen_tokens must be at least 2 (the first token comes from the prompt's prefill)",
                              "gen_tokens")

    @classmethod
    def quick(cls, **overrides) -> "EvalConfig":
        """The CI configuration (``--quick``): four schemes at 1024 tokens, 2 NIAH samples, no ablations."""
        base = dict(methods=["bf16", "naive-int2", "quarot-int2", "oscar"], context_lengths=[1024], niah_samples=2,
                    ablations=False)
        base.update(overrides)
        return cls(**base)

    @classmethod
    def suite(cls, name: str, **overrides) -> "EvalConfig":
        """A long-context suite (``--suite``, suite.SUITES): its tasks, bf16 and oscar, no ablations."""
        base = dict(tasks=suite_tasks(name), methods=list(SUITE_METHODS), ablations=False)
        base.update(overrides)
        return cls(**base)


def evaluation_text(path: str | None) -> str:
    """The text of ``path`` (.txt / .jsonl), or the shipped corpus from EVAL_TEXT_OFFSET on."""
    if path:
        return "\n\n".join(read_text_file(path))
    return DEFAULT_CORPUS.read_text()[EVAL_TEXT_OFFSET:]


class AuthorsValueProxy:
    """The authors' value covariance: per KV head, sum_t w_t (v_t - mu)(v_t - mu)^T / sum_t w_t with
    w_t = k_t^T C_Q k_t (raw logits squared, no softmax, no causality), given the first pass's C_Q."""

    def __init__(self, c_q: torch.Tensor, mu_v: torch.Tensor):
        self.c_q, self.mu_v = c_q, mu_v
        self.wvv = torch.zeros_like(c_q)
        self.w = torch.zeros(c_q.shape[:2], dtype=torch.float64)

    def add(self, layer, q, k, v, out):
        dev = k.device  # the model's (--device cuda); the sums stay on the CPU with the statistics
        k64 = k[0].to(torch.float64)  # [Hkv, T, D]
        v64 = v[0].to(torch.float64) - self.mu_v[layer].to(dev)[:, None]
        w = torch.einsum("htd,hde,hte->ht", k64, self.c_q[layer].to(dev), k64)
        self.wvv[layer] += torch.einsum("ht,htd,hte->hde", w, v64, v64).cpu()
        self.w[layer] += w.sum(-1).cpu()

    def covariance(self) -> torch.Tensor:
        """The proxy covariance, float64 [L, Hkv, D, D]."""
        return self.wvv / self.w[..., None, None].clamp_min(1e-30)


def _calibration_statistics(model, tokenizer, oscar: Rotations):
    """Re-stream the artifact's calibration data to fit ablations from the same statistics."""
    cal = dict(oscar.manifest.get("calibration", {}))
    if not cal.get("rope_pairs"):  # 0: the artifact keeps no per-position mean; a rope ablation fits the default
        cal["rope_pairs"] = DEFAULT_PAIRS
    known = CalibrationSettings.__dataclass_fields__
    settings = CalibrationSettings(**{k: v for k, v in cal.items() if k in known})
    # ablations change one choice of the artifact as shipped, so "auto" becomes what it chose
    settings = replace(settings, key_centering=oscar.key_centering, key_rescale=oscar.k_rescale,
                       value_rescale=oscar.v_rescale)
    data = cal.get("data", "")
    texts, _ = load_calibration_text(None if str(data).startswith("builtin:") or not data else str(data).split(","))
    seq_len = int(cal.get("seq_len", settings.seq_len))
    count = int(cal.get("sequences", 8))
    geometry = AttentionGeometry.of(model.config)
    try:
        rope = layer_rope_tables(model, geometry.head_dim)
    except RopeUnsupported:
        rope = None
    # pairs scored as the artifact's were (None: the artifact records no horizon)
    stats = Statistics(geometry, rope, settings.rope_horizon)
    unprepare_model(model)
    max_len = getattr(model.config, "max_position_embeddings", None) or settings.probe_tokens
    sequences, probe_ids = split_probe(tokenizer, texts, seq_len, count, min(settings.probe_tokens, max_len))
    with torch.no_grad(), observing(model, stats.add):
        for ids in tqdm(sequences, desc="calibration statistics", leave=False):
            run_layers(model, ids)
    c_q, _, _, mu_v, _ = stats.moments(settings.key_centering, settings.center_values)
    proxy = AuthorsValueProxy(c_q, mu_v)
    with torch.no_grad(), observing(model, proxy.add):
        for ids in tqdm(sequences, desc="authors' value proxy", leave=False):
            run_layers(model, ids)
    probe = capture_samples(model, probe_ids)
    return stats, settings, proxy.covariance(), probe


def build_schemes(model, tokenizer, oscar: Rotations, config: EvalConfig) -> list[Scheme]:
    """The configured standard schemes, then (with ``config.ablations``) the ablations, fitted from the artifact's
    calibration data streamed again."""
    geometry = AttentionGeometry.of(model.config)
    base = CacheSettings("int2", config.sink_size, config.recent_size, config.page_size)
    schemes = [standard_scheme(name, geometry, oscar, base) for name in config.methods]
    for name, rot in config.compare.items():
        if name in STANDARD or name in config.methods:
            raise ConfigError(f"compared artifact name {name!r} is taken by a method")
        rot.validate(geometry)
        schemes.append(Scheme(name, rot, base, f"artifact {rot.source or name} ({rot.width_summary()})"))
    if config.ablations and {"kl", "ppl", "attn"} & set(config.tasks):  # ablations are scored on these only
        stats, settings, proxy_c_s, probe = _calibration_statistics(model, tokenizer, oscar)
        schemes += ablation_schemes(stats, settings, oscar, base, proxy_c_s, probe)
    return schemes


def run_eval(model, tokenizer, oscar: Rotations, config: EvalConfig, output: str | Path, progress: bool = True) -> dict:
    """Score every scheme on the configured tasks at every context length.

    Args:
        model, tokenizer: the model under test.
        oscar: the artifact to evaluate.
        config: what to run.
        output: the directory for results.json (rewritten after each context length), results.md and plots.
        progress: show a progress bar.
    Returns:
        The results as written to results.json.
    """
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    geometry = AttentionGeometry.of(model.config)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and max(config.context_lengths) > limit:
        raise ConfigError(f"context length {max(config.context_lengths)} exceeds the model's context of {limit}")
    if limit and "longgen" in config.tasks and max(config.context_lengths) + config.gen_tokens > limit:
        raise ConfigError(f"context length {max(config.context_lengths)} plus gen_tokens {config.gen_tokens} "
                          f"exceeds the model's context of {limit}", "gen_tokens")
    started = time.perf_counter()
    text = evaluation_text(config.text)
    suite = [t for t in config.tasks if t in SUITE_TASKS]
    # the suite's prompts first: a length they cannot fit fails before any scheme is built
    prompts = {ctx: suite_samples(tokenizer, suite, ctx, config.suite_samples, config.seed, text, config.code_package,
                                  config.code_lines, config.suite_max_tokens)
               for ctx in config.context_lengths} if suite else {}
    if suite:
        (output / "suite_outputs.jsonl").write_text("")
    schemes = build_schemes(model, tokenizer, oscar, config)
    all_ids = tokenizer(text, return_tensors="pt").input_ids
    results = {"model": getattr(model, "oscar_model_name", ""), "context_lengths": config.context_lengths,
               "methods": {s.name: {"description": s.description, "bits_per_element": {}} for s in schemes}}
    timings = {}
    steps = len(config.context_lengths) * len(schemes)
    bar = tqdm(total=steps, desc="evaluating", disable=not progress)
    for ctx in config.context_lengths:
        key = str(ctx)
        # text windows for the tasks that read one (the suite brings its own prompts, of any length)
        docs = _documents(all_ids, ctx, config.kl_docs) if {"kl", "ppl", "attn", "longgen"} & set(config.tasks) else []
        t0 = time.perf_counter()
        refs = [tasks.reference_hidden(model, d) for d in docs] if {"kl", "ppl"} & set(config.tasks) else []
        samples = capture_samples(model, docs[0]) if "attn" in config.tasks else None
        timings[f"reference@{ctx}"] = round(time.perf_counter() - t0, 1)
        for scheme in schemes:
            t0 = time.perf_counter()
            row = results["methods"][scheme.name]
            row["bits_per_element"][key] = round(scheme.bits_per_element(ctx, geometry), 4)
            if refs:
                scores = [tasks.kl_and_ppl(model, scheme, d, r) for d, r in zip(docs, refs)]
                mean = {m: sum(s[m] for s in scores) / len(scores) for m in ("kl", "top1_agreement", "ppl")}
                if "kl" in config.tasks:
                    row.setdefault("kl", {})[key] = mean["kl"]
                    row.setdefault("top1_agreement", {})[key] = mean["top1_agreement"]
                    row.setdefault("kl_by_position", {})[key] = {
                        end: sum(s["kl_by_position"][end] for s in scores) / len(scores)
                        for end in scores[0]["kl_by_position"]}
                if "ppl" in config.tasks:
                    row.setdefault("ppl", {})[key] = mean["ppl"]
            if samples is not None:
                cache = tasks.prepare(model, scheme)
                errs = tasks.layer_attention_errors(scheme, cache, samples)
                row.setdefault("attn_error", {})[key] = errs
                row.setdefault("attn_error_mean", {})[key] = sum(errs) / len(errs)
            timings[f"{scheme.name}@{ctx}"] = round(time.perf_counter() - t0, 1)
            bar.update()
            bar.set_postfix_str(f"{scheme.name}@{ctx}")
        del refs, samples
        # ablations are scored on KL/ppl/attn only; each haystack is prefilled once and asked through every scheme
        scored = [s for s in schemes if s.name in config.methods or s.name in config.compare]
        for task in ("niah", "niah_multikey"):
            if task not in config.tasks:
                continue
            t0 = time.perf_counter()
            reference = [] if config.engine_only else scored  # the schemes the reference path answers for
            hits = {s.name: [] for s in reference}
            needle = {s.name: [] for s in reference}  # teacher-forced answer scores (tasks.needle_scores)
            prompts = list(_needle_prompts(tokenizer, text, ctx, config, multikey=task == "niah_multikey"))
            for prompt in prompts if reference else []:
                kv = tasks.haystack_kv(model, prompt.haystack)
                answer = tokenizer(" " + prompt.answer, add_special_tokens=False).input_ids  # after "... is"
                log_probs = {}
                for scheme in reference:
                    hits[scheme.name].append(prompt.answer in tasks.niah_answer(model, tokenizer, scheme, kv,
                                                                                 prompt.question))
                    log_probs[scheme.name] = tasks.answer_log_probs(model, scheme, kv, prompt.question, answer)
                for name, lp in log_probs.items():
                    needle[name].append(tasks.needle_scores(lp, answer, log_probs.get("bf16")))
                del kv, log_probs
            if config.served:
                for name in (s.name for s in scored if s.name in SERVED_SCHEMES):
                    answers = served_answers(model, tokenizer, oscar, name, prompts, config.page_size,
                                             config.sink_size, config.recent_size)
                    row = _engine_row(results, name, key)
                    row.setdefault(f"{task}_answers", {})[key] = answers
                    hits[f"{name}@engine"] = [p.answer in a for p, a in zip(prompts, answers)]
            for name, h in hits.items():
                results["methods"][name].setdefault(task, {})[key] = sum(h) / len(h)
            for name, scores in needle.items():
                for metric in scores[0] if scores else ():
                    results["methods"][name].setdefault(f"{task}_{metric}", {})[key] = \
                        sum(s[metric] for s in scores) / len(scores)
            timings[f"{task}@{ctx}"] = round(time.perf_counter() - t0, 1)
        # longgen: the KL task's first text window is the prompt, BF16's greedy continuation the reference
        if "longgen" in config.tasks:
            t0 = time.perf_counter()
            reference = next(s for s in scored if s.name == "bf16")
            scores = score_long_generation(model, scored, reference, docs[0], config.gen_tokens, progress)
            for name, measured in scores.items():
                for metric, value in measured.items():
                    results["methods"][name].setdefault(metric, {})[key] = value
            timings[f"longgen@{ctx}"] = round(time.perf_counter() - t0, 1)
        if suite:
            t0 = time.perf_counter()
            outputs = {} if config.engine_only else answer_all(model, tokenizer, scored, prompts[ctx], config.code_lines,
                                                               progress, f"suite@{ctx}")
            if config.served:
                outputs.update(answer_served(model, tokenizer, oscar, [s.name for s in scored], prompts[ctx],
                                             config.page_size, config.sink_size, config.recent_size))
            scores, records = score_outputs(prompts[ctx], outputs, config.code_lines)
            for name, measured in scores.items():
                row = _engine_row(results, name.removesuffix("@engine"), key) if name.endswith("@engine") \
                    else results["methods"][name]
                for metric, value in measured.items():
                    row.setdefault(metric, {})[key] = value
            with open(output / "suite_outputs.jsonl", "a") as f:
                f.writelines(json.dumps(dict(r, context=ctx)) + "\n" for r in records)
            timings[f"suite@{ctx}"] = round(time.perf_counter() - t0, 1)
        # a long run keeps what it measured so far (the report and plots are written at the end)
        (output / "results.json").write_text(json.dumps(dict(results, timings=timings, partial=True), indent=1) + "\n")
    bar.close()
    unprepare_model(model)
    if config.engine_only:  # the reference rows hold only their bits per element: the engine's rows are the results
        results["methods"] = {name: row for name, row in results["methods"].items() if name.endswith("@engine")}
    results["config"] = {k: v for k, v in config.__dict__.items() if k != "compare"}
    results["config"]["compare"] = {name: rot.source for name, rot in config.compare.items()}
    if "longcode" in config.tasks:  # its prompts are this interpreter's standard library
        results["config"]["python"] = platform.python_version()
    results["seconds"] = round(time.perf_counter() - started, 1)
    results["timings"] = timings
    (output / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    write_report(results, output)
    return results


def _engine_row(results: dict, name: str, key: str) -> dict:
    """The results row ``NAME@engine`` (the scheme through the serving engine), made on first use."""
    row = results["methods"].setdefault(f"{name}@engine", {
        "description": f"`{name}` through the serving engine (paged pool, kernels)", "bits_per_element": {}})
    row["bits_per_element"][key] = results["methods"][name]["bits_per_element"][key]
    return row


def _documents(all_ids: torch.Tensor, length: int, count: int) -> list[torch.Tensor]:
    total = all_ids.shape[1]
    if total < length:
        raise CorpusError(f"the evaluation text has {total} tokens, fewer than the context length {length}; "
                          f"--text {STDLIB_SOURCE} evaluates on the standard library's source (~1M tokens)")
    stride = max((total - length) // max(count, 1), 1)
    return [all_ids[:, i * stride:i * stride + length] for i in range(count) if i * stride + length <= total]


def _needle_prompts(tokenizer, text: str, ctx: int, config: EvalConfig, multikey: bool = False):
    """NIAH prompts of about ``ctx`` tokens, each on a different stretch of filler: single needles cycle
    through tasks.DEPTHS; multi-key prompts hide 4 keyed numbers and ask for one."""
    chars = len(text)
    for i in range(config.niah_samples):
        start = (i * 7919 * 13) % max(chars - ctx * 8, 1)
        filler = text[start:start + ctx * 8]
        if multikey:
            yield tasks.multikey_prompt(tokenizer, filler, ctx, config.seed + ctx + i)
        else:
            number = tasks.needle_numbers(config.niah_samples, config.seed + ctx)[i]
            yield tasks.niah_prompt(tokenizer, filler, ctx, tasks.DEPTHS[i % len(tasks.DEPTHS)], number)
