"""RULER's synthetic long-context tasks, generated offline (``oscar-kv eval --suite ruler``).

RULER (Hsieh et al. 2024, arXiv 2404.06654) asks more of a long context than one needle: several needles and
distractors, values that must all be returned, chains of references, and counting over the whole context.  This
module writes the prompts from the task definitions published in the paper, with our own wording, at any length
and tokenizer, without downloads:

- NIAH (eight variants, RULER's names): key-value needles ("a special magic number for <key> is: <value>") in a
  haystack of repeated noise sentences, of real text (RULER's essays; here the evaluation text, the shipped
  Python documentation unless ``--text``), or of distractor needles.  Keys are word pairs or UUIDs, values 7-digit
  numbers or UUIDs; multi-key hides several keys and asks one, multi-value gives one key several values,
  multi-query asks several keys at once.
- ``vt`` (variable tracking): a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... (four hops) spread over noise; the
  answer is every variable that holds the value.
- ``cwe`` (common-words extraction): a numbered list of words in which ten words appear many times and the rest a
  few times; the answer is the ten.
- ``fwe`` (frequent-words extraction): coded words drawn with Zipf frequencies (exponent 2); the answer is the
  three most frequent.

RULER's one-shot examples for vt / cwe / fwe are left out: every scheme is asked the same prompts, which is what
the comparison needs, and the context goes to the task.  A prompt plus the task's generation budget fits the
requested length (RULER counts the budget inside the length too), so a length equal to the model's context is
valid.  Scoring is RULER's recall: the share of expected strings found in the output, case-insensitive.

Each prompt is a NeedlePrompt (tasks.py): the haystack, prefilled once and shared by every scheme, and the question
that reads it through the scheme's cache.
"""

from __future__ import annotations

import random
import re
import string
import uuid
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

from ..corpus import DEFAULT_CORPUS
from ..errors import ConfigError
from .tasks import DEPTHS, NeedlePrompt, chat_text, needle_prompt

# The passkey noise RULER repeats (from the passkey-retrieval test of Mohtashami and Jaggi, 2023).
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@dataclass(frozen=True)
class NiahSpec:
    """One NIAH variant: the haystack ("noise", "essay" or "needles": distractor needles), the key and value
    kinds ("word" / "uuid", "number" / "uuid"), keys hidden, values per asked key, keys asked."""

    haystack: str
    key: str
    value: str
    keys: int = 1
    values: int = 1
    queries: int = 1


NIAH = {
    "niah_single_1": NiahSpec("noise", "word", "number"),
    "niah_single_2": NiahSpec("essay", "word", "number"),
    "niah_single_3": NiahSpec("essay", "word", "uuid"),
    "niah_multikey_1": NiahSpec("essay", "word", "number", keys=4),
    "niah_multikey_2": NiahSpec("needles", "word", "number"),
    "niah_multikey_3": NiahSpec("needles", "uuid", "uuid"),
    "niah_multivalue": NiahSpec("essay", "word", "number", values=4),
    "niah_multiquery": NiahSpec("essay", "word", "number", keys=4, queries=4),
}
RULER_TASKS = tuple(NIAH) + ("vt", "cwe", "fwe")
# RULER's generation budgets (tokens_to_generate): the most a scheme may decode; the reference path stops sooner
# once every expected string is in the output (more output cannot lower a recall score) or at EOS.
GEN_TOKENS = {**{name: 128 for name in NIAH}, "vt": 30, "cwe": 120, "fwe": 50}
VT_HOPS = 4
CWE_COMMON, CWE_RARE_FREQ = 10, 3
FWE_TOP, FWE_ALPHA, FWE_VOCAB = 3, 2.0, 400


@dataclass
class SuiteSample:
    """One prompt of the suite: the prompt (haystack / question ids, needle spans), the strings a correct answer
    contains, the depths (0..1) its needles were put at, and the decode budget."""

    task: str
    prompt: NeedlePrompt
    answers: list[str]
    max_new_tokens: int
    depths: list[float] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return len(self.prompt.haystack) + len(self.prompt.question)


def recall(output: str, answers: list[str]) -> float:
    """RULER's string_match_all: the share of ``answers`` that occur in ``output``, ignoring case."""
    if not answers:
        raise ValueError("a sample needs at least one expected answer")
    low = output.lower()
    return sum(a.lower() in low for a in answers) / len(answers)


@lru_cache(maxsize=1)
def corpus_words() -> tuple[str, ...]:
    """Distinct lowercase words of 4-9 letters from the shipped corpus, sorted: keys and CWE's words (RULER draws
    them from an English word list; any fixed list every install has will do)."""
    return tuple(sorted(set(re.findall(r"\b[a-z]{4,9}\b", DEFAULT_CORPUS.read_text()))))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _keys(rng: random.Random, kind: str, count: int, taken: frozenset[str] = frozenset()) -> list[str]:
    words, out, seen = corpus_words(), [], set(taken)
    while len(out) < count:
        key = _uuid(rng) if kind == "uuid" else f"{rng.choice(words)}-{rng.choice(words)}"
        if key not in seen:
            seen.add(key)
            out.append(key)
    return out


def _values(rng: random.Random, kind: str, count: int) -> list[str]:
    if kind == "uuid":
        return [_uuid(rng) for _ in range(count)]
    return [str(rng.randrange(1_000_000, 10_000_000)) for _ in range(count)]  # 7 digits, as the harness's needles


def _fit(build, ctx: int, gen: int, task: str):
    """The longest ``build(target_tokens)`` whose prompt plus the generation budget fits ``ctx``: needle_prompt's
    length is an estimate (sentences tokenized one by one, the template guessed), so the target is corrected from
    the measured size a few times."""
    budget, target, best = ctx - gen, ctx - gen, None
    for _ in range(6):
        sample = build(target)
        if sample.tokens <= budget and (best is None or sample.tokens > best.tokens):
            best = sample
        if best is not None and best.tokens >= budget * 0.98:
            break
        target += budget - sample.tokens - (4 if sample.tokens > budget else 0)
    if best is None or best.tokens < budget // 2:
        raise ConfigError(f"task {task}: cannot fit a prompt and {gen} generated tokens into {ctx} tokens")
    return best


def _noise(ctx: int) -> str:
    return " ".join([NOISE] * (ctx // 8 + 4))  # more than enough: a repeat is ~20 tokens; the rest is cut


def _essay(text: str, ctx: int, index: int) -> str:
    """A stretch of ``text`` of ample size for ``ctx`` tokens, a different one per sample, wrapping around (the
    shipped text holds ~43K tokens; RULER repeats its essays too)."""
    need = ctx * 8
    text = text * (need // max(len(text), 1) + 2)
    start = (index * 7919 * 13) % max(len(text) - need, 1)
    cut = text.find(". ", start, start + 2000)
    start = cut + 2 if cut >= 0 else start  # from a sentence's start
    return text[start:start + need]


def niah_sample(tokenizer, task: str, ctx: int, index: int, seed: int, text: str) -> SuiteSample:
    """Sample ``index`` of NIAH variant ``task`` at ``ctx`` tokens (prompt + generation budget)."""
    spec, gen = NIAH[task], GEN_TOKENS[task]
    rng = random.Random(f"{task}/{ctx}/{index}/{seed}")
    kind = "numbers" if spec.value == "number" else "UUIDs"
    one = "number" if spec.value == "number" else "UUID"
    keys = _keys(rng, spec.key, spec.keys)
    values = {k: _values(rng, spec.value, spec.values) for k in keys}
    asked = keys[:spec.queries]
    if spec.keys == 1 and spec.values == 1:  # one needle: the depths cycle, as in the harness's niah task
        depths = [DEPTHS[index % len(DEPTHS)]]
    else:
        depths = sorted(rng.random() for _ in range(spec.keys * spec.values))
    rng.shuffle(depths)  # which needle goes where
    sentence = "One of the special magic {kind} for {key} is: {value}."
    needles = [(k, v) for k in keys for v in values[k]]
    placed = [(d, sentence.format(kind=kind, key=k, value=v)) for d, (k, v) in zip(depths, needles)]
    if spec.haystack == "noise":
        filler = _noise(ctx)
    elif spec.haystack == "essay":
        filler = _essay(text, ctx, index)
    else:  # distractor needles: other keys, other values, in the same sentence
        others = _keys(rng, spec.key, ctx // 10 + 8, taken=frozenset(keys))
        filler = " ".join(sentence.format(kind=kind, key=k, value=_values(rng, spec.value, 1)[0]) for k in others)
    preface = (f"Some special magic {kind} are hidden in the text below. Memorize them: you will be asked about "
               "them afterwards.\n\n")
    answers = [v for k in asked for v in values[k]]
    if len(asked) > 1:
        names = ", ".join(asked[:-1]) + " and " + asked[-1]
        question = f"What are all the special magic {kind} for {names} in the text above?"
        prefix = f"The special magic {kind} for {names} in the text above are"
    elif spec.values > 1:
        question = f"What are all the special magic {kind} for {asked[0]} in the text above?"
        prefix = f"The special magic {kind} for {asked[0]} in the text above are"
    else:
        question = f"What is the special magic {one} for {asked[0]} in the text above?"
        prefix = f"The special magic {one} for {asked[0]} in the text above is"
    target = needles.index((asked[0], values[asked[0]][0]))

    def build(length):
        prompt = needle_prompt(tokenizer, filler, length, placed, question, prefix, answers[0], target, preface)
        return SuiteSample(task, prompt, answers, gen, [d for d, _ in placed])

    return _fit(build, ctx, gen, task)


def vt_sample(tokenizer, ctx: int, index: int, seed: int) -> SuiteSample:
    """Variable tracking: one chain of VT_HOPS assignments after a 5-digit value, at random depths in noise."""
    gen = GEN_TOKENS["vt"]
    rng = random.Random(f"vt/{ctx}/{index}/{seed}")
    names: list[str] = []
    while len(names) < VT_HOPS + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    value = str(rng.randrange(10000, 100000))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    depths = sorted(rng.random() for _ in chain)
    preface = "Memorize and track the chain of variable assignments hidden in the text below.\n\n"
    question = f"Which variables are assigned the value {value} in the text above? Name them all."
    prefix = f"Following the chain of assignments in the text above, the {len(names)} variables assigned the value " \
             f"{value} are:"

    def build(length):
        prompt = needle_prompt(tokenizer, _noise(ctx), length, list(zip(depths, chain)), question, prefix, names[0],
                               0, preface)
        return SuiteSample("vt", prompt, list(names), gen, depths)

    return _fit(build, ctx, gen, "vt")


def _list_prompt(tokenizer, task: str, context: str, question: str, prefix: str, answers: list[str], gen: int,
                 meta: dict) -> SuiteSample:
    text, split = chat_text(tokenizer, context, question, prefix)
    prompt = NeedlePrompt(tokenizer(text[:split], add_special_tokens=False).input_ids,
                          tokenizer(text[split:], add_special_tokens=False).input_ids, answers[0], [])
    return SuiteSample(task, prompt, answers, gen, [], meta)


def cwe_sample(tokenizer, ctx: int, index: int, seed: int) -> SuiteSample:
    """Common-words extraction: CWE_COMMON words repeated often among rarer ones in a shuffled numbered list.

    RULER repeats its common words 30 times and the others 3; a short context cannot hold 300 repeats, so the
    common words' count scales with the list (between 6 and 30 times, always twice the rare count or more)."""
    gen = GEN_TOKENS["cwe"]
    rng = random.Random(f"cwe/{ctx}/{index}/{seed}")
    words = list(corpus_words())
    rng.shuffle(words)
    common, rare = words[:CWE_COMMON], words[CWE_COMMON:]
    question = f"What are the {CWE_COMMON} most common words in the list above?"
    prefix = f"The {CWE_COMMON} words that appear most often in the list above are:"
    preface = "Below is a numbered list of words. Some of them appear more often than others: remember which.\n\n"

    def build(items: int) -> SuiteSample:
        freq = max(6, min(30, items // 20))
        rare_freq = max(CWE_RARE_FREQ, -(-(items - CWE_COMMON * freq) // len(rare)))
        freq = max(freq, 2 * rare_freq)
        n_rare = max((items - CWE_COMMON * freq) // rare_freq, 0)
        order = [w for w in common for _ in range(freq)] + [w for w in rare[:n_rare] for _ in range(rare_freq)]
        local = random.Random(f"cwe-order/{ctx}/{index}/{seed}")
        local.shuffle(order)
        listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(order))
        return _list_prompt(tokenizer, "cwe", preface + listing, question, prefix, list(common), gen,
                            {"common_freq": freq, "rare_freq": rare_freq})

    return _grow(build, ctx, gen, "cwe", per_item=4)


def fwe_sample(tokenizer, ctx: int, index: int, seed: int) -> SuiteSample:
    """Frequent-words extraction: coded words with Zipf counts; the answer is the FWE_TOP most frequent.

    Counts are Zipf's expectation (rank r gets N / r^alpha, normalized), not draws, so the top words are strictly
    ordered; rank 1 is an ellipsis, a separator rather than a word (else one word would be 60% of the text)."""
    gen = GEN_TOKENS["fwe"]
    rng = random.Random(f"fwe/{ctx}/{index}/{seed}")
    vocab: list[str] = []
    while len(vocab) < FWE_VOCAB:
        word = "".join(rng.choices(string.ascii_lowercase, k=6))
        if word not in vocab:
            vocab.append(word)
    question = f"What are the {FWE_TOP} most frequent coded words in the text above?"
    prefix = f"The {FWE_TOP} most frequent coded words in the text above are:"
    preface = "Read the coded text below and keep track of how often each coded word appears.\n\n"
    weights = [1 / (r + 1) ** FWE_ALPHA for r in range(FWE_VOCAB + 1)]
    total = sum(weights)

    def build(items: int) -> SuiteSample:
        counts = [round(items * w / total) for w in weights]
        order = ["..."] * counts[0] + [w for w, c in zip(vocab, counts[1:]) for _ in range(c)]
        local = random.Random(f"fwe-order/{ctx}/{index}/{seed}")
        local.shuffle(order)
        top = [w for w, _ in Counter(w for w in order if w != "...").most_common(FWE_TOP)]
        return _list_prompt(tokenizer, "fwe", preface + " ".join(order), question, prefix, top, gen, {})

    return _grow(build, ctx, gen, "fwe", per_item=3)


def _grow(build, ctx: int, gen: int, task: str, per_item: int) -> SuiteSample:
    """``build(items)`` with as many list items as fit ``ctx`` with the generation budget: a first guess from
    ``per_item`` tokens an item, corrected from the measured size, then shrunk until it fits."""
    budget = ctx - gen
    items = max(budget // per_item, 1)
    sample = build(items)
    items = max(int(items * budget / sample.tokens * 0.98), 1)
    for _ in range(8):
        sample = build(items)
        if sample.tokens <= budget:
            if items < 2 * CWE_COMMON:
                break
            return sample
        items = int(items * budget / sample.tokens * 0.98) - 1
    raise ConfigError(f"task {task}: cannot fit a prompt and {gen} generated tokens into {ctx} tokens")


def ruler_sample(tokenizer, task: str, ctx: int, index: int, seed: int, text: str) -> SuiteSample:
    """Sample ``index`` of RULER task ``task`` at ``ctx`` tokens, the same for the same arguments."""
    if task in NIAH:
        return niah_sample(tokenizer, task, ctx, index, seed, text)
    if task == "vt":
        return vt_sample(tokenizer, ctx, index, seed)
    if task == "cwe":
        return cwe_sample(tokenizer, ctx, index, seed)
    if task == "fwe":
        return fwe_sample(tokenizer, ctx, index, seed)
    raise ConfigError(f"unknown RULER task {task!r}; choose from {', '.join(RULER_TASKS)}")
