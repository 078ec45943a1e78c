"""PoolGeometry (kernels/layout.py): the one description of a paged pool that the engine and the kernels share.

Every number is worked out by hand for SmolLM2-135M's attention (30 layers, 3 KV heads, head dim 64) with
group 64, pages of 16 tokens, a 64-token sink and a 256-token recent window."""

import re

import pytest
import torch

from oscar_kv.engine.block_pool import PoolPlan
from oscar_kv.errors import ConfigError
from oscar_kv.kernels.layout import PagedKVPool, PoolGeometry

SMOL = dict(num_layers=30, num_kv_heads=3, head_dim=64, group_size=64, page_size=16, sink_size=64, recent_size=256)


def smol(bits=2, **changes):
    return PoolGeometry(**{**SMOL, "k_bits": (bits,) * SMOL["num_layers"], **changes})


def test_pages_of_a_sequence():
    g = smol()
    assert g.quantizes and g.sink_pages == 4  # 64 / 16
    assert g.pages_for(1000) == 63  # 62.5 pages, the last one partly filled
    assert g.pages_for(1008) == 63 and g.pages_for(1009) == 64
    # steady state: (T - 64 - 256) // 16 quantized pages
    assert g.int2_pages_for(1000) == 42
    assert [g.int2_pages_for(n) for n in (0, 100, 320, 335, 336)] == [0, 0, 0, 0, 1]
    assert g.window_pages_per_seq() == 22  # 4 sink + ceil((256 + 15) / 16) = 17 recent + 1 in flight
    assert g.decode_pages(1000) == (22, 42)
    assert g.decode_pages(100) == (7, 0)  # short: every page is a window page


def test_bf16_cache_has_no_sink_and_no_quantized_pages():
    g = smol(16)
    assert not g.quantizes and g.sink_pages == 0
    assert g.int2_pages_for(1000) == 0
    assert g.decode_pages(1000) == (63, 0)
    with pytest.raises(ValueError, match="no bound on window pages"):
        g.window_pages_per_seq()


def test_bytes_per_token_page_and_sequence():
    g = smol()
    # per token, KV head and layer, K and V: codes 2 * 64 * 2 / 8 = 32 B + a float16 scale and a uint8 zero point
    # each 2 * 3 = 6 B
    assert g.quant_bytes_per_token() == 38
    assert g.window_bytes_per_token() == 2 * 64 * 2  # BF16 K and V rows
    assert g.quant_page_bytes == 30 * 3 * 16 * 38 == 54_720
    assert g.window_page_bytes == 30 * 3 * 16 * 256 == 368_640
    # 1000 tokens: 63 pages, 42 quantized, 21 in the window pool
    assert g.sequence_bytes(1000) == 21 * 368_640 + 42 * 54_720 == 10_039_680
    # one layer's read of a decode step counts tokens, not pages: 672 quantized tokens, 328 window rows
    assert g.layer_read_bytes(1000) == 3 * (672 * 38 + 328 * 256) == 328_512


def test_a_windowed_layer_reads_only_its_window():
    import dataclasses

    g = smol()
    w = dataclasses.replace(g, layer_windows=(500, 100, 2000) + (None,) * (g.num_layers - 3))
    # 1000 tokens: sink [0, 64), INT2 [64, 736), recent [736, 1000); a window of 500 reads from position 500 on
    assert w.layer_read_bytes(1000, 0) == 3 * (236 * 38 + 264 * 256)
    assert w.layer_read_bytes(1000, 1) == 3 * 100 * 256  # only recent rows
    assert w.layer_read_bytes(1000, 2) == w.layer_read_bytes(1000, 3) == g.layer_read_bytes(1000)
    assert dataclasses.replace(smol(16), layer_windows=w.layer_windows).layer_read_bytes(1000, 1) == 3 * 100 * 256


def test_bf16_bytes():
    g = smol(16)
    assert g.quant_bytes_per_token() == 0 and g.quant_page_bytes == 0
    assert g.window_page_bytes == 368_640
    assert g.sequence_bytes(1000) == 63 * 368_640
    assert g.layer_read_bytes(1000) == 3 * 1000 * 256
    assert smol().as_bf16() == g


def test_wider_layers_count_their_own_codes():
    g = smol(k_bits=(2,) * 29 + (4,))
    assert g.quant_bytes_per_token(29) == 64 * (4 + 4) // 8 + 6 == 70
    assert g.quant_page_bytes == 3 * 16 * (29 * 38 + 70)


def test_five_bit_keys_count_five_eighths_of_the_head_dim():
    """INT5 rows are an INT4 plane (D/2 bytes) and a high-bit plane (D/8): 5D/8 bytes, 40 at head dim 64."""
    g = smol(k_bits=(5,) * 30, v_bits=(2,) * 30)
    assert g.quant_bytes_per_token() == 64 * (5 + 2) // 8 + 6 == 62
    assert g.kernel_error() is None and g.width_summary() == "K5V2 x 30"
    pool = PagedKVPool.allocate(g, 2, 1)
    assert pool.k_codes.shape[-1] == 40 and pool.v_codes.shape[-1] == 16


def test_default_is_an_int2_cache():
    g = PoolGeometry(num_layers=2, num_kv_heads=1)
    assert g.k_bits == (2, 2) and g.quantizes
    assert (g.head_dim, g.group_size, g.page_size, g.sink_size, g.recent_size) == (128, 128, 16, 64, 256)


def test_pool_plan_holds_one_sequence_with_its_page_in_flight():
    g = smol()  # 1000 tokens: 42 quantized pages, 21 window pages + 1 in flight
    assert PoolPlan(22, 42, g).holds(1000)
    assert not PoolPlan(21, 42, g).holds(1000)
    assert not PoolPlan(22, 41, g).holds(1000)
    assert PoolPlan(63, 0, smol(16)).holds(1000) and not PoolPlan(62, 0, smol(16)).holds(1000)


def test_settings_no_pool_can_use():
    with pytest.raises(ConfigError, match="sink_size 40 must be a multiple of page_size 16") as info:
        smol(sink_size=40)
    assert info.value.fields == ("sink_size", "page_size")
    with pytest.raises(ConfigError, match="group_size 48 must divide the head dim 64"):
        smol(group_size=48)
    with pytest.raises(ValueError, match="cannot mix BF16 layers"):
        smol(k_bits=(2,) * 29 + (16,))
    with pytest.raises(ValueError, match="k_bits has 29 entries for 30 layers"):
        smol(k_bits=(2,) * 29)
    smol(16, sink_size=40, group_size=48)  # a BF16 cache has neither a sink nor groups


@pytest.mark.parametrize("changes, why", [
    (dict(head_dim=96, group_size=96), "head dim must be a power of two >= 32, got 96"),
    (dict(group_size=8), "group size 8 must divide head dim 64 and be >= D/4 = 16"),
    (dict(page_size=8), "page size must be 16, 32 or 64, got 8"),
    (dict(k_bits=(2,) * 29 + (6,)), "layers at K6V6 (the kernels read keys at 2, 3, 4, 5 or 8 bits, values at 2, 3, 4 "
                                    "or 8)"),
    (dict(v_bits=(2,) * 29 + (5,)), "layers at K2V5 (the kernels read keys at 2, 3, 4, 5 or 8 bits"),
    (dict(window_dtype=torch.float16), "the kernels read BF16 windows"),
])
def test_kernel_error_says_why(changes, why):
    assert smol().kernel_error() is None and smol(16).kernel_error() is None
    g = smol(**changes)
    assert why in g.kernel_error()
    with pytest.raises(ValueError, match=re.escape(why)):
        PagedKVPool.allocate(g, 1, 1)


def test_metadata_slots_pair_tokens_j_and_j_plus_8():
    """Within each 16 tokens of a page, tokens j and j + 8 keep their metadata side by side (the CUDA kernel's thread
    reads both with one load); a permutation of the page, the identity for pages the kernels never read."""
    from oscar_kv.kernels.layout import metadata_slot

    slots = metadata_slot(torch.arange(32), 32)
    assert sorted(slots.tolist()) == list(range(32))
    assert slots[:16].tolist() == [0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15]
    assert (slots[16:] == slots[:16] + 16).all()
    assert metadata_slot(9, 16) == 3 and metadata_slot(5, 8) == 5
