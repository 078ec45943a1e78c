"""Benchmarks.  ``attention``: paged INT2 decode / extend attention vs BF16 baselines (CUDA); ``decode``: end-to-end
decode through the engine, bf16 vs int2 (CUDA); ``load``: a load test of a running server."""
