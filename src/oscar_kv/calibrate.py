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
Then R = U . P_br . H_G per head (or per layer, covariances averaged over heads), each layer's key and value
widths with clip ratios fitted at them on a held-back sequence (width_choice.py; probe.py scores that sequence),
and a validation table of per-layer attention error.  The settings are calibration_settings.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .activations import LayerSample, capture_samples, observing, run_layers
from .allocation import KEY_WIDTHS, VALUE_WIDTHS
from .artifacts import DEFAULT_K_CLIP, DEFAULT_V_CLIP, Rotations, model_fingerprint
from .calibration_settings import NEEDLE_PROBE_MEMORY_SHARE, NEEDLE_PROBE_MIN_ANSWERED, CalibrationSettings
from .calibration_text import calibration_sequences, kl_probe, needle_probe, stored_needle_probe_tokens
from .corpus import load_calibration_text
from .errors import ConfigError
from .models import AttentionGeometry
from .parallel import SINGLE, TensorParallel, shard_model
from .memory import bits_per_element
from .probe import layer_error
from .rope import (RopeTable, RopeUnsupported, keep_pairs, layer_rope_tables, mean_phase, pair_counts,
                   remove_rope, rotate_half, rotated_only)
from .rotation import compose
from .width_choice import answered_needles, choose_widths, kl_measure, needle_measure

log = logging.getLogger(__name__)

ROPE_GAIN = 0.05  # "auto" picks position-aware centering when it cuts the probe's attention error by 5%
# "auto" keeps the fewest pairs within this share of the lowest probe error.  Qwen2.5 (pairs scored over 32K):
# 8 pairs 6% above 32's on the probe, KL at 32K 0.030 vs 0.026 and at 8K equal, decode attention ~1.1x instead
# of 1.5-1.95x constant centering's; a key bias spread over every pair measures several times 32's error with 8
# and keeps 32 (benchmarks/NOTES.md, "pairs scored over the model's context")
PAIRS_TOLERANCE = 0.10


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

    def query_moments(self) -> torch.Tensor:
        """C_Q, float64 [L, Hkv, D, D]: the mean q q^T over each KV head's query group (weighs key errors)."""
        return self.qq / self.rows[:, None, None, None]

    def moments(self, key_centering: str, center_values: bool, rope_pairs: int | None = None):
        """(C_Q, C_S, mu_K, mu_V, mu_pre) per layer and KV head, float64: C_Q, C_S [L, Hkv, D, D] (C_S about
        mu_V), the means [L, Hkv, D].  Arguments as ``key_means``; ``center_values``: False makes mu_V zero."""
        rows = self.rows[:, None, None, None]
        toks = self.tokens[:, None, None]
        c_q = self.query_moments()
        mu_k, mu_pre = self.key_means(key_centering, rope_pairs)
        mu_v = self.v_sum / toks if center_values else torch.zeros_like(self.v_sum)
        mean_o = self.o_sum / self.rows[:, None, None]
        # E[(O - mu)(O - mu)^T] = E[O O^T] - mu E[O]^T - E[O] mu^T + mu mu^T
        c_s = (self.oo / rows - mu_v[..., :, None] * mean_o[..., None, :] - mean_o[..., :, None] * mu_v[..., None, :]
               + mu_v[..., :, None] * mu_v[..., None, :])
        return c_q, c_s, mu_k, mu_v, mu_pre


class _PhaseReport:
    """One line per finished calibration phase with its time (the long phases also have progress bars)."""

    def __init__(self, enabled: bool):
        self.enabled, self.last = enabled, time.perf_counter()

    def __call__(self, what: str) -> None:
        now = time.perf_counter()
        if self.enabled:
            tqdm.write(f"calibrate: {what} ({now - self.last:.1f} s)")
        self.last = now


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
    if (settings.max_kl is not None or settings.max_answer_kl is not None) and tp.size > 1:
        # the KL probe runs the whole model in one process: under --tp the widths are the tolerance's alone
        log.warning("the KL check (--max-kl / --max-answer-kl) needs the whole model in one process: skipped under "
                    "--tp %d; the widths are the key-noise tolerance's (calibrate without --tp to check them)", tp.size)
        settings = dataclasses.replace(settings, max_kl=None, max_answer_kl=None)
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
    # the probe's scores (the centering choice, the clips at every width, the noise, the validation table) run where
    # the model does: on the host CPU they were most of a GPU calibration's time (benchmarks/NOTES.md, runs D7-D9)
    probe = [s.to(model.device) for s in probe]
    rotations = fit_rotations(stats, settings, group_size)
    say("rotations fitted (eigen-decompositions)")
    centering = choose_key_centering(rotations, stats, settings, probe)
    say(f"key centering: {centering['chosen']}, {centering['pairs']} RoPE pairs")
    allocated = settings.key_bits == "auto" or settings.value_bits == "auto"  # else the KL target has no choice
    # the checks measure in float32 wherever the model runs: in bfloat16 they measured the forward's own rounding too
    # (SmolLM2's widest widths 0.002 against 0.0001 on a CPU, a fifth of the 0.01 target; NOTES, runs D28-D31)
    with float32_weights(model):
        widths = _checked_widths(model, tokenizer, texts, settings, rotations, stats, probe, max_len, allocated,
                                 progress, say)
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


@contextlib.contextmanager
def float32_weights(model):
    """The model's floating-point parameters in float32 for the block, then back in their own dtypes: a bfloat16 or
    float16 value is exact in float32, so nothing changes the model afterwards (buffers such as RoPE frequencies stay
    as they are)."""
    dtypes = {name: p.dtype for name, p in model.named_parameters() if p.is_floating_point()}
    narrow = {name for name, dtype in dtypes.items() if dtype != torch.float32}
    params = dict(model.named_parameters())
    for name in narrow:
        params[name].data = params[name].data.float()
    try:
        yield
    finally:
        params = dict(model.named_parameters())
        for name in narrow:
            if name in params:
                params[name].data = params[name].data.to(dtypes[name])


def _checked_widths(model, tokenizer, texts, settings: CalibrationSettings, rotations: Rotations, stats: Statistics,
                    probe, max_len: int, allocated: bool, progress: bool, say) -> dict:
    """choose_widths with the checks the settings ask for (the text KL and the needle prompts' answer KL, each
    against the unquantized model): the manifest's widths record, with the probes' lengths and how many needle
    prompts the model answers."""
    kl_ids = kl_probe(tokenizer, texts, settings, max_len) if settings.max_kl is not None and allocated else None
    if kl_ids is not None and progress:  # a forward at 32K is seconds on a GPU, up to an hour on a small CPU
        tqdm.write(f"calibrate: KL check on {kl_ids.shape[1]} held-back tokens: one unquantized forward, then one per "
                   f"point of the widening path measured (--kl-probe-tokens shortens them)")
    measures = [kl_measure(model, kl_ids)] if kl_ids is not None else []
    needles = None
    if settings.max_answer_kl is not None and allocated:
        shorter = stored_needle_probe_tokens(model, settings, max_len)
        if shorter is not None:
            log.warning(f"the needle probe's stored haystacks at the context ({max_len} tokens) would take more than "
                        f"{NEEDLE_PROBE_MEMORY_SHARE:.0%} of the free memory: prompts of {shorter} tokens "
                        f"(--needle-probe-tokens sets their length)")
            settings = dataclasses.replace(settings, needle_probe_tokens=shorter)
        needles = needle_probe(tokenizer, texts, settings, max_len)
    answered, width_settings = [], settings
    if needles:
        length = max(int(prompt.ids.shape[1]) for prompt in needles)
        if progress:
            first, per_point = ("a forward of each prompt", "one forward per answered prompt") \
                if settings.needle_probe_haystack == "decoded" else \
                ("an exact prefill of each prompt's haystack, kept where answered", "its question and answer")
            tqdm.write(f"calibrate: answer KL check on {len(needles)} keyed needle prompts of {length} tokens: the "
                       f"unquantized model's answers first ({first}), then {per_point} per point of the widening "
                       f"path measured (--needle-probe-tokens shortens them)")
        every = settings.needle_probe_scored == "all"
        keep_all = settings.needle_probe_scored != "answered"
        scored, tried = answered_needles(model, needles, 0 if every else NEEDLE_PROBE_MIN_ANSWERED, progress,
                                         settings.needle_probe_haystack, keep_all=keep_all)
        answered = [needle for needle in scored if needle.answered]
        enough = every or len(answered) >= NEEDLE_PROBE_MIN_ANSWERED
        # "2 of 8", or where the rest could not bring the check's minimum: "1 of the first 6 of 8"
        of = f"{len(answered)} of {len(needles)}" if tried == len(needles) else \
            f"{len(answered)} of the first {tried} of {len(needles)}"
        say(f"the unquantized model answers {of} needle prompts"
            + ("; the answer KL is the mean over all of them" if keep_all and enough else
               "" if enough else f": no answer KL check (it needs {NEEDLE_PROBE_MIN_ANSWERED}: over fewer, one "
                                 "barely given answer carries the mean)"))
        if enough:
            measures.append(needle_measure(model, scored))
        elif settings.max_kl is None and settings.key_noise is None and settings.kv_bits is None:
            raise ConfigError(f"the answer KL target is the only width rule, and the model answers {of} "
                              f"needle prompts of {length} tokens (the check needs "
                              f"{NEEDLE_PROBE_MIN_ANSWERED}): add --key-noise, --kv-bits or --max-kl, or a shorter "
                              f"--needle-probe-tokens")
        else:
            width_settings = dataclasses.replace(settings, max_answer_kl=None)
            scored = answered = None  # no check: the kept haystacks' K/V are not held through the widening path
    kl = (lambda rot: {name: value for measure in measures for name, value in measure(rot).items()}) \
        if measures else None
    widths = choose_widths(rotations, stats.query_moments(), width_settings, probe, max_len, progress, kl)
    if kl_ids is not None:
        widths["kl_probe_tokens"] = int(kl_ids.shape[1])
    if needles:
        widths["needle_probe_tokens"] = length
        widths["needle_probe_haystack"] = settings.needle_probe_haystack
        widths["needle_probe_scored"] = settings.needle_probe_scored
        widths["needle_prompts_answered"] = of
    return widths


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
        return sum(layer_error(candidate, probe[i], i) for i in layers) / len(layers)

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


def error_table(rot: Rotations, probe: list[LayerSample]) -> dict[str, list[float]]:
    """Per-layer relative attention error at INT2 for identity, Hadamard-only and this artifact."""
    g = rot.geometry
    baselines = {
        "identity": Rotations.data_free(g, "identity", rot.group_size, DEFAULT_K_CLIP, DEFAULT_V_CLIP),
        "hadamard": Rotations.data_free(g, "hadamard", rot.group_size, DEFAULT_K_CLIP, DEFAULT_V_CLIP),
        "oscar": rot,
    }
    return {name: [round(layer_error(r, probe[i], i), 5) for i in range(g.num_layers)]
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
