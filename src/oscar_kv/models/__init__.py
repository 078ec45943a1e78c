"""Models: loading (HF directory, .gguf, hub id, embedded default) and our own executor (decoder.py, a module per
family; executor.py picks one by model type)."""

from .loading import (DEFAULT_MODEL, EMBEDDED_MODELS, AttentionGeometry, default_dtype, layer_windows,
                      load_model, projection_rows, publish_dir, resolve_model)

__all__ = ["DEFAULT_MODEL", "EMBEDDED_MODELS", "AttentionGeometry", "default_dtype", "layer_windows",
           "load_model", "projection_rows", "publish_dir", "resolve_model"]
