"""Serving engine: continuous batching over a paged INT2 KV pool with prefix caching.

Small on purpose (scheduler + block pool + model runner + sequence), in the spirit of nano-vllm:
  sequence.py    a request: tokens, sampling parameters, pages
  block_pool.py  paged BF16-window + INT2 pools, accounting, prefix cache with LRU eviction
  scheduler.py   continuous batching, chunked prefill, preemption by recompute
  runner.py      packed forward through transformers' model with a registered paged attention
  engine.py      LLMEngine: built from model + artifact, takes requests, runs the step loop
  describe.py    its start-up lines (scheme, kernels, forward, pool capacity against BF16)
  outputs.py     what it hands back: RequestOutput, EngineStats, stop strings in streamed text
  thread.py      EngineThread: drives an LLMEngine for the HTTP server
"""

from .block_pool import PagePool, PoolPlan, plan_pool
from .engine import EngineConfig, LLMEngine
from .outputs import EngineStats, RequestOutput
from .sequence import SamplingParams, Sequence
from .thread import EngineThread

__all__ = ["EngineConfig", "EngineStats", "EngineThread", "LLMEngine", "PagePool", "PoolPlan", "RequestOutput",
           "SamplingParams", "Sequence", "plan_pool"]
