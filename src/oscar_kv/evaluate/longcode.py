"""Long-code completion over the Python standard library (``eval --tasks longcode``, part of ``--suite ruler``).

Real long text that every machine has: the source of the running interpreter's standard library.  A prompt is one
package's code (default ``asyncio``, ~130K tokens on 3.11): other modules of the package, then the target module up
to a function, then that function's signature and docstring; the model writes the function's next lines.  Code
completion reads far back (names, signatures and idioms defined thousands of lines earlier), so it measures what
a quantized history costs on a task unlike the needles.

The prompt is raw code, no chat template: what a completion endpoint is sent.  Scores, over the first CODE_LINES
non-blank lines written: exact match and edit similarity (difflib's ratio) against BF16's own greedy output on the
same prompt, so a scheme is judged against what the unquantized cache would have answered, not against what the
model could not know; and edit similarity against the source's real lines beside them (BF16's row included).
The standard library differs between Python versions: compare runs of one interpreter (results record it).
"""

from __future__ import annotations

import ast
import difflib
import random
import sys
import sysconfig
from functools import lru_cache
from pathlib import Path

from ..errors import ConfigError
from .ruler import SuiteSample
from .tasks import NeedlePrompt

CODE_PACKAGE = "asyncio"
CODE_LINES = 4
TOKENS_PER_LINE = 20  # the decode budget per expected line (the reference path stops once the lines are written)
SKIP_DIRS = {"test", "tests", "idle_test", "__pycache__"}


@lru_cache(maxsize=4)
def package_sources(package: str) -> tuple[tuple[str, str], ...]:
    """The package's modules as (path relative to the standard library, source), sorted by path; tests skipped."""
    root = Path(sysconfig.get_paths()["stdlib"])
    base = root / package.replace(".", "/")
    files = sorted(p for p in base.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(root).parts)) \
        if base.is_dir() else [base.with_suffix(".py")] if base.with_suffix(".py").is_file() else []
    sources = []
    for p in files:
        try:
            sources.append((p.relative_to(root).as_posix(), p.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):  # an unreadable module is not a prompt
            continue
    if not sources:
        raise ConfigError(f"no Python source for standard-library package {package!r} under {root}", "code_package")
    return tuple(sources)


def function_targets(source: str, lines: int = CODE_LINES) -> list[tuple[int, int]]:
    """(def line, first body line), 0-based, of every function whose body, after its docstring, has at least
    ``lines`` non-blank lines to complete."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    text_lines = source.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.lineno < 2:
            continue
        body = node.body
        if isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                and isinstance(body[0].value.value, str):
            body = body[1:]
        if not body:
            continue
        start = body[0].lineno - 1
        rest = [t for t in text_lines[start:node.end_lineno] if t.strip()]
        if len(rest) >= lines and body[0].lineno > node.lineno:  # a body on the def line has no lines to write
            out.append((node.lineno - 1, start))
    return sorted(out)


def code_lines(text: str, lines: int) -> list[str]:
    """The first ``lines`` non-blank lines of ``text``, trailing whitespace dropped."""
    return [t.rstrip() for t in text.split("\n") if t.strip()][:lines]


def lines_written(text: str, lines: int) -> bool:
    """Whether ``text`` holds ``lines`` complete non-blank lines (the decode can stop)."""
    return len([t for t in text.split("\n")[:-1] if t.strip()]) >= lines


def exact_match(output: str, reference: str, lines: int) -> float:
    """1.0 when the first ``lines`` non-blank lines of both texts are equal (as many as the reference has: a decode
    budget or EOS may end it sooner), else 0.0."""
    return float(code_lines(output, lines) == code_lines(reference, lines))


def edit_similarity(output: str, reference: str, lines: int) -> float:
    """difflib's similarity ratio (1 - edits / length, in 0..1) of the first ``lines`` non-blank lines."""
    a, b = "\n".join(code_lines(output, lines)), "\n".join(code_lines(reference, lines))
    if not a and not b:
        return 1.0
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def _size(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def longcode_sample(tokenizer, ctx: int, index: int, seed: int, package: str = CODE_PACKAGE,
                    lines: int = CODE_LINES) -> SuiteSample:
    """Sample ``index`` at ``ctx`` tokens: a function of ``package`` chosen by the seed, the package's code before
    it (the target module's own start last, other modules before it, the farthest cut at a line), its signature
    and docstring as the question; the answer is the source's next ``lines`` non-blank lines."""
    gen = TOKENS_PER_LINE * lines
    sources = package_sources(package)
    targets = [(i, t) for i, (_, src) in enumerate(sources) for t in function_targets(src, lines)]
    if not targets:
        raise ConfigError(f"package {package!r} has no function with {lines} lines to complete", "code_package")
    rng = random.Random(f"longcode/{package}/{ctx}/{index}/{seed}")
    fi, (def0, body0) = rng.choice(targets)
    path, source = sources[fi]
    src_lines = source.splitlines(keepends=True)
    question = "".join(src_lines[def0:body0])
    answer = "\n".join(code_lines("".join(src_lines[body0:]), lines))
    budget = ctx - gen - _size(tokenizer, question)
    # the code before the function, nearest first: the target module's start, then the other modules of the
    # package, from a seeded place onward, each under a header naming its file
    pieces = [f"# file: {path}\n"] + src_lines[:def0]
    order = [j for j in range(len(sources)) if j != fi]
    shift = rng.randrange(len(order)) if order else 0
    others = order[shift:] + order[:shift]
    blocks = [pieces] + [[f"# file: {sources[j][0]}\n"] + sources[j][1].splitlines(keepends=True) + ["\n"]
                         for j in others]
    chosen: list[list[str]] = []
    used = 0
    for block in blocks:
        size = _size(tokenizer, "".join(block))
        if used + size <= budget:
            chosen.append(block)
            used += size
            continue
        # the block that does not fit: its last lines, as many as the estimate allows
        sizes = [_size(tokenizer, t) for t in block]
        keep, room = len(block), budget - used
        while keep > 0 and room - sizes[keep - 1] >= 0:
            room -= sizes[keep - 1]
            keep -= 1
        chosen.append(block[keep:])
        break
    text_lines = [t for block in reversed(chosen) for t in block]
    # the per-piece sizes are an estimate (tokens merge across lines): trim the farthest lines until it fits
    while True:
        haystack = tokenizer("".join(text_lines)).input_ids  # special tokens as the tokenizer adds them (BOS)
        over = len(haystack) - budget
        if over <= 0:
            break
        text_lines = text_lines[max(over // 8, 1):]
    if len(haystack) < budget // 2:
        raise ConfigError(f"package {package!r} holds fewer than {budget // 2} tokens before its functions: pick a "
                          f"larger one for {ctx} tokens (e.g. asyncio, email, unittest)", "code_package")
    prompt = NeedlePrompt(haystack, tokenizer(question, add_special_tokens=False).input_ids, answer, [])
    meta = {"file": path, "line": def0 + 1, "python": sys.version.split()[0], "package": package}
    return SuiteSample("longcode", prompt, [answer], gen, [], meta)
