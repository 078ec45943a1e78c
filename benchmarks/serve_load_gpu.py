"""The real server on a GPU under load: int2 (Triton kernels) vs bf16, same model, same requests.

    python benchmarks/serve_load_gpu.py --model-dir DIR --output OUT

DIR holds an HF config and tokenizer (no weights: the device machine cannot download the embedded
model, and serving speed does not depend on weight values), so the model is built with random bf16
weights.  Rotations are data-free Hadamard ones for the same reason.  For each KV scheme the server
starts on 127.0.0.1, the load test (oscar_kv.bench.load) runs at each concurrency with fixed-length
outputs (ignore_eos), and the numbers go to OUT/serve_load.json.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import logging
import time
import os
import sys
from dataclasses import asdict

import torch


def build_random_model(model_dir: str, device: str):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    for p in model.parameters():  # small random weights keep activations finite through all layers
        torch.nn.init.normal_(p, std=0.02)
    model.generation_config = GenerationConfig.from_pretrained(model_dir)
    return model.eval(), AutoTokenizer.from_pretrained(model_dir)


def engine_smoke_test(model, tok, rotations, scheme: str, memory: float) -> None:
    """The engine alone (no HTTP, no thread): two requests to completion, timed."""
    from oscar_kv.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(model, tok, rotations, EngineConfig(kv_cache_dtype=scheme, kv_cache_memory=memory,
                                                          max_model_len=2048))
    for i in range(2):
        engine.add_request(f"smoke{i}", list(range(100 + i, 400 + 50 * i)),
                           SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    started, steps = time.perf_counter(), 0
    while engine.has_work() and steps < 100:
        engine.step()
        steps += 1
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    print(f"[{scheme}] engine smoke test: {steps} steps in {time.perf_counter() - started:.1f} s, "
          f"finished {engine.stats().finished}", flush=True)
    del engine


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--output", default=os.environ.get("OUT", "."))
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--requests-per-stream", type=int, default=4, help="requests = concurrency x this")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kv-cache-memory", type=float, default=4.0)
    ap.add_argument("--schemes", default="int2,bf16")
    ap.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke test)")
    ap.add_argument("--hang-dump", type=float, default=0, help="if > 0: print every thread's stack after this many s")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.hang_dump > 0:
        faulthandler.dump_traceback_later(args.hang_dump, exit=False)

    from oscar_kv.artifacts import Rotations
    from oscar_kv.bench.load import run_load
    from oscar_kv.models import AttentionGeometry
    from oscar_kv.server import BackgroundServer, ServeConfig
    from oscar_kv.server.main import free_port

    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    results = {"device": device_name, "torch": torch.__version__, "runs": []}
    for scheme in args.schemes.split(","):
        model, tok = build_random_model(args.model_dir, args.device)
        rot = Rotations.data_free(AttentionGeometry.of(model.config), "hadamard", k_clip=0.96, v_clip=0.92)
        config = ServeConfig(model="random", kv_cache_dtype=scheme, kv_cache_memory=args.kv_cache_memory,
                             max_model_len=2048, max_num_seqs=64, port=free_port(), device=args.device,
                             log_level="warning")
        engine_smoke_test(model, tok, rot if scheme == "int2" else None, scheme, args.kv_cache_memory)
        server = BackgroundServer(config, model, tok, rot if scheme == "int2" else None).start()
        print(f"[{scheme}] " + " | ".join(server.engine.describe()[:2]), flush=True)
        try:
            for conc in map(int, args.concurrency.split(",")):
                report = asyncio.run(run_load(server.url, "random", conc * args.requests_per_stream, conc, args.max_tokens,
                                              300.0, ignore_eos=True))
                print(f"[{scheme}] concurrency {conc}\n{report.table()}", flush=True)
                results["runs"].append({"scheme": scheme, **asdict(report)})
        finally:
            server.stop()
        del model, server
        if args.device == "cuda":
            torch.cuda.empty_cache()
    os.makedirs(args.output, exist_ok=True)
    with open(os.path.join(args.output, "serve_load.json"), "w") as f:
        json.dump(results, f, indent=2)
    print("\nscheme  conc  req/s   tok/s   p50 s   p99 s  ttft p50")
    for r in results["runs"]:
        print(f"{r['scheme']:6s} {r['concurrency']:5d} {r['requests_per_s']:6.2f} {r['generated_tokens_per_s']:7.1f} "
              f"{r['latency_p50']:7.3f} {r['latency_p99']:7.3f} {r['ttft_p50']:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
