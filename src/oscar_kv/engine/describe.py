"""The engine's start-up description: the lines the server logs (and ``bench decode`` records) saying what an
engine runs: its KV cache scheme, the attention kernels of prefill and decode, the model forward, and what the
pool holds against a BF16 cache of the same memory.

``EngineDescription`` is a mixin of ``LLMEngine`` (engine.py): it only reads what the engine built (``config``,
``model``, ``device``, ``codecs``, ``pool``, ``plan``, ``runner``, ``tp``, ``max_model_len``, ``kernel_status``,
``executor_status``) and changes nothing.
"""

from __future__ import annotations

from ..kernels import pdl
from ..kernels.tuning import TUNING
from ..memory import width_summary

GB = 1e9  # kv_cache_memory's unit (config.py), and the start-up lines'


class EngineDescription:
    """Describes an engine; methods of ``LLMEngine``."""

    def describe(self) -> list[str]:
        """Start-up lines: scheme and pool capacity, compared with a BF16 cache of the same memory."""
        spec, plan = self.pool.geometry, self.plan
        bf16_tokens = plan.total_bytes // spec.window_page_bytes * spec.page_size
        scheme = (f"{self.config.kv_cache_dtype} (sink {spec.sink_size}, recent {spec.recent_size}, "
                  f"group {spec.group_size}, page {spec.page_size}, layer widths {spec.width_summary()})"
                  if spec.quantizes else f"bf16 (page {spec.page_size})")
        backend = (f"Triton kernels (paged decode; prefill chunks: history materialized in float16, then "
                   f"{self.prefill_attention_description()}; short chunks through the extend kernel)"
                   if self.kernel_status is None else f"torch reference ({self.kernel_status})")
        if self.kernel_status is None and any(codec.k_rope_mean is not None for codec in self.codecs):
            pairs = max(codec.rope_pairs.shape[1] for codec in self.codecs if codec.rope_pairs is not None)
            backend += f"; keys centered per position over {pairs} RoPE pairs: the kernels add that term"
        if self.kernel_status is None and spec.quantizes:
            int2 = all(spec.layer_widths(i) == (2, 2) for i in range(spec.num_layers))
            backend += f"; {'INT2' if int2 else 'quantized'} decode: {self.int2_decode_description()}"
        if self.runner.graphs is not None:
            backend += "; CUDA graphs for decode steps (--enforce-eager: off)"
        if self.kernel_status is None and pdl.enabled(self.device):
            backend += f"; programmatic dependent launch between the step's kernels (${pdl.ENV}=off: off)"
        per_rank = (f" per rank (tensor parallel: {spec.num_kv_heads} of {spec.num_kv_heads * self.tp.size} KV heads "
                    f"on each of {self.tp.size} ranks)" if self.tp.size > 1 else "")
        if self.executor_status is None:
            executor = self.runner.forward.executor
            gemv = (f"; projections of <= {TUNING.gemv_max_rows} tokens: Triton GEMV" if executor.gemm == "triton"
                    else f"; projections: cuBLAS ({executor.gemm_why})")
            forward = f"oscar executor (fused QKV and gate/up GEMMs, fused norms and RoPE{gemv})"
        else:
            forward = f"transformers ({self.executor_status})"
        lines = [f"KV cache: {scheme}", f"attention: {backend}", f"model forward: {forward}",
                 f"KV pool{per_rank}: {plan.total_bytes / GB:.3f} GB = {plan.window_pages} BF16 window pages "
                 f"({plan.window_bytes / GB:.3f} GB, {plan.window_pages * spec.page_size} tokens) + "
                 f"{plan.quant_pages} quantized pages ({plan.quant_bytes / GB:.3f} GB incl. scales and zero points, "
                 f"{plan.quant_pages * spec.page_size} tokens)",
                 f"KV pool capacity: {plan.capacity_tokens} tokens; a BF16 cache in the same memory holds "
                 f"{bf16_tokens} tokens ({plan.capacity_tokens / max(bf16_tokens, 1):.2f}x)"]
        if spec.quantizes:
            per_seq = spec.sequence_bytes(self.max_model_len)
            bf16_seq = spec.as_bf16().sequence_bytes(self.max_model_len)
            lines.append(f"one {self.max_model_len}-token sequence: {per_seq / 2**20:.1f} MiB "
                         f"({8 * per_seq / (2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * self.max_model_len):.2f}"
                         f" bits/element; BF16 {bf16_seq / 2**20:.1f} MiB); the pool holds "
                         f"{min(plan.window_pages // spec.window_pages_per_seq(), plan.total_bytes // per_seq)} such "
                         f"sequences, a BF16 pool {plan.total_bytes // bf16_seq}")
        return lines

    def _gqa(self) -> int:
        config = self.model.config
        return config.num_attention_heads // (getattr(config, "num_key_value_heads", None) or config.num_attention_heads)

    def int2_decode_kernel(self, widths: tuple[int, int] = (2, 2)) -> tuple[str, str | None]:
        """("cuda", None) or ("triton", why): the kernel this engine's decode steps run (kernels/decode.py) on its
        layers stored at these (key, value) ``widths`` (full and sliding-window layers alike)."""
        from types import SimpleNamespace

        from ..kernels.decode import int2_kernel_choice

        codec = next((c for c in self.codecs if c.rope_pairs is not None), None)
        rope = SimpleNamespace(pairs=codec.rope_pairs) if codec is not None else None  # only its pair count counts
        return int2_kernel_choice(self.device, self.pool.geometry, self._gqa(), rope,
                                  next(self.model.parameters()).dtype, widths=widths)

    def int2_decode_description(self) -> str:
        """The decode kernel(s) for the start-up line: one for every layer, or where some layers are stored at widths
        the CUDA kernel does not read (kernels/int2_cuda.WIDTHS) and the others take the CUDA kernel, which layers take
        which."""
        from ..kernels.int2_cuda import KEY_BITS, VALUE_BITS, WIDTHS, split_error

        spec = self.pool.geometry
        kernel, why = self.int2_decode_kernel()
        if kernel != "cuda":
            return f"the Triton kernel ({why})"
        on_cuda = [i for i in range(spec.num_layers)
                   if spec.layer_widths(i) in WIDTHS and split_error(spec.k_split[i], spec.head_dim) is None]
        wider = [i for i in range(spec.num_layers) if i not in on_cuda]
        if not wider:
            return "the one-launch CUDA kernel"
        layers = lambda k: f"{k} layer" + "s" * (k != 1)  # noqa: E731

        def widths(ids):
            return width_summary([spec.key_widths()[i] for i in ids], [spec.v_bits[i] for i in ids])

        def reads(bits):
            return f"{', '.join(map(str, bits[:-1]))} or {bits[-1]}"
        wide = (f"the {layers(len(wider))} stored at {widths(wider)} (the CUDA kernel reads keys at {reads(KEY_BITS)} "
                f"bits, values at {reads(VALUE_BITS)}, split keys at D = 64 or 128 with the rest at 2, 3 or 4 bits)")
        if not on_cuda:
            return f"the Triton kernel on every layer: {wide}"
        return f"the one-launch CUDA kernel on {layers(len(on_cuda))} ({widths(on_cuda)}), the Triton kernel on {wide}"

    def prefill_attention_description(self) -> str:
        """How the kernels' long prefill chunks attend over their materialized history (kernels/chunk_attention.py)."""
        from ..kernels.chunk_attention import prefill_attention_choice
        from ..kernels.materialized_extend import SCRATCH_DTYPE

        spec = self.pool.geometry
        kernel, why = prefill_attention_choice(self.device, SCRATCH_DTYPE, spec.num_kv_heads * self._gqa(),
                                               spec.num_kv_heads, spec.head_dim)
        if kernel == "split":
            return ("attention over the history and over the chunk (causal) merged by log-sum-exp"
                    + (" (cuDNN)" if self.device.type == "cuda" else ""))
        return f"one flash attention call with a lower-right causal mask ({why})"
