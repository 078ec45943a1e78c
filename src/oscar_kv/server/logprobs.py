"""Log-probabilities in OpenAI's two response formats, from the engine's ``Logprob`` entries (engine/sequence.py).

* chat: ``choices[].logprobs.content[]`` = ``{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}``;
* completions (legacy): ``choices[].logprobs`` = ``{tokens, token_logprobs, top_logprobs, text_offset}``, where
  ``top_logprobs[i]`` maps token strings to logprobs: the token itself first, then the top k (vLLM's layout; a
  token among its own top k appears once).  With ``echo`` the prompt's tokens come first, the first one with
  ``null`` logprob and ``null`` top_logprobs (nothing predicts it).

A token's string is its own decode (special tokens included); where that decode is not whole UTF-8 (a byte-level
token holding part of a character shows U+FFFD) ``bytes`` still gives the token's exact bytes.  ``text_offset`` is
the running length of the token strings, starting at 0 (at the first prompt token with echo), as vLLM counts it.
"""

from __future__ import annotations

import re

from ..engine.sequence import Logprob

FLOOR = -9999.0  # what stands for -inf: JSON has no infinities (vLLM and OpenAI use the same floor)
_HEX_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback tokens


def _byte_level_alphabet() -> dict[str, int]:
    """The character -> byte table of byte-level BPE (GPT-2's vocabulary spelling): the printable bytes stand for
    themselves, the others for the characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + extra)
            extra += 1
    return {c: b for b, c in table.items()}


class TokenStrings:
    """Token id -> (its string, its bytes), cached (a request's logprobs name the same tokens again and again)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_level = "ByteLevel" in repr(getattr(backend, "decoder", None))
        self.alphabet = _byte_level_alphabet() if self.byte_level else {}
        self.added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._describe(token_id)
        return found

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]

    def _describe(self, token_id: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode([token_id])
        raw = self.tokenizer.convert_ids_to_tokens(token_id)
        data = text.encode("utf-8")
        if token_id not in self.added and isinstance(raw, str):
            if self.byte_level and raw and all(c in self.alphabet for c in raw):
                data = bytes(self.alphabet[c] for c in raw)
            elif (m := _HEX_BYTE.fullmatch(raw)) is not None:
                data = bytes([int(m.group(1), 16)])
        return text, list(data)


def _value(x: float) -> float:
    return max(x, FLOOR)


def chat_content(token_ids: list[int], entries: list[Logprob], strings: TokenStrings) -> list[dict]:
    """``logprobs.content`` of a chat choice (or of one stream chunk) for these tokens."""
    content = []
    for token, entry in zip(token_ids, entries):
        text, data = strings.get(token)
        top = []
        for tid, lp in zip(entry.top_ids, entry.top_logprobs):
            t_text, t_data = strings.get(tid)
            top.append({"token": t_text, "logprob": _value(lp), "bytes": t_data})
        content.append({"token": text, "logprob": _value(entry.logprob), "bytes": data, "top_logprobs": top})
    return content


class CompletionLogprobs:
    """The legacy ``logprobs`` object of one completion choice, built chunk by chunk (streaming) or at once;
    ``text_offset`` runs on across chunks."""

    def __init__(self, strings: TokenStrings):
        self.strings = strings
        self.offset = 0

    def block(self, token_ids: list[int], entries: list[Logprob | None]) -> dict:
        """The logprobs of these tokens (an entry None: a first prompt token, scored by nothing)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry in zip(token_ids, entries):
            text = self.strings.text(token)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_value(entry.logprob))
            top = {text: _value(entry.logprob)}
            for tid, lp in zip(entry.top_ids, entry.top_logprobs):
                top.setdefault(self.strings.text(tid), _value(lp))
            out["top_logprobs"].append(top)
        return out
