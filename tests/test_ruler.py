"""The long-context suite (`oscar-kv eval --suite ruler`): RULER's task generators, long-code completion over the
standard library, their scores, and a run through the command line on the embedded model."""

import json
from collections import Counter

import pytest
from typer.testing import CliRunner

from oscar_kv.artifacts import SHIPPED_DIR
from oscar_kv.cli import app
from oscar_kv.errors import ConfigError
from oscar_kv.evaluate.harness import EvalConfig, evaluation_text
from oscar_kv.evaluate.longcode import (code_lines, edit_similarity, exact_match, function_targets, lines_written,
                                        longcode_sample)
from oscar_kv.evaluate.ruler import GEN_TOKENS, NIAH, RULER_TASKS, recall, ruler_sample
from oscar_kv.evaluate.suite import SUITE_TASKS, score_outputs, suite_samples

runner = CliRunner()


@pytest.fixture(scope="module")
def text():
    return evaluation_text(None)


@pytest.mark.parametrize("task", RULER_TASKS)
def test_ruler_prompts_are_deterministic_and_fit_the_length(tokenizer, text, task):
    a = ruler_sample(tokenizer, task, 1024, 0, 0, text)
    b = ruler_sample(tokenizer, task, 1024, 0, 0, text)
    assert a.prompt.haystack == b.prompt.haystack and a.prompt.question == b.prompt.question
    assert a.answers == b.answers and a.answers
    other = ruler_sample(tokenizer, task, 1024, 1, 0, text)
    assert other.prompt.haystack != a.prompt.haystack and ruler_sample(tokenizer, task, 1024, 0, 1, text).answers \
        != a.answers
    # the prompt plus the answer's budget fits the length, and the haystack fills most of it
    assert a.tokens + a.max_new_tokens <= 1024 and a.tokens > 0.6 * (1024 - GEN_TOKENS[task])
    assert a.max_new_tokens == GEN_TOKENS[task]


@pytest.mark.parametrize("task", [t for t in RULER_TASKS if t in NIAH or t == "vt"])
def test_needles_are_in_the_haystack_at_their_depths(tokenizer, text, task):
    for index in range(3):
        s = ruler_sample(tokenizer, task, 2048, index, 0, text)
        haystack = tokenizer.decode(s.prompt.haystack)
        question = tokenizer.decode(s.prompt.question)
        assert len(s.prompt.spans) == len(s.depths) >= 1
        for answer in s.answers:  # every expected string is in the haystack, none leaks into the question
            assert answer in haystack and answer not in question
        n = len(s.prompt.haystack)
        for (start, end), depth in zip(s.prompt.spans, s.depths):
            assert abs(start / n - depth) < 0.1, (task, start / n, depth)
            needle = tokenizer.decode(s.prompt.haystack[start:end])
            assert any(a in needle for a in s.answers) or "VAR" in needle or "special magic" in needle


def test_niah_variants_follow_their_definitions(tokenizer, text):
    s = ruler_sample(tokenizer, "niah_multivalue", 2048, 0, 0, text)
    assert len(s.answers) == 4 and len(s.prompt.spans) == 4
    q = ruler_sample(tokenizer, "niah_multiquery", 2048, 0, 0, text)
    assert len(q.answers) == 4 and "What are all" in tokenizer.decode(q.prompt.question)
    u = ruler_sample(tokenizer, "niah_multikey_3", 2048, 0, 0, text)
    assert len(u.answers[0]) == 36 and u.answers[0].count("-") == 4  # a UUID
    # a haystack of distractor needles: many keyed sentences, only one with the asked value
    hay = tokenizer.decode(ruler_sample(tokenizer, "niah_multikey_2", 2048, 0, 0, text).prompt.haystack)
    assert hay.count("special magic numbers for") > 30
    noise = tokenizer.decode(ruler_sample(tokenizer, "niah_single_1", 2048, 0, 0, text).prompt.haystack)
    assert noise.count("The grass is green.") > 20


def test_aggregation_answers_are_what_the_context_says(tokenizer, text):
    import re

    cwe = ruler_sample(tokenizer, "cwe", 2048, 0, 0, text)
    listing = tokenizer.decode(cwe.prompt.haystack)
    counts = Counter(re.findall(r"\d+\. ([a-z]+)", listing))
    top = [w for w, _ in counts.most_common(11)]
    assert set(top[:10]) == set(cwe.answers) and counts[top[9]] > counts[top[10]]
    fwe = ruler_sample(tokenizer, "fwe", 2048, 0, 0, text)
    body = tokenizer.decode(fwe.prompt.haystack).split("\n\n", 2)[-1]
    words = Counter(w for w in re.findall(r"\b[a-z]{6}\b", body))
    ranked = [w for w, _ in words.most_common(4)]
    assert ranked[:3] == fwe.answers and words[ranked[2]] > words[ranked[3]]
    vt = ruler_sample(tokenizer, "vt", 2048, 0, 0, text)
    hay = tokenizer.decode(vt.prompt.haystack)
    value = re.search(rf"VAR {vt.answers[0]} = (\d+)", hay).group(1)
    assert value in tokenizer.decode(vt.prompt.question)
    for a, b in zip(vt.answers, vt.answers[1:]):  # a chain: each variable takes the previous one
        assert f"VAR {b} = VAR {a}." in hay


def test_recall_scores_hand_made_outputs():
    assert recall("The number is 1234567.", ["1234567"]) == 1.0
    assert recall("The number is 7654321.", ["1234567"]) == 0.0
    assert recall("ABCDE, fghij and KLMNO", ["ABCDE", "FGHIJ", "KLMNO", "PQRST"]) == 0.75
    assert recall("", ["x"]) == 0.0
    with pytest.raises(ValueError):
        recall("anything", [])


def test_code_scores_hand_made_outputs():
    ref = "        x = 1\n\n        y = x + 1\n        return y\n        # more"
    assert code_lines(ref, 3) == ["        x = 1", "        y = x + 1", "        return y"]
    assert exact_match(ref + "   ", ref, 3) == 1.0
    assert exact_match("        x = 1\n        y = x + 2\n        return y\n", ref, 3) == 0.0
    assert exact_match("        x = 1\n", ref, 3) == 0.0  # too few lines
    assert edit_similarity(ref, ref, 3) == 1.0
    close = edit_similarity("        x = 1\n        y = x + 2\n        return y\n", ref, 3)
    far = edit_similarity("pass\n", ref, 3)
    assert 0.9 < close < 1.0 and far < 0.3
    assert lines_written("a\n\nb\nc\n", 3) and not lines_written("a\nb\nc", 3)


def test_function_targets_skip_docstrings():
    src = 'import os\n\ndef f(a):\n    """Doc.\n\n    More."""\n    x = a\n    y = x\n    z = y\n    return z\n' \
          'def g():\n    return 1\n'
    assert function_targets(src, 4) == [(2, 6)]
    assert function_targets("def broken(:\n", 1) == []


def test_longcode_prompt_is_the_package_before_the_function(tokenizer):
    a = longcode_sample(tokenizer, 2048, 0, 0)
    assert a.prompt.haystack == longcode_sample(tokenizer, 2048, 0, 0).prompt.haystack
    assert a.tokens + a.max_new_tokens <= 2048 and a.tokens > 1200
    question = tokenizer.decode(a.prompt.question)
    assert question.lstrip().startswith(("def ", "async def ")) and question.endswith("\n")
    assert a.meta["package"] == "asyncio" and a.meta["file"].startswith("asyncio/")
    # the expected lines are the source's, right after the question in the file
    from pathlib import Path
    import sysconfig

    source = (Path(sysconfig.get_paths()["stdlib"]) / a.meta["file"]).read_text()
    after = source[source.index(question) + len(question):]
    assert code_lines(after, 4) == a.answers[0].split("\n")
    with pytest.raises(ConfigError, match="no Python source"):
        longcode_sample(tokenizer, 2048, 0, 0, package="no_such_package_here")


def test_suite_scores_longcode_against_bf16(tokenizer, text):
    samples = suite_samples(tokenizer, ["niah_single_1", "longcode"], 1024, 1, 0, text)
    ref = samples[1].answers[0] + "\n"
    outputs = {"bf16": [f"is {samples[0].answers[0]}.", ref],
               "oscar": ["is 0000000.", ref.replace("(", "[", 1) if "(" in ref else "x" + ref]}
    scores, records = score_outputs(samples, outputs)
    assert scores["bf16"]["niah_single_1"] == 1.0 and scores["oscar"]["niah_single_1"] == 0.0
    assert scores["bf16"]["ruler_mean"] == 1.0
    assert scores["bf16"]["longcode_em"] == 1.0 and scores["bf16"]["longcode_es"] == 1.0
    assert scores["oscar"]["longcode_em"] == 0.0 and 0.5 < scores["oscar"]["longcode_es"] < 1.0
    assert scores["bf16"]["longcode_es_source"] == 1.0
    assert len(records) == 4 and {r["method"] for r in records} == {"bf16", "oscar"}
    # engine rows are scored against the engine's own BF16
    engine = {"bf16@engine": ["", ref.replace("(", "[", 1) if "(" in ref else "x" + ref], "oscar@engine": ["", ref]}
    scores, _ = score_outputs(samples, dict(outputs, **engine))
    assert scores["bf16@engine"]["longcode_em"] == 1.0 and scores["oscar@engine"]["longcode_em"] == 0.0
    assert scores["oscar@engine"]["longcode_es_source"] == 1.0


def test_bad_suite_input_is_refused(tokenizer, text):
    with pytest.raises(ValueError, match="unknown tasks"):
        EvalConfig.suite("ruler", tasks=["niah_single_9"])
    with pytest.raises(ValueError, match="unknown suite"):
        EvalConfig.suite("longbench")
    with pytest.raises(ValueError, match="cannot fit"):
        ruler_sample(tokenizer, "cwe", 128, 0, 0, text)
    assert set(SUITE_TASKS) == set(RULER_TASKS) | {"longcode"}


def _invoke(tmp_path, *extra):
    return runner.invoke(app, ["eval", "--rotations", str(SHIPPED_DIR / "smollm2-135m"), "--output", str(tmp_path),
                               "--suite", "ruler", *extra])


def test_cli_refuses_an_unknown_task_and_a_length_past_the_model(tmp_path):
    result = _invoke(tmp_path, "--tasks", "niah_single_1,mmlu")
    assert result.exit_code != 0 and "mmlu" in result.output and "not in suite" in result.output
    result = _invoke(tmp_path, "--suite", "longbench")
    assert result.exit_code != 0 and "unknown --suite 'longbench'; choose from ruler" in result.output
    result = _invoke(tmp_path, "--contexts", "16384", "--tasks", "vt")
    assert result.exit_code != 0 and "exceeds the model's context of 8192" in result.output


def test_suite_through_the_cli_on_the_embedded_model(tmp_path, one_torch_thread):
    """The whole suite at 1K tokens, one sample per task, bf16 and oscar, through the reference path (answers
    capped at 12 tokens: the CI's time)."""
    result = _invoke(tmp_path, "--contexts", "1024", "--suite-samples", "1", "--suite-max-tokens", "12")
    assert result.exit_code == 0, result.output
    saved = json.loads((tmp_path / "results.json").read_text())
    m = saved["methods"]
    assert set(m) == {"bf16", "oscar"} and saved["context_lengths"] == [1024]
    for name, row in m.items():
        for task in RULER_TASKS + ("ruler_mean", "longcode_em", "longcode_es", "longcode_es_source"):
            assert 0.0 <= row[task]["1024"] <= 1.0, (name, task)
    print("\nsuite @1024:", {n: {t: round(v["1024"], 2) for t, v in row.items() if t != "bits_per_element"
                                 and isinstance(v, dict)} for n, row in m.items()})
    assert m["bf16"]["longcode_em"]["1024"] == 1.0 and m["bf16"]["longcode_es"]["1024"] == 1.0
    assert m["bf16"]["niah_single_1"]["1024"] == 1.0  # the embedded model finds a passkey in noise at 1K
    records = [json.loads(line) for line in (tmp_path / "suite_outputs.jsonl").read_text().splitlines()]
    assert len(records) == 2 * len(SUITE_TASKS) and all(r["context"] == 1024 for r in records)
    report = (tmp_path / "results.md").read_text()
    assert "long-context suite" in report and "niah_multivalue" in report
    assert (tmp_path / "suite_vs_context.png").is_file() and (tmp_path / "suite_vt_vs_context.png").is_file()


def test_suite_through_the_serving_engine(model, tokenizer, tmp_path, one_torch_thread):
    """`--suite ... --served`: the same prompts through LLMEngine, rows bf16@engine and oscar@engine beside the
    reference rows; the engine's BF16 finds the passkey as the reference path does (one task: the engine is slow on
    the CPU)."""
    from oscar_kv.artifacts import Rotations
    from oscar_kv.evaluate.harness import run_eval

    rotations = Rotations.load(SHIPPED_DIR / "smollm2-135m")  # the shipped artifact: no calibration in this test
    config = EvalConfig.suite("ruler", tasks=["niah_single_1"], context_lengths=[1024], suite_samples=1,
                              suite_max_tokens=10, served=True)
    results = run_eval(model, tokenizer, rotations, config, tmp_path, progress=False)
    m = results["methods"]
    assert set(m) == {"bf16", "oscar", "bf16@engine", "oscar@engine"}
    print("\nserved suite:", {n: {t: v["1024"] for t, v in row.items() if isinstance(v, dict)} for n, row in m.items()})
    assert m["bf16@engine"]["niah_single_1"]["1024"] == m["bf16"]["niah_single_1"]["1024"] == 1.0
    assert "oscar@engine" in (tmp_path / "results.md").read_text()


def test_suite_through_the_engine_alone(model, tokenizer, tmp_path, one_torch_thread):
    """`--suite ... --engine-only`: only the engine answers (the suite at GPU speed); the results hold the engine's
    rows alone, and its BF16 still finds the passkey."""
    from oscar_kv.artifacts import Rotations
    from oscar_kv.evaluate.harness import run_eval

    rotations = Rotations.load(SHIPPED_DIR / "smollm2-135m")
    config = EvalConfig.suite("ruler", tasks=["niah_single_1"], context_lengths=[1024], suite_samples=1,
                              suite_max_tokens=10, engine_only=True)
    assert config.served
    results = run_eval(model, tokenizer, rotations, config, tmp_path, progress=False)
    m = results["methods"]
    assert set(m) == {"bf16@engine", "oscar@engine"}
    assert m["bf16@engine"]["niah_single_1"]["1024"] == 1.0
    records = [json.loads(line) for line in (tmp_path / "suite_outputs.jsonl").read_text().splitlines()]
    assert {r["method"] for r in records} == {"bf16@engine", "oscar@engine"}


@pytest.mark.parametrize("overrides, named", [
    (dict(tasks=["kl", "niah"]), "kl need the reference path"),
    (dict(tasks=["niah"], methods=["bf16", "naive-int2"]), "not naive-int2"),
])
def test_engine_only_refuses_what_the_engine_cannot_answer(overrides, named):
    with pytest.raises(ConfigError, match=named):
        EvalConfig(engine_only=True, **overrides)
