"""The long-context suite (``oscar-kv eval --suite ruler``): RULER's synthetic tasks and long-code completion,
asked of every scheme at one context length, scored per task.

Each prompt's haystack is prefilled once by the exact model and stored in every scheme's cache (tasks.stored_cache,
as in a prefix-cache hit); the question and the answer then read it through the scheme's cache, greedily, as the
harness's NIAH task does.  With ``--served`` the same prompts also go through the serving engine (served.py): rows
``bf16@engine`` and ``oscar@engine``.

Scores per method and task (results.json, ``methods[NAME][TASK][CTX]``): RULER's recall (ruler.recall) averaged over
the samples, and ``ruler_mean`` over the RULER tasks run; for ``longcode``: ``longcode_em`` / ``longcode_es``
(exact match / edit similarity against BF16's output on the same prompt: the reference path's ``bf16`` for
reference rows, ``bf16@engine`` for engine rows) and ``longcode_es_source`` (against the source's real lines).
"""

from __future__ import annotations

from tqdm.auto import tqdm

from ..errors import ConfigError
from . import tasks as harness_tasks
from .longcode import CODE_LINES, CODE_PACKAGE, edit_similarity, exact_match, lines_written, longcode_sample
from .ruler import RULER_TASKS, SuiteSample, recall, ruler_sample
from .schemes import Scheme
from .served import SERVED_SCHEMES, served_outputs

SUITE_TASKS = RULER_TASKS + ("longcode",)
SUITES = {"ruler": SUITE_TASKS}  # --suite NAME: the tasks it runs
SUITE_METHODS = ("bf16", "oscar")  # --suite's default methods: is INT2 safe for this model?


def suite_tasks(name: str) -> list[str]:
    """The tasks of suite ``name``; ConfigError names the suites there are."""
    if name not in SUITES:
        raise ConfigError(f"unknown suite {name!r}; choose from {', '.join(SUITES)}", "suite")
    return list(SUITES[name])


def suite_samples(tokenizer, task_names: list[str], ctx: int, samples: int, seed: int, text: str,
                  code_package: str = CODE_PACKAGE, code_lines: int = CODE_LINES,
                  max_tokens: int | None = None) -> list[SuiteSample]:
    """``samples`` prompts of each suite task in ``task_names`` at ``ctx`` tokens (prompt plus generation budget),
    the same for the same arguments.  ``max_tokens`` caps each task's decode budget (a quick run); the prompts are
    sized by the full budget either way, so they do not change with the cap."""
    out = []
    for task in task_names:
        for i in range(samples):
            if task == "longcode":
                sample = longcode_sample(tokenizer, ctx, i, seed, code_package, code_lines)
            else:
                sample = ruler_sample(tokenizer, task, ctx, i, seed, text)
            if max_tokens is not None:
                sample.max_new_tokens = min(sample.max_new_tokens, max_tokens)
            out.append(sample)
    return out


def _stop(sample: SuiteSample, code_lines: int):
    """When the reference path may stop decoding: the code's lines are written, or every expected string is in the
    output (more text cannot lower a recall score)."""
    if sample.task == "longcode":
        return lambda text: lines_written(text, code_lines)
    return lambda text: recall(text, sample.answers) == 1.0


def answer_all(model, tokenizer, schemes: list[Scheme], samples: list[SuiteSample], code_lines: int = CODE_LINES,
               progress: bool = False, desc: str = "suite") -> dict[str, list[str]]:
    """Every scheme's greedy output for every sample through the reference path: {scheme name: [text]}."""
    outputs = {s.name: [] for s in schemes}
    bar = tqdm(samples, desc=desc, disable=not progress, leave=False)
    for sample in bar:
        bar.set_postfix_str(sample.task)
        kv = harness_tasks.haystack_kv(model, sample.prompt.haystack)
        for scheme in schemes:
            outputs[scheme.name].append(harness_tasks.greedy_answer(
                model, tokenizer, scheme, kv, sample.prompt.question, sample.max_new_tokens,
                _stop(sample, code_lines)))
        del kv
    return outputs


def answer_served(model, tokenizer, rotations, names: list[str], samples: list[SuiteSample], page_size: int,
                  sink_size: int, recent_size: int) -> dict[str, list[str]]:
    """The same samples through the serving engine for each of ``names`` the engine serves: {"NAME@engine": [text]}."""
    prompts, budgets = [s.prompt for s in samples], [s.max_new_tokens for s in samples]
    return {f"{name}@engine": served_outputs(model, tokenizer, rotations, name, prompts, budgets, page_size,
                                             sink_size, recent_size)
            for name in names if name in SERVED_SCHEMES}


def score_outputs(samples: list[SuiteSample], outputs: dict[str, list[str]],
                  code_lines: int = CODE_LINES) -> tuple[dict[str, dict[str, float]], list[dict]]:
    """Per method, each task's mean score (and ``ruler_mean``), and one record per method and sample.

    Args:
        samples: the prompts, in the order of each method's outputs.
        outputs: {method: [output text]}; "bf16" must be among them when longcode is (the reference of its scores).
    Returns:
        ({method: {metric: value}}, [{"task", "index", "method", "output", "expected", "score"}]).
    """
    scores, records = {}, []
    for method, texts in outputs.items():
        reference = outputs.get("bf16@engine" if method.endswith("@engine") else "bf16")
        per_task: dict[str, list[float]] = {}
        counts: dict[str, int] = {}
        for i, (sample, text) in enumerate(zip(samples, texts)):
            index = counts[sample.task] = counts.get(sample.task, -1) + 1
            record = {"task": sample.task, "index": index, "method": method, "output": text,
                      "expected": sample.answers}
            if sample.task == "longcode":
                if reference is None:
                    raise ConfigError("longcode is scored against bf16's output: bf16 must be among the methods")
                em = exact_match(text, reference[i], code_lines)
                es = edit_similarity(text, reference[i], code_lines)
                source = edit_similarity(text, sample.answers[0], code_lines)
                per_task.setdefault("longcode_em", []).append(em)
                per_task.setdefault("longcode_es", []).append(es)
                per_task.setdefault("longcode_es_source", []).append(source)
                record.update(score=es, exact_match=em, edit_similarity_source=source, **sample.meta)
            else:
                score = recall(text, sample.answers)
                per_task.setdefault(sample.task, []).append(score)
                record.update(score=score, depths=sample.depths)
            records.append(record)
        row = {task: sum(v) / len(v) for task, v in per_task.items()}
        ruler = [row[t] for t in RULER_TASKS if t in row]
        if ruler:
            row["ruler_mean"] = sum(ruler) / len(ruler)
        scores[method] = row
    return scores, records
