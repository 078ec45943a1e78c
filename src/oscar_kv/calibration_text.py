"""What calibrate cuts from its text: the fitting sequences, the held-back probe after them, and after those the KL
check's text and the answer KL check's keyed needle prompts (each a different part, so no check sees the fitting
data)."""

from __future__ import annotations

import logging
import math

import torch

from .calibration_settings import (KL_PROBE_MAX_TOKENS, NEEDLE_PROBE_MAX_TOKENS, NEEDLE_PROBE_MEMORY_SHARE,
                                   NEEDLE_PROBE_PROMPTS, CalibrationSettings)
from .corpus import CorpusError
from .memory import free_bytes
from .models import AttentionGeometry
from .width_choice import NeedleProbePrompt

log = logging.getLogger(__name__)


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


def kl_probe(tokenizer, texts: list[str], settings: CalibrationSettings, max_len: int) -> torch.Tensor:
    """The held-back text ``--max-kl`` measures on (width_choice.kl_measure), int64 [1, length]: one sequence of
    ``settings.kl_probe_tokens`` (default min(context, KL_PROBE_MAX_TOKENS)) cut after the fitting text and the
    probe."""
    length = min(settings.kl_probe_tokens or KL_PROBE_MAX_TOKENS, max_len)
    after = math.ceil((settings.calib_tokens + settings.probe_tokens) / length)
    sequences = token_sequences(tokenizer, texts, length, after + 1)
    if len(sequences) <= after:
        log.warning("the calibration text is too short for a KL probe after the fitting text: it overlaps it")
    return sequences[-1]


def needle_probe(tokenizer, texts: list[str], settings: CalibrationSettings, max_len: int
                 ) -> list[NeedleProbePrompt]:
    """The prompts ``--max-answer-kl`` measures on (width_choice.needle_measure): NEEDLE_PROBE_PROMPTS keyed needle
    prompts (four keyed numbers in a haystack, a question for one: evaluate.tasks.multikey_prompt, as `eval`'s
    multi-key task builds them, with other seeds) of about min(context, ``settings.needle_probe_tokens``) tokens
    (None: the context, at most NEEDLE_PROBE_MAX_TOKENS for decoded haystacks), their haystacks cut from the text after
    the fitting sequences and the probe, each followed by its expected answer (width_choice.NeedleProbePrompt: the
    ids, where the answer and where the question start)."""
    from .evaluate.tasks import multikey_prompt

    default = max_len if settings.needle_probe_haystack == "stored" else NEEDLE_PROBE_MAX_TOKENS
    length = min(settings.needle_probe_tokens or default, max_len)
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False).input_ids)
    held = tokenizer.decode(ids[settings.calib_tokens + settings.probe_tokens:], skip_special_tokens=True)
    need = 8 * length  # characters: a haystack of `length` tokens with room to spare
    if len(held) < 2 * need:
        log.warning("the text after the fitting sequences is short for the needle probe: its haystacks repeat it")
        held = "\n\n".join([held] * math.ceil(2 * need / max(len(held), 1)))
    prompts = []
    for i in range(NEEDLE_PROBE_PROMPTS):
        start = i * (len(held) - need) // max(NEEDLE_PROBE_PROMPTS - 1, 1)
        prompt = multikey_prompt(tokenizer, held[start:start + need], length - 16, seed=NEEDLE_PROBE_SEED + i)
        answer = tokenizer(" " + prompt.answer, add_special_tokens=False).input_ids  # after "... is"
        prompts.append(NeedleProbePrompt(torch.tensor([prompt.haystack + prompt.question + answer]),
                                         len(prompt.haystack) + len(prompt.question), len(prompt.haystack)))
    return prompts


NEEDLE_PROBE_SEED = 7_000_000  # not eval's needle seeds (0 + context + i): the probe's needles are other numbers


def stored_needle_probe_tokens(model, settings: CalibrationSettings, max_len: int) -> int | None:
    """Where calibrate shortens the needle probe: with stored haystacks and no --needle-probe-tokens, the longest
    prompts (a multiple of 1024, at least 1024) whose float32 K/V, all NEEDLE_PROBE_PROMPTS of them, fit in
    NEEDLE_PROBE_MEMORY_SHARE of the memory free where the model runs, if the context's do not; else None."""
    if settings.needle_probe_haystack != "stored" or settings.needle_probe_tokens is not None:
        return None
    geometry = AttentionGeometry.of(model.config)
    per_token = 2 * geometry.num_layers * geometry.num_kv_heads * geometry.head_dim * 4  # K and V, float32
    fits = int(NEEDLE_PROBE_MEMORY_SHARE * free_bytes(next(model.parameters()).device)) // (
        NEEDLE_PROBE_PROMPTS * per_token)
    return max(fits // 1024 * 1024, 1024) if fits < max_len else None
