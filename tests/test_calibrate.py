import dataclasses
import json
import re

import pytest
import torch

from oscar_kv.activations import NonFiniteActivations
from oscar_kv.artifacts import Rotations
from oscar_kv.allocation import WidthChoice
from oscar_kv.calibrate import PAIRS_TOLERANCE, ROPE_GAIN, calibrate, choose_centering
from oscar_kv.calibration_settings import CalibrationSettings
from oscar_kv.corpus import STDLIB_SOURCE, read_text_file
from oscar_kv.errors import ConfigError
from oscar_kv.rope import kernel_pairs
from oscar_kv.rotation import orthogonality_error
from oscar_kv.width_choice import search_kl_steps

# no KL check unless a test asks (its default probe is an 8K-token forward: minutes on a 2-core CPU)
SMALL = dict(calib_tokens=512, seq_len=256, probe_tokens=128, max_kl=None, max_answer_kl=None)


def test_artifact_is_valid_and_describes_itself(rotations, model):
    g = rotations.geometry
    assert (g.num_layers, g.num_kv_heads, g.head_dim) == (30, 3, 64)
    assert rotations.k_rotation.shape == (30, 3, 64, 64) and rotations.scope == "per-head"
    assert orthogonality_error(rotations.k_rotation) < 1e-5 and orthogonality_error(rotations.v_rotation) < 1e-5
    assert torch.all(rotations.k_eigenvalues[..., :-1] >= rotations.k_eigenvalues[..., 1:])
    m = rotations.manifest
    # SmolLM2's keys have a clear pre-RoPE offset; "auto" measured position-aware centering as better
    assert rotations.key_centering == "rope" and m["calibration"]["key_centering_choice"]["chosen"] == "rope"
    errors = m["calibration"]["key_centering_choice"]["probe_error"]
    assert errors["rope"] < 0.95 * errors["constant"]
    assert rotations.k_rope_mean.norm(dim=-1).mean() > 1.0
    assert m["calibration"]["tokens"] == 2048 and m["calibration"]["data"] == "builtin:python_docs.txt"
    assert set(m["validation"]["attention_relative_error"]) == {"identity", "hadamard", "oscar"}
    assert len(m["fingerprint"]) == 16


def test_calibration_is_deterministic(model, tokenizer, tmp_path):
    a = calibrate(model, tokenizer, CalibrationSettings(**SMALL), progress=False)
    b = calibrate(model, tokenizer, CalibrationSettings(**SMALL), progress=False)
    for name in Rotations.TENSORS + Rotations.OPTIONAL_TENSORS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_per_layer_scope_and_clip_fitting(model, tokenizer):
    rot = calibrate(model, tokenizer, CalibrationSettings(rotation_scope="per-layer", clip="fit", **SMALL),
                    progress=False)
    assert rot.k_rotation.shape == (30, 1, 64, 64) and rot.scope == "per-layer"
    assert rot.k_clip.shape == (30, 3)
    assert torch.all(rot.k_clip == rot.k_clip[:, :1]), "per-layer scope fits one ratio per layer"
    assert rot.k_clip.min() >= 0.8 and rot.k_clip.max() <= 1.0
    rot.validate()


def test_user_calibration_data(model, tokenizer, tmp_path):
    from oscar_kv.corpus import DEFAULT_CORPUS

    text = DEFAULT_CORPUS.read_text()[100_000:110_000]
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": p}) for p in text.split("\n\n") if p.strip()) + "\n")
    rot = calibrate(model, tokenizer, CalibrationSettings(**SMALL), [str(jsonl)], progress=False)
    assert rot.manifest["calibration"]["data"] == str(jsonl)


def test_bad_calibration_data(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2 is not valid JSON"):
        read_text_file(bad)
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(ValueError, match=".txt or .jsonl"):
        read_text_file(tmp_path / "x.csv")
    with pytest.raises(FileNotFoundError):
        read_text_file(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        read_text_file(tmp_path / "empty.txt")


def test_stdlib_source_is_long_real_text(tokenizer):
    docs = read_text_file(STDLIB_SOURCE)
    assert read_text_file(STDLIB_SOURCE) == docs, "the same text on every call"
    assert any("def " in d for d in docs) and sum(map(len, docs)) > 1_000_000, "enough for a 128K-token context"
    assert len(tokenizer("\n\n".join(docs)[:400_000]).input_ids) > 80_000


def test_too_little_text_is_a_clear_error(model, tokenizer, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Only a few words here.")
    with pytest.raises(ValueError, match="only .* tokens"):
        calibrate(model, tokenizer, CalibrationSettings(**SMALL), [str(short)], progress=False)


def test_nan_activations_are_reported_with_the_layer(model, tokenizer):
    w = model.model.layers[4].self_attn.k_proj.weight
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w[0, 0] = float("nan")
        with pytest.raises(NonFiniteActivations, match="layer 4"):
            calibrate(model, tokenizer, CalibrationSettings(**SMALL), progress=False)
    finally:
        with torch.no_grad():
            w.copy_(saved)




def test_bad_settings():
    with pytest.raises(ValueError, match="rotation scope"):
        CalibrationSettings(rotation_scope="per-token")
    with pytest.raises(ValueError, match="clip ratios"):
        CalibrationSettings(k_clip=1.5)


def test_centering_choice_takes_the_fewest_pairs_near_the_lowest_error():
    # 16 pairs within the tolerance of 32's error: the cheaper count wins
    near = choose_centering({8: 0.3650 * (1 + 2 * PAIRS_TOLERANCE), 16: 0.3650 * (1 + PAIRS_TOLERANCE / 2), 32: 0.3650},
                            0.45)
    assert (near.centering, near.pairs) == ("rope", 16)
    assert "16 pairs" in near.reason and "fewest" in near.reason and "below constant" in near.reason
    # just outside it: the most accurate count
    far = choose_centering({8: 0.3650 * (1 + 3 * PAIRS_TOLERANCE), 16: 0.3650 * (1 + 2 * PAIRS_TOLERANCE), 32: 0.3650},
                           0.45)
    assert (far.centering, far.pairs) == ("rope", 32) and "lowest rope error" in far.reason
    # fewer pairs measured better (as SmolLM2's 16 vs all 32): fewer it is
    assert choose_centering({8: 0.45, 16: 0.3646, 32: 0.3659}, 0.45).pairs == 16
    # one count measured (pinned): rope against constant only
    assert choose_centering({32: 0.36}, 0.45).pairs == 32


def test_centering_choice_with_pinned_pairs_weighs_rope_at_the_most_pairs():
    # Qwen2.5 with 8 pairs scored over 32K (NOTES.md run H1): 4% below constant on the short probe, 9.7% with 32
    pinned = choose_centering({8: 0.3937, 32: 0.3702}, 0.4099, pairs=8)
    assert (pinned.centering, pinned.pairs) == ("rope", 8)
    assert "asked for" in pinned.reason and "32 pairs is 9.7% below constant" in pinned.reason
    assert choose_centering({8: 0.40, 32: 0.395}, 0.4099, pairs=8).centering == "constant"


def test_centering_choice_falls_back_to_constant_without_the_gain():
    weak = choose_centering({8: 0.60, 16: 0.44, 32: 0.437}, 0.45)  # 16 is near 32's error but < 5% below constant
    assert (weak.centering, weak.pairs, weak.rope_pairs) == ("constant", 0, 16)
    assert f"{ROPE_GAIN:.0%}" in weak.reason and "constant" in weak.reason
    edge = 0.45 * (1 - ROPE_GAIN)
    assert choose_centering({16: edge * 0.999}, 0.45).centering == "rope"
    assert choose_centering({16: edge * 1.001}, 0.45).centering == "constant"
    # without constant as a candidate (key centering "rope", pairs "auto") only the pair count is chosen
    only = choose_centering({8: 0.60, 16: 0.44, 32: 0.437})
    assert (only.centering, only.pairs) == ("rope", 16)


def test_auto_chooses_pairs_and_the_manifest_says_which(model, tokenizer, tmp_path):
    rot = calibrate(model, tokenizer, CalibrationSettings(rope_pairs="auto", **SMALL), progress=False)
    rot.save(tmp_path)
    cal = Rotations.load(tmp_path).manifest["calibration"]
    choice = cal["key_centering_choice"]
    assert cal["key_centering"] == "auto" and cal["rope_pairs"] == choice["pairs"]
    errors = {int(p): e for p, e in choice["probe_error_by_pairs"].items()}
    assert set(errors) == {8, 16, 32} and set(choice["probe_error"]) == {"constant", "rope"}
    assert choice["reason"]
    if choice["chosen"] == "rope":
        assert errors[choice["pairs"]] <= (1 + PAIRS_TOLERANCE) * min(errors.values())
        assert choice["probe_error"]["rope"] == errors[choice["pairs"]]
        assert rot.key_centering == "rope"
        # what the kernels will visit is what the manifest says was kept
        for layer in rot.rope_layers():
            assert kernel_pairs(rot.k_rope_mean[layer]).shape[1] == choice["pairs"], layer
    else:
        assert choice["pairs"] == 0 and rot.key_centering == "constant"


def test_pinned_rope_pairs_are_kept_as_asked(model, tokenizer):
    rot = calibrate(model, tokenizer, CalibrationSettings(key_centering="rope", rope_pairs=16, **SMALL), progress=False)
    cal = rot.manifest["calibration"]
    assert cal["rope_pairs"] == 16 and cal["key_centering_choice"] == {"chosen": "rope", "pairs": 16,
                                                                       "reason": "requested"}
    assert {kernel_pairs(rot.k_rope_mean[layer]).shape[1] for layer in rot.rope_layers()} == {16}


def test_bad_rope_pairs():
    for bad in (0, "many", 2.5, True):
        with pytest.raises(ValueError, match="rope_pairs"):
            CalibrationSettings(rope_pairs=bad)


def test_auto_widths_follow_the_key_noise_and_the_manifest_says_why(model, tokenizer):
    settings = CalibrationSettings(**SMALL)
    rot = calibrate(model, tokenizer, settings, progress=False)
    w = rot.manifest["calibration"]["widths"]
    assert w["k_bits"] == rot.k_bits.tolist() and set(w["k_bits"]) <= {2, 3, 4, 5, 8}
    assert w["v_bits"] == rot.v_bits.tolist() and set(w["v_bits"]) <= {2, 3, 4}
    assert w["tolerance"] == settings.key_noise
    for side, widths, chosen in (("key", (2, 3, 4, 5, 8), "k_bits"), ("value", (2, 3, 4), "v_bits")):
        by_width = w[f"{side}_noise_by_width"]
        for layer in range(30):
            noise = [by_width[str(b)][layer] for b in widths]
            assert noise == sorted(noise, reverse=True) and noise[0] > noise[-1], (side, layer)
            bits = w[chosen][layer]
            assert w[f"{side}_noise"][layer] == by_width[str(bits)][layer]
            # within the tolerance or as wide as it goes, and no wider than it needs
            assert w[f"{side}_noise"][layer] <= settings.key_noise or bits == widths[-1], (side, layer)
            narrower = widths[widths.index(bits) - 1] if bits != widths[0] else None
            assert narrower is None or by_width[str(narrower)][layer] > settings.key_noise, (side, layer)
    assert w["bits_per_element"] == pytest.approx(rot_bits(rot, 8192), abs=1e-3)
    rot.validate()


def rot_bits(rot, seq_len):
    from oscar_kv.memory import bits_per_element

    return bits_per_element(seq_len, 64, 64, k_bits=rot.k_bits.tolist(), v_bits=rot.v_bits.tolist())


def test_requested_widths_and_budgets_are_kept(model, tokenizer):
    from oscar_kv.memory import bits_per_element

    rot = calibrate(model, tokenizer, CalibrationSettings(key_bits=3, value_bits=3, **SMALL), progress=False)
    assert rot.k_bits.tolist() == [3] * 30 and rot.v_bits.tolist() == [3] * 30
    assert rot.manifest["calibration"]["widths"]["reason"] == "requested"
    k2v2 = bits_per_element(8192, 64, 64)
    rot = calibrate(model, tokenizer, CalibrationSettings(key_noise=None, kv_bits=k2v2 + 0.1, **SMALL), progress=False)
    assert rot_bits(rot, 8192) <= k2v2 + 0.1 and 0 < sum(b > 2 for b in rot.k_bits.tolist()) < 30


def test_bad_width_settings():
    with pytest.raises(ValueError, match="key bits must be 'auto' or one of"):
        CalibrationSettings(key_bits=6)
    assert CalibrationSettings(key_bits=5).key_bits == 5
    with pytest.raises(ValueError, match="value bits"):
        CalibrationSettings(value_bits=5)  # 5 bits is a key width only
    with pytest.raises(ValueError, match="needs a key noise tolerance, a bit budget or a KL target"):
        CalibrationSettings(key_noise=None, kv_bits=None, max_kl=None, max_answer_kl=None)
    # the KL target alone: the fewest widenings from every part at its narrowest that meet it
    assert CalibrationSettings(key_noise=None, max_kl=0.05).key_noise is None
    with pytest.raises(ValueError, match="bit budget must lie"):
        CalibrationSettings(kv_bits=1.5)


def test_a_budget_below_the_narrowest_widths_is_refused_before_any_work(model, tokenizer):
    import time

    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="below the narrowest widths' 2.907 at this model's context of 8192") as info:
        calibrate(model, tokenizer, CalibrationSettings(kv_bits=2.85, **SMALL), progress=False)
    assert info.value.fields == ("kv_bits",) and time.perf_counter() - t0 < 5


def test_the_kl_search_takes_the_fewest_widenings_that_meet_the_target():
    """search_kl_steps bisects the widening path: the step it returns meets the target, every measured step before
    it does not, and it measures about log2 of the path, not all of it."""
    kl_at = {n: 1.0 / (1 + n) for n in range(41)}  # falls as layers widen
    state = {}

    def allocation(n):
        n = min(n, 40)
        return WidthChoice([2] * 20 if n == 0 else [4] * (n // 2) + [3] * (n % 2) + [2] * (20 - n // 2 - n % 2),
                           [0.0] * 20, 2.0 + n / 40, "", steps=n)

    choice, measured = search_kl_steps(allocation, lambda c: state.update(n=sum(c.k_bits) - 40),
                                       lambda: {"kl": kl_at[state["n"]]}, targets={"kl": 0.1}, progress=False)
    chosen = sum(choice.k_bits) - 40
    assert chosen == 9 and kl_at[chosen] <= 0.1 < kl_at[chosen - 1]
    assert all(v["kl"] > 0.1 for n, v in measured.items() if n < chosen)
    assert len(measured) <= 7 and "the fewest widenings (9)" in choice.reason
    _, unmet = search_kl_steps(allocation, lambda c: state.update(n=sum(c.k_bits) - 40),
                               lambda: {"kl": kl_at[state["n"]]}, targets={"kl": 1e-3}, progress=False)
    assert list(unmet) == [40]  # the widest end is measured first; when it misses, nothing else is
    # with a noise tolerance, the search starts at its point: met there, one measurement; else beyond it only
    choice, measured = search_kl_steps(allocation, lambda c: state.update(n=sum(c.k_bits) - 40),
                                       lambda: {"kl": kl_at[state["n"]]}, targets={"kl": 0.1}, progress=False, start=12)
    assert list(measured) == [12] and sum(choice.k_bits) - 40 == 12 and "tolerance's 12 widening(s)" in choice.reason
    choice, measured = search_kl_steps(allocation, lambda c: state.update(n=sum(c.k_bits) - 40),
                                       lambda: {"kl": kl_at[state["n"]]}, targets={"kl": 0.1}, progress=False, start=4)
    assert sum(choice.k_bits) - 40 == 9 and min(measured) == 4
    # two measures: the step meets both (the answer KL here needs 19 widenings), and both are recorded
    choice, measured = search_kl_steps(allocation, lambda c: state.update(n=sum(c.k_bits) - 40),
                                       lambda: {"kl": kl_at[state["n"]], "answer_kl": 2 * kl_at[state["n"]]},
                                       targets={"kl": 0.1, "answer_kl": 0.1}, progress=False)
    assert sum(choice.k_bits) - 40 == 19 and all(set(v) >= {"kl", "answer_kl"} for v in measured.values())
    assert "KL 0.05 <= 0.1, answer KL 0.1 <= 0.1" in choice.reason


def test_a_kl_target_out_of_reach_takes_the_widest_widths_and_says_so(model, tokenizer):
    rot = calibrate(model, tokenizer, CalibrationSettings(**{**SMALL, "max_kl": 1e-9}, kl_probe_tokens=1024),
                    progress=False)
    widths = rot.manifest["calibration"]["widths"]
    assert set(rot.k_bits.tolist()) == {8} and set(rot.v_bits.tolist()) == {4}
    assert widths["max_kl"] == 1e-9 and widths["tolerance"] == 0.3 and "not met" in widths["reason"]
    # the tolerance's point first, then the widest end: every layer's keys four widths up (2 -> 3 -> 4 -> 5 -> 8),
    # its values two (2 -> 3 -> 4)
    *_, (step, measured) = widths["kl_by_step"].items()
    assert len(widths["kl_by_step"]) <= 2 and step == 6 * rot.geometry.num_layers and measured["kl"] > 1e-9
    assert measured["bits_per_element"] == widths["bits_per_element"]


def test_an_answer_kl_target_measures_the_needle_probe(model, tokenizer):
    """--max-answer-kl alone: the needle probe's answer KL is measured along the same path; out of reach it takes the
    widest widths and says so, within reach of the tolerance's widths one measurement keeps them; inspect shows it."""
    from oscar_kv.artifact_report import width_map

    unmet = calibrate(model, tokenizer, CalibrationSettings(**{**SMALL, "max_answer_kl": 1e-9},
                                                            needle_probe_tokens=1024), progress=False)
    widths = unmet.manifest["calibration"]["widths"]
    assert widths["max_answer_kl"] == 1e-9 and widths["max_kl"] is None and "not met" in widths["reason"]
    assert set(unmet.k_bits.tolist()) == {8} and set(unmet.v_bits.tolist()) == {4}
    assert widths["needle_probe_tokens"] <= 1024 and widths["needle_prompts_answered"] == "6 of 8"
    assert all("answer_kl" in p and "kl" not in p for p in widths["kl_by_step"].values())
    met = calibrate(model, tokenizer, CalibrationSettings(**{**SMALL, "max_answer_kl": 100.0},
                                                          needle_probe_tokens=1024), progress=False)
    widths = met.manifest["calibration"]["widths"]
    (step, measured), = widths["kl_by_step"].items()
    assert "tolerance's" in widths["reason"] and "answer KL" in widths["reason"] and measured["answer_kl"] > 0
    assert "answer KL 100, on needle prompts of" in width_map(widths)


def test_the_answer_kl_counts_only_the_needles_the_model_finds(model, tokenizer):
    """A prompt counts when the unquantized model's most likely answer tokens are the expected ones: not when the
    expected number is not in the haystack."""
    from oscar_kv.calibration_text import needle_probe
    from oscar_kv.corpus import load_calibration_text
    from oscar_kv.width_choice import answered_needles

    texts, _ = load_calibration_text()
    prompts = needle_probe(tokenizer, texts, CalibrationSettings(**SMALL, needle_probe_tokens=1024), 8192)
    answered, tried = answered_needles(model, prompts)
    assert 4 <= len(answered) < len(prompts) and tried == len(prompts)  # SmolLM2 finds 6 of these 8 at 1K (1 of 8 at 4K)
    for prompt, reference, kv, found in answered:
        assert reference.shape[0] == prompt.ids.shape[1] - prompt.answer_start and kv is None and found
    found = answered[0].prompt
    ids, start = found.ids, found.answer_start
    other = next(p for p in prompts if not torch.equal(p.ids[0, p.answer_start:], ids[0, start:]))
    elsewhere = found._replace(ids=torch.cat([ids[:, :start], other.ids[:, other.answer_start:]], 1))  # a number the
    assert answered_needles(model, [elsewhere]) == ([], 1)  # haystack does not hold
    # once too few could still be answered for the check, the rest are not run: the first two prompts missed, two
    # prompts left cannot make the three needed
    missed = [elsewhere] * 2 + [needle.prompt for needle in answered[:2]]
    assert answered_needles(model, missed, needed=3) == ([], 2)
    assert len(answered_needles(model, missed, needed=2)[0]) == 2
    # --needle-probe-scored all: every prompt kept, each marked, the unanswered one with the exact model's own
    # distribution over the expected answer as its reference
    kept, tried = answered_needles(model, missed, keep_all=True)
    assert tried == 4 and [needle.answered for needle in kept] == [False, False, True, True]
    assert kept[0].reference.shape[0] == elsewhere.ids.shape[1] - elsewhere.answer_start
    # "auto" keeps every prompt but stops as "answered" does: the kept misses do not count towards the three needed
    kept, tried = answered_needles(model, missed, needed=3, keep_all=True)
    assert tried == 2 and [needle.answered for needle in kept] == [False, False]


def test_the_stored_haystack_answer_kl_reads_the_needle_from_the_cache(model, tokenizer, rotations):
    """needle_probe_haystack "stored": each haystack is prefilled exactly once, where the model's own answer is read
    (through the unquantized cache, the question and answer after it: the same prompts answered as over the whole
    prompt), and kept for the prompts answered; per artifact only the question and answer run through its cache.  An
    artifact quantizing nothing scores ~0; INT2 scores more than keys at 8 bits and values at 4; calibrate records the
    choice and measures with it."""
    import copy

    from oscar_kv.calibration_text import needle_probe
    from oscar_kv.cache import CacheSettings
    from oscar_kv.corpus import load_calibration_text
    from oscar_kv.evaluate.schemes import standard_scheme
    from oscar_kv.evaluate.tasks import answer_log_probs, kl_divergence
    from oscar_kv.models import AttentionGeometry
    from oscar_kv.width_choice import answered_needles, needle_measure

    texts, _ = load_calibration_text()
    prompts = needle_probe(tokenizer, texts, CalibrationSettings(**SMALL, needle_probe_tokens=1024), 8192)[:4]
    answered, tried = answered_needles(model, prompts, haystack="stored")
    decoded, _ = answered_needles(model, prompts)
    assert tried == 4 and len(answered) >= 2
    assert [needle.prompt for needle in answered] == [needle.prompt for needle in decoded]
    exact = standard_scheme("bf16", AttentionGeometry.of(model.config), rotations, CacheSettings())
    for (prompt, reference, kv, _), (_, whole, _, _) in zip(answered, decoded):
        ids = prompt.ids[0].tolist()
        assert len(kv) == model.config.num_hidden_layers and kv[0][0].shape[2] == prompt.question_start
        log_probs = answer_log_probs(model, exact, kv, ids[prompt.question_start:prompt.answer_start],
                                     ids[prompt.answer_start:])
        assert torch.equal(log_probs, reference)  # the reference is the unquantized cache's answer
        assert float(kl_divergence(whole, reference).mean()) < 1e-3  # and about the whole prompt's
    int2 = needle_measure(model, answered)(rotations)["answer_kl"]
    wide = copy.deepcopy(rotations)
    wide.set_bits([8] * len(wide.k_bits), [4] * len(wide.v_bits))
    assert 0 < needle_measure(model, answered)(wide)["answer_kl"] < int2
    # a haystack within the exact windows (sink 64 + recent 256): nothing is quantized
    short = [p._replace(ids=p.ids[:, p.question_start - 200:], answer_start=p.answer_start - p.question_start + 200,
                        question_start=200) for p, *_ in answered]
    assert needle_measure(model, answered_needles(model, short, haystack="stored")[0])(rotations)["answer_kl"] < 1e-3

    rot = calibrate(model, tokenizer, CalibrationSettings(**{**SMALL, "max_answer_kl": 100.0}, needle_probe_tokens=1024,
                                                          needle_probe_haystack="stored"), progress=False)
    calibration = rot.manifest["calibration"]
    (measured,) = calibration["widths"]["kl_by_step"].values()
    assert calibration["needle_probe_haystack"] == "stored" and measured["answer_kl"] > 0
    with pytest.raises(ConfigError, match="haystack"):
        CalibrationSettings(needle_probe_haystack="prefilled")


def test_a_model_that_finds_no_needle_skips_the_answer_kl_check(tokenizer):
    """A random-weight model answers none of the needle prompts: the widths are the other rules' (the manifest says
    0 of the first 5 of 8), and with no other rule calibrate refuses before choosing any."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from oscar_kv.artifact_report import width_map

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048)
    random_model = LlamaForCausalLM(config).eval()
    settings = CalibrationSettings(calib_tokens=512, seq_len=256, probe_tokens=128, max_kl=None)
    assert settings.max_answer_kl == 0.01  # the default
    rot = calibrate(random_model, tokenizer, settings, progress=False)
    widths = rot.manifest["calibration"]["widths"]
    # five misses leave three prompts, too few for the check's four: those are not run
    assert widths["needle_prompts_answered"] == "0 of the first 5 of 8" and "max_answer_kl" not in widths
    assert "noise is within 0.3" in widths["reason"] and "kl_by_step" not in widths
    assert "answer KL check skipped: the model answers 0 of the first 5 of 8 needle prompts of" in width_map(widths)
    with pytest.raises(ConfigError, match="answers 0 of the first 5 of 8 needle prompts"):
        calibrate(random_model, tokenizer, dataclasses.replace(settings, key_noise=None), progress=False)
    # --needle-probe-scored all: every prompt's answer KL counts, answered or not, so the check runs (and at head dim
    # 32 the split widths measured are only those whose parts pack: 4 wide channels take no 3 bits)
    every = calibrate(random_model, tokenizer, dataclasses.replace(settings, needle_probe_scored="all",
                                                                   max_answer_kl=100.0), progress=False)
    widths = every.manifest["calibration"]["widths"]
    assert widths["needle_prompts_answered"] == "0 of 8" and widths["needle_probe_scored"] == "all"
    assert widths["kl_by_step"] and all(step["answer_kl"] > 0 for step in widths["kl_by_step"].values())
    assert "0 of 8 answered, all scored" in width_map(widths)
    with pytest.raises(ConfigError, match="scored prompts"):
        CalibrationSettings(needle_probe_scored="some")


def test_the_answer_kl_check_needs_half_of_the_needles_answered(model, tokenizer):
    """SmolLM2 answers 1 of the 8 needle prompts at 4K: a mean over one barely given answer is no measure (run D32),
    so the widths are the other rules' and the manifest and inspect say why."""
    from oscar_kv.artifact_report import width_map

    rot = calibrate(model, tokenizer, CalibrationSettings(**{**SMALL, "max_answer_kl": 0.01}, needle_probe_tokens=4096),
                    progress=False)
    widths = rot.manifest["calibration"]["widths"]
    assert re.fullmatch(r"1 of (the first \d of )?8", widths["needle_prompts_answered"]) and "max_answer_kl" not in widths
    assert "kl_by_step" not in widths and "noise is within" in widths["reason"]
    assert f"answer KL check skipped: the model answers {widths['needle_prompts_answered']} needle prompts of" \
        in width_map(widths)
    assert "(the check needs half)" in width_map(widths)


def test_the_checks_run_on_float32_weights_and_leave_the_model_as_it_was():
    """calibrate.float32_weights: inside, every floating-point parameter is float32 (the checks then measure the
    cache, not bfloat16's rounding); after, each is back in its dtype with the same bits; buffers are not touched."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from oscar_kv.calibrate import float32_weights

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = LlamaForCausalLM(config).eval().to(torch.bfloat16)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    ids = torch.tensor([[1, 5, 9, 3]])
    with float32_weights(model):
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert model(ids).logits.dtype == torch.float32
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, before[name]), name
    for name, b in model.named_buffers():
        assert b.dtype == buffers[name].dtype and torch.equal(b, buffers[name]), name


def test_the_needle_probe_asks_for_a_number_it_holds(tokenizer):
    from oscar_kv.calibration_text import needle_probe
    from oscar_kv.calibration_settings import NEEDLE_PROBE_PROMPTS
    from oscar_kv.corpus import load_calibration_text

    texts, _ = load_calibration_text()
    prompts = needle_probe(tokenizer, texts, CalibrationSettings(needle_probe_tokens=2048), 8192)
    assert len(prompts) == NEEDLE_PROBE_PROMPTS
    for ids, start, question in prompts:
        assert 1500 < ids.shape[1] <= 2048
        number = tokenizer.decode(ids[0, start:]).strip()
        assert len(number) == 7 and number.isdigit()
        assert number in tokenizer.decode(ids[0, :question])  # the needle is in the haystack, before the question
        assert "special magic number for" in tokenizer.decode(ids[0, question:start])  # the question, then the answer
    assert len({tokenizer.decode(ids[0, start:]) for ids, start, _ in prompts}) == NEEDLE_PROBE_PROMPTS


def test_the_needle_probe_is_the_context_where_its_stored_haystacks_fit(model, tokenizer, monkeypatch):
    """Stored haystacks (the default): prompts of the context; where the 8 prompts' float32 K/V would take more than
    half the free memory, the longest multiple of 1024 that fits, never below 1024; --needle-probe-tokens and decoded
    haystacks (at most 16K) keep their own length."""
    import oscar_kv.calibration_text as calibration_text
    from oscar_kv.calibration_text import needle_probe, stored_needle_probe_tokens
    from oscar_kv.corpus import load_calibration_text

    per_prompt_token = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M: 30 layers, 3 KV heads of 64, K and V in float32
    default = CalibrationSettings()
    assert default.needle_probe_haystack == "stored"
    monkeypatch.setattr(calibration_text, "free_bytes", lambda device: 2 * 8 * per_prompt_token * 8192)
    assert stored_needle_probe_tokens(model, default, 8192) is None  # exactly half the free memory: the context
    monkeypatch.setattr(calibration_text, "free_bytes", lambda device: 2 * 8 * per_prompt_token * 5000)
    assert stored_needle_probe_tokens(model, default, 8192) == 4096
    monkeypatch.setattr(calibration_text, "free_bytes", lambda device: 1000)
    assert stored_needle_probe_tokens(model, default, 8192) == 1024
    assert stored_needle_probe_tokens(model, CalibrationSettings(needle_probe_tokens=2048), 8192) is None
    assert stored_needle_probe_tokens(model, CalibrationSettings(needle_probe_haystack="decoded"), 8192) is None

    texts, _ = load_calibration_text()
    longest = lambda settings, context: max(p.ids.shape[1] for p in needle_probe(tokenizer, texts, settings, context))
    assert 1900 < longest(default, 2048) <= 2048 + 32  # about the context (question and answer after the haystack)
    decoded = CalibrationSettings(needle_probe_haystack="decoded")
    assert 15000 < longest(decoded, 131072) <= 16384 + 32


def test_the_kl_probe_is_the_models_context_up_to_32k(tokenizer):
    from oscar_kv.calibration_text import kl_probe
    from oscar_kv.corpus import load_calibration_text

    texts, _ = load_calibration_text()
    assert kl_probe(tokenizer, texts, CalibrationSettings(), 8192).shape == (1, 8192)
    assert kl_probe(tokenizer, texts, CalibrationSettings(), 131072).shape == (1, 32768)
    assert kl_probe(tokenizer, texts, CalibrationSettings(kl_probe_tokens=2048), 131072).shape == (1, 2048)


def test_a_kl_target_refuses_what_it_cannot_do():
    with pytest.raises(ConfigError, match="KL target must be > 0"):
        CalibrationSettings(max_kl=0)
    with pytest.raises(ConfigError, match="at least 1024 tokens"):
        CalibrationSettings(max_kl=0.05, kl_probe_tokens=100)
    with pytest.raises(ConfigError, match="answer KL target must be > 0"):
        CalibrationSettings(max_answer_kl=0)
    with pytest.raises(ConfigError, match="needle probe needs at least 1024 tokens"):
        CalibrationSettings(max_answer_kl=0.1, needle_probe_tokens=512)
