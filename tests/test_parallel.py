"""Tensor parallelism on the CPU: 2 processes over gloo (torchrun), a random-weight Llama with 4 KV heads.

Greedy outputs of the engine and of `oscar-kv serve --tp 2` must equal one process's; `oscar-kv calibrate
--tp 2` must write the artifact one process writes; head counts that do not split are refused up front.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from oscar_kv import parallel
from oscar_kv.parallel import TensorParallel, TensorParallelError

HERE = Path(__file__).parent
SRC = str(HERE.parent / "src")
TIMEOUT = 600


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
                TOKENIZERS_PARALLELISM="false")


def _torchrun(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


def _cli(*args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "oscar_kv.cli", *args], env=_env(), capture_output=True,
                          text=True, timeout=timeout)


def _wait_until_healthy(url: str, procs: list[subprocess.Popen], what: str) -> None:
    """Poll ``url``/health until it answers 200; fail with a process's output if one of ``procs`` (started with
    stdout piped) exits first, or when ``what`` has not started within TIMEOUT."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        for proc in procs:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, f"{what} did not start"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.5)


@pytest.fixture(scope="module")
def llama4(tmp_path_factory, tokenizer):
    """A random-weight Llama with 8 query / 4 KV heads (SmolLM2's tokenizer), saved, and its calibrated artifact."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from oscar_kv.calibrate import calibrate
    from oscar_kv.calibration_settings import CalibrationSettings

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config).eval()
    directory = tmp_path_factory.mktemp("llama4")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    settings = CalibrationSettings(calib_tokens=1024, max_kl=None, max_answer_kl=None)
    rotations = calibrate(model, tokenizer, settings, progress=False)
    rotations.save(directory / "rotations")
    return directory


def test_heads_split_in_contiguous_blocks():
    assert TensorParallel(1, 2).heads(8) == slice(4, 8)
    assert TensorParallel(2, 4).heads(8, "query heads") == slice(4, 6)
    with pytest.raises(TensorParallelError, match="tp 2 must divide the model's 3 KV heads"):
        TensorParallel(0, 2).heads(3)


def test_tp_without_torchrun_says_how_to_start(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(TensorParallelError, match="torchrun --nproc-per-node 2"):
        parallel.init(2, "cpu")
    assert parallel.init(1, "cpu") is parallel.SINGLE


def test_shard_plan_is_transformers_plan_for_every_layer(llama4):
    from transformers import AutoModelForCausalLM

    plan = parallel.shard_plan(AutoModelForCausalLM.from_pretrained(llama4))
    for i in range(2):
        for name in ("q_proj", "k_proj", "v_proj"):
            assert plan[f"model.layers.{i}.self_attn.{name}"] == "colwise"
        assert plan[f"model.layers.{i}.self_attn.o_proj"] == "rowwise"
        assert plan[f"model.layers.{i}.mlp.down_proj"] == "rowwise"
    assert not any("embed" in k or "lm_head" in k or "norm" in k for k in plan)


@pytest.mark.parametrize("dtype", ["int2", "bf16"])
def test_engine_tp2_greedy_outputs_equal_one_process(llama4, tmp_path, dtype):
    sys.path.insert(0, str(HERE))
    try:
        from tp_engine_run import run
    finally:
        sys.path.remove(str(HERE))
    rot = str(llama4 / "rotations")
    single = run(str(llama4), rot, dtype, parallel.SINGLE)
    out = tmp_path / "tp2.json"
    proc = subprocess.run(_torchrun(2, str(HERE / "tp_engine_run.py"), "--model", str(llama4), "--rotations", rot,
                                    "--dtype", dtype, "--tp", "2", "--out", str(out)),
                          env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    split = json.loads(out.read_text())
    assert split["kv_heads_per_rank"] == 2 and single["kv_heads_per_rank"] == 4
    if dtype == "int2":  # the long prompts reached the INT2 history
        assert max(single["int2_pages"]) > 0 and split["int2_pages"] == single["int2_pages"]
    assert split["outputs"] == single["outputs"]
    assert single["second_engine"] == "built"
    assert "sharded for tensor parallelism" in split["second_engine"]
    assert len({tuple(o) for o in single["outputs"]}) == len(single["outputs"])  # distinct prompts, distinct outputs


def test_calibrate_tp2_writes_the_single_process_artifact(llama4, tmp_path):
    from safetensors.torch import load_file

    one, two = tmp_path / "tp1", tmp_path / "tp2"
    for target, extra in ((one, []), (two, ["--tp", "2"])):
        proc = _cli("calibrate", "--model", str(llama4), "--output-dir", str(target), "--calib-tokens", "1024", *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wrote" in proc.stdout and proc.stdout.count("calibrated on") == 1  # rank 0 reports, once
    a, b = load_file(one / "rotations.safetensors"), load_file(two / "rotations.safetensors")
    assert a.keys() == b.keys()
    for name in a:  # row-parallel sums add in another order: float32 rounding, nothing more
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-4, msg=name)
    ma, mb = (json.loads((d / "manifest.json").read_text()) for d in (one, two))
    assert ma["fingerprint"] == mb["fingerprint"]
    assert ma["calibration"]["tokens"] == mb["calibration"]["tokens"]


@pytest.mark.parametrize("command", ["serve", "calibrate"])
def test_tp_that_does_not_divide_the_heads_is_refused_before_starting(command, tmp_path):
    extra = ["--output-dir", str(tmp_path)] if command == "calibrate" else ["--kv-cache-dtype", "bf16"]
    started = time.monotonic()
    proc = _cli(command, "--model", "smollm2-135m", "--tp", "2", *extra, timeout=120)
    assert proc.returncode == 2
    assert "--tp 2 must divide the model's 3 KV heads" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - started < 60


def test_serve_tp2_answers_the_openai_client_like_one_process(llama4):
    openai = pytest.importorskip("openai")
    from oscar_kv.server import BackgroundServer, ServeConfig
    from oscar_kv.server.main import free_port

    common = dict(model=str(llama4), rotations=str(llama4 / "rotations"), kv_cache_memory=0.05, max_model_len=1024,
                  log_level="warning")
    prompt = "The quick brown fox jumps over the lazy dog. " * 50  # past the sink and recent windows: INT2
    ask = dict(model=str(llama4), prompt=prompt, max_tokens=10, temperature=0)
    single = BackgroundServer(ServeConfig(port=free_port(), **common)).start()
    try:
        client = openai.OpenAI(base_url=single.url + "/v1", api_key="x", timeout=120, max_retries=0)
        expected = client.completions.create(**ask).choices[0].text
    finally:
        single.stop()

    port = free_port()
    args = ["serve", "--model", common["model"], "--rotations", common["rotations"], "--kv-cache-memory", "0.05",
            "--max-model-len", "1024", "--port", str(port), "--tp", "2", "--log-level", "warning"]
    proc = subprocess.Popen([sys.executable, "-m", "oscar_kv.cli", *args], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_until_healthy(url, [proc], "the --tp 2 server")
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=120, max_retries=0)
        answers = [client.completions.create(**ask).choices[0].text for _ in range(2)]  # the second: a prefix hit
        assert expected and answers == [expected, expected]
        with pytest.raises(openai.BadRequestError, match="maximum context length"):  # rank 0 refuses, ranks live on
            client.completions.create(**{**ask, "prompt": "word " * 1100})
        assert client.completions.create(**ask).choices[0].text == expected
        proc.send_signal(signal.SIGTERM)  # the launcher hands it to rank 0, which releases the others
        code = proc.wait(timeout=60)
        output = proc.stdout.read()
        assert code == 0, output[-3000:]  # (once seen: 134, rank 0 aborted at exit, in a full suite run only)
        assert "Traceback" not in output, output[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_serve_tp2_over_two_nodes_on_loopback(llama4):
    """--tp 2 over two "hosts" (--nnodes 2, one rank each, gloo on the CPU) meeting at node 0's rendezvous:
    node 0 serves the greedy answer one process gives; a SIGTERM to node 0 stops both hosts cleanly."""
    openai = pytest.importorskip("openai")
    from oscar_kv.server import BackgroundServer, ServeConfig
    from oscar_kv.server.main import free_port

    common = dict(model=str(llama4), rotations=str(llama4 / "rotations"), kv_cache_memory=0.05, max_model_len=1024,
                  log_level="warning")
    ask = dict(model=str(llama4), prompt="The quick brown fox jumps over the lazy dog. " * 40, max_tokens=8,
               temperature=0)
    single = BackgroundServer(ServeConfig(port=free_port(), **common)).start()
    try:
        client = openai.OpenAI(base_url=single.url + "/v1", api_key="x", timeout=120, max_retries=0)
        expected = client.completions.create(**ask).choices[0].text
    finally:
        single.stop()

    port, rendezvous = free_port(), free_port()
    args = ["serve", "--model", common["model"], "--rotations", common["rotations"], "--kv-cache-memory", "0.05",
            "--max-model-len", "1024", "--port", str(port), "--tp", "2", "--log-level", "warning", "--nnodes", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(rendezvous)]
    nodes = [subprocess.Popen([sys.executable, "-m", "oscar_kv.cli", *args, "--node-rank", str(r)], env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for r in (1, 0)]  # node 1 first: it waits at the rendezvous for node 0
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_until_healthy(url, nodes, "the two-node server")
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=120, max_retries=0)
        assert [client.completions.create(**ask).choices[0].text for _ in range(2)] == [expected, expected]
        nodes[1].send_signal(signal.SIGTERM)  # node 0's launcher: rank 0 shuts down and releases node 1's rank
        for node in nodes:
            code = node.wait(timeout=60)
            output = node.stdout.read()
            assert code == 0 and "Traceback" not in output, output[-3000:]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()


@pytest.mark.parametrize("flags, message", [
    (["--node-rank", "1"], "--node-rank 1 needs --nnodes (the number of hosts) above 1"),
    (["--tp", "2", "--nnodes", "2", "--master-addr", "10.0.0.1"], "--nnodes 2 needs --node-rank"),
    (["--tp", "2", "--nnodes", "2", "--node-rank", "1"], "--nnodes 2 needs --master-addr"),
    (["--tp", "3", "--nnodes", "2", "--node-rank", "0", "--master-addr", "h"], "--tp 3 does not split over --nnodes 2"),
    (["--tp", "2", "--nnodes", "2", "--node-rank", "2", "--master-addr", "h"], "--node-rank 2 must lie in [0, 1]"),
])
def test_serve_refuses_inconsistent_node_flags_before_loading(flags, message):
    proc = _cli("serve", "--port", "0", *flags, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr + proc.stdout, proc.stderr[-2000:]


def test_bench_decode_tp2_runs_both_schemes(tmp_path):
    """`oscar-kv bench decode --tp 2` (tiny model, CPU): rank 0 measures both caches, the other rank follows."""
    proc = _cli("bench", "decode", "--arch", "tiny", "--batch-sizes", "1,2", "--decode-steps", "2", "--warmup-steps",
                "1", "--device", "cpu", "--kv-cache-memory", "0.004", "--contexts", "600", "--throughput-steps", "0",
                "--output", str(tmp_path), "--tp", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "decode.json").read_text())
    assert data["errors"] == [] and data["model"]["tensor_parallel"] == 2
    measured = {(r["scheme"], r["batch"]) for r in data["decode"] if r.get("measured")}
    assert measured == {("bf16", 1), ("bf16", 2), ("int2", 1), ("int2", 2)}
    assert "per rank (tensor parallel: 1 of 2 KV heads on each of 2 ranks)" in " ".join(data["schemes"]["int2"]["describe"])
