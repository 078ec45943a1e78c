"""Position-aware key centering.

A biased k_proj (Qwen2 / Qwen2.5) adds a large constant to every pre-RoPE key.  RoPE turns that
constant into RoPE_p(b): in each channel pair a sinusoid of the position whose amplitude is |b|.
A constant post-RoPE mean cannot remove it, so it fills the INT2 range and the keys' real content
drowns.  With ``key_centering="rope"`` the cache stores k_p - RoPE_p(mu_pre) (mu_pre: the calibrated
mean pre-RoPE key) and attention adds q . RoPE_p(mu_pre) back exactly; unlike a constant offset it
depends on the key's position, so it does not cancel in softmax.

The model's rotary module supplies the frequencies and scaling, so static RoPE variants (scaled, YaRN,
Llama-3) are followed; the angles p * theta are taken in float64, so the offset is the same function of
the position wherever it is computed (write side in torch, kernels).  Partial rotary (RoPE on the first
rotary_dim channels of a head, rotate-half as Phi-3 or interleaved as GLM) is described by a RotaryLayout;
RoPE that changes with the sequence is refused.  A model whose rotary module keeps one RoPE per layer type (Gemma 3:
base 10000 on its sliding layers, 1e6 and a scaling on its full ones) gets one table per type
(``layer_rope_tables``); the artifact's mu_pre does not depend on the frequencies, each layer's codec turns it with
its own.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch

from .errors import OscarKVError

STEP = 16  # the decode kernel rebuilds RoPE angles in steps of 16 positions (KernelRope)
MIN_PAIRS = 8  # the kernels' dot over pairs needs 2 x pairs >= 16
# the pair counts the CUDA decode kernel compiles (1, 2, 4 MMA k-steps); calibration's "auto" chooses among them
PAIR_COUNTS = (8, 16, 32)
# pairs per KV head calibration keeps by default (and the benchmarks' synthetic mu_pre): scored over the model's
# context, 8 pairs measured lower KL at 32K on Qwen2.5 than 32 pairs scored over the calibration's 1024 positions,
# and the decode kernel runs them within 1.15x of constant centering (benchmarks/NOTES.md, "pairs scored over the
# model's context" and "the attention table with the kept kernel")
DEFAULT_PAIRS = PAIR_COUNTS[0]
TILE_MARGIN = 1024  # table rows beyond the last key position: no kernel tile may reach further past it


class RopeUnsupported(OscarKVError, ValueError):
    """The model's RoPE is not one that position-aware key centering can follow (no rotary module, not a static
    rotate-half or interleaved RoPE over the leading channels), or a caller needs the RoPE table and has none."""


@dataclass(frozen=True)
class RotaryLayout:
    """Which channels of a head RoPE turns together, as D/2 pairs j -> channels (lo_j, hi_j).

    Pairs j < rotary_dim/2 are RoPE's: channels (j, j + rotary_dim/2) (rotate-half: Llama, Phi-3) or (2j, 2j+1)
    (interleaved: GLM).  The pass-through channels past rotary_dim are described as pairs too, j >= rotary_dim/2
    -> (j + rotary_dim/2, j + D/2), turned by angle 0 (cos 1, sin 0).  Why pairs and not a channel permutation
    of q and k: every head keeps D/2 pairs, so the kernels' pair-indexed tables (KernelRope) and their pair loops
    stay as they are; only the host-side maps from pairs to channels (``channels``), the write kernel's partner
    channel and the CUDA prologue's two channel indices know the layout.  Calibration keeps mu_pre zero on the
    pass-through channels (their offset is a constant, which joins mu_K), so those pairs are never visited."""

    head_dim: int
    rotary_dim: int
    interleaved: bool = False

    def __post_init__(self):
        if not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0 and self.head_dim % 2 == 0):
            raise RopeUnsupported(f"RoPE over {self.rotary_dim} of {self.head_dim} channels: position-aware key "
                                  "centering needs an even rotary dim of at most the head dim")

    @classmethod
    def full(cls, head_dim: int) -> "RotaryLayout":
        return cls(head_dim, head_dim)

    @property
    def standard(self) -> bool:
        """Rotate-half over the whole head (pairs (j, j + D/2)): the layouts' fast path, plain slices."""
        return self.rotary_dim == self.head_dim and not self.interleaved

    @property
    def rotated_pairs(self) -> int:
        return self.rotary_dim // 2

    @functools.cached_property
    def channels(self) -> torch.Tensor:
        """int64 [2, D/2]: rows lo, hi, the channels of each pair."""
        half, rh = self.head_dim // 2, self.rotary_dim // 2
        j = torch.arange(half)
        rot = j < rh
        lo = torch.where(rot, 2 * j if self.interleaved else j, j + rh)
        hi = torch.where(rot, 2 * j + 1 if self.interleaved else j + rh, j + half)
        return torch.stack([lo, hi])

    def channels_on(self, device) -> torch.Tensor:
        """``channels`` on ``device`` (copied once per device)."""
        return _channels_on(self, torch.device(device))

    def parts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., D] -> (x at the pairs' lo channels, at their hi channels), [..., D/2] each."""
        if self.standard:
            half = x.shape[-1] // 2
            return x[..., :half], x[..., half:]
        lo, hi = self.channels_on(x.device)
        return x[..., lo], x[..., hi]

    def join(self, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """The inverse of ``parts``: [..., D/2] values of the lo and hi channels -> [..., D]."""
        if self.standard:
            return torch.cat([lo, hi], -1)
        out = lo.new_empty(*lo.shape[:-1], self.head_dim)
        channels = self.channels_on(lo.device)
        out[..., channels[0]], out[..., channels[1]] = lo, hi
        return out

    def spread(self, x: torch.Tensor) -> torch.Tensor:
        """Per-pair values [..., D/2] -> per-channel [..., D], each pair's value on both its channels."""
        return self.join(x, x)

    def turn(self, x: torch.Tensor) -> torch.Tensor:
        """rotate_half in this layout: (lo, hi) -> (-hi, lo) in every pair."""
        lo, hi = self.parts(x)
        return self.join(-hi, lo)

    def pair_frequencies(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """float64 [D/2]: the model's theta_j for the rotated pairs, 0 for the pass-through ones."""
        pad = self.head_dim // 2 - inv_freq.numel()
        return torch.cat([inv_freq.double().cpu(), torch.zeros(pad, dtype=torch.float64)])

    def pair_scales(self, scaling: float) -> torch.Tensor:
        """float64 [D/2]: the rotary module's attention scaling on the rotated pairs, 1 on the pass-through
        ones (transformers concatenates those channels unscaled)."""
        rh = self.rotary_dim // 2
        return torch.cat([torch.full((rh,), float(scaling), dtype=torch.float64),
                          torch.ones(self.head_dim // 2 - rh, dtype=torch.float64)])

    def as_dict(self) -> dict:
        return {"rotary_dim": self.rotary_dim, "interleaved": self.interleaved}


@functools.lru_cache(maxsize=None)
def _channels_on(layout: RotaryLayout, device: torch.device) -> torch.Tensor:
    return layout.channels.to(device)


def _layout(x: torch.Tensor, layout: RotaryLayout | None) -> RotaryLayout:
    return layout if layout is not None else RotaryLayout.full(x.shape[-1])


def rotate_half(x: torch.Tensor, layout: RotaryLayout | None = None) -> torch.Tensor:
    if layout is None or layout.standard:
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], -1)
    return layout.turn(x)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               layout: RotaryLayout | None = None) -> torch.Tensor:
    """RoPE of x with per-channel cos / sin (RopeTable's); ``layout``: None is rotate-half over all channels."""
    return x * cos + rotate_half(x, layout) * sin


def remove_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                layout: RotaryLayout | None = None) -> torch.Tensor:
    """The inverse of ``apply_rope`` (rotation by minus the angle)."""
    return x * cos - rotate_half(x, layout) * sin


def key_offsets(mu_pre: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                layout: RotaryLayout | None = None) -> torch.Tensor:
    """RoPE_p(mu_pre) for every position: mu_pre [H, D], cos/sin [T, D] -> [H, T, D]."""
    return apply_rope(mu_pre[:, None, :].float(), cos, sin, layout)


def find_rotary(model):
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None:
        rotary = next((m for name, m in model.named_modules() if name.endswith("rotary_emb")), None)
    if rotary is None:
        raise RopeUnsupported(f"{type(model).__name__} has no rotary embedding module; position-aware key "
                              "centering needs one (use --key-centering constant)")
    return rotary


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """float64 angles p * theta_i [T, D/2]."""
    return positions.double()[:, None] * inv_freq.double()[None, :]


def mean_phase(inv_freq: torch.Tensor, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(E cos p theta_i, E sin p theta_i) [D/2] float64 over the positions p < ``positions`` (closed form: the
    mean of a geometric series, so a horizon of millions of positions costs nothing)."""
    half = inv_freq.double() / 2
    ratio = torch.where(half == 0, torch.ones_like(half), (positions * half).sin() / (positions * half.sin()))
    centre = (positions - 1) * half
    return ratio * centre.cos(), ratio * centre.sin()


def keep_pairs(mu_pre: torch.Tensor, keep: torch.Tensor, layout: RotaryLayout | None = None) -> torch.Tensor:
    """mu_pre [..., D] with the channel pairs (RotaryLayout.channels) where ``keep`` [..., D/2] is false set to
    zero."""
    return mu_pre * _layout(mu_pre, layout).spread(keep.to(mu_pre.dtype))


def rotated_only(mu_pre: torch.Tensor, layout: RotaryLayout) -> torch.Tensor:
    """mu_pre [..., D] with its pass-through channels zeroed (their offset is a constant: it joins mu_K)."""
    if layout.rotary_dim == layout.head_dim:
        return mu_pre
    keep = torch.arange(layout.head_dim // 2, device=mu_pre.device) < layout.rotated_pairs
    return keep_pairs(mu_pre, keep, layout)


def random_pairs(heads: int, half: int, count: int, gen: torch.Generator) -> torch.Tensor:
    """[heads, half] bool: ``count`` random pairs per head (tests and benchmarks of sparse mu_pre)."""
    keep = torch.zeros(heads, half, dtype=torch.bool)
    for i in range(heads):
        keep[i, torch.randperm(half, generator=gen)[:count]] = True
    return keep


def pair_counts(head_dim: int, rotary_dim: int | None = None) -> tuple[int, ...]:
    """The PAIR_COUNTS a head of ``head_dim`` channels, RoPE on ``rotary_dim`` of them (default all), can keep
    (at most its rotary_dim / 2 rotated pairs), ascending."""
    return tuple(sorted({min(count, (rotary_dim or head_dim) // 2) for count in PAIR_COUNTS}))


def kernel_pairs(mu_pre: torch.Tensor, layout: RotaryLayout | None = None) -> torch.Tensor:
    """[Hkv, R] int32: the channel pairs (RotaryLayout.channels) the kernels visit per KV head.  Calibration keeps
    mu_pre in a few pairs only (CalibrationSettings.rope_pairs); the others are zero and cost nothing when
    skipped.  Live pairs first, padded with dead ones to a power of two >= MIN_PAIRS, sorted."""
    half = mu_pre.shape[-1] // 2
    lo, hi = _layout(mu_pre, layout).parts(mu_pre)
    live = (lo != 0) | (hi != 0)
    count = int(live.sum(-1).max()) if live.numel() else 0
    r = min(half, max(MIN_PAIRS, 1 << max(count - 1, 0).bit_length()))
    order = torch.argsort((~live).to(torch.int8), dim=-1, stable=True)[:, :r]
    return order.sort(-1).values.to(torch.int32).contiguous()


def table_rows(positions: int) -> int:
    """Rows of the kernels' tables for keys at positions < ``positions``: TILE_MARGIN more (the furthest any
    kernel tile reads past its last key), a whole number of STEP rows."""
    return -(-(max(positions, 1) + TILE_MARGIN) // STEP) * STEP


@dataclass
class KernelRope:
    """What the INT2 kernels take for position-aware centering (kernels/decode.py)."""

    mu_pre: torch.Tensor  # [Hkv, D]
    pairs: torch.Tensor  # [Hkv, R] int32 (kernel_pairs): only these pairs of mu_pre may be nonzero
    table: torch.Tensor  # [N, D] float32: cos | sin of p * theta_i (times the RoPE scaling), p < N
    base: torch.Tensor  # [N / STEP + 1, D] float32: the same at p = 0, STEP, 2 STEP, ...
    steps: torch.Tensor  # [D, STEP] float32: rows 2i, 2i+1 = cos(v theta_i), -sin(v theta_i), v < STEP
    phases: torch.Tensor  # [N / STEP, D/2, 2] float32: base as (cos, sin) pairs (the CUDA kernel's loads)
    tile: torch.Tensor  # [2 STEP, D/2, 2] float32: (cos, sin) of v theta_i, v < 2 STEP, unscaled
    # the pairs' channels (pair i: theta_i = 0 and scale 1 past the rotated pairs); None: rotate-half over all D
    layout: RotaryLayout | None = None

    @property
    def rotary_layout(self) -> RotaryLayout:
        return _layout(self.mu_pre, self.layout)

    @property
    def covers(self) -> int:
        """Keys at positions < covers may be scored: every kernel tile reads at most TILE_MARGIN rows past its
        last key, and the tables hold those rows too."""
        return self.table.shape[0] - TILE_MARGIN

    def check(self, positions: int) -> None:
        """The one bound check of the kernels: keys at positions < ``positions`` (a host bound) are scored."""
        if positions > self.covers:
            raise ValueError(f"the RoPE table covers keys at positions < {self.covers}, the call scores keys up "
                             f"to position {positions - 1}")

    @classmethod
    def build(cls, mu_pre: torch.Tensor, inv_freq: torch.Tensor, scaling: float, n: int,
              layout: RotaryLayout | None = None) -> "KernelRope":
        """Fresh tables for keys at positions < n (``RopeTable.kernel_rope`` shares them between layers instead).

        Args:
            mu_pre: the mean pre-RoPE key per KV head, zero outside the pairs to visit.
            inv_freq: the RoPE frequencies theta_i.
            scaling: the rotary module's attention scaling (cos and sin are multiplied by it).
            layout: the pairs' channels; None: rotate-half over all D channels.
        Shapes:
            mu_pre: [Hkv, D]; inv_freq: [rotary_dim / 2].
        """
        layout = _layout(mu_pre, layout)
        return cls(mu_pre, kernel_pairs(mu_pre, layout), *cls.tables(inv_freq, scaling, n, mu_pre.device, layout),
                   layout=layout)

    @staticmethod
    def tables(inv_freq: torch.Tensor, scaling: float, n: int, device,
               layout: RotaryLayout | None = None) -> tuple[torch.Tensor, ...]:
        """(table, base, steps, phases, tile) for keys at positions < n: table_rows(n) rows (a kernel tile may run past the
        last key; its extra rows are read, then masked), float64 angles.  Every table has D/2 pairs: with partial
        rotary (``layout``) the pass-through pairs have angle 0 and scale 1."""
        if layout is not None:
            inv_freq, scaling = layout.pair_frequencies(inv_freq), layout.pair_scales(scaling)
        n = table_rows(n)
        ang = rope_angles(torch.arange(n), inv_freq)
        table = (torch.cat([ang.cos(), ang.sin()], 1) * torch.cat([torch.as_tensor(scaling, dtype=torch.float64)
                                                                    .expand(ang.shape[1])] * 2)).float()
        step = rope_angles(torch.arange(STEP), inv_freq)  # [STEP, D/2]
        steps = torch.stack([step.cos(), -step.sin()], -1).reshape(STEP, -1).T.float()  # [D, STEP] interleaved
        base = table[::STEP].contiguous()
        half = base.shape[1] // 2
        phases = torch.stack([base[:, :half], base[:, half:]], -1)
        tile = rope_angles(torch.arange(2 * STEP), inv_freq)
        tile = torch.stack([tile.cos(), tile.sin()], -1).float()
        return tuple(x.contiguous().to(device) for x in (table, base, steps, phases, tile))


def layer_rope_tables(model, head_dim: int) -> list["RopeTable"]:
    """One RopeTable per decoder layer: the model's one RoPE in every layer, or where its rotary module keeps one
    per layer type (``config.layer_types``, buffers ``<type>_inv_freq``: Gemma 3) the table of each layer's type,
    shared by the layers of that type.  RopeUnsupported unless every table has the same RotaryLayout (the artifact
    records one)."""
    rotary = find_rotary(model)
    types = getattr(model.config, "layer_types", None)
    if getattr(rotary, "inv_freq", None) is not None or not types:
        return [RopeTable(model, head_dim)] * model.config.num_hidden_layers
    tables = {t: RopeTable(model, head_dim, t) for t in dict.fromkeys(types)}
    if len({table.layout for table in tables.values()}) > 1:
        raise RopeUnsupported("the layer types' RoPE turn different channels; position-aware key centering needs "
                              "one layout in every layer")
    return [tables[t] for t in types]


class RopeTable:
    """float32 cos/sin of the model's RoPE by position (float64 angles), grown on demand, shared by all layers
    (of ``layer_type``, where the rotary module keeps a RoPE per layer type: ``layer_rope_tables``)."""

    def __init__(self, model, head_dim: int, layer_type: str | None = None):
        self.rotary, self.head_dim, self.layer_type = find_rotary(model), head_dim, layer_type
        prefix = "" if layer_type is None else f"{layer_type}_"
        inv_freq = getattr(self.rotary, f"{prefix}inv_freq", None)
        if inv_freq is None or not 0 < 2 * inv_freq.numel() <= head_dim:
            raise RopeUnsupported(f"the rotary embedding does not rotate channel pairs of the {head_dim}-channel "
                                  "heads; position-aware key centering needs a RoPE with one frequency per pair")
        self.device = inv_freq.device  # the rotary module's
        self.inv_freq = inv_freq.detach().double().cpu()  # [rotary_dim / 2]
        self.scaling = float(getattr(self.rotary, f"{prefix}attention_scaling", 1.0))
        self._check()
        self.layout = probe_layout(model, self.module_tables, head_dim, self.inv_freq, self.scaling)
        self.cos = self.sin = None  # float32 on the CPU; device copies in _on
        self._on: dict = {}
        self._last = None  # (positions, cos, sin) of the latest call
        self._kernel: dict = {}
        self.bound = None  # reserve(): positions are known to stay below it (no device max per call)

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.numel()

    @torch.no_grad()
    def module_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary module's own cos, sin [1, T, rotary_dim] float32 at ``positions`` [T], on its device."""
        args = (torch.zeros(1, 1, device=self.device, dtype=torch.float32), positions[None].to(self.device))
        return self.rotary(*args) if self.layer_type is None else self.rotary(*args, self.layer_type)

    @torch.no_grad()
    def _check(self) -> None:
        """The model's own cos/sin must be this table's (up to its float32 angles) on the first positions."""
        cos, sin = self.module_tables(torch.arange(64))
        emb = torch.cat([rope_angles(torch.arange(64), self.inv_freq)] * 2, -1)  # the module's rotate-half form
        mine_cos, mine_sin = (emb.cos() * self.scaling).float(), (emb.sin() * self.scaling).float()
        if cos.shape[-1] != self.rotary_dim or not (torch.allclose(cos[0].cpu().float(), mine_cos, atol=1e-5) and
                                                    torch.allclose(sin[0].cpu().float(), mine_sin, atol=1e-5)):
            raise RopeUnsupported("the rotary embedding is not a static RoPE")

    def _tables(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos, sin [n, D] per channel (RotaryLayout.spread of the per-pair values)."""
        ang = rope_angles(torch.arange(n), self.layout.pair_frequencies(self.inv_freq))
        scales = self.layout.pair_scales(self.scaling)
        return (self.layout.spread(ang.cos() * scales).float(), self.layout.spread(ang.sin() * scales).float())

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] float32 for ``positions`` [T] (on the positions' device).  Every layer of a step
        asks with the same tensor: the answer is kept for it (no device sync, no gather per layer)."""
        if self._last is not None and self._last[0] is positions:
            return self._last[1], self._last[2]
        need = 0 if self.bound is not None or not positions.numel() else int(positions.max()) + 1
        if self.cos is None or self.cos.shape[0] < need:
            n = max(need, 2 * (0 if self.cos is None else self.cos.shape[0]), 1024)
            self.cos, self.sin = self._tables(n)
        dev = positions.device
        cos, sin = self._on.get(dev, (None, None))
        if cos is None or cos.shape[0] < self.cos.shape[0]:
            cos, sin = self.cos.to(dev), self.sin.to(dev)
            self._on[dev] = (cos, sin)
        self._last = (positions, cos[positions], sin[positions])
        return self._last[1], self._last[2]

    def reserve(self, n: int, device) -> None:
        """Grow every table to positions < n on ``device`` now, and from then on trust callers that positions
        stay below n (no device max per call: CUDA graph capture forbids the sync; engine/graphs.py)."""
        self(torch.tensor([n - 1], device=device))
        self.kernel_rope(torch.zeros(1, self.head_dim, device=device), n)
        self.layout.channels_on(device)  # partial rotary's channel map, there before any capture reads it
        self.bound = n
        self.forget()

    def forget(self) -> None:
        """Drop the answer kept for the latest positions tensor (before a graph capture: the capture must
        record the lookup, not reuse a result computed outside it)."""
        self._last = None

    def kernel_rope(self, mu_pre: torch.Tensor, n: int, pairs: torch.Tensor | None = None) -> KernelRope:
        """The kernels' argument for keys at positions < n; the tables are shared by all layers, grown on demand.

        Args:
            mu_pre: one layer's mean pre-RoPE key per KV head.
            n: a bound on the key positions the kernels will score.
            pairs: kernel_pairs(mu_pre), which callers keep per layer (computing it syncs the device); None:
                computed here.
        Shapes:
            mu_pre: [Hkv, D]; pairs: int32 [Hkv, R].
        """
        dev = mu_pre.device
        hit = self._kernel.get(dev)
        if hit is None or hit[0].shape[0] < table_rows(n):
            grow = max(n, 2 * (hit[0].shape[0] if hit is not None else 0), 1024)
            hit = KernelRope.tables(self.inv_freq, self.scaling, grow, dev, self.layout)
            self._kernel[dev] = hit
        return KernelRope(mu_pre, kernel_pairs(mu_pre, self.layout) if pairs is None else pairs, *hit,
                          layout=self.layout)

    def offsets(self, mu_pre: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE_p(mu_pre) [H, T, D] float32 at ``positions`` [T] (key_offsets in this table's layout)."""
        return key_offsets(mu_pre, *self(positions), self.layout)


def _apply_function(model):
    """transformers' ``apply_rotary_pos_emb`` of the model's modeling module, None when it has none."""
    for module in model.modules():
        fn = getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", None)
        if callable(fn):
            return fn
    return None


@torch.no_grad()
def probe_layout(model, module_tables, head_dim: int, inv_freq: torch.Tensor, scaling: float) -> RotaryLayout:
    """The RotaryLayout whose RoPE is the model's own ``apply_rotary_pos_emb`` on random keys: rotate-half or
    interleaved over the first 2 len(inv_freq) channels.  ``module_tables``: the rotary module's cos, sin
    (RopeTable.module_tables).  Rotate-half is assumed when the modeling code has no such function (or another
    signature); RopeUnsupported when it has one and neither layout matches it."""
    rotary_dim = 2 * inv_freq.numel()
    candidates = [RotaryLayout(head_dim, rotary_dim), RotaryLayout(head_dim, rotary_dim, interleaved=True)]
    fn = _apply_function(model)
    if fn is None:
        return candidates[0]
    x = torch.randn(1, 1, 4, head_dim, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([1, 7, 30, 200])
    try:
        cos, sin = module_tables(pos)
        device = cos.device
        theirs = fn(x.to(device), x.to(device), cos, sin)[1][0, 0].double().cpu()
    except Exception:  # noqa: BLE001 - a modeling module with another signature: the rotate-half default
        return candidates[0]
    for layout in candidates:
        ang = rope_angles(pos, layout.pair_frequencies(inv_freq))
        scales = layout.pair_scales(scaling)
        mine = apply_rope(x[0, 0].double(), layout.spread(ang.cos() * scales), layout.spread(ang.sin() * scales),
                          layout)
        if torch.allclose(mine, theirs, atol=1e-3):
            return layout
    raise RopeUnsupported(f"the model's apply_rotary_pos_emb is neither rotate-half nor interleaved RoPE over the "
                          f"first {rotary_dim} channels")
