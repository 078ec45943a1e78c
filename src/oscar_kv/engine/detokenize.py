"""A sequence's output text, grown a token at a time, at a cost per token that does not grow with the output.

Decoding every output id at every step costs O(length) per token: with SmolLM2's tokenizer on the 2-core CI
machine ~1 ms at 1000 tokens and ~3 ms at 2000, per sequence and step, more than a whole decode step on the GPU at
batch 8.  Here each token decodes only a short window: the tokens since the text was last complete (no partial
UTF-8 character at its end), once without and once with the tokens not yet shown; the difference is the new text.
Both decodes start at the same token, so what a tokenizer does at the start of a string (dropping a leading
space, say) is the same in both and cancels out.
"""

from __future__ import annotations

PARTIAL = "\ufffd"  # what a decode shows for the bytes of an unfinished UTF-8 character


class IncrementalText:
    """``text`` equals ``tokenizer.decode(ids, skip_special_tokens=True)`` up to the last complete character.
    ``ids`` is the sequence's own list of output ids: read here, appended to by its owner."""

    def __init__(self, tokenizer, ids: list[int]):
        self.tokenizer, self.ids = tokenizer, ids
        self.text = ""
        self._start = self._shown = 0  # the window's first token; tokens before _shown are in ``text``

    def following(self, ids: list[int]) -> "IncrementalText":
        """The same state over another list that starts with the same ids (a forked sequence's)."""
        twin = IncrementalText(self.tokenizer, ids)
        twin.text, twin._start, twin._shown = self.text, self._start, self._shown
        return twin

    def update(self) -> str:
        """The text that the ids appended since the last call complete ("" while a character is unfinished)."""
        return self._advance(final=False)

    def flush(self) -> str:
        """The text of tokens still held back (an unfinished character at the end of the output), as decoded."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._shown == len(self.ids):
            return ""
        before = self._decode(self._start, self._shown)
        after = self._decode(self._start, len(self.ids))
        if not final and (len(after) <= len(before) or after.endswith(PARTIAL)):
            return ""
        if after.startswith(before):
            new = after[len(before):]
        else:  # a tokenizer whose window text is not a prefix of the longer window's: decode from the start once
            new = self._decode(0, len(self.ids))[len(self.text):]
        self.text += new
        self._start, self._shown = self._shown, len(self.ids)
        return new

    def _decode(self, lo: int, hi: int) -> str:
        return self.tokenizer.decode(self.ids[lo:hi], skip_special_tokens=True)
