"""The paged engine on the real SmolLM2: equality with generate(), batching, prefix cache, preemption."""

import copy
import dataclasses
import os

import pytest
import torch

from oscar_kv.cache import CacheSettings, OscarCache, unprepare_model
from oscar_kv.engine import EngineConfig, LLMEngine, SamplingParams
from oscar_kv.engine.block_pool import PageAllocator, plan_pool
from oscar_kv.generation import build_prompt, generate
from oscar_kv.hf_compat import cache_kwargs
from oscar_kv.kernels.layout import PoolGeometry
from oscar_kv.quant import SplitWidth

GREEDY = dict(temperature=0.0)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py: one torch thread for small steps


@pytest.fixture(scope="module")
def small_rotations(smol):
    from oscar_kv.calibrate import calibrate
    from oscar_kv.calibration_settings import CalibrationSettings

    lm, tok = smol
    rot = calibrate(lm, tok, CalibrationSettings(calib_tokens=512, seq_len=256, probe_tokens=128, max_kl=None,
                                                 max_answer_kl=None), progress=False)
    unprepare_model(lm)
    return rot


@pytest.fixture(scope="module")
def constant_rotations(smol):
    """Keys centered by one constant mean: what the Triton kernels compute (no per-position offset yet)."""
    from oscar_kv.calibrate import calibrate
    from oscar_kv.calibration_settings import CalibrationSettings

    lm, tok = smol
    rot = calibrate(lm, tok, CalibrationSettings(calib_tokens=512, seq_len=256, probe_tokens=128,
                                                 key_centering="constant", max_kl=None, max_answer_kl=None),
                    progress=False)
    unprepare_model(lm)
    return rot


@pytest.fixture(scope="module")
def long_prompt():
    from oscar_kv.corpus import DEFAULT_CORPUS

    return DEFAULT_CORPUS.read_text()[1000:2600] + "\n\nSummarize the text above in one sentence."


def run_all(engine, limit=400):
    outputs = {}
    for _ in range(limit):
        if not engine.has_work():
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert not engine.has_work(), "the engine did not finish"
    return outputs


def text_of(outs):
    return "".join(o.text for o in outs)


# The engine tests run the CPU model; its Triton kernels need the interpreter, which conftest turns on only where
# there is no CUDA (on a GPU machine the kernels' own tests and test_graphs cover them on the device).
cpu_kernels = pytest.mark.skipif(torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET"),
                                 reason="the CPU engine's Triton kernels run under TRITON_INTERPRET=1 only")


def make_engine(model, tokenizer, rotations, **kwargs):
    settings = dict(kv_cache_memory=0.1, max_model_len=1024)
    settings.update(kwargs)
    return LLMEngine(model, tokenizer, rotations, EngineConfig(**settings))


def greedy_with_cache_chunks(model, rotations, dtype, ids, cuts, n):
    """Greedy tokens from cache.py's OscarCache fed the prompt in forwards split at ``cuts``."""
    cache = OscarCache(model, rotations, CacheSettings(dtype))
    bounds = [0, *cuts, ids.shape[1]]
    with torch.no_grad():
        for a, b in zip(bounds, bounds[1:]):
            logits = model(ids[:, a:b], **cache_kwargs(model, cache)).logits
        out = [int(logits[0, -1].argmax())]
        while len(out) < n:
            out.append(int(model(torch.tensor([[out[-1]]]), **cache_kwargs(model, cache)).logits[0, -1].argmax()))
    unprepare_model(model)
    return out


@pytest.mark.parametrize("dtype", ["bf16", "int2"])
def test_greedy_output_equals_generate(model, tokenizer, small_rotations, long_prompt, dtype):
    ref = generate(model, tokenizer, long_prompt, small_rotations, CacheSettings(dtype), max_new_tokens=10)
    assert ref.prompt_tokens > 320  # INT2 history pages exist after prefill, and migrate while decoding
    unprepare_model(model)
    engine = make_engine(model, tokenizer, small_rotations, kv_cache_dtype=dtype)
    ids = build_prompt(tokenizer, long_prompt)[0].tolist()
    engine.add_request("r", ids, SamplingParams(max_tokens=10, **GREEDY))
    outs = run_all(engine)["r"]
    assert text_of(outs).strip() == ref.text
    assert outs[-1].completion_tokens == ref.new_tokens
    if dtype == "int2":
        assert engine.pool.quant.num_pages > 0 and engine.pool.quant.cached > 0  # INT2 pages were written and kept
    assert engine.pool.all_free()


def test_chunked_prefill_matches_cache_with_the_same_chunks(model, tokenizer, small_rotations, long_prompt):
    """Prefill in 128-token forwards: the same stored history as OscarCache fed the same chunks."""
    ids = build_prompt(tokenizer, long_prompt)
    expected = greedy_with_cache_chunks(model, small_rotations, "int2", ids, list(range(128, ids.shape[1], 128)), 6)
    engine = make_engine(model, tokenizer, small_rotations, max_num_batched_tokens=128)
    engine.add_request("r", ids[0].tolist(), SamplingParams(max_tokens=6, ignore_eos=True, **GREEDY))
    outs = run_all(engine)["r"]
    assert [t for o in outs for t in o.token_ids] == expected


def test_continuous_batching_admits_while_decoding_and_frees_every_page(model, tokenizer, small_rotations):
    engine = make_engine(model, tokenizer, small_rotations, max_num_seqs=4)
    prompts = [f"Count from {i} to {i + 5}." for i in range(6)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", build_prompt(tokenizer, p)[0].tolist(), SamplingParams(max_tokens=4 + i, **GREEDY))
    engine.step()
    assert len(engine.scheduler.running) == 4 and len(engine.scheduler.waiting) == 2
    outputs = run_all(engine)
    assert sorted(outputs) == [f"r{i}" for i in range(6)]
    for i in range(6):
        assert outputs[f"r{i}"][-1].finished and outputs[f"r{i}"][-1].completion_tokens <= 4 + i
    assert engine.pool.all_free() and engine.stats().running == 0


@pytest.mark.parametrize("dtype", ["bf16", "int2"])
def test_prefix_cache_reuses_pages_exactly(model, tokenizer, small_rotations, long_prompt, dtype):
    """A hit shares the sink and INT2 pages (all full pages with BF16) and recomputes the rest: the
    output is cache.py's with the prompt fed in two forwards split where the hit ends."""
    ids = build_prompt(tokenizer, long_prompt)
    engine = make_engine(model, tokenizer, small_rotations, kv_cache_dtype=dtype)
    params = SamplingParams(max_tokens=6, ignore_eos=True, **GREEDY)
    tokens = {}
    for rid in "ab":
        engine.add_request(rid, ids[0].tolist(), params)
        tokens[rid] = [t for o in run_all(engine)[rid] for t in o.token_ids]
    geom, n = engine.pool.geometry, ids.shape[1]
    hit = geom.sink_size + geom.int2_pages_for(n) * geom.page_size if dtype == "int2" else (n - 1) // 16 * 16
    assert engine.pool.hit_tokens == hit and engine.stats().prefix_hit_rate == pytest.approx(hit / (2 * n))
    assert engine.pool.all_free()
    unprepare_model(model)
    assert tokens["b"] == greedy_with_cache_chunks(model, small_rotations, dtype, ids, [hit], 6)
    print(f"\n{dtype}: cold {tokens['a']} / prefix hit of {hit} tokens {tokens['b']}")


def test_preemption_recomputes_and_leaks_nothing(model, tokenizer):
    """8 window pages for 3 requests that each grow to 4: someone must be preempted and recomputed."""
    page_bytes = 30 * 2 * 3 * 16 * 64 * 2  # layers x (K, V) x KV heads x page x head dim x BF16
    engine = make_engine(model, tokenizer, None, kv_cache_dtype="bf16", max_model_len=64,
                         kv_cache_memory=8 * page_bytes / 1e9 + 1e-9)
    assert engine.plan.window_pages == 8
    prompt = tokenizer("Once upon a time, a cat and a dog met in a small garden near the river.").input_ids[:20]
    for i in range(3):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=64 - len(prompt), ignore_eos=True, **GREEDY))
    outputs = run_all(engine, limit=1000)
    assert engine.scheduler.num_preemptions > 0
    for i in range(3):
        assert outputs[f"r{i}"][-1].finish_reason == "length"
        assert outputs[f"r{i}"][-1].completion_tokens == 64 - len(prompt)
    assert engine.pool.all_free()


def test_abort_releases_pages(model, tokenizer, small_rotations):
    engine = make_engine(model, tokenizer, small_rotations)
    engine.add_request("r", build_prompt(tokenizer, "Hello!")[0].tolist(), SamplingParams(max_tokens=50, **GREEDY))
    engine.step()
    assert not engine.pool.all_free()
    out = engine.abort_request("r")
    assert out.finished and out.finish_reason == "abort"
    assert engine.pool.all_free() and not engine.has_work()


def test_fork_continues_from_the_same_cache_and_pause_keeps_it(model, tokenizer, small_rotations, long_prompt):
    """A fork copies a request's pages (INT2 history and BF16 windows): greedy, it produces the tokens the original
    produces; a paused request is not scheduled and keeps its pages."""
    engine = make_engine(model, tokenizer, small_rotations, page_size=16, sink_size=16, recent_size=32)
    prompt = build_prompt(tokenizer, long_prompt)[0].tolist()
    engine.add_request("a", prompt, SamplingParams(max_tokens=40, **GREEDY))
    while engine.requests["a"].num_computed < len(prompt):  # prefilled, its first token sampled
        engine.step()
    assert engine.requests["a"].int2_pages > 0
    engine.fork("a", "b")  # waits for a's token in flight first (the overlapped step): both have it
    forked = list(engine.requests["b"].output_ids)
    assert forked == engine.requests["a"].output_ids
    with pytest.raises(ValueError, match="already in use"):
        engine.fork("a", "b")
    engine.pause("b")
    for _ in range(5):
        engine.step()
    engine.drain()
    assert engine.requests["b"].output_ids == forked and len(engine.requests["a"].output_ids) >= len(forked) + 4
    engine.resume("b")
    engine.pause("a")
    for _ in range(5):
        engine.step()
    engine.drain()
    a, b = engine.requests["a"].output_ids, engine.requests["b"].output_ids
    assert len(b) >= len(forked) + 4 and b == a[:len(b)]
    engine.resume("a")
    run_all(engine)
    assert engine.pool.all_free()


def test_requests_that_cannot_fit_are_refused(model, tokenizer, small_rotations):
    engine = make_engine(model, tokenizer, small_rotations, max_model_len=64)
    with pytest.raises(ValueError, match="maximum context length is 64"):
        engine.add_request("r", list(range(70)), SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("r", list(range(10)), SamplingParams(max_tokens=60))
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("nan"))


# ---- pure accounting / allocator tests (no model) ---------------------------------------------------
def smol_geometry(bits=2):
    return PoolGeometry(num_layers=30, num_kv_heads=3, head_dim=64, group_size=64, page_size=16, sink_size=64,
                        recent_size=256, k_bits=(bits,) * 30)


def test_pool_accounting_counts_codes_metadata_and_windows():
    geom = smol_geometry()
    # per token, layer and KV head: K+V codes 2*16 B + a float16 scale and a uint8 zero point 2*3 B; BF16 window
    # 2*64*2 B
    assert geom.quant_page_bytes == 30 * 3 * 16 * 2 * (16 + 3)
    assert geom.window_page_bytes == 30 * 3 * 16 * 2 * 64 * 2
    budget = 2 * 10**9
    int2 = plan_pool(geom, budget, max_model_len=8192, max_num_seqs=64)
    bf16 = plan_pool(smol_geometry(16), budget, max_model_len=8192, max_num_seqs=64)
    assert int2.total_bytes <= budget and budget - int2.total_bytes < geom.window_page_bytes
    ratio = int2.capacity_tokens / bf16.capacity_tokens
    assert 4.5 < ratio < 6.74  # D = G = 64: INT2 is 2.375 bits (6.74x), BF16 windows take the rest
    seqs_int2 = int2.total_bytes // geom.sequence_bytes(8192)
    seqs_bf16 = bf16.total_bytes // smol_geometry(16).sequence_bytes(8192)
    assert seqs_int2 >= 5 * seqs_bf16


def test_pool_tensors_match_the_plan(tmp_path):
    from oscar_kv.engine.block_pool import PagePool

    geom = smol_geometry()
    plan = plan_pool(geom, 50 * 10**6, max_model_len=1024, max_num_seqs=4)
    pool = PagePool(plan)
    assert pool.tensor_bytes() == plan.total_bytes


def test_allocator_lru_eviction_and_refcounts():
    a = PageAllocator(3, "window")
    p = a.allocate(3)
    for page, key in zip(p, (b"x", b"y", b"z")):
        a.register(page, key)
    for page in p:
        a.release(page)
    assert a.available == 3 and a.used == 0 and a.cached == 3
    a.ref(a.lookup(b"x"))  # a hit takes x out of the LRU
    assert a.allocate(1) == [p[1]] and a.lookup(b"y") is None  # y was the least recently released
    assert a.lookup(b"x") == p[0]
    with pytest.raises(MemoryError):
        a.allocate(2)
    a.release(p[0])
    with pytest.raises(RuntimeError):
        a.release(p[0])


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=cpu_kernels),
                                    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                  reason="needs CUDA"))])
@pytest.mark.parametrize("dtype,centering", [("bf16", "constant"), ("int2", "constant"), ("int2", "rope"),
                                             ("mixed", "rope")])
def test_kernels_match_the_reference_on_real_activations(model, tokenizer, constant_rotations, small_rotations,
                                                         long_prompt, dtype, centering, device, monkeypatch):
    """Every step of two concurrent requests (chunked prefill, then decode): the Triton kernels (interpreted
    on the CPU) read the same pool as the torch reference path and give the same attention output, with
    keys centered by a constant or per position (SmolLM2's calibration picks the latter).  Prefill chunks take
    both extend paths (kernel_attention.extend_path): materialized flash attention for long chunks, the extend
    kernel for short ones and for decode tokens scheduled beside a chunk, in one step with per-position
    centering (100, then 50 + 50, then a decode token + 47).  On a GPU the model runs in BF16 as served, and INT2
    decode must take the one-launch CUDA kernel (SmolLM2: head dim 64), "mixed" with every layer at its own
    widths (MIXED_WIDTHS: values at 3 and 4 bits too)."""
    pytest.importorskip("triton")
    if dtype == "mixed":
        if device == "cpu":
            pytest.skip("on the CPU the mixed widths' kernels are checked by "
                        "test_keys_and_values_at_mixed_widths_run_the_kernels_with_the_torch_paths_tokens")
        small_rotations = copy.deepcopy(small_rotations)
        widths = [MIXED_WIDTHS[i % len(MIXED_WIDTHS)] for i in range(small_rotations.geometry.num_layers)]
        widths[0], widths[-1] = (4, 3), (8, 4)  # the layers checked below: wide values, and 8-bit keys
        small_rotations.set_bits(*zip(*widths))
        dtype = "int2"
    engine_options = {}
    if device == "cuda":
        from oscar_kv.models import load_model

        model, _ = load_model("smollm2-135m", device="cuda")
        monkeypatch.setenv("OSCAR_KV_INT2_KERNEL", "cuda")  # raises where the CUDA kernel cannot run the call
        engine_options["attention_backend"] = "torch"  # the reference path runs the model; the check runs the kernels
    from oscar_kv.engine import runner
    from oscar_kv.engine.kernel_attention import PoolView, kernel_step

    errors = {"DecodeStep": [], "ExtendStep": []}
    paths = []  # per extend step: which paths ran
    reference_attend = runner.StepAttention.attend

    def attend_and_check(self, layer_idx, query, key, value, scaling):
        out, weights = reference_attend(self, layer_idx, query, key, value, scaling)
        codecs = self.backend.codecs
        if layer_idx in (0, len(codecs) - 1):
            codec = codecs[layer_idx]
            plan = kernel_step(PoolView(self.backend.pool), self.plan.steps)
            got = plan.attend(layer_idx, codec, query, codec.rotate_keys(key, self.positions), value.float(), scaling)
            errors[type(plan).__name__].append(((got.float() - out.float()).norm() / out.float().norm()).item())
            if layer_idx == 0 and type(plan).__name__ == "ExtendStep":
                part, flash = plan.paths(codec.k_rope_mean is not None)
                paths.append(("flash",) * bool(flash.groups) + ("kernel",) * (part is not None))
        return out, weights

    monkeypatch.setattr(runner.StepAttention, "attend", attend_and_check)
    cuda_widths = []  # the widths of the layers the CUDA kernel decoded
    if device == "cuda":
        from oscar_kv.kernels import int2_cuda

        cuda_decode = int2_cuda.decode
        monkeypatch.setattr(int2_cuda, "decode", lambda *a, widths=(2, 2), **kw: (
            cuda_widths.append(tuple(widths)), cuda_decode(*a, widths=widths, **kw))[1])
    rotations = small_rotations if centering == "rope" else constant_rotations
    assert rotations.key_centering == centering
    engine = make_engine(model, tokenizer, rotations, kv_cache_dtype=dtype, sink_size=16, recent_size=32,
                         max_num_batched_tokens=100, **engine_options)
    ids = tokenizer(long_prompt).input_ids
    # chunks of 100 tokens; 6 and 3 INT2 pages behind the windows; different prompts: no prefix hit, so r1 still
    # prefills while r0 decodes
    for i, prompt in enumerate((ids[:150], ids[150:247])):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=3, **GREEDY))
    run_all(engine)
    assert len(errors["DecodeStep"]) == 4 and len(errors["ExtendStep"]) >= 4, errors
    assert max(errors["DecodeStep"] + errors["ExtendStep"]) < 1e-2, errors
    assert paths[0] == ("flash",) and any("kernel" in p for p in paths), paths
    if centering == "rope":
        assert ("flash", "kernel") in paths, paths
    if device == "cuda" and dtype == "int2":  # every checked layer decoded on the CUDA kernel, at its widths
        g = engine.pool.geometry
        assert set(cuda_widths) == {g.layer_widths(0), g.layer_widths(g.num_layers - 1)}, cuda_widths


@cpu_kernels
@pytest.mark.parametrize("dtype,decode_writer", [("bf16", "window"), ("int2", "window"), ("int2", "write_kv")])
def test_fused_write_path_stores_what_the_torch_path_stores(model, tokenizer, constant_rotations, long_prompt, dtype,
                                                             decode_writer, monkeypatch):
    """Kernel mode writes the pool with kernels/write.py (write_kv per layer, migrate_pages per step), the torch
    path with rotate_keys + index_put + quant.quantize_rows.  Two engines run the same requests in lockstep; the
    kernel engine's attention outputs are replaced by the torch engine's, so that every layer of both sees the
    same activations (the first two layers still run the kernels on the fused pool, checked against the
    reference).  The pools of those layers must agree bit for bit - INT2 codes and metadata, migrated pages
    (one of them partly filled by the step that migrates it) and BF16 window rows - except the window rows
    written by decode-only steps, whose keys the decode step's window writer (kernels/window_write.py; write_kv
    for steps past TUNING.window_write_max_rows, ``decode_writer``) centers and rotates in float32 (the torch path:
    float64): one BF16 ulp apart at most (Triton's interpreter also truncates float32 -> BF16 instead of
    rounding).  Scenario (page 16, sink 16, recent 32, 72 tokens per step): a 127-token request prefills in
    two chunks, the first quantizing page 1 directly, the second migrating pages 2-4 (page 4 half written by
    each chunk) and quantizing positions 72-79 directly; a 79-token request hits the prefix cache (sink + 1
    INT2 page) and prefills alongside; then decode steps with migrations (fused rotation) and without."""
    pytest.importorskip("triton")
    from oscar_kv.engine import runner
    from oscar_kv.engine.attention import KernelPlan
    from oscar_kv.engine.timing import NO_REGIONS
    from oscar_kv.kernels import tuning, window_write

    window_writes = []
    real_write_window = window_write.write_window
    monkeypatch.setattr(window_write, "write_window",
                        lambda *a, **k: (window_writes.append(1), real_write_window(*a, **k))[1])
    if decode_writer == "write_kv":  # a decode step past the window writer's bound
        monkeypatch.setattr(tuning, "TUNING", dataclasses.replace(tuning.TUNING, window_write_max_rows=0))

    checked = 2  # layers written by the fused path in the kernel engine (layer 0 also attends with the kernels)
    reference_attend = runner.StepAttention.attend
    recorded, errors, decode_rows, kinds = [], [], set(), []

    def attend(self, layer_idx, query, key, value, scaling):
        plan, backend = self.plan, self.backend
        if not isinstance(plan, KernelPlan):  # the torch engine
            out = reference_attend(self, layer_idx, query, key, value, scaling)
            recorded.append(out[0])
            return out
        ref = recorded[layer_idx]
        if layer_idx == 0:
            backend.codecs = backend.codecs[:checked]  # migrate the checked layers only (the interpreter is slow)
            kinds.append((type(plan.step).__name__, plan.fused_rotation, plan.migrations is not None))
            if plan.fused_rotation:
                p = backend.pool.geometry.page_size
                decode_rows.update((st.seq.pages[st.start // p], st.start % p) for st in plan.steps)
            got, _ = reference_attend(self, layer_idx, query, key, value, scaling)
            errors.append(((got.float() - ref.float()).norm() / ref.float().norm()).item())
        elif layer_idx < checked:  # the fused writes alone (the attention kernels are slow when interpreted)
            backend._write(plan, layer_idx, backend.codecs[layer_idx], key, value, NO_REGIONS)
        assert plan.migrations is None  # every layer's migrations ran with layer 0
        return ref, None

    monkeypatch.setattr(runner.StepAttention, "attend", attend)
    engines = [make_engine(model, tokenizer, constant_rotations, kv_cache_dtype=dtype, sink_size=16, recent_size=32,
                           max_num_batched_tokens=72, attention_backend=backend, async_scheduling=False)
               for backend in ("torch", "triton")]  # lockstep: each step's forward whole before the other engine's
    ids = tokenizer(long_prompt).input_ids[:127]
    for e in engines:
        assert (e.runner.kernels is None) == (e.config.attention_backend == "torch")
        p = e.pool
        for t in p.k_win + p.v_win + p.k_codes + p.v_codes + p.k_scale + p.v_scale + p.k_zero + p.v_zero:
            t.zero_()  # torch.empty garbage would differ between the two pools
        for i, n in enumerate((127, 79)):
            e.add_request(f"r{i}", ids[:n], SamplingParams(max_tokens=3, ignore_eos=True, **GREEDY))
    steps = 0
    while engines[0].has_work():
        recorded.clear()
        outs = [sorted((o.request_id, o.token_ids) for o in e.step()) for e in engines]
        assert outs[0] == outs[1]
        steps += 1
    assert not engines[1].has_work() and steps == (5 if dtype == "int2" else 4)
    assert bool(window_writes) == (decode_writer == "window")
    assert errors and max(errors) < 1e-2, errors
    if dtype == "int2":
        assert kinds == [("ExtendStep", False, False), ("ExtendStep", False, True), ("ExtendStep", False, True),
                         ("DecodeStep", True, True), ("DecodeStep", True, False)], kinds
        assert engines[0].pool.hit_tokens == 32
    else:
        assert kinds == [("ExtendStep", False, False)] * 2 + [("DecodeStep", True, False)] * 2, kinds

    a, b = engines[0].pool, engines[1].pool
    for name in ("k_codes", "v_codes", "k_scale", "v_scale", "k_zero", "v_zero"):
        for li in range(checked if dtype == "int2" else 0):
            x, y = getattr(a, name)[li], getattr(b, name)[li]
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), (name, li)
            assert x.view(torch.uint8).any()
    decoded = torch.zeros(a.k_win[0].shape[0], a.geometry.page_size, dtype=torch.bool)
    for page, off in decode_rows:
        decoded[page, off] = True
    assert int(decoded.sum()) == (3 if dtype == "int2" else 4)
    for name in ("k_win", "v_win"):
        for li in range(checked):
            x, y = getattr(a, name)[li].transpose(1, 2), getattr(b, name)[li].transpose(1, 2)  # [NW, P, H, D]
            assert torch.equal(x[~decoded].view(torch.int16), y[~decoded].view(torch.int16)), (name, li)
            if name == "v_win":  # values are not rotated by the kernel: stored as given
                assert torch.equal(x[decoded].view(torch.int16), y[decoded].view(torch.int16)), (name, li)
            else:
                assert torch.allclose(x[decoded].float(), y[decoded].float(), rtol=2 ** -7, atol=1e-4), (name, li)


@cpu_kernels
def test_position_aware_centering_runs_the_kernels_int2_and_bf16(model, tokenizer, small_rotations, caplog):
    """The INT2 kernels add the per-position key offset.  A BF16 cache given the same artifact ignores the
    per-position means (BF16 keys need no centering) and runs its kernels, not the torch reference (issue 23:
    that fallback ran out of memory at 32K on the GPU); it says so once."""
    pytest.importorskip("triton")
    assert small_rotations.key_centering == "rope"
    int2 = make_engine(model, tokenizer, small_rotations, attention_backend="triton")
    assert int2.runner.kernels is not None
    # the RoPE tables are sized for max_model_len at start-up: never rebuilt mid-request, no device max per step
    rope = int2.codecs[0].rope
    assert rope.bound == int2.max_model_len + 1 and rope.cos.shape[0] >= int2.max_model_len + 1
    rope.kernel_rope(int2.codecs[0].k_rope_mean, int2.max_model_len).check(int2.max_model_len)
    with caplog.at_level("INFO", logger="oscar_kv.engine.engine"):
        bf16 = make_engine(model, tokenizer, small_rotations, kv_cache_dtype="bf16", attention_backend="triton")
    assert bf16.kernel_status is None and bf16.runner.kernels is not None
    assert all(codec.k_rope_mean is None for codec in bf16.codecs)
    assert sum("per-position key means are not used" in r.message for r in caplog.records) == 1


# per layer (key bits, value bits), repeated over the layers: keys at 3 / 4 bits beside INT2 values as the accuracy
# work moves to, values at 3 / 4 too, and K2V2
MIXED_WIDTHS = [(3, 2), (4, 2), (3, 3), (2, 4), (4, 4), (2, 2)]


@cpu_kernels
def test_keys_and_values_at_mixed_widths_run_the_kernels_with_the_torch_paths_tokens(model, tokenizer, long_prompt,
                                                                                       monkeypatch):
    """The shipped artifact with each layer's keys and values at their own widths (MIXED_WIDTHS): the Triton engine
    (interpreted: write_kv, migrate_pages on each layer's pool, the materialized and extend prefill paths, decode;
    every layer at its own widths) gives the torch reference engine's greedy tokens, and start-up names the widths
    and the decode kernel.  A 95-token prompt in chunks of 64 (materialized path) and 31 (the extend kernel, over
    quantized history) leaves 2 quantized pages and a full recent window: the decode step migrates a page.  (~1 min
    interpreted: the kernel tests cover each width; this checks that every layer's kernels get its widths.)"""
    pytest.importorskip("triton")
    from oscar_kv.artifacts import load_shipped
    from oscar_kv.kernels import write

    rot = load_shipped("smollm2-135m", model)
    layers = rot.geometry.num_layers
    widths = [MIXED_WIDTHS[i % len(MIXED_WIDTHS)] for i in range(layers)]
    widths[1] = (5, 2)  # 5-bit keys (allocation.KEY_WIDTHS) on one layer
    rot.set_bits(*zip(*widths))
    migrations = []
    migrate = write.migrate_pages
    monkeypatch.setattr(write, "migrate_pages", lambda pool, *args, **kw: (
        migrations.append(pool.geometry.layer_widths(0)), migrate(pool, *args, **kw)))
    ids = tokenizer(long_prompt).input_ids[:95]
    tokens = {}
    for backend in ("torch", "triton"):
        engine = make_engine(model, tokenizer, rot, sink_size=16, recent_size=32, max_num_batched_tokens=64,
                             attention_backend=backend)
        g = engine.pool.geometry
        assert [g.layer_widths(i) for i in range(layers)] == widths
        assert [(engine.pool.k_codes[i].shape[-1] * 8 // g.head_dim, engine.pool.v_codes[i].shape[-1] * 8 // g.head_dim)
                for i in range(layers)] == widths
        if backend == "triton":
            assert engine.kernel_status is None and engine.runner.kernels is not None
            lines = "\n".join(engine.describe())
            assert "layer widths K2V2 x 5, K2V4 x 5, K3V2 x 5, K3V3 x 5, K4V2 x 4, K4V4 x 5, K5V2 x 1" in lines
            assert "quantized decode: the Triton kernel (not a CUDA device)" in lines
        engine.add_request("r", ids, SamplingParams(max_tokens=2, ignore_eos=True, **GREEDY))
        tokens[backend] = [t for o in run_all(engine)["r"] for t in o.token_ids]
        assert engine.pool.all_free()
        unprepare_model(model)
    # the kernel engine migrated pages (the second chunk's step and the decode step) of every layer at its widths
    assert len(migrations) >= 2 * layers and migrations == widths * (len(migrations) // layers)
    assert len(tokens["torch"]) == 2 and tokens["triton"] == tokens["torch"], tokens


def test_the_start_up_line_names_the_layers_the_cuda_decode_kernel_cannot_read():
    """LLMEngine.describe's decode part where the CUDA kernel runs (here as on an H100): it reads keys at 2, 3, 4, 5
    or 8 bits and values at 2, 3 or 4 (kernels/int2_cuda.WIDTHS), windowed or not; layers at other widths (values at
    8 bits) are named as taking Triton; when no layer is left for CUDA, Triton serves all."""
    from types import SimpleNamespace

    from oscar_kv.kernels import int2_cuda

    def words(bits):
        return f"{', '.join(map(str, bits[:-1]))} or {bits[-1]}"
    reads = (f"(the CUDA kernel reads keys at {words(int2_cuda.KEY_BITS)} bits, values at "
             f"{words(int2_cuda.VALUE_BITS)}, split keys at D = 64 or 128 with the rest at 2, 3 or 4 bits)")
    assert int2_cuda.KEY_BITS == (2, 3, 4, 5, 8) and int2_cuda.VALUE_BITS == (2, 3, 4)

    def engine(k_bits, v_bits, windows=None, split=None, head_dim=128):
        def choice(widths=(2, 2)):
            return "cuda", None

        geom = PoolGeometry(num_layers=len(k_bits), num_kv_heads=2, head_dim=head_dim, group_size=head_dim,
                            k_bits=k_bits, v_bits=v_bits, layer_windows=windows, k_split=split)
        return SimpleNamespace(pool=SimpleNamespace(geometry=geom), int2_decode_kernel=choice)

    describe = LLMEngine.int2_decode_description
    assert describe(engine((2, 2), (2, 2))) == "the one-launch CUDA kernel"
    assert describe(engine((3, 4, 3), (2, 2, 2))) == "the one-launch CUDA kernel"  # calibrate's default widths
    assert describe(engine((3, 8, 4, 8), (3, 2, 4, 3))) == "the one-launch CUDA kernel"  # K3V3, K8V2, K4V4, K8V3
    assert describe(engine((3, 2, 4, 2), (2, 2, 8, 2))) == (
        "the one-launch CUDA kernel on 3 layers (K2V2 x 2, K3V2 x 1), the Triton kernel on the 1 layer stored at "
        f"K4V8 x 1 {reads}")
    mixed = describe(engine((3, 2, 4), (8, 3, 2), (None, 1024, None)))
    assert mixed == ("the one-launch CUDA kernel on 2 layers (K2V3 x 1, K4V2 x 1), the Triton kernel on the 1 "
                     f"layer stored at K3V8 x 1 {reads}")
    assert describe(engine((3, 4), (8, 8))) == ("the Triton kernel on every layer: the 2 layers stored at K3V8 x 1, "
                                                f"K4V8 x 1 {reads}")
    assert describe(engine((5, 4, 5), (2, 2, 8))) == (
        "the one-launch CUDA kernel on 2 layers (K4V2 x 1, K5V2 x 1), the Triton kernel on the 1 layer stored at "
        f"K5V8 x 1 {reads}")
    # split keys: read by the CUDA kernel at head dim 64 and 128, not at 256
    split = (SplitWidth(2, 16, 4), None, SplitWidth(3, 64, 8))
    assert describe(engine((2, 2, 3), (2, 2, 2), split=split)) == "the one-launch CUDA kernel"
    assert describe(engine((2, 2), (2, 2), split=(SplitWidth(2, 32, 4), None), head_dim=256)) == (
        f"the one-launch CUDA kernel on 1 layer (K2V2 x 1), the Triton kernel on the 1 layer stored at K4x32+2V2 x 1 "
        f"{reads}")


def test_warm_up_runs_every_stage_and_leaves_no_trace(model, tokenizer, small_rotations):
    """The server's start-up request (compiles the kernels on a GPU): it reaches the INT2 history and decodes,
    then the engine serves as if fresh: no requests, zeroed counters, every page free, same outputs."""
    ids = build_prompt(tokenizer, "Name three colours.")[0].tolist()
    fresh = make_engine(model, tokenizer, small_rotations)
    fresh.add_request("r", ids, SamplingParams(max_tokens=5, **GREEDY))
    expected = text_of(run_all(fresh)["r"])
    engine = make_engine(model, tokenizer, small_rotations)
    steps = []
    real_launch = engine.runner.launch
    engine.runner.launch = lambda batch, after=None: (steps.append([(st.seq.int2_pages, st.num_tokens) for st in batch])
                                                      or real_launch(batch, after))
    assert engine.warm_up() > 0
    assert steps[0][0][0] > 0 and steps[2] == [(steps[2][0][0], 1)]  # prefill reached INT2 pages; then decode
    assert [len(s) for s in steps[3:]] == [3, 3, 3]  # then three at once, prefilling only past their shared prefix
    first = sum(n for _, n in steps[0])
    assert all(0 < n < first + extra for (_, n), extra in zip(sorted(steps[3], key=lambda x: x[1]), (1, 37, 90)))
    assert engine.pool.quant.cached == engine.pool.window.cached == 0
    stats = engine.stats()
    assert stats.prompt_tokens == stats.generation_tokens == 0 and not stats.finished and not engine.requests
    assert engine.pool.all_free()
    engine.add_request("r", ids, SamplingParams(max_tokens=5, **GREEDY))
    assert text_of(run_all(engine)["r"]) == expected


def _serve(engine, requests, abort_at=None):
    """Run ``requests`` (id -> (prompt ids, params)) to the end; ``abort_at``: (step, id) aborted before that step.
    Returns id -> (token ids, text, finish reason)."""
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    got = {rid: ([], "", None) for rid in requests}
    steps = 0
    while engine.has_work():
        if abort_at is not None and steps == abort_at[0]:
            out = engine.abort_request(abort_at[1])
            got[out.request_id] = (got[out.request_id][0], got[out.request_id][1] + out.text, out.finish_reason)
        for out in engine.step():
            tokens, text, _ = got[out.request_id]
            got[out.request_id] = (tokens + out.token_ids, text + out.text, out.finish_reason)
        steps += 1
        assert steps < 400
    assert engine.pool.all_free() and not engine.requests
    return got


def test_overlapped_steps_give_what_steps_one_at_a_time_give(model, tokenizer, small_rotations):
    """async_scheduling (the next step queued before the host takes the current one's tokens) changes nothing a
    client sees: greedy requests ending on max_tokens, on a stop string and on EOS, one sampling with a seed (its
    steps wait for the host), prefix hits, and an abort while a step of it is in flight."""
    prompts = ["Name three colours.", "Count from one to twenty.", "Name three colours. Then two animals.",
               "Write a haiku about the sea.", "Say hello."]
    ids = [build_prompt(tokenizer, p)[0].tolist() for p in prompts]
    requests = {
        "len": (ids[0], SamplingParams(max_tokens=7, **GREEDY)),
        "stop": (ids[1], SamplingParams(max_tokens=40, stop=(" five", "5"), **GREEDY)),
        "prefix": (ids[2], SamplingParams(max_tokens=12, **GREEDY)),
        "eos": (ids[4], SamplingParams(max_tokens=60, **GREEDY)),
        "seeded": (ids[3], SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=5)),
        "aborted": (ids[3], SamplingParams(max_tokens=50, **GREEDY)),
    }
    results = [_serve(make_engine(model, tokenizer, small_rotations, async_scheduling=overlap), requests,
                      abort_at=(6, "aborted")) for overlap in (False, True)]
    assert results[0] == results[1]
    assert results[0]["stop"][2] == "stop" and results[0]["len"][2] == "length" and len(results[0]["len"][0]) == 7
    assert results[0]["aborted"][2] == "abort"


def test_overlapped_steps_queue_the_next_step_before_taking_tokens(model, tokenizer, small_rotations):
    """The engine launches step n + 1 before it waits for step n's tokens, greedy or sampling (both on the
    device); the last step for a request that ends by length is never launched; without async scheduling every
    step waits."""
    engine = make_engine(model, tokenizer, small_rotations)
    calls = []
    launch, sampled = engine.runner.launch, engine.runner.sampled
    engine.runner.launch = lambda steps, after=None: calls.append("launch") or launch(steps, after)
    engine.runner.sampled = lambda launched: calls.append("wait") or sampled(launched)
    ids = build_prompt(tokenizer, "Say hello.")[0].tolist()
    engine.add_request("g", ids, SamplingParams(max_tokens=4, ignore_eos=True, **GREEDY))
    run_all(engine)
    assert calls == ["launch", "launch", "wait", "launch", "wait", "launch", "wait", "wait"]
    calls.clear()
    engine.add_request("s", ids, SamplingParams(max_tokens=3, temperature=1.0, seed=1))
    run_all(engine)
    assert calls == ["launch", "launch", "wait", "launch", "wait", "wait"]
    calls.clear()
    engine.config.async_scheduling = False
    engine.add_request("t", ids, SamplingParams(max_tokens=3, temperature=1.0, seed=1))
    run_all(engine)
    assert calls == ["launch", "wait"] * 3


def test_step_tokens_come_to_the_host_without_waiting_for_later_steps():
    """A launched step's argmax reaches the host through its own event: waiting for it does not wait for work
    queued after it (the next overlapped step), as ``.tolist()`` on the device tensor would."""
    from oscar_kv.engine.runner import _download

    on_cpu = torch.tensor([3, 1, 2])
    host, ready = _download(on_cpu)
    assert ready is None and host is on_cpu
    if not torch.cuda.is_available():
        pytest.skip("the device half needs CUDA")
    argmax = torch.tensor([5, 7, 11], device="cuda")
    host, ready = _download(argmax)
    assert host.is_pinned()
    torch.cuda._sleep(1 << 31)  # the next step: ~1 s of GPU time queued behind the copy
    later = torch.cuda.Event()
    later.record()
    ready.synchronize()
    assert host.tolist() == [5, 7, 11]
    assert not later.query(), "waiting for the step's tokens waited for the work queued after them"
    torch.cuda.synchronize()
