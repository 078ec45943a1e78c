"""Other attention variants with small random models: Qwen2 (QKV bias), Qwen3 (QK-norm), Mistral, Phi-3 (fused
qkv_proj), partial rotary (Phi-3 with RoPE on half of each head, GLM-4 with interleaved pairs: keys centered per
position on the rotated channels), the mixture-of-experts decoders Qwen3-MoE and Mixtral (Llama-like
attention), and sliding-window layers served past their window (Mistral windowing every layer, Gemma 3 mixing
sliding and full layers)."""

import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from oscar_kv.cache import CacheSettings, OscarCache, unprepare_model
from oscar_kv.calibrate import calibrate
from oscar_kv.calibration_settings import CalibrationSettings
from oscar_kv.folding import fold_values
from oscar_kv.hf_compat import cache_kwargs
from oscar_kv.models import AttentionGeometry, layer_windows

# the engine's Triton kernels run on this CPU model under the interpreter only (conftest turns it on without CUDA)
CPU_KERNELS = not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"

# Gemma 3 (1B's pattern, shrunk): QK-norm, the softmax scale from query_pre_attn_scalar, sandwich norms, GeGLU, a head
# dim apart from hidden / heads; sliding layers (window 32) beside a full one, each type with its own RoPE (local base
# 1e4; global 1e6 with linear scaling, as the 4B-27B models)
GEMMA3 = dict(model_type="gemma3_text", num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=24, sliding_window=32,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                               "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}})

ARCHS = {
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=16),
    "mistral": dict(model_type="mistral", sliding_window=None),
    # head dim 256, as Gemma's
    "llama-d256": dict(model_type="llama", head_dim=256),
    # a fused qkv_proj: values are folded into its last rows
    "phi3": dict(model_type="phi3", sliding_window=None),
    # partial rotary (RoPE on half of each head, as Phi-4-mini): keys centered per position on the rotated half
    "phi3-partial-rotary": dict(model_type="phi3", sliding_window=None, partial_rotary_factor=0.5),
    # GLM-4: partial rotary in interleaved pairs (2j, 2j + 1), QKV bias, fused gate/up
    "glm4": dict(model_type="glm4", partial_rotary_factor=0.5, pad_token_id=0),
    # mixture-of-experts decoders: Llama-like attention, expert MLPs
    "qwen3_moe": dict(model_type="qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32),
    "mixtral": dict(model_type="mixtral", sliding_window=None, num_local_experts=4, num_experts_per_tok=2),
    "gemma3": GEMMA3,
    # a large pre-RoPE key bias (before k_norm): keys centered per position, each layer with its type's RoPE
    "gemma3-key-bias": dict(GEMMA3, attention_bias=True),
}
# sliding windows far shorter than the sequences below (Mistral v0.1 windows every layer; head dim 64 is the
# kernels' smallest; larger weights than the default 0.02 make its greedy tokens vary, and depend on the window)
WINDOWED = {
    "mistral-swa": dict(model_type="mistral", sliding_window=32, head_dim=64, initializer_range=0.3),
    "gemma3": GEMMA3,
    # Qwen2's windows: layers from max_window_layers on (here the second of two); run by our executor
    "qwen2-swa": dict(model_type="qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=1,
                      head_dim=64, initializer_range=0.3),
}


def tiny_model(arch: str, **config):
    """A small random model of ``arch`` (ARCHS or WINDOWED), ``config`` overriding its settings."""
    kw = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True)
    kw.update(ARCHS.get(arch) or WINDOWED[arch], **config)
    config = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if getattr(attn, "k_proj", None) is not None and attn.k_proj.bias is not None:  # Qwen2-style large key/value offsets
                attn.k_proj.bias.add_(torch.randn_like(attn.k_proj.bias) * 20)
                attn.v_proj.bias.add_(torch.randn_like(attn.v_proj.bias) * 5)
            if getattr(attn, "qkv_proj", None) is not None and kw.get("partial_rotary_factor"):
                # a large pre-RoPE key bias: what per-position centering removes
                fused = attn.qkv_proj
                fused.bias = torch.nn.Parameter(torch.zeros(fused.out_features))
                rows = slice(config.num_attention_heads * attn.head_dim,
                             (config.num_attention_heads + config.num_key_value_heads) * attn.head_dim)
                fused.bias[rows] = torch.randn(rows.stop - rows.start) * 20
    return model


@pytest.mark.parametrize("arch", list(ARCHS))
@torch.no_grad()
def test_cache_equivalences_and_calibration(arch, tokenizer, held_out_ids):
    model = tiny_model(arch)
    ids = held_out_ids[:, :200]
    ref = model(ids, **cache_kwargs(model, DynamicCache(config=model.config))).logits

    rot = calibrate(model, tokenizer, CalibrationSettings(calib_tokens=512, seq_len=256, probe_tokens=128, max_kl=None,
                                                          max_answer_kl=None), progress=False)
    unprepare_model(model)
    geometry = AttentionGeometry.of(model.config)
    rot.validate(geometry)
    assert rot.k_mean.abs().max() > 0
    if arch == "gemma3-key-bias":  # the bias turns with two RoPEs: centered per position with each layer's
        assert rot.key_centering == "rope" and rot.manifest["calibration"]["key_centering_choice"]["chosen"] == "rope"
    if ARCHS[arch].get("partial_rotary_factor"):  # RoPE on the first half of each head: centered per position there
        layout = rot.rotary_layout
        assert rot.key_centering == "rope" and rot.manifest["calibration"]["key_centering_choice"]["chosen"] == "rope"
        assert layout.rotary_dim == geometry.head_dim // 2 and layout.interleaved == (arch == "glm4")
        assert (rot.k_rope_mean[..., layout.rotary_dim:] == 0).all()  # pass-through channels: in the constant k_mean

    fold_values(model, rot.v_rotation, rot.v_mean)
    assert (model(ids).logits - ref).abs().max() < 1e-3, "folding R_V and mu_V must not change logits"
    unprepare_model(model)

    bf16 = OscarCache(model, None, CacheSettings("bf16", window_dtype=torch.float32))
    out = torch.cat([model(ids[:, :150], **cache_kwargs(model, bf16)).logits]
                    + [model(ids[:, i:i + 1], **cache_kwargs(model, bf16)).logits for i in range(150, 200)], 1)
    assert (out - ref).abs().max() < 1e-3
    unprepare_model(model)

    wide = OscarCache(model, rot, CacheSettings("int2", sink_size=16, recent_size=512, window_dtype=torch.float32))
    out = torch.cat([model(ids[:, :150], **cache_kwargs(model, wide)).logits]
                    + [model(ids[:, i:i + 1], **cache_kwargs(model, wide)).logits for i in range(150, 200)], 1)
    assert (out - ref).abs().max() < 1e-3, "centered, rotated storage must be exact while nothing is quantized"
    unprepare_model(model)

    int2 = OscarCache(model, rot, CacheSettings("int2", sink_size=16, recent_size=32))
    model(ids, **cache_kwargs(model, int2))
    assert int2.layers[0].history_len > 0


@pytest.mark.parametrize("arch", list(ARCHS))
@torch.no_grad()
def test_engine_greedy_output_equals_generate(arch, tokenizer, held_out_ids):
    """The paged engine (INT2 history between the BF16 windows, migrating while it decodes) gives generate()'s
    greedy tokens with the same cache settings and data-free rotations, for every architecture above."""
    from oscar_kv.artifacts import Rotations
    from oscar_kv.engine import EngineConfig, LLMEngine, SamplingParams

    model = tiny_model(arch)
    model.generation_config.eos_token_id = None  # random weights: run all the tokens asked for
    geometry = AttentionGeometry.of(model.config)
    rot = Rotations.data_free(geometry, "hadamard", geometry.head_dim)
    if ARCHS[arch].get("partial_rotary_factor") or arch == "gemma3-key-bias":  # keys centered per position
        from oscar_kv.rope import keep_pairs, layer_rope_tables, random_pairs

        layout = layer_rope_tables(model, geometry.head_dim)[0].layout
        gen = torch.Generator().manual_seed(1)
        keep = random_pairs(geometry.num_layers * geometry.num_kv_heads, layout.rotated_pairs, 3, gen)
        keep = torch.nn.functional.pad(keep, (0, geometry.head_dim // 2 - layout.rotated_pairs))
        mu = torch.randn(geometry.num_layers * geometry.num_kv_heads, geometry.head_dim, generator=gen) * 20
        rot.k_rope_mean = keep_pairs(mu, keep, layout).reshape(rot.k_mean.shape)
        rot.rope_layout = layout
        rot.validate(geometry)
        assert rot.key_centering == "rope"
    ids = held_out_ids[:, :150]
    settings = dict(sink_size=16, recent_size=32, page_size=16)
    cache = OscarCache(model, rot, CacheSettings("int2", **settings))
    ref = model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=12, do_sample=False)
    ref = ref[0, ids.shape[1]:].tolist()
    assert cache.layers[0].history_len > 0
    unprepare_model(model)
    engine = LLMEngine(model, tokenizer, rot, EngineConfig(kv_cache_dtype="int2", kv_cache_memory=0.05,
                                                           max_model_len=512, **settings))
    engine.add_request("r", ids[0].tolist(), SamplingParams(max_tokens=12, temperature=0.0))
    got = []
    while engine.has_work():
        for out in engine.step():
            got += out.token_ids
    assert got == ref
    assert engine.pool.all_free()
    if geometry.head_dim > 128 and CPU_KERNELS:
        # head dim 256 (Gemma): the Triton kernels serve it too (interpreted here: few tokens), with the reference
        # path's greedy tokens; a 92-token prompt (2 INT2 pages) migrates a page at the 5th token
        prompt = held_out_ids[0, :92].tolist()
        want = greedy(engine, prompt, 6)
        unprepare_model(model)
        kernels = LLMEngine(model, tokenizer, rot, EngineConfig(kv_cache_dtype="int2", kv_cache_memory=0.05,
                                                                max_model_len=512, attention_backend="triton",
                                                                **settings))
        assert kernels.kernel_status is None and kernels.runner.kernels is not None
        assert "attention: Triton kernels" in "\n".join(kernels.describe())
        assert greedy(kernels, prompt, 6) == want
        assert kernels.pool.all_free()


def greedy(engine, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens of one request run alone."""
    from oscar_kv.engine import SamplingParams

    engine.add_request("g", prompt, SamplingParams(max_tokens=n, temperature=0.0))
    got = []
    while engine.has_work():
        for out in engine.step():
            got += out.token_ids
    return got


def test_layer_windows_of_each_config_style():
    def cfg(model_type, **kw):
        return AutoConfig.for_model(model_type, num_hidden_layers=4, **kw)

    full = (None,) * 4
    assert layer_windows(cfg("mistral", sliding_window=4096)) == (4096,) * 4  # Mistral v0.1: every layer
    assert layer_windows(cfg("mistral", sliding_window=None)) == full
    assert layer_windows(cfg("qwen2")) == full  # use_sliding_window is off by default
    # Qwen2: layers from max_window_layers on
    assert layer_windows(cfg("qwen2", use_sliding_window=True, sliding_window=512, max_window_layers=2)) == \
        (None, None, 512, 512)
    assert layer_windows(cfg("phi3", sliding_window=2047)) == (2047,) * 4  # Phi-3-mini-4k's config
    assert layer_windows(cfg("llama")) == layer_windows(cfg("qwen3")) == full
    # Gemma 3: five sliding layers, then a full one
    gemma = AutoConfig.for_model("gemma3_text", num_hidden_layers=7, sliding_window=512)
    assert layer_windows(gemma) == (512,) * 5 + (None, 512)


def test_gemma3_keys_turn_with_each_layer_types_rope():
    """Gemma 3's sliding and full layers use different RoPE (rotary_emb(x, positions, layer_type)): position-aware
    centering takes each layer's table (shared by the layers of its type), each the model's own; its geometry reads
    the configured head dim."""
    import sys

    from oscar_kv.rope import layer_rope_tables

    model = tiny_model("gemma3")
    config = model.config
    assert AttentionGeometry.of(config).head_dim == 32 != config.hidden_size // config.num_attention_heads
    tables = layer_rope_tables(model, 32)
    assert tables[0] is tables[2] and tables[0] is not tables[1]
    assert [t.layer_type for t in tables] == config.layer_types
    apply = sys.modules[type(model).__module__].apply_rotary_pos_emb
    pos = torch.tensor([0, 3, 31, 400, 1900])
    mu = torch.randn(2, 32, generator=torch.Generator().manual_seed(0)) * 20
    for table, layer_type in zip(tables, config.layer_types):
        cos, sin = model.model.rotary_emb(mu, pos[None], layer_type)
        _, want = apply(mu[None, :, None].expand(1, 2, 5, 32), mu[None, :, None].expand(1, 2, 5, 32), cos, sin)
        assert torch.allclose(table.offsets(mu, pos), want[0], atol=2e-3)
    assert not torch.allclose(tables[0].offsets(mu, pos), tables[1].offsets(mu, pos), atol=1)


def full_attention_logits(model, ids):
    """The model's logits with windows wider than the sequence (transformers builds its masks from the config)."""
    window = model.config.sliding_window
    model.config.sliding_window = 1 << 20
    try:
        return model(ids).logits
    finally:
        model.config.sliding_window = window


@pytest.mark.parametrize("arch", list(WINDOWED))
@torch.no_grad()
def test_past_the_window_the_cache_equals_transformers(arch, held_out_ids, monkeypatch):
    """Six windows long: the generate() cache with nothing quantized gives transformers' own (DynamicCache) logits,
    whose windowed layers see only their window, over a prefill, chunks that straddle window boundaries and decode
    steps; with an INT2 history a windowed layer dequantizes no row its window has left."""
    from oscar_kv.codec import LayerCodec

    model = tiny_model(arch)
    windows = layer_windows(model.config)
    window = min(w for w in windows if w is not None)
    ids = held_out_ids[:, :6 * window]
    ref = model(ids, **cache_kwargs(model, DynamicCache(config=model.config))).logits
    assert (full_attention_logits(model, ids) - ref)[:, window:].abs().max() > 1e-2, "the window must matter here"

    def run(cache, cuts=(40, 77, 100)):
        parts = [model(ids[:, a:b], **cache_kwargs(model, cache)).logits for a, b in zip((0,) + cuts, cuts)]
        return torch.cat(parts + [model(ids[:, i:i + 1], **cache_kwargs(model, cache)).logits
                                  for i in range(cuts[-1], ids.shape[1])], 1)

    out = run(OscarCache(model, None, CacheSettings("bf16", window_dtype=torch.float32)))
    assert (out - ref).abs().max() < 1e-4
    unprepare_model(model)

    dequantized = {}  # codec -> history rows it dequantized
    original = LayerCodec.dequantize_values
    monkeypatch.setattr(LayerCodec, "dequantize_values", lambda self, q, *a: dequantized.update(
        {id(self): dequantized.get(id(self), 0) + q.codes.shape[2]}) or original(self, q, *a))
    cache = OscarCache(model, None, CacheSettings("int2", sink_size=16, recent_size=16, page_size=16))
    run(cache)
    dequantized.clear()
    start = ids.shape[1]
    model(ids[:, -1:], **cache_kwargs(model, cache))  # one decode step at position ``start``
    for layer, w in zip(cache.layers, windows):
        assert layer.history_len > 2 * window
        # the history holds positions [16, 16 + history_len); a windowed layer reads (start - w, start)
        first = 16 if w is None else start - w + 1
        assert dequantized[id(layer.codec)] == min(16 + layer.history_len, start) - first
    unprepare_model(model)


@pytest.mark.parametrize("arch", list(WINDOWED))
@torch.no_grad()
def test_past_the_window_the_engine_equals_generate(arch, tokenizer, held_out_ids, monkeypatch, caplog):
    """The engine's torch reference serves windowed layers past their window: up to the model's own context, with
    generate()'s greedy tokens (which the window changes) for a prompt four windows long decoded alongside a second
    request, with an INT2 history and in BF16 prefilled in chunks (an INT2 chunk reads the earlier ones as stored:
    generate() matches it in one piece only); a windowed layer's reads start where its window does.  The kernels do
    not apply windows yet: the engine keeps such models on the reference."""
    from oscar_kv.artifacts import Rotations
    from oscar_kv.engine import EngineConfig, LLMEngine, SamplingParams
    from oscar_kv.engine.attention import TorchAttention
    from oscar_kv.errors import ConfigError

    model = tiny_model(arch)
    model.generation_config.eos_token_id = None
    geometry = AttentionGeometry.of(model.config)
    windows = layer_windows(model.config)
    window = min(w for w in windows if w is not None)
    rot = Rotations.data_free(geometry, "hadamard", geometry.head_dim)
    plans = []
    original = TorchAttention.plan
    monkeypatch.setattr(TorchAttention, "plan", lambda self, steps: plans.append(original(self, steps)) or plans[-1])
    prompts = [held_out_ids[0, :4 * window + 5].tolist(), held_out_ids[0, 300:300 + 2 * window].tolist()]
    settings = dict(sink_size=16, recent_size=32, page_size=16)
    model.config.sliding_window = 1 << 20  # what the tokens would be without the windows
    full = model.generate(torch.tensor([prompts[0]]), max_new_tokens=10, do_sample=False)[0, len(prompts[0]):].tolist()
    model.config.sliding_window = window
    for dtype, chunk in (("int2", 2048), ("bf16", 48)):
        want = []
        for prompt in prompts:
            cache = OscarCache(model, rot, CacheSettings(dtype, **settings))
            ids = torch.tensor([prompt])
            want.append(model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=10, do_sample=False)
                        [0, len(prompt):].tolist())
            unprepare_model(model)
        caplog.clear()
        with caplog.at_level("INFO", logger="oscar_kv.engine.engine"):
            engine = LLMEngine(model, tokenizer, rot, EngineConfig(
                kv_cache_dtype=dtype, kv_cache_memory=0.05, attention_backend="torch", max_num_batched_tokens=chunk,
                **settings))
        assert engine.max_model_len == model.config.max_position_embeddings
        n = sum(w is not None for w in windows)
        assert f"sliding-window layers: {n} of {len(windows)} (window {window}) read only their window" in caplog.text
        assert _greedy_tokens(engine, prompts) == want and want[0] != full
        assert engine.pool.all_free()
        unprepare_model(model)
    decodes = [plan for plan in plans if all(st.num_tokens == 1 for st in plan.steps)]
    assert decodes
    for plan in decodes:
        for w, reads in plan.reads.items():
            for st, view in zip(plan.steps, reads.views):
                assert view.first == (0 if w is None else max(st.start - w + 1, 0))
                read = sum(b - a for _, a, b in view.parts())
                assert read == st.start - view.first  # the rows gathered (and dequantized) are the window's

    if CPU_KERNELS and geometry.head_dim >= 64:  # the kernels apply each layer's window too: the same tokens
        engine = LLMEngine(model, tokenizer, rot, EngineConfig(kv_cache_dtype="bf16", kv_cache_memory=0.05,
                                                               attention_backend="triton", max_num_batched_tokens=48,
                                                               **settings))
        assert _greedy_tokens(engine, prompts) == want
        unprepare_model(model)


def _greedy_tokens(engine, prompts: list[list[int]], n: int = 10) -> list[list[int]]:
    """The engine's n greedy tokens for each prompt, served together."""
    from oscar_kv.engine import SamplingParams

    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=n, temperature=0.0))
    got = {str(i): [] for i in range(len(prompts))}
    while engine.has_work():
        for out in engine.step():
            got[out.request_id] += out.token_ids
    return [got[str(i)] for i in range(len(prompts))]


def test_the_reference_attention_masks_the_window_as_transformers_does():
    """TorchAttention's mask over keys first..first+n-1 is transformers' sliding-window causal mask (a query at p
    sees keys in (p - window, p]), and the plain causal one without a window."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    from oscar_kv.engine.attention import _causal_mask, _first_read

    for start, t, first, window in ((0, 9, 0, None), (0, 40, 0, 8), (50, 7, 43, 8), (50, 7, 20, 8), (30, 12, 0, 1),
                                    (100, 1, 93, 8), (5, 3, 0, 64)):
        n = start + t - first
        logits = torch.zeros(1, 1, 1, t, n)
        allowed = _causal_mask(start, t, n, "cpu", first, window)(logits)[0, 0, 0] == 0
        reference = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
        pos_q, pos_k = torch.arange(start, start + t)[:, None], torch.arange(first, first + n)[None, :]
        want = reference(0, 0, pos_q, pos_k).expand(t, n)
        assert torch.equal(allowed, want), (start, t, first, window)
    # a decode step reads from the oldest position its window reaches: every key read is seen, no mask needed
    assert _first_read(100, 8) == 93 and _first_read(3, 8) == 0 and _first_read(100, None) == 0
