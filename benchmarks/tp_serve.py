"""`oscar-kv calibrate --tp 2` and `oscar-kv serve --tp 2` end to end, through the CLI as a user runs them.

    python benchmarks/tp_serve.py --tokenizer-dir DIR --device cuda --out OUT.json

Builds a random-weight Llama (8 KV heads, head dim 64) with DIR's tokenizer and saves it; calibrates it with
--tp 1 and --tp 2 and compares the artifacts; serves it with --tp 2 and with --tp 1 (int2 cache, the first
artifact) and sends the same four concurrent greedy completions (prompts past the sink and recent windows) to
both; then stops the --tp 2 server with SIGTERM and checks that every rank exits.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model(directory: Path, tokenizer_dir: str) -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(directory)
    tok.save_pretrained(directory)


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "oscar_kv.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def compare_artifacts(a: Path, b: Path) -> dict:
    from safetensors.torch import load_file

    x, y = load_file(a / "rotations.safetensors"), load_file(b / "rotations.safetensors")
    return {name: float((x[name].double() - y[name].double()).abs().max()) for name in x}


def request(url: str, prompt: str, max_tokens: int = 16) -> str:
    body = json.dumps(dict(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0)).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["text"]


def serve_and_ask(model: Path, artifact: Path, device: str, tp: int, prompts: list[str]) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "oscar_kv.cli", "serve", "--model", str(model), "--rotations",
                             str(artifact), "--device", device, "--tp", str(tp), "--port", str(port),
                             "--kv-cache-memory", "2", "--max-model-len", "4096", "--served-model-name", "m"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    started = time.monotonic()
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(proc.stdout.read()[-3000:])
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        ready = time.monotonic() - started
        answers = [None] * len(prompts)

        def ask(i):
            answers[i] = request(url, prompts[i])

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.monotonic() - t0
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        log = proc.stdout.read()
        return dict(tp=tp, ready_seconds=round(ready, 1), answer_seconds=round(seconds, 2), answers=answers,
                    exit_code=code, log_tail=log[-1500:])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer-dir", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp())
    model = work / "model"
    make_model(model, args.tokenizer_dir)
    result = {}
    for tp in (1, 2):
        t0 = time.monotonic()
        proc = cli("calibrate", "--model", str(model), "--output-dir", str(work / f"cal{tp}"), "--device",
                   args.device, "--calib-tokens", "4096", "--tp", str(tp))
        if proc.returncode:
            raise SystemExit(f"calibrate --tp {tp} failed:\n{proc.stderr[-3000:]}")
        result[f"calibrate_tp{tp}_seconds"] = round(time.monotonic() - t0, 1)
    result["artifact_max_abs_difference"] = compare_artifacts(work / "cal1", work / "cal2")
    print("calibrate --tp 2 vs --tp 1, max |difference| per tensor:", result["artifact_max_abs_difference"],
          flush=True)
    text = (Path(__file__).parents[1] / "src/oscar_kv/data/python_docs.txt").read_text()
    prompts = [text[i * 7000:i * 7000 + 6000] for i in range(4)]  # ~1500 tokens each: INT2 history
    for tp in (2, 1):
        result[f"serve_tp{tp}"] = serve_and_ask(model, work / "cal1", args.device, tp, prompts)
        r = result[f"serve_tp{tp}"]
        print(f"serve --tp {tp}: ready in {r['ready_seconds']} s, 4 concurrent answers in {r['answer_seconds']} s, "
              f"exit code after SIGTERM {r['exit_code']}", flush=True)
    same = [a == b for a, b in zip(result["serve_tp2"]["answers"], result["serve_tp1"]["answers"])]
    result["answers_equal"] = same
    print("answers equal (tp2 vs tp1):", same, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
