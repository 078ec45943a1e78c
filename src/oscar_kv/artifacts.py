"""The rotation artifact: a directory with ``rotations.safetensors`` and ``manifest.json``.

Tensors (float32 unless noted; H = KV heads, or 1 when one rotation is shared per layer):
  k_rotation [L, H, D, D], v_rotation [L, H, D, D]   orthogonal, applied as ``x @ R``
  k_eigenvalues [L, H, D], v_eigenvalues [L, H, D]   descending, of the covariances R was built from
  k_mean [L, Hkv, D], v_mean [L, Hkv, D]             centering offsets (zeros when centering is off)
  k_rope_mean [L, Hkv, D]                            mean pre-RoPE key for position-aware centering
                                                     (rope.py); zeros when keys are centered by k_mean only
  k_clip [L, Hkv], v_clip [L, Hkv]                   clip ratios used for INT2 rows
  k_bits [L], v_bits [L] int32                       storage precision of each layer's quantized keys / values
                                                     (keys 2, 3, 4, 5 or 8, values 2, 3, 4 or 8; 16 on both: the
                                                     layer is not quantized).
                                                     Artifacts written before keys and values could differ hold
                                                     one ``layer_bits`` [L] for both; loading reads it so.
  k_hi_dims [L], k_hi_bits [L] int32                 split keys (quant.SplitWidth): the first k_hi_dims rotated
                                                     key channels at k_hi_bits, the rest at k_bits; 0: not split.
                                                     Written only when some layer is split.

The manifest holds the format version, the model's attention geometry and fingerprint, the
calibration settings, validation results, the quantizer's ``rescale`` strengths (``{"keys": g, "values": g}``,
g in [0, 1], quant.py; absent in artifacts written before they existed: 0, no rescale), the RoPE layout k_rope_mean
is for (``{"rotary_dim": r, "interleaved": b}``, rope.RotaryLayout; absent: rotate-half over the whole head, the only
layout before partial rotary) and a sha256 of the tensor file.
Loading checks all of it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .errors import ConfigError, OscarKVError
from .memory import width_summary
from .models import AttentionGeometry, projection_rows
from .quant import SplitWidth
from .rope import RopeUnsupported, RotaryLayout, rotated_only
from .rotation import ORTHOGONALITY_TOLERANCE, compose, orthogonality_error

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
TENSOR_FILE = "rotations.safetensors"
MANIFEST_FILE = "manifest.json"
DEFAULT_K_CLIP = 0.96
DEFAULT_V_CLIP = 0.92
# widths of a layer's quantized keys / values (16: not quantized); 5 bits is a key width only (allocation.KEY_WIDTHS)
STORED_BITS = {"k_bits": (2, 3, 4, 5, 8, 16), "v_bits": (2, 3, 4, 8, 16)}


class ArtifactError(OscarKVError, ValueError):
    """A rotation artifact is missing, corrupt, or made for another model."""


@dataclass
class Rotations:
    """A rotation artifact in memory: the tensors of the module docstring, the geometry and group size they are
    for, and the manifest.

    Shapes:
        k_rotation, v_rotation: float32 [L, H | 1, D, D]; k_eigenvalues, v_eigenvalues: [L, H | 1, D];
        k_mean, v_mean, k_rope_mean: [L, Hkv, D]; k_clip, v_clip: [L, Hkv]; k_bits, v_bits: int32 [L].
    """

    k_rotation: torch.Tensor
    v_rotation: torch.Tensor
    k_eigenvalues: torch.Tensor
    v_eigenvalues: torch.Tensor
    k_mean: torch.Tensor
    v_mean: torch.Tensor
    k_clip: torch.Tensor
    v_clip: torch.Tensor
    k_bits: torch.Tensor
    geometry: AttentionGeometry
    group_size: int
    manifest: dict = field(default_factory=dict)
    k_rope_mean: torch.Tensor | None = None  # None reads as zeros: no position-aware centering
    source: str | None = field(default=None, compare=False)  # the directory it was loaded from (None: made here)
    # how much of the clip's shrink of each INT2 row along itself the stored scale undoes (quant.py)
    k_rescale: float = 0.0
    v_rescale: float = 0.0
    # the RoPE layout of k_rope_mean's channels (partial rotary keeps it zero past rotary_dim); None: rotate-half
    # over the whole head
    rope_layout: RotaryLayout | None = None
    v_bits: torch.Tensor | None = None  # None: the keys' widths
    # split keys (quant.SplitWidth): per layer, how many leading rotated key channels are stored at k_hi_bits (the
    # rest at k_bits); 0: none.  None reads as zeros.
    k_hi_dims: torch.Tensor | None = None
    k_hi_bits: torch.Tensor | None = None

    TENSORS = ("k_rotation", "v_rotation", "k_eigenvalues", "v_eigenvalues", "k_mean", "v_mean",
               "k_clip", "v_clip", "k_bits", "v_bits")
    OPTIONAL_TENSORS = ("k_rope_mean",)  # absent from artifacts written before they existed
    SPLIT_TENSORS = ("k_hi_dims", "k_hi_bits")  # written only by an artifact with split keys
    LEGACY_BITS = "layer_bits"  # one width per layer for keys and values, before they could differ

    def __post_init__(self):
        if self.k_rope_mean is None:
            self.k_rope_mean = torch.zeros_like(self.k_mean)
        if self.v_bits is None:
            self.v_bits = self.k_bits.clone()
        for name in self.SPLIT_TENSORS:
            if getattr(self, name) is None:
                setattr(self, name, torch.zeros_like(self.k_bits))

    def side_bits(self, layer: int) -> tuple[int, int]:
        """(key bits, value bits) of ``layer``'s quantized history."""
        return int(self.k_bits[layer]), int(self.v_bits[layer])

    def key_split(self, layer: int) -> SplitWidth | None:
        """``layer``'s split keys, None when every channel is stored at k_bits."""
        m = int(self.k_hi_dims[layer])
        return SplitWidth(int(self.k_bits[layer]), m, int(self.k_hi_bits[layer])) if m else None

    def key_widths(self) -> list[int | SplitWidth]:
        """Each layer's key width: its bits, or its SplitWidth."""
        return [self.key_split(i) or int(b) for i, b in enumerate(self.k_bits.tolist())]

    @property
    def has_split_keys(self) -> bool:
        return bool(self.k_hi_dims.any())

    def width_summary(self) -> str:
        """The layers' widths in words, e.g. "K3V2 x 20, K4V2 x 4" (split keys: "K4x32+2V2")."""
        return width_summary(self.key_widths(), self.v_bits.tolist())

    def set_bits(self, k_bits, v_bits=None) -> None:
        """Set every layer's widths: a list per layer (of bits, or SplitWidth for keys) or tensor, or one number for
        all (``v_bits`` None: as keys)."""
        L = self.geometry.num_layers
        as_tensor = lambda b: (torch.full((L,), int(b), dtype=torch.int32) if isinstance(b, int)  # noqa: E731
                               else torch.as_tensor(b, dtype=torch.int32).clone())
        splits = [None] * L if isinstance(k_bits, (int, torch.Tensor)) else [
            w if isinstance(w, SplitWidth) else None for w in k_bits]
        plain = k_bits if not any(splits) else [w.bits if isinstance(w, SplitWidth) else w for w in k_bits]
        self.k_bits = as_tensor(plain)
        self.v_bits = as_tensor(plain if v_bits is None else v_bits)
        self.k_hi_dims = torch.tensor([w.hi_dims if w else 0 for w in splits], dtype=torch.int32)
        self.k_hi_bits = torch.tensor([w.hi_bits if w else 0 for w in splits], dtype=torch.int32)

    @property
    def key_centering(self) -> str:
        """The keys' centering as the tensors say: "rope" (position-aware), "constant" or "off"."""
        if self.k_rope_mean.abs().max() > 0:
            return "rope"
        return "constant" if self.k_mean.abs().max() > 0 else "off"

    @property
    def rotary_layout(self) -> RotaryLayout:
        return self.rope_layout or RotaryLayout.full(self.geometry.head_dim)

    def rope_layers(self) -> list[int]:
        """The layers whose keys are centered per position (a nonzero k_rope_mean)."""
        return [i for i in range(self.k_rope_mean.shape[0]) if self.k_rope_mean[i].abs().max() > 0]

    @property
    def scope(self) -> str:
        return "per-layer" if self.k_rotation.shape[1] == 1 else "per-head"

    def tensors(self) -> dict[str, torch.Tensor]:
        split = self.SPLIT_TENSORS if self.has_split_keys else ()  # artifacts without them stay as they were
        return {name: getattr(self, name).contiguous() for name in self.TENSORS + self.OPTIONAL_TENSORS + split}

    def rotation_for_head(self, which: str, layer: int, kv_head: int) -> torch.Tensor:
        """The [D, D] rotation of ``which`` ("k" or "v") for one layer and KV head."""
        r = getattr(self, f"{which}_rotation")[layer]
        return r[0] if r.shape[0] == 1 else r[kv_head]

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def data_free(cls, geometry: AttentionGeometry, composition: str, group_size: int | None = None,
                  k_clip: float = 1.0, v_clip: float = 1.0) -> "Rotations":
        """Rotations that need no calibration, one per layer, no centering, 2-bit layers.

        Args:
            geometry: the model's attention geometry.
            composition: ``identity`` (naive INT2) or ``hadamard`` (QuaRot-style; see rotation.compose).
            group_size: the quantization group (default: the head dim, at most 128).
            k_clip, v_clip: the clip ratio of every key / value row.
        """
        g = geometry
        group_size = group_size or min(g.head_dim, 128)
        r, _ = compose(None, g.head_dim, group_size, composition)
        rot = r.float().expand(g.num_layers, 1, g.head_dim, g.head_dim).clone()
        zeros = torch.zeros(g.num_layers, g.num_kv_heads, g.head_dim)
        return cls(rot, rot.clone(), torch.zeros(g.num_layers, 1, g.head_dim), torch.zeros(g.num_layers, 1, g.head_dim),
                   zeros, zeros.clone(), torch.full((g.num_layers, g.num_kv_heads), k_clip),
                   torch.full((g.num_layers, g.num_kv_heads), v_clip),
                   torch.full((g.num_layers,), 2, dtype=torch.int32), g, group_size,
                   {"calibration": {"composition": composition}})

    # ---- validation ---------------------------------------------------------------------
    def validate(self, geometry: AttentionGeometry | None = None) -> None:
        """Raise ArtifactError unless the tensors fit ``self.geometry`` (shapes, layer bits, group size), the
        rotations are orthogonal, the clips lie in (0, 1] and nothing is NaN or Inf.  ``geometry``: the model's,
        which must equal the artifact's; None: not compared."""
        g = self.geometry
        if geometry is not None:
            mine, theirs = g.as_dict(), geometry.as_dict()
            diff = {k: (mine[k], theirs[k]) for k in mine if mine[k] != theirs[k]}
            if diff:
                raise ArtifactError("rotation artifact was calibrated for another model: "
                                    + ", ".join(f"{k} is {a} in the artifact but {b} in the model" for k, (a, b) in diff.items()))
        L, Hkv, D = g.num_layers, g.num_kv_heads, g.head_dim
        for which in ("k", "v"):
            r = getattr(self, f"{which}_rotation")
            if r.dim() != 4 or r.shape[0] != L or r.shape[1] not in (1, Hkv) or r.shape[2:] != (D, D):
                raise ArtifactError(f"{which}_rotation has shape {tuple(r.shape)}; expected [{L}, 1 or {Hkv}, {D}, {D}]")
            extra = (("k_rope_mean", (L, Hkv, D)),) if which == "k" else ()
            for name, shape in ((f"{which}_mean", (L, Hkv, D)), (f"{which}_clip", (L, Hkv))) + extra:
                if tuple(getattr(self, name).shape) != shape:
                    raise ArtifactError(f"{name} has shape {tuple(getattr(self, name).shape)}; expected {list(shape)}")
            if not torch.isfinite(r).all():
                raise ArtifactError(f"{which}_rotation contains NaN or Inf")
            err = orthogonality_error(r)
            if err > ORTHOGONALITY_TOLERANCE:
                raise ArtifactError(f"{which}_rotation is not orthogonal: max |R R^T - I| = {err:.2e} > {ORTHOGONALITY_TOLERANCE}")
            clip = getattr(self, f"{which}_clip")
            if not ((clip > 0) & (clip <= 1)).all():
                raise ArtifactError(f"{which}_clip ratios must lie in (0, 1]")
            for name in (f"{which}_mean",) + tuple(n for n, _ in extra):
                if not torch.isfinite(getattr(self, name)).all():
                    raise ArtifactError(f"{name} contains NaN or Inf")
        for name, allowed in STORED_BITS.items():
            bits = getattr(self, name)
            if tuple(bits.shape) != (L,) or not set(bits.tolist()) <= set(allowed):
                raise ArtifactError(f"{name} must hold one of {', '.join(map(str, allowed))} per layer")
        if ((self.k_bits == 16) != (self.v_bits == 16)).any():
            raise ArtifactError("a layer stores both keys and values at 16 bits or neither (k_bits / v_bits)")
        for name in self.SPLIT_TENSORS:
            if tuple(getattr(self, name).shape) != (L,):
                raise ArtifactError(f"{name} has shape {tuple(getattr(self, name).shape)}; expected [{L}]")
        for layer in range(L):
            split = self.key_split(layer)
            if split is not None:
                try:
                    split.check(D)
                except ConfigError as exc:
                    raise ArtifactError(f"layer {layer}'s split keys: {exc}") from exc
        if self.group_size <= 0 or D % self.group_size:
            raise ArtifactError(f"group size {self.group_size} does not divide the head dim {D}")
        layout = self.rotary_layout
        if layout.head_dim != D:
            raise ArtifactError(f"rope_layout is for head dim {layout.head_dim}, the artifact's is {D}")
        if not torch.equal(rotated_only(self.k_rope_mean, layout), self.k_rope_mean):
            raise ArtifactError(f"k_rope_mean is nonzero past the {layout.rotary_dim} rotated channels of its "
                                "rope_layout")

    # ---- persistence --------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        """Validate, then write the tensor file and the manifest (with the tensor file's sha256) to ``directory``;
        returns it."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.validate()
        path = directory / TENSOR_FILE
        save_file(self.tensors(), str(path))
        manifest = dict(self.manifest)
        manifest.update(format_version=FORMAT_VERSION, geometry=self.geometry.as_dict(), group_size=self.group_size,
                        rotation_scope=self.scope, rescale={"keys": self.k_rescale, "values": self.v_rescale},
                        sha256=_sha256(path))
        if self.rope_layout is not None:
            manifest["rope_layout"] = self.rope_layout.as_dict()
        (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
        self.manifest = manifest
        return directory

    @classmethod
    def load(cls, directory: str | Path, geometry: AttentionGeometry | None = None,
             fingerprint: str | None = None) -> "Rotations":
        """Read and check an artifact directory; every problem raises ArtifactError.

        Args:
            directory: the artifact (``manifest.json`` and ``rotations.safetensors``).
            geometry: the model's attention geometry, which the artifact's must equal; None: not compared.
            fingerprint: the model's ``model_fingerprint``; a different stored one only logs a warning.
        """
        directory = Path(directory)
        if not directory.is_dir():
            raise ArtifactError(f"rotation artifact {directory} does not exist (run `oscar-kv calibrate` first)")
        manifest_path, tensor_path = directory / MANIFEST_FILE, directory / TENSOR_FILE
        for p in (manifest_path, tensor_path):
            if not p.is_file():
                raise ArtifactError(f"{directory} is not a rotation artifact: {p.name} is missing")
        try:
            manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as exc:
            raise ArtifactError(f"{manifest_path} is not valid JSON: {exc}") from exc
        if manifest.get("format_version") != FORMAT_VERSION:
            raise ArtifactError(f"unsupported artifact format version {manifest.get('format_version')!r} (expected {FORMAT_VERSION})")
        if manifest.get("sha256") != _sha256(tensor_path):
            raise ArtifactError(f"{tensor_path} does not match its checksum: the file is truncated or modified")
        try:
            tensors = load_file(str(tensor_path))
        except (SafetensorError, OSError) as exc:
            raise ArtifactError(f"cannot read {tensor_path}: {exc}") from exc
        if "k_bits" not in tensors and cls.LEGACY_BITS in tensors:
            tensors["k_bits"] = tensors.pop(cls.LEGACY_BITS)
            tensors["v_bits"] = tensors["k_bits"].clone()
        missing = [t for t in cls.TENSORS if t not in tensors]
        if missing:
            raise ArtifactError(f"{tensor_path} lacks tensors {missing}")
        try:
            art_geometry = AttentionGeometry(**manifest["geometry"])
            group_size = int(manifest["group_size"])
        except (KeyError, TypeError) as exc:
            raise ArtifactError(f"{manifest_path} lacks the model geometry or group size") from exc
        optional = {t: tensors[t] for t in cls.OPTIONAL_TENSORS + cls.SPLIT_TENSORS if t in tensors}
        rescale = manifest.get("rescale", {})
        if not isinstance(rescale, dict) or not all(
                type(rescale.get(k, 0.0)) in (int, float) and 0 <= rescale.get(k, 0.0) <= 1 for k in ("keys", "values")):
            raise ArtifactError(f"{manifest_path}: 'rescale' must be {{\"keys\": g, \"values\": g}} with g in [0, 1], "
                                f"got {rescale!r}")
        layout = manifest.get("rope_layout")
        if layout is not None:
            try:
                layout = RotaryLayout(art_geometry.head_dim, int(layout["rotary_dim"]), bool(layout["interleaved"]))
            except (KeyError, TypeError, ValueError, RopeUnsupported) as exc:
                raise ArtifactError(f"{manifest_path}: 'rope_layout' must be {{\"rotary_dim\": r, \"interleaved\": b}} "
                                    f"with an even r <= the head dim, got {manifest['rope_layout']!r}") from exc
        art = cls(**{t: tensors[t] for t in cls.TENSORS}, **optional, geometry=art_geometry, group_size=group_size,
                  manifest=manifest, source=str(directory), k_rescale=float(rescale.get("keys", 0.0)),
                  v_rescale=float(rescale.get("values", 0.0)), rope_layout=layout)
        art.validate(geometry)
        stored = manifest.get("fingerprint")
        if fingerprint and stored and stored != fingerprint:
            log.warning("the artifact was calibrated on a model with the same geometry but other weights "
                        "(fingerprint %s, model %s); accuracy may suffer - recalibrate for this model", stored, fingerprint)
        return art


SHIPPED_DIR = Path(__file__).parent / "data" / "artifacts"  # artifacts shipped for the embedded models


def shipped_artifact(model_name: str) -> Path | None:
    """The artifact directory shipped in the package for an embedded model (``--model`` name), or None.
    Made by ``oscar-kv calibrate --model NAME`` with the defaults; serving checks its fingerprint."""
    if not model_name or Path(model_name).name != model_name:  # a path or hub id, not an embedded model's name
        return None
    directory = SHIPPED_DIR / model_name
    return directory if (directory / MANIFEST_FILE).is_file() else None


def load_shipped(model_name: str, model) -> "Rotations | None":
    """The shipped artifact for ``model_name`` if it was calibrated on exactly these weights, else None."""
    directory = shipped_artifact(model_name)
    if directory is None:
        return None
    rot = Rotations.load(directory, AttentionGeometry.of(model.config))
    if rot.manifest.get("fingerprint") != model_fingerprint(model):
        log.warning("the artifact shipped for %s was calibrated on other weights; not using it", model_name)
        return None
    return rot


def model_fingerprint(model) -> str:
    """A short hash of the attention geometry and the first layer's key projection weights."""
    of = AttentionGeometry.of(model.config)
    geometry = json.dumps(of.as_dict(), sort_keys=True)
    linear, rows = projection_rows(model.model.layers[0].self_attn, "k", of)
    k_proj = linear.weight[rows].detach().to(torch.bfloat16).float().cpu()
    h = hashlib.sha256(geometry.encode())
    h.update(k_proj.numpy().tobytes())
    return h.hexdigest()[:16]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def import_reference_checkpoint(k_path: str | Path, v_path: str | Path, geometry: AttentionGeometry,
                                group_size: int | None = None, k_clip: float = DEFAULT_K_CLIP,
                                v_clip: float = DEFAULT_V_CLIP) -> Rotations:
    """Import the authors' ``{k,v}_rotation_*.pt`` checkpoints as an artifact (no centering, fixed clips).

    Args:
        k_path, v_path: the key and value checkpoints: ``{"format_version": 1 | 2, "layers": {i: {"rotation",
            "eigenvalues"}}}``.
        geometry: the model's attention geometry.
        group_size: the quantization group (default: the head dim, at most 128).
        k_clip, v_clip: the clip ratio of every key / value row.
    Shapes:
        format 1, per layer: rotation [D, D], eigenvalues [D]; format 2: [Hkv, D, D] and [Hkv, D].  Eigenvalues
        ascending, as ``eigh`` gives them (stored descending).
    Returns:
        The validated Rotations.
    """
    per_layer = {}
    d, hkv = geometry.head_dim, geometry.num_kv_heads
    for which, path in (("k", k_path), ("v", v_path)):
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises several types for bad pickles
            raise ArtifactError(f"cannot read the reference checkpoint {path}: {exc}") from exc
        layers = ckpt.get("layers") if isinstance(ckpt, dict) else None
        if not isinstance(layers, dict):
            raise ArtifactError(f"{path} is not an OSCAR reference checkpoint (no 'layers' dict)")
        version = ckpt.get("format_version", 1)
        if version not in (1, 2):
            raise ArtifactError(f"{path}: unsupported reference checkpoint format {version!r} (1 or 2)")
        heads = 1 if version == 1 else hkv
        layers = {int(k): v for k, v in layers.items()}
        missing = [i for i in range(geometry.num_layers) if i not in layers]
        if missing:
            raise ArtifactError(f"{path} lacks layers {missing[:5]}{'...' if len(missing) > 5 else ''}")
        rots, lams = [], []
        for i in range(geometry.num_layers):
            r, lam = layers[i].get("rotation"), layers[i].get("eigenvalues")
            if not isinstance(r, torch.Tensor) or not isinstance(lam, torch.Tensor):
                raise ArtifactError(f"{path}: layer {i} lacks its rotation or eigenvalues tensor")
            r, lam = r.float().reshape(-1, *r.shape[-2:]), lam.float().reshape(-1, lam.shape[-1])
            if tuple(r.shape) != (heads, d, d) or tuple(lam.shape) != (heads, d):
                raise ArtifactError(f"{path}: layer {i} has a rotation of shape {tuple(r.shape)} and eigenvalues "
                                    f"{tuple(lam.shape)}; format {version} for this model needs [{heads}, {d}, {d}] "
                                    f"and [{heads}, {d}]" + (" (one rotation per KV head)" if version == 2 else ""))
            rots.append(r)
            lams.append(lam.flip(-1))
        per_layer[which] = (torch.stack(rots), torch.stack(lams))
    g = geometry
    zeros = torch.zeros(g.num_layers, g.num_kv_heads, g.head_dim)
    art = Rotations(per_layer["k"][0], per_layer["v"][0], per_layer["k"][1], per_layer["v"][1], zeros, zeros.clone(),
                    torch.full((g.num_layers, g.num_kv_heads), k_clip), torch.full((g.num_layers, g.num_kv_heads), v_clip),
                    torch.full((g.num_layers,), 2, dtype=torch.int32), g, group_size or min(g.head_dim, 128),
                    {"calibration": {"source": "reference-checkpoint", "k_path": str(k_path), "v_path": str(v_path)}})
    art.validate()
    return art
