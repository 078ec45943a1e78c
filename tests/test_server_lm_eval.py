"""lm-eval-harness, the real package, as a client of a live `oscar-kv serve` process on the CPU.

lm-eval's `local-completions` model finds the server's tokenizer (`GET /tokenizer_info`, `POST /tokenize`), scores
multiple-choice tasks by echoed prompt logprobs (token-id prompts, `echo: true, logprobs: 1, max_tokens: 1`) and runs
generate_until tasks through plain completions.  The tasks are local YAMLs over local JSONL (tests/data/lm_eval: no
hub access): capitals as multiple choice, the same behind a ~400-token preamble (past the BF16 windows, so the INT2
history is read), and capitals generated.  With a BF16 cache every loglikelihood must equal transformers' forward on
the same tokens within BF16 rounding; the INT2 cache's are printed beside them.  A server that scored the wrong
positions would score near chance without an error: this test is what catches it.
"""

import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval's API models need lm_eval[api]

MODEL = "smollm2-135m"
DATA = Path(__file__).parent / "data" / "lm_eval"
MC_TASKS = ("oscar_capitals_mc", "oscar_capitals_mc_long")
GEN_TASK = "oscar_capitals_gen"
# BF16 K/V against the float32 forward, per scored continuation (tests/test_logprobs.py: up to 0.045 per token)
TOL = 0.15

pytestmark = pytest.mark.slow


class ServerProcess:
    """`oscar-kv serve ARGS` in its own process; ``url`` once it listens."""

    def __init__(self, args: list[str]):
        env = {**os.environ, "OSCAR_KV_API_KEY": "", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "oscar_kv.cli", "serve", *args], env=env, text=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
        deadline = time.monotonic() + 300
        while not (found := [m for line in list(self.log) if (m := re.search(r"on (http://\S+)/v1", line))]):
            assert self.proc.poll() is None and time.monotonic() < deadline, "".join(self.log)
            time.sleep(0.1)
        self.url = found[0].group(1)
        while True:  # the log line comes just before uvicorn accepts connections
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None and time.monotonic() < deadline, "".join(self.log)
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


def run_lm_eval(url: str) -> tuple[dict, dict]:
    """lm-eval's simple_evaluate over the three tasks against ``url``: its results (with samples), and for each
    multiple-choice task [(loglikelihood, is_greedy, context ids, continuation ids, doc id, choice)] with the very
    tokens lm-eval sent (its _encode_pair, through the server's /tokenize: read while the server runs)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import check_remote_tokenizer_support

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(DATA)  # the YAMLs' data_files are relative
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        # what tokenizer_backend=auto (the default) checks before it takes the server's tokenizer
        assert check_remote_tokenizer_support(url + "/v1/completions", timeout=60)
        lm = LocalCompletionsAPI(model=MODEL, base_url=url + "/v1/completions", tokenizer_backend="remote",
                                 batch_size=8, max_length=1024, max_retries=1, timeout=300)
        tasks = TaskManager(include_path=str(DATA), include_defaults=False)
        results = simple_evaluate(model=lm, tasks=[*MC_TASKS, GEN_TASK], task_manager=tasks, log_samples=True,
                                  bootstrap_iters=0)
    rows = {}
    for task in MC_TASKS:
        rows[task] = []
        for sample in results["samples"][task]:
            for i, ((context, continuation), resp) in enumerate(zip(sample["arguments"], sample["resps"])):
                ll, greedy = resp[0]
                rows[task].append((float(ll), bool(greedy), *lm._encode_pair(context, continuation),
                                   sample["doc_id"], i))
    return results, rows


def scored(rows: dict, reference) -> dict:
    """task -> [(server loglikelihood, server greedy, reference loglikelihood, reference greedy, doc, choice)]."""
    return {task: [(ll, greedy, *reference(ctx, cont), doc, choice) for ll, greedy, ctx, cont, doc, choice in task_rows]
            for task, task_rows in rows.items()}


def accuracy(rows, results, task) -> float:
    """acc from loglikelihoods (rows: (ll, ...)); the docs' targets from lm-eval's samples."""
    targets = {s["doc_id"]: int(s["target"]) for s in results["samples"][task]}
    best = {}
    for ll, *_, doc, choice in rows:
        if doc not in best or ll > best[doc][0]:
            best[doc] = (ll, choice)
    return sum(best[d][1] == t for d, t in targets.items()) / len(targets)


@pytest.fixture(scope="module")
def reference():
    """(context ids, continuation ids) -> (loglikelihood, greedy) by transformers' forward: the context once (its KV
    cache kept for the choices that share it), then the continuation after it."""
    import copy
    import functools
    import inspect

    from oscar_kv.models import load_model

    lm, _ = load_model(MODEL)
    cache_arg = "cache" if "cache" in inspect.signature(type(lm).forward).parameters else "past_key_values"

    @functools.cache
    def context(ids: tuple) -> tuple:
        with torch.no_grad():
            out = lm(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        return torch.log_softmax(out.logits[0, -1].float(), -1), getattr(out, cache_arg)

    @functools.cache
    def score(ctx: tuple, cont: tuple) -> tuple[float, bool]:
        first, cache = context(ctx)
        rows = [first]
        if len(cont) > 1:
            with torch.no_grad():
                out = lm(torch.tensor([cont[:-1]]), use_cache=True, **{cache_arg: copy.deepcopy(cache)})
            rows += list(torch.log_softmax(out.logits[0].float(), -1))
        return sum(r[t].item() for r, t in zip(rows, cont)), all(r.argmax().item() == t for r, t in zip(rows, cont))

    return lambda ctx, cont: score(tuple(ctx), tuple(cont))


# prefill chunks of 128 tokens: a scored token attends to the earlier chunks as the pool stores them (BF16, or INT2
# past the windows), as a decode step would; a prompt in one chunk would attend to itself exactly and hide the cache
SERVE = ["--max-model-len", "1024", "--max-num-batched-tokens", "128", "--kv-cache-memory", "0.2", "--port", "0"]


@pytest.fixture(scope="module")
def runs():
    """{dtype: run_lm_eval's (results, rows)} for a BF16 and an INT2 (the shipped artifact) server."""
    out = {}
    for dtype in ("bf16", "int2"):
        server = ServerProcess(["--kv-cache-dtype", dtype, *SERVE])
        try:
            started = time.perf_counter()
            out[dtype] = run_lm_eval(server.url)
            print(f"\nlm-eval against --kv-cache-dtype {dtype}: {time.perf_counter() - started:.0f} s")
        finally:
            server.stop()
    return out


def test_bf16_loglikelihoods_equal_the_models_own_and_int2_beside_them(runs, reference):
    bf16 = scored(runs["bf16"][1], reference)
    int2 = scored(runs["int2"][1], reference)
    print()
    for task in MC_TASKS:
        diff = {name: max(abs(r[0] - r[2]) for r in rows[task]) for name, rows in (("bf16", bf16), ("int2", int2))}
        mean = {name: sum(abs(r[0] - r[2]) for r in rows[task]) / len(rows[task])
                for name, rows in (("bf16", bf16), ("int2", int2))}
        acc = {name: accuracy(rows[task], runs[name][0], task) for name, rows in (("bf16", bf16), ("int2", int2))}
        ref_acc = accuracy([(r[2], *r[1:]) for r in bf16[task]], runs["bf16"][0], task)
        print(f"{task}: {len(bf16[task])} loglikelihoods; |server - transformers| max / mean: bf16 "
              f"{diff['bf16']:.4f} / {mean['bf16']:.4f}, int2 {diff['int2']:.4f} / {mean['int2']:.4f}; acc: "
              f"transformers {ref_acc:.3f}, bf16 {acc['bf16']:.3f}, int2 {acc['int2']:.3f}")
        for ll, greedy, ref_ll, ref_greedy, doc, choice in bf16[task]:
            assert math.isfinite(ll) and abs(ll - ref_ll) < TOL, (task, doc, choice, ll, ref_ll)
        # is_greedy (lm-eval compares each token's logprob with its top_logprobs) as the forward's argmax says; a
        # near tie may flip under BF16 rounding
        assert sum(r[1] == r[3] for r in bf16[task]) >= 0.9 * len(bf16[task])
        assert acc["bf16"] == ref_acc
        # lm-eval's own metric is what the loglikelihoods give
        assert runs["bf16"][0]["results"][task]["acc,none"] == pytest.approx(acc["bf16"])
        assert all(math.isfinite(r[0]) for r in int2[task])
        # INT2 is no bigger an error than a small model's rounding noise here; a misplaced score is off by nats
        assert diff["int2"] < (TOL if task == "oscar_capitals_mc" else 0.5)


def test_generate_until_answers_the_capitals(runs):
    for dtype, (results, _) in runs.items():
        samples = results["samples"][GEN_TASK]
        answers = [(s["filtered_resps"][0], s["target"]) for s in samples]
        print(f"\n{dtype}: {answers}")
        assert results["results"][GEN_TASK]["exact_match,strip"] == 1.0, answers
