"""OSCAR calibration: stream attention statistics from real text, fit rotations, write an artifact.

Per layer and KV head h (GQA group of g query heads), accumulated in float64 without storing
activations:
  C_Q  = mean q q^T over the group's post-RoPE queries     -> key rotation (logit error weight)
  mu_K = mean post-RoPE key                                  -> key centering ("constant")
  mu_pre = mean pre-RoPE key (RoPE undone with the layer's tables) -> position-aware key
         centering ("rope", rope.py), kept in the rope_pairs channel pairs where it removes the
         most logit variance (the kernels visit only those); mu_K then holds the constant rest.
         With "auto", the centering and the pair count are chosen on the held-back probe
         (choose_centering: the cheapest whose error is near the best)
  C_S  = mean O O^T over the group's attention outputs       -> value rotation; O = S V, so
         O^T O = V^T S^T S V exactly (centered by mu_V when values are centered)
  mu_V = mean value                                          -> value centering
Then R = U . P_br . H_G per head (or per layer, covariances averaged over heads), optional
clip-ratio fitting on a held-back sequence, and a validation table of per-layer attention error.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .activations import (LayerSample, capture_samples, clip_candidate_errors, observing, quantized_attention_error,
                          run_layers)
from .allocation import (KEY_WIDTHS, VALUE_WIDTHS, WidthChoice, allocate_key_widths, key_logit_noise,
                         value_output_noise)
from .artifacts import DEFAULT_K_CLIP, DEFAULT_V_CLIP, Rotations, model_fingerprint
from .corpus import CorpusError, load_calibration_text
from .errors import ConfigError
from .models import AttentionGeometry
from .parallel import SINGLE, TensorParallel, shard_model
from .memory import bits_per_element
from .quant import check_rescale, fake_quantize
from .rope import (DEFAULT_PAIRS, RopeTable, RopeUnsupported, keep_pairs, layer_rope_tables, mean_phase, pair_counts,
                   remove_rope, rotate_half, rotated_only)
from .rotation import compose, rotate

log = logging.getLogger(__name__)

CLIP_CANDIDATES = (1.0, 0.98, 0.96, 0.94, 0.92, 0.90, 0.88, 0.85, 0.80)
SCOPES = ("per-head", "per-layer")
KEY_CENTERINGS = ("auto", "rope", "constant", "off")
ROPE_GAIN = 0.05  # "auto" picks position-aware centering when it cuts the probe's attention error by 5%
# "auto" keeps the fewest pairs within this share of the lowest probe error.  Qwen2.5 (pairs scored over 32K):
# 8 pairs 6% above 32's on the probe, KL at 32K 0.030 vs 0.026 and at 8K equal, decode attention ~1.1x instead
# of 1.5-1.95x constant centering's; a key bias spread over every pair measures several times 32's error with 8
# and keeps 32 (benchmarks/NOTES.md, "pairs scored over the model's context")
PAIRS_TOLERANCE = 0.10
# How the held-back probe is scored: every position, every key past the sink INT2.  Scoring it as served
# instead (4096 tokens, recent window exact, the last 256 queries) chose harsher key clips on Qwen2.5 that shrank
# the needle's logit more (-1.5 -> -1.7 nats at the retrieval heads) and did not retrieve better
# (benchmarks/NOTES.md, "Long context"); the attention-output error favours clipping that retrieval pays for.
PROBE_QUERIES = None
PROBE_SINK, PROBE_RECENT = 64, 0
# The key logit noise (nats^2, allocation.py) every layer is widened to, and the most mean stored bits per element at
# the model's context the widening may spend.  0.3 on the protocol (benchmarks/NOTES.md, "Issue 34: keys get the bits
# they need"): SmolLM2 and Qwen2.5-Coder-1.5B keep BF16's NIAH and multi-key NIAH within one prompt of ten at 4K-32K,
# KL 0.007-0.009, at 3.0 bits per element (Qwen2.5, 32K); 0.1 (nearly every layer at 4 bits) gains one multi-key
# prompt at 16K for 0.34 more bits; every layer at 3 bits loses a needle on SmolLM2 at 4K
DEFAULT_KEY_NOISE = 0.3
# The KL against the unquantized model that the tolerance's widths must also meet, measured at min(context, 8K) on
# held-back text, else widened further (keys and values in one order).  0.01 at that probe held KL <= 0.016 and top-1
# >= 0.936 to 32K on Gemma 3 270M (the tolerance alone: KL 0.055, top-1 0.88), and is already met by the tolerance's
# widths on Qwen2.5-Coder-1.5B and SmolLM2-135M (KL 0.007-0.009): benchmarks/NOTES.md, runs D6, D10.
DEFAULT_MAX_KL = 0.01
DEFAULT_KV_BITS: float | None = None


@dataclass
class CalibrationSettings:
    """What ``oscar-kv calibrate`` takes (each field's comment says what it does); a bad value raises ConfigError."""

    calib_tokens: int = 8192
    seq_len: int = 1024
    group_size: int | None = None
    rotation_scope: str = "per-head"
    composition: str = "oscar"
    key_centering: str = "auto"  # rope | constant | off, or auto: rope where it measurably helps
    # channel pairs per KV head that rope centering keeps (kernel cost), or "auto": the fewest of
    # rope.PAIR_COUNTS whose probe error is within PAIRS_TOLERANCE of the lowest (choose_centering)
    rope_pairs: int | str = "auto"
    # positions over which the kept pairs are scored (rope_pair_mask); None: the model's max_position_embeddings
    rope_horizon: int | None = None
    center_values: bool = True
    # "fit" picks per layer/head from CLIP_CANDIDATES (SmolLM2 KL 0.0196 -> 0.0164: docs/measurements.md); "fixed"
    # uses k_clip/v_clip
    clip: str = "fit"
    k_clip: float = DEFAULT_K_CLIP
    v_clip: float = DEFAULT_V_CLIP
    probe_tokens: int = 512
    # clipped keys lose the logit of the query aligned with them (the needle); the rescale gives this share of it
    # back (quant.py).  0.5 beat both 0 and 1 on KL and single-needle retrieval (benchmarks/NOTES.md, "rescaled key
    # rows against the needle's shrink")
    key_rescale: float = 0.5
    value_rescale: float = 0.0
    # keys' widths: "auto" lets the allocation (allocation.py) choose per layer from KEY_WIDTHS, or one width for all
    key_bits: int | str = "auto"
    # values' widths: "auto" allocates them with the keys (allocation.py: the value output noise, in the keys' units)
    value_bits: int | str = "auto"
    # "auto" widens the layers whose key logit noise (nats^2 on the held-back text) is above key_noise, noisiest
    # first, while the mean stored bits per element at the model's context stay within kv_bits (None: unbounded)
    key_noise: float | None = DEFAULT_KEY_NOISE
    kv_bits: float | None = DEFAULT_KV_BITS
    # beside the tolerance: the fewest widenings past its point (noisiest part first, within kv_bits) whose KL against
    # the unquantized model, measured on kl_probe_tokens of held-back text (None: min(context, 8192)), is at most
    # max_kl (None: no KL check; ignored where both sides' widths are fixed)
    max_kl: float | None = DEFAULT_MAX_KL
    kl_probe_tokens: int | None = None

    def __post_init__(self):
        if self.key_centering not in KEY_CENTERINGS:
            raise ConfigError(f"key centering must be one of {KEY_CENTERINGS}")
        if self.rotation_scope not in SCOPES:
            raise ConfigError(f"rotation scope must be one of {SCOPES}")
        if self.clip not in ("fixed", "fit"):
            raise ConfigError("clip must be 'fixed' or 'fit'")
        if self.rope_pairs != "auto" and (type(self.rope_pairs) is not int or self.rope_pairs < 1):
            raise ConfigError(f"rope_pairs must be 'auto' or a whole number >= 1, got {self.rope_pairs!r}")
        if self.rope_horizon is not None and (type(self.rope_horizon) is not int or self.rope_horizon < 1):
            raise ConfigError(f"rope_horizon must be a whole number >= 1, got {self.rope_horizon!r}")
        check_rescale(self.key_rescale)
        check_rescale(self.value_rescale)
        if self.key_bits != "auto" and self.key_bits not in KEY_WIDTHS:
            raise ConfigError(f"key bits must be 'auto' or one of {KEY_WIDTHS}, got {self.key_bits!r}")
        if self.value_bits != "auto" and self.value_bits not in VALUE_WIDTHS:
            raise ConfigError(f"value bits must be 'auto' or one of {VALUE_WIDTHS}, got {self.value_bits!r}")
        if self.key_noise is not None and not self.key_noise > 0:
            raise ConfigError(f"the key noise tolerance must be > 0 nats^2, got {self.key_noise}")
        if self.kv_bits is not None and not 2 <= self.kv_bits <= 16:
            raise ConfigError(f"the bit budget must lie in [2, 16] bits per element, got {self.kv_bits}")
        if self.max_kl is not None and not self.max_kl > 0:
            raise ConfigError(f"the KL target must be > 0 nats, got {self.max_kl}")
        if self.kl_probe_tokens is not None and not (type(self.kl_probe_tokens) is int and self.kl_probe_tokens >= 1024):
            raise ConfigError(f"the KL probe needs at least 1024 tokens, got {self.kl_probe_tokens!r}")
        if self.key_bits == "auto" and self.key_noise is None and self.kv_bits is None and self.max_kl is None:
            raise ConfigError("key bits 'auto' needs a key noise tolerance, a bit budget or both")
        if self.calib_tokens < 16 or self.seq_len < 16:
            raise ConfigError("calibration needs at least 16 tokens")
        for c in (self.k_clip, self.v_clip):
            if not 0 < c <= 1:
                raise ConfigError("clip ratios must lie in (0, 1]")


class Statistics:
    """Float64 running sums per layer and KV head.  ``rope``: the model's RoPE table, or one per layer
    (rope.layer_rope_tables: a RoPE per layer type), for position-aware centering; None: no such centering."""

    def __init__(self, geometry: AttentionGeometry, rope: RopeTable | list[RopeTable] | None = None,
                 horizon: int | None = None):
        g = geometry
        self.ropes = [rope] * g.num_layers if isinstance(rope, RopeTable) else rope
        # the layout and rotary dim, the same in every layer (layer_rope_tables checks)
        self.rope = self.ropes[0] if self.ropes else None
        self.horizon = horizon  # positions rope_pair_mask scores pairs over (None: the calibration's own)
        shape_dd = (g.num_layers, g.num_kv_heads, g.head_dim, g.head_dim)
        shape_d = (g.num_layers, g.num_kv_heads, g.head_dim)
        self.geometry = g
        self.qq = torch.zeros(shape_dd, dtype=torch.float64)
        self.oo = torch.zeros(shape_dd, dtype=torch.float64)
        self.o_sum = torch.zeros(shape_d, dtype=torch.float64)
        self.k_sum = torch.zeros(shape_d, dtype=torch.float64)
        self.v_sum = torch.zeros(shape_d, dtype=torch.float64)
        self.k_pre_sum = torch.zeros(shape_d, dtype=torch.float64)  # RoPE undone
        self.cos_sum = torch.zeros(g.num_layers, g.head_dim, dtype=torch.float64)  # over the keys' positions
        self.sin_sum = torch.zeros(g.num_layers, g.head_dim, dtype=torch.float64)
        self.rows = torch.zeros(g.num_layers, dtype=torch.float64)  # query rows per KV head
        self.tokens = torch.zeros(g.num_layers, dtype=torch.float64)

    @torch.no_grad()
    def add(self, layer: int, q, k, v, out) -> None:
        """Accumulate one attention call (an ``activations.observing`` observer).

        Shapes:
            q, out: [B, Hq, T, D]; k, v: [B, Hkv, T, D]; post-RoPE, positions 0..T-1.
        """
        b, hq, t, d = q.shape
        hkv = k.shape[1]
        grouped_q = q.to(torch.float64).reshape(b, hkv, hq // hkv, t, d).transpose(0, 1).reshape(hkv, -1, d)
        grouped_o = out.to(torch.float64).reshape(b, hkv, hq // hkv, t, d).transpose(0, 1).reshape(hkv, -1, d)
        self.qq[layer] += (grouped_q.transpose(1, 2) @ grouped_q).cpu()
        self.oo[layer] += (grouped_o.transpose(1, 2) @ grouped_o).cpu()
        self.o_sum[layer] += grouped_o.sum(1).cpu()
        self.k_sum[layer] += k.to(torch.float64).sum((0, 2)).cpu()
        self.v_sum[layer] += v.to(torch.float64).sum((0, 2)).cpu()
        if self.rope is not None:  # calibration forwards start at position 0
            rope = self.ropes[layer]
            cos, sin = (x.to(k.device, torch.float64) for x in rope(torch.arange(k.shape[2])))
            self.k_pre_sum[layer] += remove_rope(k.to(torch.float64), cos, sin, rope.layout).sum((0, 2)).cpu()
            self.cos_sum[layer] += b * cos.sum(0).cpu()
            self.sin_sum[layer] += b * sin.sum(0).cpu()
        self.rows[layer] += grouped_q.shape[1]
        self.tokens[layer] += b * t

    def gather_heads(self, tp: TensorParallel, geometry: AttentionGeometry) -> None:
        """Replace this rank's per-head sums by all ranks' (in head order); per-layer sums are the same on all."""
        for name in ("qq", "oo", "o_sum", "k_sum", "v_sum", "k_pre_sum"):
            setattr(self, name, tp.gather_heads(getattr(self, name), 1))
        self.geometry = geometry

    def key_means(self, centering: str, pairs: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The key means of one centering.

        Args:
            centering: "rope", "constant" or "off".
            pairs: with "rope", mu_pre keeps only that many channel pairs per head (rope_pair_mask); None: all.
        Returns:
            (mu_K, mu_pre), float64 [L, Hkv, D] each: the constant offset and the mean pre-RoPE key (zeros
            unless "rope").
        """
        toks = self.tokens[:, None, None]
        zeros = torch.zeros_like(self.k_sum)
        if centering == "off":
            return zeros, zeros
        if centering == "constant":
            return self.k_sum / toks, zeros
        if self.rope is None:
            raise RopeUnsupported("position-aware key centering needs the model's RoPE tables")
        layout = self.rope.layout
        # partial rotary: the pass-through channels' mean is a constant offset, left to mu_K
        mu_pre = rotated_only(self.k_pre_sum / toks, layout)
        if pairs is not None and pairs < layout.rotated_pairs:
            mu_pre = keep_pairs(mu_pre, self.rope_pair_mask(mu_pre, pairs), layout)
        # the constant rest: mean_p [k_p - RoPE_p(mu_pre)] = mu_K - mu_pre*E[cos] - rotate_half(mu_pre)*E[sin]
        mean_offset = (mu_pre * (self.cos_sum[:, None] / toks)
                       + rotate_half(mu_pre, layout) * (self.sin_sum[:, None] / toks))
        return self.k_sum / toks - mean_offset, mu_pre

    def rope_pair_mask(self, mu_pre: torch.Tensor, count: int) -> torch.Tensor:
        """[L, Hkv, D/2] bool: the ``count`` channel pairs per head where position-aware centering removes the
        most logit variance over positions p < horizon: the part of RoPE_p(mu_pre) that the constant mean
        (calibration's, c) misses, |mu|^2 E_p |e^{ipt} - c|^2, weighted by the queries' energy in the pair.
        Over the calibration's own positions that is |mu|^2 (1 - |c|^2); over a longer horizon it also counts
        pairs that turn little within a calibration sequence but far by the horizon, which the constant mean leaves
        uncentred at long contexts (benchmarks/NOTES.md, "Why fewer pairs lost at 32K").  The kernels then visit
        only these pairs."""
        layout = self.rope.layout
        toks = self.tokens[:, None]
        scale = torch.stack([layout.pair_scales(rope.scaling) for rope in self.ropes])  # [L, D/2]: each layer's RoPE
        c_cos, c_sin = layout.parts(self.cos_sum)[0] / toks / scale, layout.parts(self.sin_sum)[0] / toks / scale
        if self.horizon is None:
            missed = 1 - c_cos ** 2 - c_sin ** 2
        else:
            phases = [mean_phase(layout.pair_frequencies(rope.inv_freq), self.horizon) for rope in self.ropes]
            m_cos, m_sin = (torch.stack(x) for x in zip(*phases))
            missed = 1 - 2 * (c_cos * m_cos + c_sin * m_sin) + c_cos ** 2 + c_sin ** 2
        lo, hi = layout.parts(mu_pre)
        amplitude = lo ** 2 + hi ** 2
        q_lo, q_hi = layout.parts(torch.diagonal(self.qq, dim1=-2, dim2=-1))
        score = amplitude * missed.clamp_min(0)[:, None] * (q_lo + q_hi)
        score[..., layout.rotated_pairs:] = -1  # pass-through pairs turn by 0: nothing to keep there
        top = score.topk(count, -1).indices
        return torch.zeros_like(score, dtype=torch.bool).scatter_(-1, top, True)

    def moments(self, key_centering: str, center_values: bool, rope_pairs: int | None = None):
        """(C_Q, C_S, mu_K, mu_V, mu_pre) per layer and KV head, float64: C_Q, C_S [L, Hkv, D, D] (C_S about
        mu_V), the means [L, Hkv, D].  Arguments as ``key_means``; ``center_values``: False makes mu_V zero."""
        rows = self.rows[:, None, None, None]
        toks = self.tokens[:, None, None]
        c_q = self.qq / rows
        mu_k, mu_pre = self.key_means(key_centering, rope_pairs)
        mu_v = self.v_sum / toks if center_values else torch.zeros_like(self.v_sum)
        mean_o = self.o_sum / self.rows[:, None, None]
        # E[(O - mu)(O - mu)^T] = E[O O^T] - mu E[O]^T - E[O] mu^T + mu mu^T
        c_s = (self.oo / rows - mu_v[..., :, None] * mean_o[..., None, :] - mean_o[..., :, None] * mu_v[..., None, :]
               + mu_v[..., :, None] * mu_v[..., None, :])
        return c_q, c_s, mu_k, mu_v, mu_pre


def token_sequences(tokenizer, texts: list[str], seq_len: int, count: int) -> list[torch.Tensor]:
    """Concatenate documents (EOS-separated) and cut ``count`` sequences of ``seq_len`` tokens, int64 [1, seq_len]
    each; fewer (with a warning) when the text runs out, CorpusError when it holds less than one."""
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False).input_ids + sep)
        if len(ids) >= seq_len * count:
            break
    available = len(ids) // seq_len
    if available == 0:
        raise CorpusError(f"the calibration text has only {len(ids)} tokens; need at least {seq_len}")
    if available < count:
        log.warning("calibration text yields %d sequences of %d tokens, fewer than the %d asked for",
                    available, seq_len, count)
    return [torch.tensor(ids[i * seq_len:(i + 1) * seq_len]).unsqueeze(0) for i in range(min(count, available))]


class _PhaseReport:
    """One line per finished calibration phase with its time (the long phases also have progress bars)."""

    def __init__(self, enabled: bool):
        self.enabled, self.last = enabled, time.perf_counter()

    def __call__(self, what: str) -> None:
        now = time.perf_counter()
        if self.enabled:
            tqdm.write(f"calibrate: {what} ({now - self.last:.1f} s)")
        self.last = now


def split_probe(tokenizer, texts: list[str], seq_len: int, count: int, probe_tokens: int):
    """(``count`` fitting sequences, the probe [1, <= probe_tokens]): the text after the fitting sequences is
    held back, so clip fitting and validation never see the fitting data."""
    held = math.ceil(probe_tokens / seq_len)
    sequences = token_sequences(tokenizer, texts, seq_len, count + held)
    if len(sequences) < 2:
        raise CorpusError("the calibration text is too short to hold back a validation sequence")
    held = min(held, len(sequences) - 1)
    return sequences[:-held], torch.cat(sequences[-held:], 1)[:, :probe_tokens]


def calibration_sequences(model, tokenizer, settings: CalibrationSettings, texts: list[str]):
    """(fitting sequences, held-back probe ids, sequence length) as ``calibrate`` cuts them from ``texts``: sequences
    capped by the model's context, the probe after them (split_probe)."""
    max_len = getattr(model.config, "max_position_embeddings", None) or settings.seq_len
    seq_len = min(settings.seq_len, max_len, settings.calib_tokens)
    count = math.ceil(settings.calib_tokens / seq_len)
    sequences, probe_ids = split_probe(tokenizer, texts, seq_len, count, min(settings.probe_tokens, max_len))
    return sequences, probe_ids, seq_len


def calibrate(model, tokenizer, settings: CalibrationSettings | None = None, calib_data: list[str] | None = None,
              progress: bool = True, tp: TensorParallel = SINGLE, device: str | None = None) -> Rotations | None:
    """Fit the OSCAR rotations for ``model`` and return them (not yet saved).

    Args:
        model, tokenizer: the model to calibrate and its tokenizer.
        settings: default CalibrationSettings().
        calib_data: .txt / .jsonl files; None: the shipped corpus (corpus.py).
        progress: show progress bars and one line per phase.
        tp: tensor parallelism (parallel.py): every rank calls this with the whole model (e.g. on the CPU); the
            model is sharded and moved to ``device``, each rank accumulates the statistics and probe activations
            of its own KV heads, and rank 0 gathers them and fits the same artifact a single process would.
        device: where the model runs (None: where it is).
    Returns:
        The Rotations with their manifest; None on ranks other than 0.
    """
    settings = settings or CalibrationSettings()
    if settings.max_kl is not None and tp.size > 1:
        # the KL probe runs the whole model in one process: under --tp the widths are the tolerance's alone
        log.warning("the KL check (--max-kl %g) needs the whole model in one process: skipped under --tp %d; the "
                    "widths are the key-noise tolerance's (calibrate without --tp to check them)", settings.max_kl,
                    tp.size)
        settings = dataclasses.replace(settings, max_kl=None)
    geometry = AttentionGeometry.of(model.config)
    fingerprint = model_fingerprint(model)  # of the whole weights, as serving checks them
    if tp.size > 1:
        shard_model(model, tp, device)
        model.to(device)
    elif device is not None:
        model.to(device)
    group_size = settings.group_size or min(geometry.head_dim, 128)
    texts, source = load_calibration_text(calib_data)
    max_len = getattr(model.config, "max_position_embeddings", None) or settings.seq_len
    if settings.key_bits == "auto" and settings.kv_bits is not None:  # refuse before the long passes, not after
        v_least = min(VALUE_WIDTHS) if settings.value_bits == "auto" else settings.value_bits
        narrowest = bits_per_element(max_len, geometry.head_dim, group_size, 2, k_bits=[min(KEY_WIDTHS)],
                                     v_bits=[v_least])
        if settings.kv_bits < narrowest:
            raise ConfigError(f"a budget of {settings.kv_bits:g} bits per element is below the narrowest widths' "
                              f"{narrowest:.3f} at this model's context of {max_len} tokens (keys at "
                              f"{min(KEY_WIDTHS)} bits, values at {v_least})", "kv_bits")
    sequences, probe_ids, seq_len = calibration_sequences(model, tokenizer, settings, texts)

    started = time.perf_counter()
    say = _PhaseReport(progress and tp.is_driver)
    try:
        rope = layer_rope_tables(model, geometry.head_dim)
    except RopeUnsupported as exc:
        if settings.key_centering == "rope":
            raise
        log.info("no position-aware key centering: %s", exc)
        rope = None
    heads = tp.heads(geometry.num_kv_heads)
    horizon = settings.rope_horizon or max_len
    stats = Statistics(dataclasses.replace(geometry, num_kv_heads=heads.stop - heads.start,
                                           num_attention_heads=geometry.num_attention_heads // tp.size), rope, horizon)
    with torch.no_grad(), observing(model, stats.add):
        for ids in tqdm(sequences, desc="calibrating", unit="seq", disable=not progress or not tp.is_driver):
            run_layers(model, ids)
    say(f"statistics over {sum(ids.shape[1] for ids in sequences)} tokens")
    probe = capture_samples(model, probe_ids)
    say(f"held-back probe of {probe_ids.shape[1]} tokens captured")
    if tp.size > 1:  # every rank saw its heads: put them together (rank 0 fits, as one process would)
        stats.gather_heads(tp, geometry)
        probe = [dataclasses.replace(s, q=tp.gather_heads(s.q, 0), k=tp.gather_heads(s.k, 0),
                                     v=tp.gather_heads(s.v, 0)) for s in probe]
        if not tp.is_driver:
            return None
    rotations = fit_rotations(stats, settings, group_size)
    say("rotations fitted (eigen-decompositions)")
    centering = choose_key_centering(rotations, stats, settings, probe)
    say(f"key centering: {centering['chosen']}, {centering['pairs']} RoPE pairs")
    allocated = settings.key_bits == "auto" or settings.value_bits == "auto"  # else the KL target has no choice
    kl = kl_measure(model, tokenizer, texts, settings, max_len) if settings.max_kl is not None and allocated else None
    widths = choose_widths(rotations, stats, settings, probe, max_len, progress, kl)
    say(f"widths: {rotations.width_summary()} ({widths['bits_per_element']:.3f} bits per element at {max_len} "
        f"tokens; {widths['reason']})" + (", clip ratios fitted at each width" if settings.clip == "fit" else ""))
    table = error_table(rotations, probe)
    say("validation table")
    rotations.manifest = {
        "model": getattr(model, "oscar_model_name", getattr(model.config, "_name_or_path", "")),
        "fingerprint": fingerprint,
        # rope_pairs: the pairs per KV head the artifact keeps (0 without position-aware centering), not the request
        "calibration": {**asdict(settings), "rope_pairs": centering["pairs"], "rope_horizon": horizon,
                        "group_size": group_size, "seq_len": seq_len,
                        "sequences": len(sequences), "tokens": int(stats.tokens[0]), "data": source,
                        "seconds": round(time.perf_counter() - started, 1), "key_centering_choice": centering,
                        "widths": widths},
        "validation": {"probe_tokens": int(probe_ids.shape[1]), "attention_relative_error": table},
    }
    return rotations


def fit_rotations(stats: Statistics, settings: CalibrationSettings, group_size: int) -> Rotations:
    """Rotations (rotation.compose per layer and head, or per layer), means and the settings' fixed clips from the
    statistics.  Key centering "auto" fits constant means, and rope_pairs "auto" the most pairs:
    ``choose_key_centering`` settles both afterwards."""
    g = stats.geometry
    centering = "constant" if settings.key_centering == "auto" else settings.key_centering
    # "auto" pairs fit with the most; choose_key_centering settles the count on the probe
    rotary_dim = stats.rope.rotary_dim if stats.rope is not None else None
    pairs = pair_counts(g.head_dim, rotary_dim)[-1] if settings.rope_pairs == "auto" else settings.rope_pairs
    c_q, c_s, mu_k, mu_v, mu_pre = stats.moments(centering, settings.center_values, pairs)
    if settings.rotation_scope == "per-layer":
        c_q, c_s = c_q.mean(1, keepdim=True), c_s.mean(1, keepdim=True)
    heads = c_q.shape[1]
    out = {}
    for which, cov in (("k", c_q), ("v", c_s)):
        rot = torch.empty(g.num_layers, heads, g.head_dim, g.head_dim)
        lam = torch.empty(g.num_layers, heads, g.head_dim)
        for layer in range(g.num_layers):
            for h in range(heads):
                r, e = compose(cov[layer, h], g.head_dim, group_size, settings.composition)
                rot[layer, h], lam[layer, h] = r.float(), e.float()
        out[which] = (rot, lam)
    clips = lambda c: torch.full((g.num_layers, g.num_kv_heads), c)  # noqa: E731
    return Rotations(out["k"][0], out["v"][0], out["k"][1], out["v"][1], mu_k.float(), mu_v.float(),
                     clips(settings.k_clip), clips(settings.v_clip),
                     torch.full((g.num_layers,), 2, dtype=torch.int32), g, group_size, k_rope_mean=mu_pre.float(),
                     k_rescale=settings.key_rescale, v_rescale=settings.value_rescale,
                     rope_layout=stats.rope.layout if stats.rope is not None else None)


def key_noise(rot: Rotations, c_q: torch.Tensor, sample: LayerSample, layer: int) -> torch.Tensor:
    """float64 [Hkv]: the key logit noise (allocation.key_logit_noise) of ``layer``'s keys past the sink on the
    probe, stored at the artifact's key width with its key clips and rescale.  ``c_q``: the layer's query second
    moments [Hkv, D, D] in the model's space."""
    hkv = rot.geometry.num_kv_heads
    r = rot.k_rotation[layer].float()
    r = r.expand(hkv, *r.shape[1:]) if r.shape[0] == 1 else r
    keys = rotate(sample.k - sample.key_offset(rot.k_mean[layer], rot.k_rope_mean[layer]), r)[:, PROBE_SINK:]
    stored = fake_quantize(keys, int(rot.k_bits[layer]), rot.group_size, rot.k_clip[layer][:, None].float(),
                           rot.k_rescale)
    c_rot = r.double().transpose(-1, -2) @ c_q.double() @ r.double()
    return key_logit_noise(keys, stored, c_rot, sample.scale)


def value_noise(rot: Rotations, sample: LayerSample, layer: int) -> torch.Tensor:
    """float64 [Hkv]: the value output noise (allocation.value_output_noise) of ``layer``'s values past the sink on
    the probe, centered and rotated as the cache stores them, at the artifact's value width with its value clips."""
    hkv = rot.geometry.num_kv_heads
    r = rot.v_rotation[layer].float()
    r = r.expand(hkv, *r.shape[1:]) if r.shape[0] == 1 else r
    values = rotate(sample.v - rot.v_mean[layer][:, None, :].float(), r)[:, PROBE_SINK:]
    stored = fake_quantize(values, int(rot.v_bits[layer]), rot.group_size, rot.v_clip[layer][:, None].float(),
                           rot.v_rescale)
    return value_output_noise(values, stored)


def choose_widths(rot: Rotations, stats: Statistics, settings: CalibrationSettings, probe: list[LayerSample],
                  seq_len: int, progress: bool = True, kl: Callable[[Rotations], float] | None = None) -> dict:
    """Set ``rot``'s key and value widths (allocation.py) and, with fitted clips, each side's clips at its width.

    Every candidate width of each side (keys: KEY_WIDTHS, values: VALUE_WIDTHS, or the one width asked for) is
    measured with that side's clips fitted at that width.
    Args:
        rot: the fitted rotations (centering settled), changed in place.
        stats: the calibration statistics (their query second moments weigh the key errors).
        settings: the calibration's settings (key_bits, value_bits, key_noise, kv_bits, max_kl, clip).
        probe: one held-back LayerSample per layer.
        seq_len: the context the bit budget is counted at (the model's).
        kl: with ``settings.max_kl``, the KL against the unquantized model of an artifact (search_kl_steps).
    Returns:
        The manifest's record: the widths, each candidate's noise per layer, the chosen noise, the bits per
        element and the reason (and with max_kl, every KL measured on the way).
    """
    g = rot.geometry
    layers = range(g.num_layers)
    c_q = stats.qq / stats.rows[:, None, None, None]
    candidates = KEY_WIDTHS if settings.key_bits == "auto" else (settings.key_bits,)
    v_candidates = VALUE_WIDTHS if settings.value_bits == "auto" else (settings.value_bits,)
    clips, noise, v_clips, v_noise = {}, {}, {}, {}
    # each side's clips and noise depend on its own width alone (the other side is not quantized in its measure)
    for width in candidates:
        rot.set_bits(width, v_candidates[0])
        if settings.clip == "fit":
            fit_clip_ratios(rot, probe, progress, sides=("k",))
        clips[width] = rot.k_clip.clone()
        noise[width] = [float(key_noise(rot, c_q[i], probe[i], i).max()) for i in layers]
    for width in v_candidates:
        rot.set_bits(candidates[0], width)
        if settings.clip == "fit":
            fit_clip_ratios(rot, probe, progress, sides=("v",))
        v_clips[width] = rot.v_clip.clone()
        v_noise[width] = [float(value_noise(rot, probe[i], i).max()) for i in layers]

    def use(k_bits: list[int], v_bits: list[int]) -> None:
        rot.set_bits(k_bits, v_bits)
        rot.k_clip = torch.stack([clips[w][i] for i, w in enumerate(k_bits)])
        rot.v_clip = torch.stack([v_clips[w][i] for i, w in enumerate(v_bits)])

    def allocate(**bounds) -> WidthChoice:
        return allocate_key_widths(noise, [v_candidates[0]] * g.num_layers, budget=settings.kv_bits,
                                   seq_len=seq_len, head_dim=g.head_dim, group_size=rot.group_size,
                                   value_noise=v_noise if len(v_candidates) > 1 else None, **bounds)

    measured = None
    if len(candidates) == 1 and len(v_candidates) == 1:
        k_bits, v_bits = [candidates[0]] * g.num_layers, [v_candidates[0]] * g.num_layers
        bits = bits_per_element(seq_len, g.head_dim, rot.group_size, 2, k_bits=k_bits, v_bits=v_bits)
        choice = WidthChoice(k_bits, noise[candidates[0]], round(bits, 4), "requested", 0, v_bits,
                             v_noise[v_candidates[0]])
    elif settings.max_kl is not None:
        if kl is None:
            raise ValueError("a KL target needs the KL measure (calibrate passes it)")
        # the tolerance's widenings are the first steps of the same path: with both, the search starts there
        start = allocate(tolerance=settings.key_noise).steps if settings.key_noise is not None else 0
        choice, measured = search_kl_steps(lambda n: allocate(tolerance=None, steps=n),
                                           lambda c: use(c.k_bits, c.v_bits), lambda: kl(rot),
                                           settings.max_kl, progress, start)
    else:
        choice = allocate(tolerance=settings.key_noise)
    use(choice.k_bits, choice.v_bits)
    allocated = len(candidates) > 1 or len(v_candidates) > 1
    record = {"k_bits": choice.k_bits, "v_bits": choice.v_bits, "key_noise": choice.noise,
              "key_noise_by_width": {str(w): [round(n, 5) for n in noise[w]] for w in candidates},
              "value_noise": [round(v_noise[w][i], 5) for i, w in enumerate(choice.v_bits)],
              "value_noise_by_width": {str(w): [round(n, 5) for n in v_noise[w]] for w in v_candidates},
              "tolerance": settings.key_noise if allocated else None,
              "budget": settings.kv_bits if allocated else None, "seq_len": seq_len,
              "bits_per_element": choice.bits_per_element, "reason": choice.reason,
              # what the widths cost at the lengths users compare (memory.bits_per_element: windows, scale/min counted)
              "bits_per_element_at": {str(n): round(bits_per_element(n, g.head_dim, rot.group_size, 2,
                                                                     k_bits=choice.k_bits, v_bits=choice.v_bits), 4)
                                      for n in (32768, 131072)}}
    if measured is not None:
        record["max_kl"] = settings.max_kl
        record["kl_by_step"] = measured
    return record


def search_kl_steps(allocation: Callable[[int], WidthChoice], use: Callable[[WidthChoice], None],
                    kl: Callable[[], float], max_kl: float, progress: bool = True, start: int = 0):
    """The fewest widenings along the noise order (allocation.py), at least ``start``, whose measured KL is at most
    ``max_kl``.

    KL falls as layers widen (each bit divides a layer's key noise by 3-4: benchmarks/NOTES.md, and the noise ranks
    allocations as KL does), so a bisection over the step count measures ~log2(2L) artifacts, not every one.
    Args:
        allocation: the WidthChoice after n widenings (its bits stay within the budget: the path ends there).
        use: sets the artifact's widths (and their clips) to a WidthChoice's.
        kl: the KL of the artifact as it is set now.
        max_kl: the target.
    Returns:
        (the WidthChoice, {step: {"k_bits_mean", "bits_per_element", "kl"}} for every step measured).
    """
    last = allocation(10 ** 6)  # as far as the budget (or the widest width) lets the path go
    widest = last.steps
    start = min(start, widest)
    measured: dict[int, dict] = {}

    def measure(n: int) -> float:
        choice = allocation(n)
        use(choice)
        value = kl()
        measured[n] = {"bits_per_element": choice.bits_per_element, "kl": round(value, 6)}
        if progress:
            print(f"  KL search: {n} widening(s), {choice.bits_per_element:.3f} bits per element: KL {value:.4f}",
                  flush=True)
        return value

    if start and measure(start) <= max_kl:  # the usual case with a tolerance: one measurement
        reason = (f"the key noise tolerance's {start} widening(s) meet the KL target: measured KL "
                  f"{measured[start]['kl']:.4g} <= {max_kl:g}")
        return _with_reason(allocation(start), reason), measured
    if measure(widest) > max_kl:
        reason = (f"the KL target {max_kl:g} is not met within the budget or the widest widths "
                  f"(KL {measured[widest]['kl']:.4g} with {widest} widenings)")
        return _with_reason(last, reason), measured
    lo, hi = start - 1 if start else -1, widest  # KL(lo) > max_kl (or lo is below the path), KL(hi) <= max_kl
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if measure(mid) <= max_kl:
            hi = mid
        else:
            lo = mid
    reason = f"the fewest widenings ({hi}) whose measured KL {measured[hi]['kl']:.4g} is within {max_kl:g}"
    return _with_reason(allocation(hi), reason), measured


def _with_reason(choice: WidthChoice, reason: str) -> WidthChoice:
    return dataclasses.replace(choice, reason=reason)


def kl_measure(model, tokenizer, texts: list[str], settings: CalibrationSettings, max_len: int):
    """The KL measure of ``--max-kl``: an artifact's mean KL(unquantized || artifact's cache) over one sequence of
    ``settings.kl_probe_tokens`` (default min(context, 8192)) cut after the fitting text and the probe, as
    ``oscar-kv eval``'s kl task scores it (the cache simulated in one teacher-forced forward)."""
    from .cache import CacheSettings, unprepare_model
    from .evaluate.schemes import standard_scheme
    from .evaluate.tasks import kl_and_ppl, reference_hidden

    length = min(settings.kl_probe_tokens or 8192, max_len)
    after = math.ceil((settings.calib_tokens + settings.probe_tokens) / length)
    sequences = token_sequences(tokenizer, texts, length, after + 1)
    if len(sequences) <= after:
        log.warning("the calibration text is too short for a KL probe after the fitting text: it overlaps it")
    ids = sequences[-1]
    reference = reference_hidden(model, ids)
    geometry = AttentionGeometry.of(model.config)

    def kl(rot: Rotations) -> float:
        scheme = standard_scheme("oscar", geometry, rot, CacheSettings())
        value = kl_and_ppl(model, scheme, ids, reference)["kl"]
        unprepare_model(model)
        return value

    return kl


@dataclass(frozen=True)
class CenteringChoice:
    """What ``choose_centering`` picked, and why."""

    centering: str  # "rope" or "constant"
    pairs: int  # channel pairs per KV head the kernels visit for the per-position term (0 with constant)
    rope_pairs: int  # the rope candidate weighed against constant (the one chosen when centering is "rope")
    reason: str


def choose_centering(rope_errors: dict[int, float], constant_error: float | None = None,
                     pairs: int | None = None) -> CenteringChoice:
    """The cheapest key centering the probe errors justify.

    Rope is chosen over constant when its lowest error (the count the probe sees most of the position-dependent
    mean with) is ROPE_GAIN below constant's: whether the keys carry such a mean is the model's, and a short probe
    understates what fewer pairs scored over a long horizon keep.

    Args:
        rope_errors: the probe error of position-aware centering per pair count (the kernels' cost grows with it).
        constant_error: constant centering's, or None when it is not a candidate.
        pairs: the pair count asked for, or None to take the fewest within PAIRS_TOLERANCE of the lowest error.
    """
    lowest = min(rope_errors.values())
    best_pairs = min(p for p, e in rope_errors.items() if e == lowest)
    if pairs is not None:
        rope = f"rope with {pairs} pairs (asked for)"
    else:
        pairs = min(p for p, e in rope_errors.items() if e <= (1 + PAIRS_TOLERANCE) * lowest)
        if len(rope_errors) == 1:
            rope = f"rope with {pairs} pairs"
        elif pairs == best_pairs:
            rope = f"rope with {pairs} pairs (the lowest rope error)"
        else:
            rope = (f"rope with {pairs} pairs (the fewest within {PAIRS_TOLERANCE:.0%} of the lowest rope error, "
                    f"{lowest:.4f} with {best_pairs})")
    if constant_error is None:
        return CenteringChoice("rope", pairs, pairs, rope)
    gain = 1 - lowest / constant_error if constant_error > 0 else 0.0
    measured = f"rope with {best_pairs} pairs" if len(rope_errors) > 1 or best_pairs != pairs else "it"
    if gain < ROPE_GAIN:
        return CenteringChoice("constant", 0, pairs, f"{rope}: {measured} is only {gain:.1%} below constant, under "
                                                     f"the {ROPE_GAIN:.0%} it needs")
    return CenteringChoice("rope", pairs, pairs, f"{rope}: {measured} is {gain:.1%} below constant")


def choose_key_centering(rot: Rotations, stats: Statistics, settings: CalibrationSettings,
                         probe: list[LayerSample]) -> dict:
    """Settle what the settings leave to "auto" (the key centering, the RoPE pair count or both).

    Measures the mean INT2 attention error on the held-back probe for each candidate and sets ``rot``'s key means
    (k_mean, k_rope_mean) to choose_centering's pick.

    Args:
        rot: fit_rotations' result, changed in place.
        stats: the statistics it was fitted from.
        settings: the calibration's settings.
        probe: one held-back LayerSample per layer.
    Returns:
        The record for the manifest: "chosen", "pairs", "reason" and, when measured, the probe errors.
    """
    requested, pairs_asked = settings.key_centering, settings.rope_pairs
    if requested in ("constant", "off"):
        return {"chosen": requested, "pairs": 0, "reason": "requested"}
    if stats.rope is None:  # calibrate() refused "rope" already
        return {"chosen": "constant", "pairs": 0, "reason": "the model's RoPE does not allow position-aware "
                                                           "centering (a static rotate-half or interleaved RoPE)"}
    half = stats.rope.layout.rotated_pairs
    if requested == "rope" and pairs_asked != "auto":  # nothing left to choose: fit_rotations applied it
        return {"chosen": "rope", "pairs": min(pairs_asked, half), "reason": "requested"}
    # "auto" centering weighs rope at the most pairs too: the probe sees the position-dependent mean best there
    asked = None if pairs_asked == "auto" else min(pairs_asked, half)
    available = pair_counts(rot.geometry.head_dim, stats.rope.rotary_dim)
    most = available[-1]
    counts = available if asked is None else sorted({asked, most} if requested == "auto" else {asked})
    layers = range(rot.geometry.num_layers)

    def probe_error(means: tuple[torch.Tensor, torch.Tensor]) -> float:
        candidate = dataclasses.replace(rot, k_mean=means[0].float(), k_rope_mean=means[1].float())
        return sum(_layer_error(candidate, probe[i], i) for i in layers) / len(layers)

    rope_means = {p: stats.key_means("rope", p) for p in counts}
    rope_errors = {p: probe_error(m) for p, m in rope_means.items()}
    constant_means = stats.key_means("constant") if requested == "auto" else None
    constant_error = probe_error(constant_means) if constant_means is not None else None
    choice = choose_centering(rope_errors, constant_error, asked)
    mu_k, mu_pre = rope_means[choice.pairs] if choice.centering == "rope" else constant_means
    rot.k_mean, rot.k_rope_mean = mu_k.float(), mu_pre.float()
    errors = {"constant": constant_error, "rope": rope_errors[choice.rope_pairs]}  # rope: the candidate weighed
    return {"chosen": choice.centering, "pairs": choice.pairs,
            "probe_error": {k: round(v, 5) for k, v in errors.items() if v is not None},
            "probe_error_by_pairs": {str(p): round(e, 5) for p, e in rope_errors.items()},
            "reason": choice.reason}


def _layer_error(rot: Rotations, sample: LayerSample, layer: int, k_clip=None, v_clip=None, **kwargs) -> float:
    """The probe's attention error of ``layer`` with each side stored at the artifact's width (16: at 2, as the
    validation table compares schemes at INT2)."""
    k_bits, v_bits = (b if b < 16 else 2 for b in rot.side_bits(layer))
    return quantized_attention_error(
        sample, rot.k_rotation[layer], rot.v_rotation[layer],
        sample.key_offset(rot.k_mean[layer], rot.k_rope_mean[layer]), rot.v_mean[layer],
        rot.k_clip[layer] if k_clip is None else k_clip, rot.v_clip[layer] if v_clip is None else v_clip,
        bits=k_bits, value_bits=v_bits, group_size=rot.group_size, sink_size=PROBE_SINK, recent_size=PROBE_RECENT,
        queries=PROBE_QUERIES, rescale=(rot.k_rescale, rot.v_rescale), **kwargs)


def fit_clip_ratios(rot: Rotations, probe: list[LayerSample], progress: bool = True,
                    sides: tuple[str, ...] = ("k", "v")) -> None:
    """Set ``rot``'s k_clip / v_clip in place: per layer (and KV head when rotations are per head), the ratio of
    CLIP_CANDIDATES that minimizes the attention output error on the held-back ``probe`` (one LayerSample per
    layer) with that side stored at its width (k_bits / v_bits; a layer at 16 bits keeps its clips), keys and
    values separately.  ``sides``: which of "k" and "v" to fit."""
    hkv = rot.geometry.num_kv_heads
    per_head = rot.scope == "per-head"
    candidates = torch.tensor(CLIP_CANDIDATES)
    for layer in tqdm(range(rot.geometry.num_layers), desc="fitting clip ratios", disable=not progress):
        sample = probe[layer]
        offset = sample.key_offset(rot.k_mean[layer], rot.k_rope_mean[layer])
        for which, bits in zip(("k", "v"), rot.side_bits(layer)):
            if which not in sides or bits == 16:
                continue
            errors = torch.stack([clip_candidate_errors(
                sample, h, rot.k_rotation[layer], rot.v_rotation[layer], offset, rot.v_mean[layer], which,
                candidates, bits, rot.group_size, PROBE_SINK, PROBE_RECENT, PROBE_QUERIES,
                getattr(rot, f"{which}_rescale")) for h in range(hkv)])
            clips = getattr(rot, f"{which}_clip")
            if per_head:
                clips[layer] = candidates[errors.argmin(-1)]
            else:  # one clip for the layer's heads
                clips[layer, :] = candidates[errors.sum(0).argmin()]


def error_table(rot: Rotations, probe: list[LayerSample]) -> dict[str, list[float]]:
    """Per-layer relative attention error at INT2 for identity, Hadamard-only and this artifact."""
    g = rot.geometry
    baselines = {
        "identity": Rotations.data_free(g, "identity", rot.group_size, DEFAULT_K_CLIP, DEFAULT_V_CLIP),
        "hadamard": Rotations.data_free(g, "hadamard", rot.group_size, DEFAULT_K_CLIP, DEFAULT_V_CLIP),
        "oscar": rot,
    }
    return {name: [round(_layer_error(r, probe[i], i), 5) for i in range(g.num_layers)]
            for name, r in baselines.items()}


def format_error_table(table: dict[str, list[float]]) -> str:
    names = list(table)
    lines = ["layer  " + "  ".join(f"{n:>9}" for n in names)]
    for i in range(len(table[names[0]])):
        lines.append(f"{i:5d}  " + "  ".join(f"{table[n][i]:9.4f}" for n in names))
    lines.append(" mean  " + "  ".join(f"{sum(table[n]) / len(table[n]):9.4f}" for n in names))
    return "\n".join(lines)


def write_summary(rot: Rotations, directory: Path) -> None:
    """Write the manifest's validation table to ``directory``/validation.txt and log the calibration settings."""
    (directory / "validation.txt").write_text(
        format_error_table(rot.manifest["validation"]["attention_relative_error"]) + "\n")
    log.info("artifact written to %s: %s", directory, json.dumps(rot.manifest["calibration"]))
