"""Benchmarks.  ``attention``: paged INT2 decode / extend attention, and one layer per (key, value) width pair of an
artifact, vs BF16 baselines (CUDA); ``decode``: end-to-end decode through the engine, bf16 vs int2 vs the artifact's
mixed widths (CUDA); ``load``: a load test of a running server.  Shared: ``synthetic`` (geometry, synthetic artifact,
widths), ``floors`` (bytes and bandwidth floors), ``timing`` (how a kernel call is timed)."""
