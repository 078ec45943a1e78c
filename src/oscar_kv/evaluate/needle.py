"""Why a needle is lost at long context: the stored haystack of a scheme, seen from the answering query.

A scheme's cache stores the haystack once (``tasks.stored_cache``).  ``stored_haystack`` reads it back in the
model's own space (keys post-RoPE, values as v_proj makes them: rotations undone, offsets and means restored),
so schemes can be compared key for key with the exact K/V, mixed (keys of one scheme, values of another, one
head at another precision), and scored by asking the question through the unprepared model
(``answer_score``): the question and answer attend to the stored haystack exactly as through the cache.
``head_report`` measures, per layer and query head, what storage does to the last prompt token's attention.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..activations import attention_override, observing
from ..cache import OscarCacheLayer, unprepare_model
from ..hf_compat import cache_kwargs
from ..rotation import rotate
from .schemes import Scheme
from .tasks import NeedlePrompt, stored_cache

ANSWER_KEY = "oscar_kv_stored_haystack"
_active: list = []


@dataclass
class StoredHaystack:
    """Per layer: keys [Hkv, N, D] post-RoPE and values [Hkv, N, D] as stored, in the model's space, and the
    quantized history's positions [start, end) (the rest is exact: sink, recent window)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    history: tuple[int, int]
    logit_bias: list[torch.Tensor] | None = None  # per layer [Hkv]: added to the logits of history keys

    def mixed(self, other: "StoredHaystack", keys_from_other=None, values_from_other=None) -> "StoredHaystack":
        """A copy taking, per layer, the KV heads marked in ``keys_from_other`` / ``values_from_other``
        ([L, Hkv] bool, or True for all) from ``other``."""

        def pick(mine, theirs, mask):
            if mask is None or mask is False:
                return list(mine)
            if mask is True:
                return list(theirs)
            return [torch.where(m.to(a.device)[:, None, None], b, a) for a, b, m in zip(mine, theirs, mask)]

        history = self.history if self.history[1] > self.history[0] else other.history
        return StoredHaystack(pick(self.keys, other.keys, keys_from_other),
                              pick(self.values, other.values, values_from_other), history, self.logit_bias)


def _model_space(layer: OscarCacheLayer, scheme: Scheme, index: int, n: int):
    ks, vs = layer.segments_before(n)
    keys = torch.cat(ks, 2)[0]
    values = torch.cat(vs, 2)[0]
    if scheme.rotations is None:
        return layer.codec.restore_offsets(keys[None])[0], values
    rv = scheme.rotations.v_rotation[index].to(keys.device)
    values = rotate(values, rv.transpose(-1, -2)) + scheme.rotations.v_mean[index][:, None].to(keys.device)
    return layer.codec.model_space_keys(keys), values


@torch.no_grad()
def stored_haystack(model, scheme: Scheme, kv, appended: int = 0) -> StoredHaystack:
    """Store the exact haystack K/V ``kv`` (tasks.haystack_kv) in ``scheme``'s cache and read it back as it
    stands once ``appended`` more tokens (the question) have entered the cache: they push the oldest pages of
    the recent window into the INT2 history before the question's attention reads it."""
    cache = stored_cache(model, scheme, kv)
    n = kv[0][0].shape[2]
    if appended:
        for layer, (k, v) in zip(cache.layers, kv):
            layer.update(k.new_zeros(*k.shape[:2], appended, k.shape[3]), v.new_zeros(*v.shape[:2], appended, v.shape[3]))
            layer.chunk = None
    keys, values = [], []
    for i, layer in enumerate(cache.layers):
        k, v = _model_space(layer, scheme, i, n)
        keys.append(k.float())
        values.append(v.float())
    first = cache.layers[0]
    start = first.settings.sink_size if first.codec.quantizes else 0
    unprepare_model(model)
    return StoredHaystack(keys, values, (start, start + first.history_len))


def _stored_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Float32 attention of the question chunk over [stored haystack | question keys], causal within the
    chunk, with the stored history's logit bias."""
    stored: StoredHaystack = _active[-1]
    b, hq, t, d = query.shape
    hkv, n_all = key.shape[1], key.shape[2]
    g = hq // hkv
    scaling = d**-0.5 if scaling is None else scaling
    q = query.float().reshape(b, hkv, g * t, d)
    logits = (q @ key.float().transpose(-1, -2) * scaling).reshape(b, hkv, g, t, n_all)
    if stored.logit_bias is not None:
        lo, hi = stored.history
        bias = stored.logit_bias[module.layer_idx].to(logits.device, torch.float32)
        logits[..., lo:hi] += bias[None, :, None, None, None]
    first = n_all - t
    allowed = torch.arange(n_all, device=query.device)[None, :] <= first + torch.arange(t, device=query.device)[:, None]
    logits = logits.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(logits, -1).reshape(b, hkv, g * t, n_all)
    out = (probs @ value.float()).reshape(b, hq, t, d)
    return out.transpose(1, 2).to(query.dtype).contiguous(), None


def _stored_cache(model, stored: StoredHaystack) -> DynamicCache:
    cache = DynamicCache()  # no config: a model's sliding-window layers would keep only their last window tokens
    dtype = next(model.parameters()).dtype
    for i, (k, v) in enumerate(zip(stored.keys, stored.values)):
        cache.update(k[None].to(dtype), v[None].to(dtype), i)
    return cache


@dataclass
class AnswerScore:
    """How a scheme's stored haystack answers one needle prompt (answer_score)."""

    nll: float  # mean negative log-likelihood of the answer's tokens, teacher-forced
    first_digit_correct: bool
    text: str  # the greedy answer
    hit: bool


@torch.no_grad()
def answer_score(model, tokenizer, stored: StoredHaystack, prompt: NeedlePrompt, max_new_tokens: int = 12) -> AnswerScore:
    """Ask ``prompt``'s question of the stored haystack: teacher-forced NLL of the answer, then greedy."""
    unprepare_model(model)
    device = model.device
    answer_ids = tokenizer(" " + prompt.answer, add_special_tokens=False).input_ids
    with attention_override(model, ANSWER_KEY, _stored_attention, stored, _active):
        ids = torch.tensor([prompt.question + answer_ids], device=device)
        logits = model(ids, **cache_kwargs(model, _stored_cache(model, stored))).logits[0].float()
        q = len(prompt.question)
        lp = torch.log_softmax(logits[q - 1:-1], -1)
        target = torch.tensor(answer_ids, device=device)
        nll = float(-lp.gather(-1, target[:, None]).mean())
        digits = [i for i, t in enumerate(answer_ids) if re.search(r"\d", tokenizer.decode([t]))]
        first = digits[0] if digits else 0
        first_ok = int(lp[first].argmax()) == answer_ids[first]
        cache = _stored_cache(model, stored)
        ids, out = torch.tensor([prompt.question], device=device), []
        for _ in range(max_new_tokens):
            token = int(model(ids, **cache_kwargs(model, cache)).logits[0, -1].argmax())
            if token == tokenizer.eos_token_id:
                break
            out.append(token)
            if re.search(r"\d{7}", tokenizer.decode(out)):
                break
            ids = torch.tensor([[token]], device=device)
    text = tokenizer.decode(out, skip_special_tokens=True)
    return AnswerScore(nll, first_ok, text, prompt.answer in text)


@torch.no_grad()
def answering_queries(model, prompt: NeedlePrompt, last: int = 1) -> list[torch.Tensor]:
    """Per layer, the post-RoPE queries [Hq, last, D] of the prompt's last ``last`` tokens (exact model)."""
    unprepare_model(model)
    out: dict[int, torch.Tensor] = {}

    def keep(layer, q, k, v, o):
        out[layer] = q[0, :, -last:].float()

    ids = torch.tensor([prompt.haystack + prompt.question], device=model.device)
    with observing(model, keep):
        model(ids, use_cache=False)
    return [out[i] for i in range(len(out))]


def head_report(queries: list[torch.Tensor], exact: StoredHaystack, stored: StoredHaystack,
                prompt: NeedlePrompt, scaling: float | None = None) -> dict[str, torch.Tensor]:
    """Per layer and query head, for the answering query over the haystack alone: what the stored haystack
    changes against the exact one.

    Args:
        queries: answering_queries(model, prompt) (the last query of each is used).
        exact, stored: the haystack exact (the BF16 scheme) and as the scheme stores it.
        prompt: the prompt, for the needle's span.
        scaling: the softmax scale (default 1 / sqrt(D)).
    Returns:
        float32 [L, Hq] tensors on the CPU: "needle_exact" / "needle_stored" and "history_exact" /
        "history_stored" (attention mass), "delta_mean" / "delta_std" (the history logits' error),
        "needle_delta" (the mass-weighted logit error of the needle) and "out_error" (the relative error of
        the attention output).
    """
    lo, hi = stored.history
    n0, n1 = prompt.spans[prompt.target]
    rows = {k: [] for k in ("needle_exact", "needle_stored", "history_exact", "history_stored", "delta_mean",
                            "delta_std", "needle_delta", "out_error")}
    for layer, q in enumerate(queries):
        q = q[:, -1]  # [Hq, D]
        hq, d = q.shape
        hkv = exact.keys[layer].shape[0]
        head = torch.arange(hq, device=q.device) // (hq // hkv)
        s = d**-0.5 if scaling is None else scaling

        def attend(keys, values, bias):
            z = torch.einsum("hd,hnd->hn", q, keys[head]) * s
            if bias is not None:
                z[:, lo:hi] += bias.to(z.device)[head][:, None]
            p = torch.softmax(z, -1)
            return z, p, torch.einsum("hn,hnd->hd", p, values[head])

        bias = stored.logit_bias[layer] if stored.logit_bias is not None else None
        z, p, o = attend(exact.keys[layer], exact.values[layer], None)
        zs, ps, os_ = attend(stored.keys[layer], stored.values[layer], bias)
        delta = (zs - z)[:, lo:hi]
        rows["needle_exact"].append(p[:, n0:n1].sum(-1))
        rows["needle_stored"].append(ps[:, n0:n1].sum(-1))
        rows["history_exact"].append(p[:, lo:hi].sum(-1))
        rows["history_stored"].append(ps[:, lo:hi].sum(-1))
        rows["delta_mean"].append(delta.mean(-1) if hi > lo else torch.zeros(hq, device=q.device))
        rows["delta_std"].append(delta.std(-1) if hi - lo > 1 else torch.zeros(hq, device=q.device))
        w = p[:, n0:n1] / p[:, n0:n1].sum(-1, keepdim=True).clamp_min(1e-30)
        rows["needle_delta"].append(((zs - z)[:, n0:n1] * w).sum(-1))
        rows["out_error"].append((os_ - o).norm(dim=-1) / o.norm(dim=-1).clamp_min(1e-12))
    return {k: torch.stack(v).cpu() for k, v in rows.items()}


def variance_bias(report: dict[str, torch.Tensor], hkv: int) -> list[torch.Tensor]:
    """-sigma^2 / 2 per layer and KV head from a report's history logit error (mean over the group)."""
    var = report["delta_std"] ** 2  # [L, Hq]
    layers, hq = var.shape
    return [-0.5 * var[i].reshape(hkv, hq // hkv).mean(-1) for i in range(layers)]


def geometric_mean(values) -> float:
    values = [max(float(v), 1e-12) for v in values]
    return math.exp(sum(math.log(v) for v in values) / len(values))
