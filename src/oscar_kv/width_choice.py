"""Choosing each layer's key and value widths (allocation.py's noise order, optionally checked against a KL target),
with each side's clips fitted at its width: the width step of calibrate.py, which runs it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch
from tqdm.auto import tqdm

from .activations import LayerSample, per_head
from .allocation import (KEY_WIDTHS, VALUE_WIDTHS, WidthChoice, allocate_key_widths, key_logit_noise,
                         split_widths, value_output_noise)
from .artifacts import Rotations
from .calibration_settings import CalibrationSettings
from .memory import bits_per_element
from .models import AttentionGeometry
from .probe import PROBE_SINK, fit_clip_ratios
from .quant import SplitWidth, fake_quantize
from .rotation import compose_split, rotate


def key_noise(rot: Rotations, c_q: torch.Tensor, sample: LayerSample, layer: int) -> torch.Tensor:
    """float64 [Hkv]: the key logit noise (allocation.key_logit_noise) of ``layer``'s keys past the sink on the
    probe, stored at the artifact's key width with its key clips and rescale.  ``c_q``: the layer's query second
    moments [Hkv, D, D] in the model's space."""
    r = per_head(rot.k_rotation[layer], rot.geometry.num_kv_heads, sample.device)
    keys = rotate(sample.k - sample.key_offset(rot.k_mean[layer], rot.k_rope_mean[layer]), r)[:, PROBE_SINK:]
    stored = fake_quantize(keys, int(rot.k_bits[layer]), rot.group_size,
                           rot.k_clip[layer][:, None].float().to(sample.device), rot.k_rescale)
    c_rot = r.double().transpose(-1, -2) @ c_q.to(sample.device, torch.float64) @ r.double()
    return key_logit_noise(keys, stored, c_rot, sample.scale).cpu()


def value_noise(rot: Rotations, sample: LayerSample, layer: int) -> torch.Tensor:
    """float64 [Hkv]: the value output noise (allocation.value_output_noise) of ``layer``'s values past the sink on
    the probe, centered and rotated as the cache stores them, at the artifact's value width with its value clips."""
    r = per_head(rot.v_rotation[layer], rot.geometry.num_kv_heads, sample.device)
    values = rotate(sample.v - rot.v_mean[layer][:, None, :].float().to(sample.device), r)[:, PROBE_SINK:]
    stored = fake_quantize(values, int(rot.v_bits[layer]), rot.group_size,
                           rot.v_clip[layer][:, None].float().to(sample.device), rot.v_rescale)
    return value_output_noise(values, stored).cpu()


# the clip ratios a split width's keys are tried at (one per KV head for both parts, the quietest kept): the
# key logit noise chooses them, not the attention error the plain widths' clips are fitted by
# (probe.fit_clip_ratios), which would run every one of the ~27 split widths through the attention
SPLIT_CLIPS = (1.0, 0.995, 0.99, 0.98, 0.96, 0.94, 0.92, 0.9, 0.85)


def split_rotations(rot: Rotations, c_q: torch.Tensor) -> dict[int, torch.Tensor]:
    """{hi_dims: float32 [L, H, D, D]}: the split keys' rotation (rotation.compose_split) of every layer and head for
    each split the menu has (per-layer artifacts: of the heads' mean query moment, as fit_rotations does)."""
    g = rot.geometry
    shared = rot.k_rotation.shape[1] == 1
    out = {}
    for m in sorted({w.hi_dims for w in split_widths(g.head_dim)}):
        r = torch.empty_like(rot.k_rotation)
        for layer in range(g.num_layers):
            covs = c_q[layer].mean(0, keepdim=True) if shared else c_q[layer]
            for h in range(covs.shape[0]):
                r[layer, h] = compose_split(covs[h], g.head_dim, m)[0].float()
        out[m] = r
    return out


def measure_split_widths(rot: Rotations, c_q: torch.Tensor, probe: list[LayerSample],
                         rotations: dict[int, torch.Tensor]) -> tuple[dict, dict]:
    """Every split width's key logit noise per layer (worst KV head) at its quietest clip of SPLIT_CLIPS per head.

    Returns:
        ({SplitWidth: [noise per layer]}, {SplitWidth: float32 [L, Hkv] clip ratios}).
    """
    g = rot.geometry
    widths = split_widths(g.head_dim)
    noise = {w: [] for w in widths}
    clips = {w: torch.empty(g.num_layers, g.num_kv_heads) for w in widths}
    for layer in range(g.num_layers):
        sample = probe[layer]
        centered = sample.k - sample.key_offset(rot.k_mean[layer], rot.k_rope_mean[layer])
        for m, rotation in rotations.items():
            r = per_head(rotation[layer], g.num_kv_heads, sample.device)
            keys = rotate(centered, r)[:, PROBE_SINK:]
            c_rot = r.double().transpose(-1, -2) @ c_q[layer].to(sample.device, torch.float64) @ r.double()
            errors = {}  # (part, bits, clip) -> the part's stored error
            at_m = [w for w in widths if w.hi_dims == m]  # the part widths that pack at this split (head dim 32: 4
            # wide channels cannot take 3 bits)
            parts = [("hi", b) for b in {w.hi_bits for w in at_m}] + [("lo", b) for b in {w.bits for w in at_m}]
            for part, bits in parts:
                x = keys[..., :m] if part == "hi" else keys[..., m:]
                for c in SPLIT_CLIPS:
                    errors[part, bits, c] = x - fake_quantize(x, bits, x.shape[-1], c, rot.k_rescale)
            for w in at_m:
                per_clip = torch.stack([  # [clips, Hkv]
                    key_logit_noise(torch.cat([errors["hi", w.hi_bits, c], errors["lo", w.bits, c]], -1),
                                    torch.zeros_like(keys), c_rot, sample.scale) for c in SPLIT_CLIPS])
                best, which = per_clip.min(0)
                noise[w].append(float(best.max()))
                clips[w][layer] = torch.tensor([SPLIT_CLIPS[j] for j in which.tolist()])
    return noise, clips


def choose_widths(rot: Rotations, c_q: torch.Tensor, settings: CalibrationSettings, probe: list[LayerSample],
                  seq_len: int, progress: bool = True, kl: Callable[[Rotations], dict] | None = None) -> dict:
    """Set ``rot``'s key and value widths (allocation.py) and, with fitted clips, each side's clips at its width.

    Every candidate width of each side (keys: KEY_WIDTHS, values: VALUE_WIDTHS, or the one width asked for) is
    measured with that side's clips fitted at that width.
    Args:
        rot: the fitted rotations (centering settled), changed in place.
        c_q: the query second moments per layer and KV head, float64 [L, Hkv, D, D] (Statistics.query_moments):
            they weigh the key errors.
        settings: the calibration's settings (key_bits, value_bits, key_noise, kv_bits, max_kl, max_answer_kl,
            clip).
        probe: one held-back LayerSample per layer.
        seq_len: the context the bit budget is counted at (the model's).
        kl: with ``settings.max_kl`` or ``max_answer_kl``, an artifact's measures against the unquantized model:
            {"kl": ...} (kl_measure) and / or {"answer_kl": ...} (needle_measure), as search_kl_steps takes them.
    Returns:
        The manifest's record: the widths, each candidate's noise per layer, the chosen noise, the bits per
        element and the reason (and with max_kl, every KL measured on the way).
    """
    g = rot.geometry
    layers = range(g.num_layers)
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
    plain_rotation = rot.k_rotation.clone()
    split_rotation: dict[int, torch.Tensor] = {}
    # "auto" with one requested key width or without a KL check keeps plain widths (below): the split ones are not
    # measured for nothing
    if settings.key_formats == "split" or (settings.key_formats == "auto" and settings.key_bits == "auto"
                                           and kl_targets(settings)):
        split_rotation = split_rotations(rot, c_q)
        split_noise, split_clips = measure_split_widths(rot, c_q, probe, split_rotation)
        noise.update(split_noise)
        clips.update(split_clips)
    for width in v_candidates:
        rot.set_bits(candidates[0], width)
        if settings.clip == "fit":
            fit_clip_ratios(rot, probe, progress, sides=("v",))
        v_clips[width] = rot.v_clip.clone()
        v_noise[width] = [float(value_noise(rot, probe[i], i).max()) for i in layers]

    def use(k_bits: list[int | SplitWidth], v_bits: list[int]) -> None:
        rot.set_bits(k_bits, v_bits)
        rot.k_clip = torch.stack([clips[w][i] for i, w in enumerate(k_bits)])
        if split_rotation:  # a split layer's keys are stored in its split rotation
            rot.k_rotation = torch.stack([split_rotation[w.hi_dims][i] if isinstance(w, SplitWidth)
                                          else plain_rotation[i] for i, w in enumerate(k_bits)])
        rot.v_clip = torch.stack([v_clips[w][i] for i, w in enumerate(v_bits)])

    def allocate(table: dict, **bounds) -> WidthChoice:
        return allocate_key_widths(table, [v_candidates[0]] * g.num_layers, budget=settings.kv_bits,
                                   seq_len=seq_len, head_dim=g.head_dim, group_size=rot.group_size,
                                   value_noise=v_noise if len(v_candidates) > 1 else None, **bounds)

    def choose(table: dict) -> tuple[WidthChoice, dict | None]:
        """The widths over ``table``'s key candidates, and every KL measured on the way (None: no check)."""
        if len(candidates) == 1 and len(v_candidates) == 1:
            k_bits, v_bits = [candidates[0]] * g.num_layers, [v_candidates[0]] * g.num_layers
            bits = bits_per_element(seq_len, g.head_dim, rot.group_size, 2, k_bits=k_bits, v_bits=v_bits)
            return WidthChoice(k_bits, noise[candidates[0]], round(bits, 4), "requested", 0, v_bits,
                               v_noise[v_candidates[0]]), None
        if not kl_targets(settings):
            return allocate(table, tolerance=settings.key_noise), None
        if kl is None:
            raise ValueError("a KL target needs the KL measure (calibrate passes it)")
        # the tolerance's widenings are the first steps of the same path: with both, the search starts there
        start = allocate(table, tolerance=settings.key_noise).steps if settings.key_noise is not None else 0
        return search_kl_steps(lambda n: allocate(table, tolerance=None, steps=n),
                               lambda c: use(c.k_bits, c.v_bits), lambda: kl(rot), kl_targets(settings), progress,
                               start)

    plain = {w: noise[w] for w in candidates}
    formats = {"plain": plain} if not split_rotation else {"split": noise} if settings.key_formats == "split" else {
        "plain": plain, "split": noise}
    say_auto = None
    if settings.key_formats == "auto" and not kl_targets(settings):  # the key noise does not rank the two families
        say_auto = "no KL check ran (the key noise alone does not rank plain against split widths): plain widths"
    paths = {}
    for name, table in formats.items():
        if progress and len(formats) > 1:
            print(f"  key formats {name}:", flush=True)
        paths[name] = choose(table)
    # below the search's own resolution the two families cost the same: keep plain widths, which decode faster (a
    # split layer takes 1.14-1.41x an INT2 layer's time for 1.10x its bytes: benchmarks/NOTES.md, run SK3)
    one_widening = (bits_per_element(seq_len, g.head_dim, rot.group_size, 2, k_bits=[3] + [2] * (g.num_layers - 1),
                                     v_bits=[2] * g.num_layers)
                    - bits_per_element(seq_len, g.head_dim, rot.group_size, 2, k_bits=[2] * g.num_layers,
                                       v_bits=[2] * g.num_layers))
    chosen = cheapest_meeting(paths, kl_targets(settings), tie_bits=one_widening)
    choice, measured = paths[chosen]
    use(choice.k_bits, choice.v_bits)
    allocated = len(candidates) > 1 or len(v_candidates) > 1
    record = {"k_bits": [w.bits if isinstance(w, SplitWidth) else w for w in choice.k_bits],
              "v_bits": choice.v_bits, "key_noise": choice.noise,
              "key_noise_by_width": {str(w): [round(n, 5) for n in noise[w]] for w in candidates},
              "value_noise": [round(v_noise[w][i], 5) for i, w in enumerate(choice.v_bits)],
              "value_noise_by_width": {str(w): [round(n, 5) for n in v_noise[w]] for w in v_candidates},
              "tolerance": settings.key_noise if allocated else None,
              "budget": settings.kv_bits if allocated else None, "seq_len": seq_len,
              "bits_per_element": choice.bits_per_element, "reason": choice.reason,
              # what the widths cost at the lengths users compare (memory.bits_per_element: windows, scales and zero points counted)
              "bits_per_element_at": {str(n): round(bits_per_element(n, g.head_dim, rot.group_size, 2,
                                                                     k_bits=choice.k_bits, v_bits=choice.v_bits), 4)
                                      for n in (32768, 131072)}}
    if settings.key_formats == "auto" and settings.key_bits == "auto":
        record["key_formats"] = {"chosen": chosen, "reason": say_auto or (
            f"of the widths meeting the KL check, the fewest bits per element at {seq_len} tokens; plain widths "
            f"where they cost at most one layer's widening more ({one_widening:.4f} bits)" if len(paths) > 1
            else ""), "tie_bits": round(one_widening, 5), "paths": {name: {"bits_per_element": c.bits_per_element, "reason": c.reason,
                                        **{k: v for k, v in (m or {}).get(c.steps, {}).items()
                                           if k in ("kl", "answer_kl")}}
                                 for name, (c, m) in paths.items()}}
    if split_rotation:
        record["k_widths"] = [str(w) for w in choice.k_bits]
        record["split_key_noise_by_width"] = {str(w): [round(n, 5) for n in noise[w]] for w in noise
                                              if isinstance(w, SplitWidth)}
    if measured is not None:
        record["max_kl"] = settings.max_kl
        if settings.max_answer_kl is not None:
            record["max_answer_kl"] = settings.max_answer_kl
        record["kl_by_step"] = measured
    return record


def cheapest_meeting(paths: dict[str, tuple[WidthChoice, dict | None]], targets: dict[str, float],
                     tie_bits: float = 0.0) -> str:
    """The name of the path whose widths meet every KL target (as measured at its chosen step) with the fewest bits
    per element; the first path's ("plain") where it meets them within ``tie_bits`` of those, or none meets them."""
    def meets(choice: WidthChoice, measured: dict | None) -> bool:
        if measured is None or choice.steps not in measured:
            return measured is None
        return all(measured[choice.steps][name] <= target for name, target in targets.items())

    meeting = [name for name, (c, m) in paths.items() if meets(c, m)]
    first = next(iter(paths))
    if not meeting:
        return first
    best = min(meeting, key=lambda name: paths[name][0].bits_per_element)
    if first in meeting and paths[first][0].bits_per_element - paths[best][0].bits_per_element <= tie_bits:
        return first
    return best


def kl_targets(settings: CalibrationSettings) -> dict[str, float]:
    """The measures the widths must meet and their targets: {"kl": max_kl, "answer_kl": max_answer_kl}, each where
    it is set (empty: no check)."""
    targets = {"kl": settings.max_kl, "answer_kl": settings.max_answer_kl}
    return {name: target for name, target in targets.items() if target is not None}


def search_kl_steps(allocation: Callable[[int], WidthChoice], use: Callable[[WidthChoice], None],
                    kl: Callable[[], dict], targets: dict[str, float], progress: bool = True, start: int = 0):
    """The fewest widenings along the noise order (allocation.py), at least ``start``, whose measures are all within
    their ``targets`` (the KL on held-back text, the answer KL of the needle probe).

    KL falls as layers widen (each bit divides a layer's key noise by 3-4: benchmarks/NOTES.md, and the noise ranks
    allocations as KL does), so a bisection over the step count measures ~log2(2L) artifacts, not every one.
    Args:
        allocation: the WidthChoice after n widenings (its bits stay within the budget: the path ends there).
        use: sets the artifact's widths (and their clips) to a WidthChoice's.
        kl: the measures of the artifact as it is set now: {"kl": value, "answer_kl": value, ...}; the other
            entries (kl_measure's "kl_by_position") are kept with the step.
        targets: {measure: the most it may be} (kl_targets).
    Returns:
        (the WidthChoice, {step: {"bits_per_element", "kl", ...kl's other entries}} for every step measured).
    """
    last = allocation(10 ** 6)  # as far as the budget (or the widest width) lets the path go
    widest = last.steps
    start = min(start, widest)
    measured: dict[int, dict] = {}

    def shown(n: int, sign: str = "<=") -> str:  # "KL 0.0086 <= 0.01, answer KL 0.21 <= 0.3"
        return ", ".join(f"{name.replace('_', ' ').replace('kl', 'KL')} {measured[n][name]:.4g} {sign} {target:g}"
                         for name, target in targets.items())

    def meets(n: int) -> bool:
        choice = allocation(n)
        use(choice)
        result = kl()
        measured[n] = {"bits_per_element": choice.bits_per_element,
                       **{k: round(v, 6) if k in targets else v for k, v in result.items()}}
        if progress:
            print(f"  KL search: {n} widening(s), {choice.bits_per_element:.3f} bits per element: "
                  + ", ".join(f"{name} {result[name]:.4f}" for name in targets), flush=True)
        return all(result[name] <= target for name, target in targets.items())

    if start and meets(start):  # the usual case with a tolerance: one measurement
        reason = f"the key noise tolerance's {start} widening(s) meet the KL target: measured {shown(start)}"
        return _with_reason(allocation(start), reason), measured
    if not meets(widest):
        reason = (f"the KL target is not met within the budget or the widest widths ({shown(widest, 'against')} "
                  f"with {widest} widenings)")
        return _with_reason(last, reason), measured
    lo, hi = start - 1 if start else -1, widest  # lo misses a target (or is below the path), hi meets them all
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if meets(mid):
            hi = mid
        else:
            lo = mid
    reason = f"the fewest widenings ({hi}) whose measured {shown(hi)}"
    return _with_reason(allocation(hi), reason), measured


def _with_reason(choice: WidthChoice, reason: str) -> WidthChoice:
    return dataclasses.replace(choice, reason=reason)


class NeedleProbePrompt(NamedTuple):
    """One prompt of the needle probe (calibration_text.needle_probe): int64 [1, T] ids (haystack, question, expected answer),
    where the answer starts and where the question starts (the haystack ends)."""

    ids: torch.Tensor
    answer_start: int
    question_start: int


class AnsweredNeedle(NamedTuple):
    """A needle probe prompt the unquantized model answers (answered_needles), with the exact log-probabilities
    (float32 [A, vocab]) of its A answer positions and, for stored haystacks, the haystack's exact K/V (haystack_kv)
    that every artifact's cache is given (None for decoded haystacks); ``answered``: whether the model's most likely
    token is the expected one at every answer position (False only where answered_needles keeps every prompt)."""

    prompt: NeedleProbePrompt
    reference: torch.Tensor
    kv: list | None = None
    answered: bool = True


def answered_needles(model, prompts: list[NeedleProbePrompt], needed: int = 0, progress: bool = False,
                     haystack: str = "decoded", keep_all: bool = False) -> tuple[list[AnsweredNeedle], int]:
    """The needle prompts (calibration_text.needle_probe) whose expected answer the unquantized model itself gives (its most
    likely token, teacher-forced, at every answer position), each with those positions' exact log-probabilities.
    Retrieval the model does not do is none a cache can lose, and bits spent on the answer KL of a prompt it fails buy
    nothing (SmolLM2-135M finds a few multi-key needles of ten at 8K, Qwen2.5-Coder-1.5B nine: benchmarks/NOTES.md).

    ``haystack`` (calibration_settings.NEEDLE_HAYSTACKS) says on which path the answer is read, the one needle_measure
    then scores: "decoded", one forward of the whole prompt (tasks.answer_reference); "stored", the haystack prefilled
    once (kept for the prompts answered) and the question and answer through the unquantized cache holding it, as
    `eval` asks its needles (one long forward per prompt instead of two).

    Args:
        needed: stop as soon as fewer than this many could still be answered (the check would be skipped: on a CPU
            each 8K prompt of SmolLM2-135M is a minute's forward).
        keep_all: keep every prompt, each marked whether answered (``--needle-probe-scored all`` / ``auto``).
    Returns:
        (the prompts answered (with keep_all, every prompt), how many prompts were run).
    """
    from .cache import CacheSettings
    from .evaluate.schemes import standard_scheme
    from .evaluate.tasks import answer_log_probs, answer_reference, haystack_kv

    geometry = AttentionGeometry.of(model.config)
    exact = standard_scheme("bf16", geometry, Rotations.data_free(geometry, "identity"), CacheSettings())
    kept, tried = [], 0
    for prompt in tqdm(prompts, desc="the model's own answers", unit="prompt", disable=not progress):
        if sum(needle.answered for needle in kept) + len(prompts) - tried < needed:
            break
        tried += 1
        ids, start = prompt.ids, prompt.answer_start
        if haystack == "stored":
            tokens = ids[0].tolist()
            kv = haystack_kv(model, tokens[:prompt.question_start])
            reference = answer_log_probs(model, exact, kv, tokens[prompt.question_start:start], tokens[start:])
        else:
            kv, reference = None, answer_reference(model, ids, start)
        found = torch.equal(reference.argmax(-1).cpu(), ids[0, start:].cpu())
        if found or keep_all:
            kept.append(AnsweredNeedle(prompt, reference, kv, found))
    return kept, tried


def needle_measure(model, answered: list[AnsweredNeedle]) -> Callable[[Rotations], dict]:
    """The measure of ``--max-answer-kl``: an artifact's mean KL(unquantized || artifact's cache) over the answer
    tokens of the keyed needle prompts the model answers (answered_needles): {"answer_kl": mean over prompts}.
    Retrieval through many similar needles fails where this grows, while the KL over ordinary text stays small; across
    widths it orders multi-key accuracy (benchmarks/NOTES.md, runs D22-D25).

    On the path answered_needles read each answer: with the stored haystack's K/V (``kv``), only the question and the
    answer go through the artifact's cache holding them (as `eval`'s needle tasks score it); without, the cache is
    simulated over one teacher-forced forward of the whole prompt (tasks.simulated_answer_kl).
    """
    from .cache import CacheSettings, unprepare_model
    from .evaluate.schemes import standard_scheme
    from .evaluate.tasks import answer_log_probs, kl_divergence, simulated_answer_kl

    geometry = AttentionGeometry.of(model.config)

    def answer_kl(scheme, needle: AnsweredNeedle) -> float:
        prompt, reference = needle.prompt, needle.reference
        if needle.kv is None:
            return simulated_answer_kl(model, scheme, prompt.ids, prompt.answer_start, reference)
        ids = prompt.ids[0].tolist()
        question, answer = ids[prompt.question_start:prompt.answer_start], ids[prompt.answer_start:]
        return float(kl_divergence(reference, answer_log_probs(model, scheme, needle.kv, question, answer)).mean())

    def measure(rot: Rotations) -> dict:
        scheme = standard_scheme("oscar", geometry, rot, CacheSettings())
        values = [answer_kl(scheme, needle) for needle in answered]
        unprepare_model(model)
        return {"answer_kl": sum(values) / len(values)}

    return measure


def kl_measure(model, ids: torch.Tensor) -> Callable[[Rotations], dict]:
    """The KL measure of ``--max-kl``: an artifact's mean KL(unquantized || artifact's cache) over ``ids`` (int64
    [1, T]: calibration_text.kl_probe's held-back sequence), as ``oscar-kv eval``'s kl task scores it (the cache simulated
    in one teacher-forced forward): {"kl": mean, "kl_by_position": the mean per power-of-two position bin, rounded}.
    The bins show whether KL still grows at the probe's end (a context past the probe then has more)."""
    from .cache import CacheSettings, unprepare_model
    from .evaluate.schemes import standard_scheme
    from .evaluate.tasks import kl_and_ppl, reference_hidden

    reference = reference_hidden(model, ids)
    geometry = AttentionGeometry.of(model.config)

    def kl(rot: Rotations) -> float:
        scheme = standard_scheme("oscar", geometry, rot, CacheSettings())
        scores = kl_and_ppl(model, scheme, ids, reference)
        unprepare_model(model)
        bins = {end: round(v, 6) for end, v in scores["kl_by_position"].items()}
        return {"kl": scores["kl"], "kl_by_position": bins}

    return kl
