"""Programmatic dependent launch (kernels/pdl.py): when it is on, and that kernels launched with it compute what
they compute without it (on a GPU of compute capability 9 or more, inside a CUDA graph as the engine runs them)."""

import pytest
import torch

from oscar_kv.kernels import pdl

needs_hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                  reason="PDL needs a CUDA GPU of compute capability 9 or more")


def test_pdl_is_off_on_the_cpu_and_under_the_interpreter(monkeypatch):
    monkeypatch.setenv(pdl.ENV, "on")
    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(pdl, "INTERPRET", True)
    assert not pdl.enabled(torch.device("cuda", 0))  # decided before the device is asked


def test_a_bad_pdl_setting_says_what_it_takes(monkeypatch):
    monkeypatch.setattr(pdl, "INTERPRET", False)
    monkeypatch.setattr(pdl, "_device_has_pdl", lambda index: True)
    monkeypatch.setenv(pdl.ENV, "yes")
    with pytest.raises(ValueError, match="OSCAR_KV_PDL must be on or off, got 'yes'"):
        pdl.enabled(torch.device("cuda", 0))
    monkeypatch.setenv(pdl.ENV, "off")
    assert not pdl.enabled(torch.device("cuda", 0))
    monkeypatch.setenv(pdl.ENV, "on")
    assert pdl.enabled(torch.device("cuda", 0))
    pdl.set_enabled(False)
    try:
        assert pdl.launch_options(torch.device("cuda", 0)) == {"PDL": False}
    finally:
        pdl.set_enabled(None)


def test_cuda_kernel_arguments_are_laid_out_as_torch_lays_them_out():
    """launch_cuda's parameter array: a tensor's data pointer, an int (or bool) as a C int, a float as a double."""
    import ctypes

    x = torch.arange(4, dtype=torch.float32)
    array, values = pdl._kernel_arguments([x, 7, True, 0.5])
    assert len(array) == 4
    assert ctypes.cast(array[0], ctypes.POINTER(ctypes.c_void_p)).contents.value == x.data_ptr()
    assert ctypes.cast(array[1], ctypes.POINTER(ctypes.c_int)).contents.value == 7
    assert ctypes.cast(array[2], ctypes.POINTER(ctypes.c_int)).contents.value == 1
    assert ctypes.cast(array[3], ctypes.POINTER(ctypes.c_double)).contents.value == 0.5
    with pytest.raises(TypeError, match="unsupported kernel argument type str"):
        pdl._kernel_arguments(["seven"])


def test_the_launch_structs_have_cuda_h_layout():
    import ctypes

    assert ctypes.sizeof(pdl._LaunchAttribute) == 72  # id, pad to 8, a 64-byte union
    assert pdl._LaunchConfig.stream.offset == 32 and pdl._LaunchConfig.attrs.offset == 40
    assert ctypes.sizeof(pdl._LaunchConfig) == 56


@needs_hopper
@pytest.mark.parametrize("tokens", [1, 5])
def test_a_graph_of_pdl_launches_computes_what_plain_launches_do(tokens):
    """Norm, GEMV, RoPE, GEMV with gate|up, GEMV over a few layers: each kernel reads the one before it, and the
    graph replays back to back, so a kernel that read before its wait would see the last replay's values."""
    from oscar_kv.kernels import elementwise
    from oscar_kv.kernels.gemv import linear, linear_glu

    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    hidden, heads, d, ffn = 512, (4, 2), 64, 1536

    def w(*shape):
        return (torch.randn(*shape, device=device, generator=g) * shape[-1] ** -0.5).to(torch.bfloat16)

    layers = [(w((heads[0] + 2 * heads[1]) * d, hidden), w(hidden, heads[0] * d), w(2 * ffn, hidden),
               w(hidden, ffn)) for _ in range(4)]
    norm = torch.ones(hidden, device=device, dtype=torch.bfloat16)
    cos, sin = w(64, d), w(64, d)
    positions = torch.arange(3, 3 + tokens, device=device)
    first, second = w(tokens, hidden), w(tokens, hidden)
    h0 = first.clone()

    def forward():
        h, residual = h0, None
        for qkv, o, gate_up, down in layers:
            x, residual = elementwise.rms_norm(h, norm, 1e-6, residual)
            q, _, _ = elementwise.rope_qkv(linear(x, qkv), positions, cos, sin, heads, d)
            x, residual = elementwise.rms_norm(linear(q.reshape(tokens, -1), o), norm, 1e-6, residual)
            h = linear(linear_glu(x, gate_up), down)
        return h

    outputs = {}
    for on in (False, True):
        pdl.set_enabled(on)
        try:
            h0.copy_(first)
            forward()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = forward()
            h0.copy_(second)  # new inputs, as a decode step's: the replays must read them
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            outputs[on] = out.clone()
        finally:
            pdl.set_enabled(None)
        eager = forward()
        assert torch.equal(outputs[on], eager)
    assert torch.equal(outputs[False], outputs[True])
