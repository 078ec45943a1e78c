"""Every setting of oscar-kv, declared once, in one tree that the library, the CLI and the server share.

  CacheConfig      how a KV cache stores tokens: dtype, BF16 windows, page, group (the generate() cache and the engine)
  SchedulerConfig  how much the engine batches: sequences, tokens per step, the longest sequence, prefix caching
  EngineConfig     CacheConfig + SchedulerConfig + the pool's memory and the attention path
  ModelConfig      which model and rotation artifact to load, and where
  HTTPConfig       the OpenAI server's address, auth and limits
  ServeConfig      ModelConfig + EngineConfig + HTTPConfig: every ``oscar-kv serve`` flag

A level adds its fields to those of the levels it builds on (dataclass inheritance), so a field is declared once and
read flat (``config.page_size`` on every level that has it); ``part(EngineConfig)`` cuts a level out of a larger one.
Each field carries its help text and its range; constructing a config validates every field by name, and a bad value
raises ``ConfigError`` naming the field (the CLI prints it as the flag: errors.flag).

Imports nothing heavy: the CLI's ``--help`` reads it.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, get_args, get_origin

from .errors import ConfigError

KVCacheDtype = Literal["bf16", "int2", "int4", "int8"]
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KVCacheDtype)  # what the generate() cache stores (cache.py)
KV_CACHE_BITS = {d: 16 if d == "bf16" else int(d[3:]) for d in KV_CACHE_DTYPES}  # bits per element of the history
ServedKVCacheDtype = Literal["bf16", "int2"]
SERVED_KV_CACHE_DTYPES: tuple[str, ...] = get_args(ServedKVCacheDtype)  # what the paged engine serves
AttentionBackend = Literal["auto", "triton", "torch"]
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackend)
ModelImpl = Literal["auto", "oscar", "transformers"]
MODEL_IMPLS: tuple[str, ...] = get_args(ModelImpl)

T = TypeVar("T", bound="Settings")


def setting(default, help: str, *, at_least: float | None = None, above: float | None = None,
            at_most: float | None = None) -> Any:
    """A config field: its default, what it means (the CLI's help text) and the range ``validate`` enforces."""
    return field(default=default, metadata={"help": help, "at_least": at_least, "above": above, "at_most": at_most})


def split_optional(hint) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (hint, False)."""
    if get_origin(hint) in (typing.Union, types.UnionType) and type(None) in get_args(hint):
        rest = [a for a in get_args(hint) if a is not type(None)]
        return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), True
    return hint, False


def choices(hint) -> tuple | None:
    """The values a ``Literal`` field (optional or not) may take; None for other fields."""
    inner, _ = split_optional(hint)
    return get_args(inner) if get_origin(inner) is Literal else None


@cache
def type_hints(cls: type) -> dict[str, Any]:
    """Field name -> resolved type of a config class (its levels may live in several modules)."""
    return typing.get_type_hints(cls)


def _alternatives(values: tuple) -> str:
    quoted = [repr(v) for v in values]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def _check_field(name: str, hint, value, metadata) -> None:
    inner, optional = split_optional(hint)
    if value is None and optional:
        return
    allowed = choices(hint)
    if allowed is not None and value not in allowed:
        raise ConfigError(f"{name} must be {_alternatives(allowed)}, got {value!r}", name)
    at_least, above, at_most = (metadata.get(k) for k in ("at_least", "above", "at_most"))
    if at_least is None and above is None and at_most is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}", name)
    # written as `not ok` so that NaN fails too
    if at_least is not None and at_most is not None and not at_least <= value <= at_most:
        raise ConfigError(f"{name} must lie in {at_least}..{at_most}, got {value!r}", name)
    if at_least is not None and not value >= at_least:
        raise ConfigError(f"{name} must be at least {at_least}, got {value!r}", name)
    if above is not None and not value > above:
        raise ConfigError(f"{name} must be {'positive' if above == 0 else f'above {above}'}, got {value!r}", name)


class Settings:
    """What every level shares: validation on construction, and cutting a level out of a larger config."""

    title: ClassVar[str] = ""  # the level's name in `oscar-kv serve --help`

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the first field out of its range (its type's choices, its bounds), then check
        the fields that must agree with each other."""
        hints = type_hints(type(self))
        for f in fields(self):
            _check_field(f.name, hints[f.name], getattr(self, f.name), f.metadata)
        self._check_together()

    def _check_together(self) -> None:
        """Rules over several fields; a level with some extends this and calls super()."""

    def part(self, level: type[T]) -> T:
        """This config's fields of ``level`` (a level this one builds on) as a ``level``."""
        return level(**{f.name: getattr(self, f.name) for f in fields(level)})


def setting_help(config_class: type, name: str) -> str:
    """A field's help text (for a command that offers the setting outside ``serve``)."""
    return next(f for f in fields(config_class) if f.name == name).metadata["help"]


def declaring_level(config_class: type, name: str) -> type:
    """The level of the tree that declares field ``name`` first (the one it belongs to)."""
    return next(c for c in reversed(config_class.__mro__) if name in vars(c).get("__annotations__", {}))


@dataclass
class CacheConfig(Settings):
    """How a KV cache stores tokens: the generate() cache (cache.CacheSettings) and the engine's pool."""

    title: ClassVar[str] = "KV cache"
    kv_cache_dtype: KVCacheDtype = setting("int2", "Precision of the history: bf16 keeps every token at 16 bits; "
                                                   "int2 is OSCAR.")
    sink_size: int = setting(64, "First tokens of every sequence kept in BF16 (a multiple of --page-size).",
                             at_least=0)
    recent_size: int = setting(256, "Most recent tokens kept in BF16.", at_least=0)
    page_size: int = setting(16, "Tokens per KV page; also how many tokens leave the recent window at a time.",
                             at_least=1)
    group_size: int | None = setting(None, "INT2 quantization group size (default: the artifact's; must divide the "
                                           "head dim).", at_least=1)

    @property
    def bits(self) -> int:
        return KV_CACHE_BITS[self.kv_cache_dtype]


@dataclass
class SchedulerConfig(Settings):
    """How much the engine batches into one forward step and keeps in flight."""

    title: ClassVar[str] = "Scheduler"
    max_model_len: int | None = setting(None, "Longest prompt + completion in tokens (default: the model's context).",
                                        at_least=2)
    max_num_seqs: int = setting(64, "Most sequences decoded together.", at_least=1)
    max_num_batched_tokens: int = setting(
        2048, "Most tokens per forward step; longer prompts are prefilled in chunks of this size. A step is not "
        "interrupted: an abort, a /metrics scrape and the other streams wait for it (a 2000-token step took 40 s on a "
        "busy 2-core CPU).", at_least=1)
    enable_prefix_caching: bool = setting(True, "Reuse cached KV pages of shared prompt prefixes.")
    async_scheduling: bool = setting(
        True, "Schedule and queue the next step while the GPU runs the current one (its new token ids are read on "
        "the GPU, where sampling runs too). A sequence ending on EOS or a stop string computes one extra token, "
        "which is dropped.")


@dataclass
class EngineConfig(SchedulerConfig, CacheConfig):
    """The paged engine's settings (engine.LLMEngine): its cache, its scheduler, its pool's memory and its attention."""

    title: ClassVar[str] = "Engine"
    # the engine serves fewer dtypes than the generate() cache stores
    kv_cache_dtype: ServedKVCacheDtype = setting("int2", "KV cache storage: 'int2' (OSCAR: BF16 sink + recent window, "
                                                         "INT2 history) or 'bf16'.")
    kv_cache_memory: float | None = setting(
        None, "KV pool size in GB, everything counted (INT2 codes, scales and zero points, BF16 windows). Default: 80% of free "
        "GPU memory after loading the model, or 10% of available RAM on CPU.", above=0)
    attention_backend: AttentionBackend = setting(
        "auto", "Paged attention: 'triton' (kernels: decode + extend), 'torch' (reference), or 'auto' (Triton on "
        "CUDA, torch on CPU).")
    model_impl: ModelImpl = setting(
        "auto", "Model forward: 'oscar' (our executor for Llama, Mistral, Qwen2, Qwen3, Phi-3, GLM-4 and Gemma 3: "
        "fused QKV and gate/up GEMMs, fused norms and RoPE), 'transformers' (the model's own modules), or 'auto' "
        "(oscar where it runs the model, else transformers; the start-up log says which and why).")
    enforce_eager: bool = setting(False, "Run decode steps eagerly (no CUDA graphs; they are used with the Triton "
                                         "kernels on CUDA otherwise).")

    def _check_together(self) -> None:
        super()._check_together()
        # a quantized pool keeps the sink in whole pages
        if self.kv_cache_dtype != "bf16" and self.sink_size % self.page_size:
            raise ConfigError(f"sink_size {self.sink_size} must be a multiple of page_size {self.page_size}",
                              "sink_size", "page_size")


@dataclass
class ModelConfig(Settings):
    """Which model and rotation artifact to load, and where to run them."""

    title: ClassVar[str] = "Model"
    model: str = setting("smollm2-135m", "HF model directory, .gguf file, hub id (when online), or 'smollm2-135m' "
                                         "(the embedded default).")
    rotations: Path | None = setting(None, "Rotation artifact directory from `oscar-kv calibrate` (needed for int2).")
    calibrate: bool = setting(False, "If int2 has no --rotations: calibrate now (cached under "
                                     "$OSCAR_KV_HOME/artifacts/<model>) instead of refusing to start.")
    device: str = setting("cpu", "cpu or cuda.")
    tp: int = setting(1, "Tensor parallelism: split the model, its KV heads and the KV pool over N GPUs, one process "
                         "each (started by this command, or run it under `torchrun --nproc-per-node N`). N must divide "
                         "the KV and query heads; --kv-cache-memory is per GPU.", at_least=1)

    def _check_together(self) -> None:
        super()._check_together()
        if self.tp > 1 and self.calibrate:
            raise ConfigError(f"calibrate does not run under tp {self.tp}; make the artifact first (`oscar-kv "
                              f"calibrate --model {self.model} --output-dir DIR`, with `--tp {self.tp}` if the model "
                              f"needs several GPUs) and pass rotations DIR", "calibrate", "tp", "rotations")


@dataclass
class NodesConfig(ModelConfig):
    """Tensor parallelism over several hosts: torch.distributed's own rendezvous (torchrun's and vLLM's names)."""

    title: ClassVar[str] = "Multi-node tensor parallelism"
    nnodes: int = setting(1, "Hosts the tp ranks span (the same command runs on each, with its own node_rank); each "
                             "host runs tp / nnodes ranks, one per GPU. Rank 0 (on node 0) serves HTTP.", at_least=1)
    node_rank: int | None = setting(None, "This host's index in [0, nnodes) (needed with nnodes > 1).", at_least=0)
    master_addr: str | None = setting(None, "Address of node 0 that every host can reach (needed with nnodes > 1).")
    master_port: int = setting(29500, "Port of the rendezvous on master_addr (node 0 listens on it).",
                               at_least=1, at_most=65535)

    def _check_together(self) -> None:
        super()._check_together()
        if self.nnodes == 1:
            if self.node_rank not in (None, 0):
                raise ConfigError(f"node_rank {self.node_rank} needs nnodes (the number of hosts) above 1",
                                  "node_rank", "nnodes")
            return
        if self.node_rank is None:
            raise ConfigError(f"nnodes {self.nnodes} needs node_rank: this host's index, 0 to {self.nnodes - 1}",
                              "nnodes", "node_rank")
        if self.node_rank >= self.nnodes:
            raise ConfigError(f"node_rank {self.node_rank} must lie in [0, {self.nnodes - 1}] for nnodes "
                              f"{self.nnodes}", "node_rank", "nnodes")
        if self.tp % self.nnodes:
            raise ConfigError(f"tp {self.tp} does not split over nnodes {self.nnodes}: every host runs tp / nnodes "
                              "ranks", "tp", "nnodes")
        if not self.master_addr:
            raise ConfigError(f"nnodes {self.nnodes} needs master_addr: the address of node 0 that every host can "
                              "reach", "nnodes", "master_addr")


@dataclass
class HTTPConfig(Settings):
    """The OpenAI-compatible server: where it listens, whom it admits, how it stops."""

    title: ClassVar[str] = "HTTP server"
    host: str = setting("127.0.0.1", "Address to listen on.")
    port: int = setting(30000, "Port to listen on (checked before the model loads; 0: any free port).",
                        at_least=0, at_most=65535)
    api_key: str | None = setting(None, "If set, requests must send 'Authorization: Bearer <key>' "
                                        "(default: $OSCAR_KV_API_KEY, else no auth).")
    served_model_name: str | None = setting(None, "Model name clients must send (default: --model); several, comma "
                                                  "separated, are each accepted and listed in /v1/models.")
    shutdown_timeout: float = setting(30.0, "On SIGTERM / SIGINT: stop admitting, give requests in flight this many "
                                            "seconds to finish, then end the rest with an error (streams get an error "
                                            "event and [DONE]). A second signal stops at once.", at_least=0)
    max_body_mb: float = setting(16.0, "Largest request body in MB (2**20 bytes); larger ones get 413.", above=0)
    log_level: str = setting("info", "Log level of the server and uvicorn.")


@dataclass
class ServeConfig(HTTPConfig, EngineConfig, NodesConfig):
    """Every ``oscar-kv serve`` flag (field name = flag name with dashes): the model, the engine, the HTTP server."""

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def model_names(self) -> list[str]:
        """--served-model-name's names (comma separated), or --model."""
        names = [n.strip() for n in (self.served_model_name or "").split(",") if n.strip()]
        return names or [self.model]

    @property
    def engine(self) -> EngineConfig:
        return self.part(EngineConfig)
