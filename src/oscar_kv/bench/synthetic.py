"""What the benchmarks time when no real model is at hand: the attention geometry (Qwen3-8B's by default), a synthetic
artifact shaped like calibrate's (``calibrated_like``), the per-layer key / value widths it is timed at, and filled
pools of random codes.

Widths (``--key-bits`` / ``--value-bits`` / ``--kv-bits``, both benchmarks; a ``--rotations`` directory carries its
own ``k_bits`` / ``v_bits``):

* none of them: every layer at K2V2, the INT2 default (what older results were measured at);
* ``--key-bits B`` / ``--value-bits B``: every layer's keys / values at B bits (the other side at 2);
* ``--kv-bits X``: a mixed allocation like calibrate's (``kv_bits_allocation``): values at ``--value-bits`` (2), keys
  at two adjacent widths of the kernels' key widths (2, 3, 4, 5, 8), K3 and K4 for X between the all-K3 and the all-K4
  cost (about 2.78 and 3.28 bits at 128K tokens; K2 and K3 below, K4 and K5 or K5 and K8 above), as many layers at the wider one as keep the mean stored bits per element at the largest
  ``--contexts`` within X (memory.bits_per_element: BF16 windows and scales and zero points counted), spread evenly over
  the layers.  Calibrate picks which layers by their key noise; decode speed depends only on how many.
"""

from __future__ import annotations

import argparse

import torch

from ..artifacts import ArtifactError

from ..kernels.layout import KERNEL_KEY_WIDTHS, KERNEL_VALUE_WIDTHS
from ..memory import bits_per_element
from ..quant import SplitWidth, parse_key_width
from ..rope import DEFAULT_PAIRS, keep_pairs, random_pairs

GEOMETRY = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, group_size=128, page_size=16, sink_size=64,
                recent_size=256, num_layers=36)


def use_head_dim(head_dim: int) -> None:
    """Time head dim 64 as Llama-3.2-1B's attention (32 query / 8 KV heads of 64 channels, group 64), 128 as
    Qwen3-8B's (GEOMETRY)."""
    GEOMETRY.update(head_dim=head_dim, group_size=min(head_dim, 128))


def layer_geometry(k_bits=2, v_bits: int | None = None):
    """The pool geometry of one Qwen3-8B layer (GEOMETRY) with keys / values at these widths (default K2V2; keys may be
    a quant.SplitWidth), as every attention benchmark times it."""
    from ..kernels.layout import PoolGeometry

    split = k_bits if isinstance(k_bits, SplitWidth) else None
    k_bits = split.bits if split is not None else k_bits
    v_bits = k_bits if v_bits is None else v_bits
    return PoolGeometry(num_layers=1, k_bits=(k_bits,), v_bits=(v_bits,), k_split=(split,),
                        **{k: GEOMETRY[k] for k in ("num_kv_heads", "head_dim", "group_size", "page_size",
                                                    "sink_size", "recent_size")})


def _ints(s: str) -> list[int]:
    out = []
    for part in s.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1024 if part.endswith("k") else 1
        out.append(int(part.rstrip("k")) * mult)
    return out


# ---------------------------------------------------------------------------------------------- widths
def pair_label(k_bits: int, v_bits: int) -> str:
    return f"K{k_bits}V{v_bits}"


def _width(b):
    """A width as the benchmarks key it: an int, or a quant.SplitWidth as it is."""
    return b if isinstance(b, SplitWidth) else int(b)


def _width_order(b) -> tuple:
    """Plain widths in ascending order, then split ones by (narrow bits, channels, wide bits)."""
    return (1, b.bits, b.hi_dims, b.hi_bits) if isinstance(b, SplitWidth) else (0, b, 0, 0)


def widths_label(k_bits, v_bits) -> str:
    """Each side's widths over the layers, e.g. "K3x21 K4x7 / V2" (a side at one width: no count; a split key width
    in parentheses: "K(4x16+2)x9"); "BF16" when no layer is quantized."""
    k_bits, v_bits = [_width(b) for b in k_bits], [int(b) for b in v_bits]
    if all(not isinstance(b, SplitWidth) and b >= 16 for b in k_bits + v_bits):
        return "BF16"

    def side(prefix: str, bits: list) -> str:
        widths = sorted(set(bits), key=_width_order)
        name = {w: f"({w})" if isinstance(w, SplitWidth) else str(w) for w in widths}
        if len(widths) == 1:
            return f"{prefix}{name[widths[0]]}"
        return " ".join(f"{prefix}{name[b]}x{bits.count(b)}" for b in widths)

    return f"{side('K', k_bits)} / {side('V', v_bits)}"


def width_pairs(k_bits, v_bits) -> dict[tuple, list[int]]:
    """The layers of each distinct (key width, value bits) pair, pairs in ascending order (key widths: ints or
    quant.SplitWidth)."""
    out: dict[tuple, list[int]] = {}
    for i, pair in enumerate(zip((_width(b) for b in k_bits), (int(b) for b in v_bits))):
        out.setdefault(pair, []).append(i)
    return dict(sorted(out.items(), key=lambda item: (_width_order(item[0][0]), item[0][1])))


def spread(n: int, num_layers: int) -> list[bool]:
    """``n`` of ``num_layers`` layers picked evenly: layer i when floor((i + 1) n / L) > floor(i n / L)."""
    return [(i + 1) * n // num_layers > i * n // num_layers for i in range(num_layers)]


def kv_bits_allocation(kv_bits: float, num_layers: int, context: int, head_dim: int, group_size: int | None = None,
                       sink_size: int = 64, recent_size: int = 256, value_bits: int = 2) -> list[int]:
    """The keys' widths of the synthetic ``--kv-bits`` allocation (module docstring): two adjacent widths lo < hi of
    KERNEL_KEY_WIDTHS, lo the widest whose all-layer cost at ``context`` tokens is within ``kv_bits``, and as many
    layers at hi (spread evenly) as keep the mean stored bits per element within it.  ValueError outside [all-K2,
    all-K8]."""
    def cost(k_bits):
        return bits_per_element(context, head_dim, group_size, 2, sink_size, recent_size, k_bits=k_bits,
                                v_bits=[value_bits] * num_layers)

    widths = sorted(KERNEL_KEY_WIDTHS)
    flat = {w: cost([w] * num_layers) for w in widths}
    eps = 1e-9
    if not flat[widths[0]] - eps <= kv_bits <= flat[widths[-1]] + eps:
        raise ValueError(f"--kv-bits {kv_bits:g} is outside what keys at {widths[0]}-{widths[-1]} bits with values at "
                         f"{value_bits} cost at {context} tokens: {flat[widths[0]]:.3f}-{flat[widths[-1]]:.3f}")
    lo = max(w for w in widths if flat[w] <= kv_bits + eps)
    if lo == widths[-1]:
        return [lo] * num_layers
    hi = widths[widths.index(lo) + 1]
    best = [lo] * num_layers
    for n in range(1, num_layers + 1):
        k_bits = [hi if wide else lo for wide in spread(n, num_layers)]
        if cost(k_bits) > kv_bits + eps:
            break
        best = k_bits
    return best


def add_width_arguments(ap) -> None:
    """``--key-bits``, ``--value-bits`` and ``--kv-bits`` (module docstring)."""
    ap.add_argument("--key-bits", type=_key_width, default=None,
                    help="every layer's keys at this width (the synthetic or hadamard artifact; default 2): "
                         f"{', '.join(map(str, KERNEL_KEY_WIDTHS))}, or split keys WIDExCHANNELS+NARROW, e.g. 4x16+2 "
                         "(16 channels at 4 bits, the rest at 2; calibrate --key-formats)")
    ap.add_argument("--value-bits", type=int, choices=KERNEL_VALUE_WIDTHS, default=None,
                    help="every layer's values at this width (default 2)")
    ap.add_argument("--kv-bits", type=float, default=None,
                    help="a mixed allocation like calibrate's: keys at K3 / K4 (K2 / K3 below the all-K3 cost, K4 / K5 "
                         "or K5 / K8 above the all-K4 cost), as "
                         "many layers at the wider width, spread evenly, as keep the mean stored bits per element "
                         "at the largest context within X; values at --value-bits")


def _key_width(text: str):
    """--key-bits: a width the kernels read, plain or split (argparse reports the ValueError's message)."""
    width = parse_key_width(text)
    plain = width.bits if isinstance(width, SplitWidth) else width
    if plain not in KERNEL_KEY_WIDTHS or isinstance(width, SplitWidth) and width.hi_bits > 8:
        raise argparse.ArgumentTypeError(f"{text}: the kernels read keys at {', '.join(map(str, KERNEL_KEY_WIDTHS))} "
                                         "bits (a split's narrow width among them, its wide one at most 8)")
    return width


def check_width_arguments(ap, a) -> None:
    """Refuse width options that contradict each other or a ``--rotations`` directory (it has its own widths)."""
    if a.kv_bits is not None and a.key_bits is not None:
        ap.error("--kv-bits chooses the keys' widths: pass it or --key-bits, not both")
    given = a.kv_bits is not None or a.key_bits is not None or a.value_bits is not None
    if given and a.rotations not in (None, "", "synthetic", "hadamard"):
        ap.error(f"--rotations {a.rotations} carries its own per-layer widths (k_bits / v_bits); --key-bits, "
                 "--value-bits and --kv-bits set the synthetic or hadamard artifact's")


def apply_widths(rot, a, context: int, sink_size: int, recent_size: int) -> dict:
    """Set ``rot``'s widths from the parsed width options ``a`` (none: left as they are) and return the record the
    benchmarks write: the label, the widths per layer, the layers per pair and the bits per element at ``context``
    tokens."""
    g = rot.geometry
    key_bits, value_bits, kv_bits = (getattr(a, n, None) for n in ("key_bits", "value_bits", "kv_bits"))
    if kv_bits is not None:
        v = value_bits or 2
        try:
            k = kv_bits_allocation(kv_bits, g.num_layers, context, g.head_dim, rot.group_size, sink_size,
                                   recent_size, v)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        rot.set_bits(k, [v] * g.num_layers)
        rule = (f"--kv-bits {kv_bits:g}: values at {v}, keys at two adjacent widths, as many layers at the wider "
                f"(spread evenly) as keep the bits per element at {context} tokens within {kv_bits:g}")
    elif key_bits is not None or value_bits is not None:
        keys = [key_bits] * g.num_layers if isinstance(key_bits, SplitWidth) else key_bits or 2
        try:
            rot.set_bits(keys, value_bits or 2)
            rot.validate()
        except (ValueError, ArtifactError) as e:
            raise SystemExit(f"--key-bits {key_bits}: {e}") from None
        rule = f"flat: keys at {key_bits or 2}, values at {value_bits or 2} on every layer"
    else:
        rule = "the artifact's k_bits / v_bits"
    return widths_record(rot, context, sink_size, recent_size, rule)


def widths_record(rot, context: int, sink_size: int, recent_size: int, rule: str = "the artifact's k_bits / v_bits"
                  ) -> dict:
    k_bits, v_bits = rot.key_widths(), rot.v_bits.tolist()
    bits = bits_per_element(context, rot.geometry.head_dim, rot.group_size, 2, sink_size, recent_size,
                            k_bits=k_bits, v_bits=v_bits)
    return dict(label=widths_label(k_bits, v_bits), rule=rule, k_bits=[_json_width(b) for b in k_bits], v_bits=v_bits,
                layers={pair_label(*p): len(ls) for p, ls in width_pairs(k_bits, v_bits).items()},
                bits_per_element=round(bits, 4), context=context)


def _json_width(b):
    return str(b) if isinstance(b, SplitWidth) else int(b)


# ---------------------------------------------------------------------------------------------- artifacts
def _orthogonal(h: int, d: int, device) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(h, d, d, dtype=torch.float64))
    return q.float().to(device)


def _rope_mean(h: int, d: int, gen: torch.Generator, pairs: int = DEFAULT_PAIRS, layout=None) -> torch.Tensor:
    """A pre-RoPE key mean as calibration ships it: large (a k_proj bias), live in ``pairs`` of the RoPE pairs
    per head (the rotated ones of ``layout``)."""
    rotated = d // 2 if layout is None else layout.rotated_pairs
    keep = torch.zeros(h, d // 2, dtype=torch.bool)
    keep[:, :rotated] = random_pairs(h, rotated, min(pairs, rotated), gen)
    return keep_pairs(torch.randn(h, d, generator=gen) * 20, keep, layout)


def calibrated_like(geometry, seed: int = 0, pairs: int = DEFAULT_PAIRS, layout=None):
    """A synthetic artifact shaped like the one ``calibrate`` ships, for random-weight models: per-head
    orthogonal key and value rotations, a constant key mean plus per-position means live in ``pairs`` RoPE pairs
    per head (magnitude as _rope_mean), default clips, every layer at K2V2 (``apply_widths`` sets others);
    ``layout``: the model's rope.RotaryLayout where its RoPE is partial or interleaved.  Speed depends on this
    shape, not on the numbers."""
    from ..artifacts import DEFAULT_K_CLIP, DEFAULT_V_CLIP, Rotations

    g = geometry
    gen = torch.Generator().manual_seed(seed)
    rot = Rotations.data_free(g, "hadamard", k_clip=DEFAULT_K_CLIP, v_clip=DEFAULT_V_CLIP)
    for name in ("k_rotation", "v_rotation"):
        q, _ = torch.linalg.qr(torch.randn(g.num_layers * g.num_kv_heads, g.head_dim, g.head_dim, generator=gen,
                                           dtype=torch.float64))
        setattr(rot, name, q.float().view(g.num_layers, g.num_kv_heads, g.head_dim, g.head_dim))
    rot.k_mean = torch.randn(g.num_layers, g.num_kv_heads, g.head_dim, generator=gen)
    rot.k_rope_mean = torch.stack([_rope_mean(g.num_kv_heads, g.head_dim, gen, pairs, layout)
                                   for _ in range(g.num_layers)])
    if layout is not None and not layout.standard:
        rot.rope_layout = layout
    rot.manifest = {"calibration": {"composition": "synthetic calibrated-like (bench.attention.calibrated_like)",
                                    "key_centering": "rope", "rope_pairs": pairs}}
    rot.validate()
    return rot


def load_rotations(spec: str | None, geometry, validate: bool = True, rope_pairs: int = DEFAULT_PAIRS, layout=None):
    """``--rotations`` of the benchmarks: an artifact directory, ``synthetic`` (default: calibrated_like with
    ``rope_pairs`` pairs in ``layout``'s rotated pairs) or ``hadamard`` (data-free, no centering: the cheapest decode
    attention).  ``validate``: a directory's artifact must be for ``geometry`` exactly (else only its KV heads and
    head dim)."""
    from ..artifacts import DEFAULT_K_CLIP, DEFAULT_V_CLIP, Rotations

    if spec in (None, "", "synthetic"):
        return calibrated_like(geometry, pairs=rope_pairs, layout=layout)
    if spec == "hadamard":
        return Rotations.data_free(geometry, "hadamard", k_clip=DEFAULT_K_CLIP, v_clip=DEFAULT_V_CLIP)
    rot = Rotations.load(spec)
    g = rot.geometry
    if (g.num_kv_heads, g.head_dim) != (geometry.num_kv_heads, geometry.head_dim) or \
            (validate and g.as_dict() != geometry.as_dict()):
        raise SystemExit(f"--rotations {spec}: the artifact is for {g.as_dict()}, the benchmark runs {geometry.as_dict()}")
    return rot


# ---------------------------------------------------------------------------------------------- filled pools
def _mixed_batch(geom, bs: int, ctx: int, device, gen: torch.Generator):
    """Uniform-length batch with shuffled physical pages; returns (PagedBatch, quantized pages, window pages)."""
    from ..kernels.layout import PagedBatch

    sp = geom.sink_pages
    nq = geom.int2_pages_for(ctx)
    nw = geom.pages_for(ctx) - nq
    q_ids = torch.randperm(bs * nq, generator=gen).view(bs, nq).int() if nq else torch.zeros(bs, 0, dtype=torch.int32)
    w_ids = torch.randperm(bs * nw, generator=gen).view(bs, nw).int()
    table = torch.cat([w_ids[:, :sp], q_ids, w_ids[:, sp:]], 1)
    batch = PagedBatch(table, torch.full((bs,), ctx, dtype=torch.int32), torch.full((bs,), nq, dtype=torch.int32))
    return batch.to(device), bs * nq, bs * nw


def _fill_pool(pool, gen_device_seed: int = 0):
    """Random codes and zero points (any width: every byte pattern is one), scales and window rows.  A split key
    row's tail (split_keys.py) holds its first part's float16 scale: random bytes there would be NaN or infinite
    one time in 32, so those scales are drawn like the others."""
    from ..kernels.split_keys import tile_views

    torch.manual_seed(gen_device_seed)
    for c in (pool.k_codes, pool.v_codes, pool.k_zero, pool.v_zero):
        c.random_(0, 256)
    for m in (pool.k_scale, pool.v_scale):
        m.uniform_(0.01, 0.1)
    for w in (pool.k_win, pool.v_win):
        w.normal_()
    for i, width in enumerate(pool.geometry.k_split):
        if width is not None:
            tail = tile_views(pool.layer(i)["k_codes"], width, pool.geometry.head_dim)[1]
            scale = torch.empty(tail.shape[:-1] + (1,), dtype=torch.float16, device=tail.device).uniform_(0.01, 0.1)
            tail[..., :2] = scale.view(torch.uint8)


def int2_case(geom, ctx: int, bs: int, device, gen):
    """One timing point: a filled mixed pool (at ``geom``'s widths) of bs sequences of ctx tokens, a bf16 query,
    per-head rotations.  Returns (pool, batch, q, rotations, max quantized pages)."""
    from ..kernels.layout import PagedKVPool

    batch, nq, nw = _mixed_batch(geom, bs, ctx, device, gen)
    pool = PagedKVPool.allocate(geom, nq, nw, device=device)
    _fill_pool(pool)
    q = torch.randn(bs, GEOMETRY["num_q_heads"], geom.head_dim, device=device, dtype=torch.bfloat16)
    rot = _orthogonal(geom.num_kv_heads, geom.head_dim, device)
    return pool, batch, q, rot, geom.int2_pages_for(ctx)
