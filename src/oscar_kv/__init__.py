"""oscar-kv: 2-bit KV caches with attention-aware rotations (OSCAR) for long-context LLM serving.

Python API::

    from oscar_kv import load_model, Rotations, OscarCache
    model, tokenizer = load_model("smollm2-135m")
    rotations = Rotations.load("artifacts/smollm2")        # from `oscar-kv calibrate`
    cache = OscarCache(model, rotations)                     # folds R_V into the model once
    model.generate(input_ids, past_key_values=cache, max_new_tokens=64)
"""

from .artifacts import ArtifactError, Rotations
from .cache import CacheSettings, OscarCache, prepare_model, unprepare_model
from .calibrate import CalibrationSettings, calibrate
from .memory import bits_per_element
from .models import AttentionGeometry, load_model

__all__ = ["ArtifactError", "AttentionGeometry", "CacheSettings", "CalibrationSettings", "OscarCache", "Rotations",
           "bits_per_element", "calibrate", "load_model", "prepare_model", "unprepare_model"]
__version__ = "0.1.0"
