"""Serving engine: continuous batching over a paged INT2 KV pool with prefix caching.

Small on purpose (scheduler + block pool + model runner + sequence), in the spirit of nano-vllm:
  sequence.py    a request: tokens, sampling parameters, pages
  block_pool.py  paged BF16-window + INT2 pools, accounting, prefix cache with LRU eviction
  scheduler.py   continuous batching, chunked prefill, preemption by recompute
  runner.py      packed forward through transformers' model with a registered paged attention
  engine.py      LLMEngine (step loop) and EngineThread (drives it for the HTTP server)
"""

from .block_pool import PagePool, PoolPlan, plan_pool
from .engine import EngineConfig, EngineStats, EngineThread, LLMEngine, RequestOutput
from .sequence import SamplingParams, Sequence

__all__ = ["EngineConfig", "EngineStats", "EngineThread", "LLMEngine", "PagePool", "PoolPlan", "RequestOutput",
           "SamplingParams", "Sequence", "plan_pool"]
