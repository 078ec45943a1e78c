"""What ``oscar-kv calibrate`` takes: CalibrationSettings and its defaults.

A module of its own so that the calibration's steps (width_choice.py) can read the settings without importing
calibrate.py, which runs those steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from .allocation import KEY_WIDTHS, VALUE_WIDTHS
from .artifacts import DEFAULT_K_CLIP, DEFAULT_V_CLIP
from .errors import ConfigError
from .quant import check_rescale

SCOPES = ("per-head", "per-layer")
KEY_CENTERINGS = ("auto", "rope", "constant", "off")
KEY_FORMATS = ("plain", "split", "auto")
# The key logit noise (nats^2, allocation.py) every layer is widened to, and the most mean stored bits per element at
# the model's context the widening may spend.  0.3 on the protocol (benchmarks/NOTES.md, "Issue 34: keys get the bits
# they need"): SmolLM2 and Qwen2.5-Coder-1.5B keep BF16's NIAH and multi-key NIAH within one prompt of ten at 4K-32K,
# KL 0.007-0.009, at 3.0 bits per element (Qwen2.5, 32K); 0.1 (nearly every layer at 4 bits) gains one multi-key
# prompt at 16K for 0.34 more bits; every layer at 3 bits loses a needle on SmolLM2 at 4K
DEFAULT_KEY_NOISE = 0.3
# The KL against the unquantized model that the tolerance's widths must also meet, measured on held-back text at
# min(context, KL_PROBE_MAX_TOKENS), else widened further (keys and values in one order).  0.01 at an 8K probe held
# KL <= 0.016 and top-1 >= 0.936 to 32K on Gemma 3 270M (the tolerance alone: KL 0.055, top-1 0.88), and is already
# met by the tolerance's widths on Qwen2.5-Coder-1.5B and SmolLM2-135M (KL 0.007-0.009): benchmarks/NOTES.md, runs
# D6, D10.
DEFAULT_MAX_KL = 0.01
# The KL probe's longest length.  KL grows with the history a token sees (Gemma 3 270M: a KL of 0.046 at an 8K probe
# was 0.081 at 32K; the positions past 16K alone 0.10; run D13), so the target is measured at the model's context,
# up to 32K (one forward per measurement: seconds on a GPU; minutes to an hour for a 1B+ model on a CPU, where
# --kl-probe-tokens shortens it).  Longer contexts take the 32K measurement.
KL_PROBE_MAX_TOKENS = 32768
DEFAULT_KV_BITS: float | None = None
# The answer KL the widths must also meet: the mean KL against the unquantized model over the answer tokens of the
# needle probe below.  Multi-key retrieval fails where the KL over ordinary text stays small (Qwen2.5-Coder-1.5B at
# 16K: text KL 0.0065, multi-key 0.73 against BF16's 0.93); across eight widths the evaluation's answer KL ordered
# multi-key accuracy with Spearman -0.96, and a 0.01 target (the text KL's own) chose 3.30 bits at 32K that keep
# multi-key within 0.10 of BF16 (0.83), where the text KL alone chose 2.98 (benchmarks/NOTES.md, runs D24-D25).
DEFAULT_MAX_ANSWER_KL = 0.01
# The needle probe: NEEDLE_PROBE_PROMPTS keyed needle prompts (four keyed numbers, a question for one) of the model's
# context (needle_probe_tokens) cut from held-back text; one unquantized forward each for the model's own answers.
NEEDLE_PROBE_PROMPTS = 8
# The decoded haystack's prompts are at most this long: it costs one float32 forward of every prompt per measurement
# (~95 s of H200 time per measurement at 64K on Qwen2.5-Coder-1.5B), where a stored haystack costs a few dozen tokens.
NEEDLE_PROBE_MAX_TOKENS = 16384
# The stored haystacks' K/V (float32, every layer, each prompt's) take at most this share of the memory free where the
# model runs; a longer context gets prompts that fit (calibrate says so; --needle-probe-tokens overrides).
NEEDLE_PROBE_MEMORY_SHARE = 0.5
# The check needs the model to answer at least half of them: over fewer, the mean is carried by one or two answers the
# model barely gives (SmolLM2-135M answers 2 of 8 at 8K: four calibrations that differed only in float rounding
# measured the same widening step's answer KL at 0.028-0.18 and chose 3.72-4.37 bits; Qwen2.5-Coder-1.5B answers 8 of
# 8 at 16K and moved one widening of 55; benchmarks/NOTES.md, runs D28-D32).
NEEDLE_PROBE_MIN_ANSWERED = NEEDLE_PROBE_PROMPTS // 2
# How the needle probe's haystack reaches the cache.  "stored" (the default): the haystack is prefilled exactly once
# and its K/V stored in the artifact's cache, then only the question and the answer run through it (as `eval`'s needle
# tasks, generate()'s one-forward prefill and a prefix-cache hit): one exact forward per prompt for the whole
# calibration, a few dozen tokens per measurement, the prompts' K/V held meanwhile.  "decoded": every haystack token
# is decoded through the simulated cache (one teacher-forced float32 forward of the whole prompt per measurement, as
# the KL check, and as chunked prefill sees earlier chunks).  Why "stored" at the context: on Qwen2.5-Coder-1.5B with
# YaRN at 64K the 16K decoded probe lost one single needle and two multi-key answers of twelve (NIAH 0.92, multi-key
# 0.50 against BF16's 1.00 / 0.67), the 64K stored probe none (1.00 / 0.83) for 0.04 more bits per element; at 32K it
# chose 2.68 bits where the decoded probe at 32K chose 2.76 (NIAH and multi-key the same, BF16's), calibrating in 251 s
# instead of 1,037; SmolLM2-135M's widths stay the same (benchmarks/NOTES.md, runs D43, D46, D50-D53).
NEEDLE_HAYSTACKS = ("decoded", "stored")
# Which needle prompts the answer KL is the mean over.  "answered": those whose expected answer the unquantized model
# gives (at least NEEDLE_PROBE_MIN_ANSWERED of them); "all": every prompt, as `eval` scores its needles' answer KL
# (the reference is the unquantized model's distribution whether or not its top token is the answer: a cache moves
# most probability where the model is least sure); "auto" (the default): every prompt where the model answers at
# least NEEDLE_PROBE_MIN_ANSWERED of them, no check where it answers fewer.  Why: on Qwen2.5-Coder-1.5B at 32K (5 of 8
# answered) the answered-only mean read a third of the evaluation's answer KL and its widths (2.68 bits) kept multi-key
# 0.77 at 16K against BF16's 0.93; every prompt scored kept 0.87 / 0.47 (BF16 0.93 / 0.43) at 3.29 bits, and NIAH and
# multi-key at BF16's from 8K to 128K with YaRN.  Over a model that answers few (SmolLM2-135M 2 of 8 at 8K) the mean
# is carried by answers it barely gives and would widen it by 0.6-0.85 bits where it already keeps BF16's retrieval
# (benchmarks/NOTES.md, runs D41, D59-D62, D65-D66).
NEEDLE_SCORED = ("auto", "answered", "all")


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
    # rope.PAIR_COUNTS whose probe error is within PAIRS_TOLERANCE of the lowest (calibrate.choose_centering)
    rope_pairs: int | str = "auto"
    # positions over which the kept pairs are scored (calibrate.Statistics.rope_pair_mask); None: the model's
    # max_position_embeddings
    rope_horizon: int | None = None
    center_values: bool = True
    # "fit" picks per layer/head from probe.CLIP_CANDIDATES (SmolLM2 KL 0.0196 -> 0.0164: docs/measurements.md);
    # "fixed" uses k_clip/v_clip
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
    # "split" adds split key widths to "auto"'s candidates (allocation.py, "Split keys"): a layer's keys may store
    # the queries' top eigen-directions wider than the rest; "plain": one width a row; "auto": both paths through the
    # KL check, the fewer bits that meet it, plain within one layer's widening (the key noise ranks widths within a
    # family, not plain against split: benchmarks/NOTES.md, runs D36-D38); without a KL check, plain.  The default:
    # it chose split on Qwen2.5 at 32K (2.77 bits against plain's 3.30, every accuracy target met) and plain on
    # SmolLM2, Gemma 3 and Qwen2.5 with YaRN at 128K (runs D38-D44; on a CPU SmolLM2 gets the GPU's widths).  The
    # serving engine reads both (split layers in the CUDA decode kernel at head dim 64 and 128, 1.14-1.41x an INT2
    # layer's time for 1.10x its bytes at 4x16+2: run SK3)
    key_formats: str = "auto"
    # values' widths: "auto" allocates them with the keys (allocation.py: the value output noise, in the keys' units)
    value_bits: int | str = "auto"
    # "auto" widens the layers whose key logit noise (nats^2 on the held-back text) is above key_noise, noisiest
    # first, while the mean stored bits per element at the model's context stay within kv_bits (None: unbounded)
    key_noise: float | None = DEFAULT_KEY_NOISE
    kv_bits: float | None = DEFAULT_KV_BITS
    # beside the tolerance: the fewest widenings past its point (noisiest part first, within kv_bits) whose KL against
    # the unquantized model, measured on kl_probe_tokens of held-back text (None: min(context, KL_PROBE_MAX_TOKENS)),
    # is at most max_kl (None: no KL check; ignored where both sides' widths are fixed)
    max_kl: float | None = DEFAULT_MAX_KL
    kl_probe_tokens: int | None = None
    # beside (or instead of) max_kl: the most mean KL against the unquantized model over the answer tokens of the
    # needle probe (None: not measured); the same widening path and bisection
    max_answer_kl: float | None = DEFAULT_MAX_ANSWER_KL
    # None: the context (decoded haystacks: at most NEEDLE_PROBE_MAX_TOKENS; stored: as long as NEEDLE_PROBE_MEMORY_SHARE
    # of free memory holds them)
    needle_probe_tokens: int | None = None
    needle_probe_haystack: str = "stored"  # one of NEEDLE_HAYSTACKS
    needle_probe_scored: str = "auto"  # one of NEEDLE_SCORED

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
        if self.key_formats not in KEY_FORMATS:
            raise ConfigError(f"key formats must be one of {KEY_FORMATS}, got {self.key_formats!r}")
        if self.key_formats == "split" and self.key_bits != "auto":  # "auto" with one key width: plain
            raise ConfigError("split key widths are chosen by the allocation: they need key bits 'auto'")
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
        if self.max_answer_kl is not None and not self.max_answer_kl > 0:
            raise ConfigError(f"the answer KL target must be > 0 nats, got {self.max_answer_kl}")
        if self.needle_probe_tokens is not None and not (type(self.needle_probe_tokens) is int
                                                         and self.needle_probe_tokens >= 1024):
            raise ConfigError(f"the needle probe needs at least 1024 tokens, got {self.needle_probe_tokens!r}")
        if self.needle_probe_haystack not in NEEDLE_HAYSTACKS:
            raise ConfigError(f"the needle probe's haystack must be one of {NEEDLE_HAYSTACKS}, "
                              f"got {self.needle_probe_haystack!r}")
        if self.needle_probe_scored not in NEEDLE_SCORED:
            raise ConfigError(f"the needle probe's scored prompts must be one of {NEEDLE_SCORED}, "
                              f"got {self.needle_probe_scored!r}")
        if (self.key_bits == "auto" and self.key_noise is None and self.kv_bits is None and self.max_kl is None
                and self.max_answer_kl is None):
            raise ConfigError("key bits 'auto' needs a key noise tolerance, a bit budget or a KL target")
        if self.calib_tokens < 16 or self.seq_len < 16:
            raise ConfigError("calibration needs at least 16 tokens")
        for c in (self.k_clip, self.v_clip):
            if not 0 < c <= 1:
                raise ConfigError("clip ratios must lie in (0, 1]")

