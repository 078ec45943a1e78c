"""Compatibility shim for Triton's CPU interpreter (TRITON_INTERPRET=1), used by the tests in CI.

Triton 3.6's interpreter turns a scalar tensor into a Python int with ``int(array)``; scalars are 1-element
arrays there, which NumPy >= 2.3 refuses ("only 0-dimensional arrays can be converted").  That breaks
``for t in range(start, end, BLOCK)`` with run-time bounds.  We wrap the patch hook so ``__index__``
takes the single element.  Nothing changes on a GPU (the shim is only installed under the interpreter).
"""

from __future__ import annotations

import os

_INSTALLED = False


def install_interpreter_shim() -> None:
    global _INSTALLED
    if _INSTALLED or os.environ.get("TRITON_INTERPRET", "0") != "1":
        return
    try:
        import triton.runtime.interpreter as ti
    except Exception:  # pragma: no cover
        return
    orig = getattr(ti, "_patch_lang_tensor", None)
    if orig is None:  # pragma: no cover - another Triton version
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    ti._patch_lang_tensor = patched
    _INSTALLED = True
