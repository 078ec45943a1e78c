"""oscar-kv: 2-bit KV caches with attention-aware rotations (OSCAR) for long-context LLM serving.

Python API (README.md, "Python API", has a complete example)::

    from oscar_kv import load_model, obtain, OscarCache
    model, tokenizer = load_model("smollm2-135m")
    rotations = obtain("smollm2-135m", model)  # the shipped artifact; or Rotations.load(DIR from `oscar-kv calibrate`)
    cache = OscarCache(model, rotations)                                 # folds R_V into the model once
    model.generate(input_ids, cache=cache, max_new_tokens=64)  # transformers < 5.24: past_key_values=cache
"""

import importlib
import sys
import types

# Names resolve on first use (PEP 562): importing torch and transformers takes seconds, and `oscar-kv --help`
# or the server's flag parsing should not wait for them.
_EXPORTS = {
    "ArtifactError": "artifacts", "Rotations": "artifacts", "obtain": "provision",
    "CacheSettings": "cache", "OscarCache": "cache", "prepare_model": "cache", "unprepare_model": "cache",
    "CalibrationSettings": "calibration_settings", "calibrate": "calibrate",
    "CacheConfig": "config", "EngineConfig": "config", "ServeConfig": "config", "ConfigError": "errors",
    "bits_per_element": "memory",
    "AttentionGeometry": "models", "load_model": "models",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'oscar_kv' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        # importing the submodule oscar_kv.calibrate binds it to this name; the API's `calibrate` is its function
        if name == "calibrate" and isinstance(value, types.ModuleType):
            value = value.calibrate
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
