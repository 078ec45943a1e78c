"""The errors oscar-kv raises on purpose, under one base class, and how a setting's error names its flag.

Library code names settings by their field names (``sink_size``); the CLI and the server turn those into
their flags (``--sink-size``) with :func:`user_message`, so the same error reads right in Python and on the
command line."""

from __future__ import annotations

import re


class OscarKVError(Exception):
    """Base class of the errors oscar-kv raises on purpose (bad settings, artifacts, models, requests)."""


class ConfigError(OscarKVError, ValueError):
    """A setting is out of range or does not fit the model or the machine.  ``fields``: the settings the message
    names (as field names, e.g. ``kv_cache_memory``)."""

    def __init__(self, message: str, *fields: str):
        super().__init__(message)
        self.fields = fields

    def with_flags(self) -> str:
        """The message with each named field written as its command-line flag.  Text between backticks is a
        command line, quoted as written."""
        parts = str(self).split("`")
        for i in range(0, len(parts), 2):  # outside the backticks
            for name in sorted(self.fields, key=len, reverse=True):
                parts[i] = re.sub(rf"(?<![\w-]){re.escape(name)}\b", flag(name), parts[i])
        return "`".join(parts)


class NonFiniteActivations(OscarKVError, ValueError):
    """The model produced NaN or Inf queries, keys, values or attention outputs (bad weights, or a dtype too
    narrow for them)."""


class RequestError(OscarKVError, ValueError):
    """A request the engine cannot take as asked: an empty or too long prompt, token ids outside the vocabulary,
    sampling parameters out of range, a request id in use (the server answers 400)."""


class ModelNotFound(OscarKVError, FileNotFoundError):
    """``--model`` names nothing that can be loaded here; the message says what was looked for and how to get it."""


def flag(name: str) -> str:
    """A setting's command-line flag: its field name with dashes (``max_model_len`` -> ``--max-model-len``)."""
    return "--" + name.replace("_", "-")


def user_message(exc: BaseException) -> str:
    """What the CLI and the server print for ``exc``: settings as flags."""
    return exc.with_flags() if isinstance(exc, ConfigError) else str(exc)
