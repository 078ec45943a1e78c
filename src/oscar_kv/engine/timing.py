"""Named regions of an engine step, for benchmarks and profilers: the runner's timing seam.

The runner opens ``regions.region(name)`` around the parts of a step; the default does nothing.  A benchmark
installs its own object (``engine.runner.regions = ...``) to time them, e.g. with CUDA events; nothing is
patched.  Regions inside the model forward (per layer) open only on eager steps: a CUDA graph replays kernels, not
Python.

    runner                 ModelRunner.run: the whole step after scheduling
    step_plan              the step's plan (the attention backend's plan(), attention.py)
    attend_total           a layer's attention call, KV write included
    kv_write_and_migration a layer's KV write (the first layer's includes the step's page migrations)
    key_rotation           rotating keys in torch (steps that do not fuse it into the write)
    query_rotation         rotating queries in torch (the torch reference path)
    sampling               the next tokens from the logits
"""

from __future__ import annotations

import contextlib

REGIONS = ("runner", "step_plan", "attend_total", "kv_write_and_migration", "key_rotation", "query_rotation",
           "sampling")


class NoRegions:
    """The default: every region is a no-op."""

    def region(self, name: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


NO_REGIONS = NoRegions()
