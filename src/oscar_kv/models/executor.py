"""Which executor runs a model: the family of its model type (llama.py, phi3.py, glm4.py, gemma3.py), each running
models/decoder.py's forward.  The engine asks here (``executor_support`` at start-up, then ``make_executor``)."""

from __future__ import annotations

from .decoder import DecoderExecutor
from .gemma3 import Gemma3Executor
from .glm4 import Glm4Executor
from .llama import LlamaExecutor
from .phi3 import Phi3Executor

EXECUTORS: dict[str, type[DecoderExecutor]] = {
    model_type: cls for cls in (LlamaExecutor, Phi3Executor, Glm4Executor, Gemma3Executor)
    for model_type in cls.MODEL_TYPES}


def executor_support(model) -> str | None:
    """None when our executor runs ``model``, else why not (said at start-up)."""
    cls = EXECUTORS.get(model.config.model_type)
    if cls is None:
        return f"model type {model.config.model_type!r} is not one the executor runs ({', '.join(EXECUTORS)})"
    return cls.support(model)


def make_executor(model, max_positions: int, kernels: bool | None = None) -> DecoderExecutor:
    """The executor of ``model``'s family (ValueError saying why where none runs it); ``max_positions``: its RoPE
    tables' length; ``kernels``: as DecoderExecutor's."""
    why = executor_support(model)
    if why is not None:
        raise ValueError(f"the executor cannot run this model: {why}")
    return EXECUTORS[model.config.model_type](model, max_positions, kernels)
