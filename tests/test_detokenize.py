"""Incremental detokenization: the text grown a token at a time equals decoding all ids at once, with unfinished
UTF-8 characters held back until complete (engine/detokenize.py)."""

import random

from oscar_kv.engine.detokenize import PARTIAL, IncrementalText

TEXT = ("Prefill and decode: naïve café — 東京の天気は晴れです。 Emoji 🎉🚀 mixed with code `x += 1`\n\tdone. "
        "Ünïcödé, Ελληνικά, русский, עברית, हिन्दी.")


def test_real_text_token_by_token_equals_one_decode(tokenizer):
    ids = tokenizer(TEXT).input_ids
    shown = []
    text = IncrementalText(tokenizer, shown)
    pieces = []
    for t in ids:
        shown.append(t)
        pieces.append(text.update())
    text.flush()
    assert text.text == "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any(PARTIAL in p for p in pieces)  # an emoji's byte tokens show only once complete
    held = [i for i, p in enumerate(pieces) if p == ""]
    assert held, "some characters span several tokens in this text"


def test_random_ids_and_special_tokens_match_one_decode(tokenizer):
    rng = random.Random(0)
    specials = list(tokenizer.all_special_ids)
    for _ in range(20):
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(tokenizer.vocab_size)
               for _ in range(rng.randrange(1, 60))]
        shown = []
        text = IncrementalText(tokenizer, shown)
        for t in ids:
            shown.append(t)
            text.update()
        text.flush()
        assert text.text == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_fork_continues_independently(tokenizer):
    ids = tokenizer(TEXT).input_ids
    a_ids = []
    a = IncrementalText(tokenizer, a_ids)
    for t in ids[:20]:
        a_ids.append(t)
        a.update()
    b = a.following(list(a_ids))
    for t in ids[20:]:
        a_ids.append(t)
        a.update()
    a.flush()
    b.flush()
    assert a.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert b.text == tokenizer.decode(ids[:20], skip_special_tokens=True)


class _CountingTokenizer:
    """Records how many ids each decode call gets."""

    def __init__(self, tokenizer):
        self.inner, self.sizes = tokenizer, []

    def decode(self, ids, skip_special_tokens=True):
        self.sizes.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_cost_per_token_does_not_grow_with_the_output(tokenizer):
    counting = _CountingTokenizer(tokenizer)
    shown = []
    text = IncrementalText(counting, shown)
    ids = tokenizer(TEXT * 20).input_ids
    for t in ids:
        shown.append(t)
        text.update()
    assert len(ids) > 1000 and max(counting.sizes) <= 8
    assert text.text == tokenizer.decode(ids, skip_special_tokens=True)
