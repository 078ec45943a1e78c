"""transformers across the versions pyproject.toml allows.

transformers 5.24 renamed the cache argument of the models' ``forward`` (and of ``generate()``) from
``past_key_values`` to ``cache``; the old name still works there but warns on every call (a FutureWarning: removed
from the forward in 5.40, from ``generate()`` in 6.0), and older releases know only the old name.  Our call sites pass
a cache through ``cache_kwargs``, which takes the name the model's own ``forward`` declares (read from its signature
once per class), not a version number.
"""

from __future__ import annotations

import functools
import inspect

NEW, OLD = "cache", "past_key_values"


@functools.cache
def _keyword(cls: type) -> str:
    try:
        params = inspect.signature(cls.forward).parameters  # follows transformers' deprecation wrapper
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return OLD
    return NEW if NEW in params else OLD


def cache_keyword(model) -> str:
    """"cache" where ``model``'s forward (and so its ``generate()``) takes that name, else "past_key_values"."""
    return _keyword(type(model))


def cache_kwargs(model, cache) -> dict:
    """``{keyword: cache}`` for ``model(...)``, ``model.model(...)`` or ``model.generate(...)`` (pass the module
    being called: its own forward is read)."""
    return {cache_keyword(model): cache}
