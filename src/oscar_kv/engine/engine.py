"""The engine: scheduler + paged pool + model runner, and a background thread that drives it.

``LLMEngine`` is single-threaded: ``add_request`` / ``abort_request`` / ``step``.  ``EngineThread``
owns one and runs ``step`` in a loop, taking requests and aborts from other threads (the HTTP
server) through queues and handing every output to the callback given with the request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ..codec import layer_codecs, shared_ropes, validated_artifact
from ..config import EngineConfig
from ..errors import ConfigError, RequestError
from ..folding import fold_values
from ..kernels.layout import PoolGeometry
from ..kernels.tuning import TUNING
from ..memory import width_summary
from ..models import layer_windows
from ..models.llama import LlamaExecutor, executor_support
from ..parallel import SINGLE, TensorParallel, is_sharded, shard_model
from .block_pool import PagePool, plan_pool
from .detokenize import IncrementalText
from .kernel_attention import PoolView, kernel_support
from .runner import ATTENTION_KEY, ModelForward, ModelRunner, register_paged_attention
from .scheduler import Scheduler
from .sequence import PENDING, Logprob, SamplingParams, Sequence, SeqStatus

log = logging.getLogger(__name__)

GB = 1e9
WARM_UP_ID = "oscar-kv-warm-up"  # the throwaway request of LLMEngine.warm_up
RATE_WINDOW_S = 10.0  # tokens/s is measured over this many seconds


@dataclass
class RequestOutput:
    request_id: str
    text: str  # new text since the last output
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    logprobs: list[Logprob] | None = None  # one per token of token_ids, when the request asked (params.logprobs)
    # every prompt token's (the first None), on the request's first output, when it asked (params.prompt_logprobs)
    prompt_logprobs: list[Logprob | None] | None = None


@dataclass
class EngineStats:
    running: int
    waiting: int
    pool_used_tokens: int
    pool_capacity_tokens: int
    pool_used_bytes: int
    pool_capacity_bytes: int
    window_pages_used: int
    window_pages: int
    quant_pages_used: int
    quant_pages: int
    cached_pages: int
    prefix_hit_rate: float
    prefix_hit_tokens: int
    prefix_queried_tokens: int
    prompt_tokens: int
    generation_tokens: int
    preemptions: int
    tokens_per_second: float
    finished: dict = field(default_factory=dict)


def default_kv_cache_memory(device: torch.device) -> float:
    """GB: 80% of free device memory (after the model is loaded), or 10% of available RAM on CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return 0.8 * free / GB
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        available = info.get("MemAvailable", info["MemTotal"])
    except (OSError, KeyError, ValueError):
        import os

        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return 0.1 * available / GB


class LLMEngine:
    """The engine.  With ``tp`` (parallel.py) every rank builds one over the whole model: the model is folded,
    then sharded, and this rank keeps its KV heads' rotations and pool.  Rank 0 is driven as usual; the others
    call :meth:`follow` and run its steps until :meth:`shutdown`."""

    def __init__(self, model, tokenizer, rotations, config: EngineConfig | None = None,
                 tp: TensorParallel = SINGLE, device: torch.device | str | None = None):
        """``device``: where to run (default: where the model is).  A model on the CPU is moved there after
        folding and sharding, so that a rank's GPU only ever holds its slices (and one whole tensor at a time)."""
        self.config = config = config or EngineConfig()
        self.model, self.tokenizer, self.tp = model, tokenizer, tp
        if is_sharded(model):
            raise ValueError("this model was sharded for tensor parallelism by an earlier engine and holds only its "
                             "slices; load it again for a new engine")
        config.validate()  # again: a config's fields can change after it was built
        if any(getattr(model.config, f"{where}_logit_softcapping", None) for where in ("attn", "final")):
            raise ConfigError("logit softcapping (Gemma 2) is not supported: the engine's attention and sampling "
                              "would leave it out")
        rotations = validated_artifact(model, rotations)
        fold_values(model, rotations.v_rotation, rotations.v_mean, tag=rotations)  # values are born rotated
        codecs = layer_codecs(model, rotations, config.kv_cache_dtype, config.group_size)
        geometry = rotations.geometry
        heads = tp.heads(geometry.num_kv_heads)
        shard_model(model, tp, device)  # after folding: the folded weights are what gets split
        if device is not None:
            model.to(device)
        self.device = next(model.parameters()).device
        if config.kv_cache_dtype == "bf16" and any(codec.k_rope_mean is not None for codec in codecs):
            # BF16 keys need no centering (softmax is exact without it) and the BF16 kernel does not add the
            # position-aware term back: drop it rather than fall back to the torch reference
            log.info("BF16 KV cache: the artifact's per-position key means are not used (they serve INT2 only)")
            codecs = [replace(codec, k_rope_mean=None, rope_pairs=None) for codec in codecs]
        self.codecs = [codec.keep_heads(heads).to(self.device) for codec in codecs]
        register_paged_attention()
        model.set_attn_implementation(ATTENTION_KEY)
        pool_geometry = PoolGeometry(geometry.num_layers, heads.stop - heads.start, geometry.head_dim,
                                     codecs[0].group_size, config.page_size, config.sink_size, config.recent_size,
                                     tuple(codec.k_bits for codec in self.codecs),
                                     layer_windows=layer_windows(model.config),
                                     v_bits=tuple(codec.v_bits for codec in self.codecs))
        limit = getattr(model.config, "max_position_embeddings", None) or 8192
        self.max_model_len = config.max_model_len or limit
        if self.max_model_len > limit:
            raise ConfigError(f"max_model_len {self.max_model_len} exceeds the model's context of {limit} tokens",
                              "max_model_len")
        windowed = [w for w in pool_geometry.layer_windows if w is not None]
        if windowed:
            log.info("sliding-window layers: %d of %d (window %s) read only their window; every layer stores every "
                     "token", len(windowed), geometry.num_layers, "/".join(str(w) for w in sorted(set(windowed))))
        # per-position centering's RoPE tables, sized once for every position a kernel may read: grown on demand,
        # they were rebuilt on the host mid-prefill while the GPU waited (and each step synced for the positions' max)
        for rope in shared_ropes(self.codecs):
            rope.reserve(self.max_model_len + 1, self.device)
        memory = config.kv_cache_memory if config.kv_cache_memory is not None else default_kv_cache_memory(self.device)
        memory = tp.smallest(memory)  # rank 0 places pages for all ranks: their pools must be equal
        self.plan = plan_pool(pool_geometry, int(memory * GB), self.max_model_len, config.max_num_seqs)
        self._check_plan(memory)
        self.pool = PagePool(self.plan, self.device)
        self.pool.tables.reserve(config.max_num_seqs, pool_geometry.pages_for(self.max_model_len))
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_prefix_caching)
        self.kernel_status = kernel_support(self.pool, config.attention_backend,
                                            rope_centered=any(codec.k_rope_mean is not None for codec in self.codecs))
        if config.attention_backend == "triton" and self.kernel_status is not None:
            raise ConfigError(f"attention_backend triton: {self.kernel_status}", "attention_backend")
        if self.kernel_status is not None and self.device.type == "cuda" and config.attention_backend != "torch":
            # the torch reference materializes [heads, tokens] logits in float32: slow, and out of memory at
            # long context; say so once, at start-up, never silently
            log.warning("attention runs on the torch reference path on the GPU (slow, memory-hungry at long "
                        "context): %s", self.kernel_status)
        view = PoolView(self.pool) if self.kernel_status is None else None
        self.executor_status, forward = self._model_forward(model, config.model_impl)
        self.runner = ModelRunner(model, self.pool, self.codecs, view, None, tp, forward)
        if view is not None and self.device.type == "cuda" and not config.enforce_eager:
            from .graphs import DecodeGraphs

            self.runner.graphs = DecodeGraphs(forward, self.runner.attention, self.max_model_len)
        eos = model.generation_config.eos_token_id
        eos = tokenizer.eos_token_id if eos is None else eos
        self.stop_token_ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
        self.requests: dict[str, Sequence] = {}
        self._in_flight = None  # runner.LaunchedStep queued on the device, its tokens not yet taken (step)
        self._ready: list[RequestOutput] = []  # outputs of a step drained outside ``step``
        self.prompt_tokens = self.generation_tokens = 0
        self.finished: dict[str, int] = {}
        self._recent: deque[tuple[float, int]] = deque()

    def _model_forward(self, model, impl: str) -> tuple[str | None, ModelForward]:
        """Our executor where it runs the model (and ``impl`` allows it), else transformers' forward.
        Returns (None, forward) with the executor, else (why not, forward)."""
        if impl == "transformers":
            return "model_impl is 'transformers'", ModelForward(model)
        why = executor_support(model)
        if why is not None:
            if impl == "oscar":
                raise ConfigError(f"model_impl oscar: the executor cannot run this model: {why}", "model_impl")
            log.info("model forward: transformers (%s)", why)
            return why, ModelForward(model)
        return None, ModelForward(model, LlamaExecutor(model, self.max_model_len + 1))

    def _check_plan(self, memory: float) -> None:
        plan = self.plan
        if not plan.holds(self.max_model_len):
            raise ConfigError(
                f"kv_cache_memory {memory:.3f} GB holds {plan.capacity_tokens} tokens "
                f"({plan.window_pages} window + {plan.quant_pages} quantized pages), not one sequence of "
                f"max_model_len {self.max_model_len} tokens; raise kv_cache_memory or lower max_model_len",
                "kv_cache_memory", "max_model_len")

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
                 f"{plan.quant_pages} quantized pages ({plan.quant_bytes / GB:.3f} GB incl. scale/min, "
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

    def int2_decode_kernel(self, window: int | None = None, widths: tuple[int, int] = (2, 2)) -> tuple[str, str | None]:
        """("cuda", None) or ("triton", why): the kernel this engine's decode steps run (kernels/decode.py) on its
        layers with this sliding ``window`` (None: the full-attention layers) stored at these (key, value)
        ``widths``."""
        from types import SimpleNamespace

        from ..kernels.decode import int2_kernel_choice

        codec = next((c for c in self.codecs if c.rope_pairs is not None), None)
        rope = SimpleNamespace(pairs=codec.rope_pairs) if codec is not None else None  # only its pair count counts
        return int2_kernel_choice(self.device, self.pool.geometry, self._gqa(), rope,
                                  next(self.model.parameters()).dtype, window=window, widths=widths)

    def int2_decode_description(self) -> str:
        """The decode kernel(s) for the start-up line: one for every layer, or where some layers have a sliding
        window or are stored at widths the CUDA kernel does not read (kernels/int2_cuda.WIDTHS: keys at 2-4 bits,
        values at 2) and the others take the CUDA kernel, which layers take which (the CUDA kernel reads whole
        histories)."""
        from ..kernels.int2_cuda import WIDTHS

        spec = self.pool.geometry
        windows = spec.layer_windows
        kernel, why = self.int2_decode_kernel()
        if kernel != "cuda":
            return f"the Triton kernel ({why})"
        int2 = [i for i in range(spec.num_layers) if spec.layer_widths(i) in WIDTHS]  # the layers CUDA can read
        windowed = [i for i in int2 if windows[i] is not None]
        wider = [i for i in range(spec.num_layers) if i not in int2]
        if not windowed and not wider:
            return "the one-launch CUDA kernel"
        layers = lambda k: f"{k} layer" + "s" * (k != 1)  # noqa: E731
        sizes = ", ".join(map(str, sorted({windows[i] for i in windowed})))
        cuda = len(int2) - len(windowed)
        if not wider:  # only sliding windows keep layers off the CUDA kernel
            if not cuda:
                return (f"the Triton kernel (every layer has a sliding window of {sizes} tokens: the CUDA kernel reads "
                        f"whole histories)")
            return (f"the one-launch CUDA kernel on {layers(cuda)} of full attention, the Triton kernel on the "
                    f"{layers(len(windowed))} with a sliding window ({sizes} tokens: the CUDA kernel reads whole "
                    f"histories)")

        def widths(ids):
            return width_summary(*zip(*(spec.layer_widths(i) for i in ids)))

        parts = [f"the {layers(len(wider))} stored at {widths(wider)} (the CUDA kernel reads values at 2 bits only)"]
        if windowed:
            parts.append(f"the {layers(len(windowed))} with a sliding window ({sizes} tokens: the CUDA kernel reads "
                         f"whole histories)")
        if not cuda:
            return f"the Triton kernel on every layer: {' and '.join(parts)}"
        full = " of full attention" if windowed else ""
        on_cuda = [i for i in int2 if windows[i] is None]
        return (f"the one-launch CUDA kernel on {layers(cuda)}{full} ({widths(on_cuda)}), the Triton kernel on "
                f"{' and '.join(parts)}")

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

    def follow(self) -> None:
        """Ranks > 0 under tensor parallelism: run rank 0's steps until it shuts down."""
        self.runner.follow()

    def shutdown(self) -> None:
        """Rank 0: release the other ranks (their ``follow`` returns)."""
        self.runner.release_followers()

    def warm_up(self) -> float:
        """Run throwaway requests so that the kernels are compiled (and small decode graphs captured) before
        the first real request (Triton compiles a kernel on its first call: seconds each).  The first prompt
        reaches past the sink and recent windows, so prefill, the write path, migration and the decode kernel
        with an INT2 history all run; counters and the prefix cache are reset afterwards.  Returns seconds."""
        started = time.perf_counter()
        spec = self.pool.geometry
        n = max(1, min(self.max_model_len - 100, spec.sink_size + spec.recent_size + 4 * spec.page_size))
        vocab = self.model.config.vocab_size
        prompt = [(7 * i + 1) % vocab for i in range(n)]
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        # alone (batch 1), then three together whose prompts extend the first one's (prefix hits: prefill
        # chunks over a stored history): Triton compiles separate variants for some sizes
        for batch in ([prompt], [prompt + prompt[:extra] for extra in (1, 37, 90)]):
            for i, ids in enumerate(batch):
                self.add_request(f"{WARM_UP_ID}-{i}", ids[:self.max_model_len - 4], params)
            while self.has_work():
                self.step()
        if self.kernel_status is None and self.device.type == "cuda":
            from ..kernels.decode import compile_merges

            compile_merges(self.device, spec.head_dim)
        self.prompt_tokens = self.generation_tokens = 0
        self.finished.clear()
        self._recent.clear()
        self.pool.reset_prefix_cache()  # its pages would never be hit again
        self.pool.hit_tokens = self.pool.queried_tokens = 0
        return time.perf_counter() - started

    # ---- requests ------------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError with a client-facing message if the request cannot be served."""
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise RequestError(f"this model's maximum context length is {self.max_model_len} tokens; "
                             f"the prompt has {n} tokens")
        if n + params.max_tokens > self.max_model_len:
            raise RequestError(f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                             f"{n} tokens and max_tokens is {params.max_tokens} (at most {self.max_model_len - n})")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise RequestError(f"prompt token ids must lie in [0, {vocab})")
        if any(not 0 <= t < vocab for t, _ in params.logit_bias):
            raise RequestError(f"logit_bias token ids must lie in [0, {vocab})")

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        self.validate(prompt_ids, params)
        seq = Sequence(request_id, list(prompt_ids), params)
        seq.detokenizer = IncrementalText(self.tokenizer, seq.output_ids)
        self.requests[request_id] = seq
        self.prompt_tokens += len(seq.prompt_ids)
        self.scheduler.add(seq)
        return seq

    def abort_request(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        """End a request: as "abort" (its client went away), or as "error" with ``error`` (the server stops)."""
        seq = self.requests.get(request_id)
        if seq is None or seq.finished:
            return None
        return self._finish(seq, "abort" if error is None else "error", error)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._ready) or self._live(self._in_flight)

    @staticmethod
    def _live(launched) -> bool:
        """A launched step some of whose sequences still wait for its tokens (not aborted or stopped since)."""
        return launched is not None and any(not st.seq.finished for st in launched.steps)

    def fork(self, request_id: str, new_id: str) -> Sequence:
        """A new running request with the tokens, sampling parameters and a copy of the KV cache of a running
        request (fresh pages, every layer, on every rank): decoding continues from the same state.  The decode
        benchmark builds its batches this way.  Raises MemoryError when the pool is short of pages."""
        from .block_pool import QUANT, WINDOW

        self.drain()
        src = self.requests[request_id]
        if new_id in self.requests:
            raise RequestError(f"request id {new_id!r} is already in use")
        pool = self.pool
        seq = Sequence(new_id, src.prompt_ids, src.params)
        seq.output_ids = list(src.output_ids)
        seq.output_logprobs = list(src.output_logprobs)
        if src.prompt_logprobs is not None:  # its prompt is computed: what it scored is the fork's too
            seq.prompt_logprobs, seq.prompt_logprobs_next = list(src.prompt_logprobs), src.prompt_logprobs_next
            seq.prompt_logprobs_sent = src.prompt_logprobs_sent
        seq.detokenizer = src.detokenizer.following(seq.output_ids)
        kinds = [pool.kind_of(i, src.int2_pages) for i in range(len(src.pages))]
        src_q = [p for p, k in zip(src.pages, kinds) if k == QUANT]
        src_w = [p for p, k in zip(src.pages, kinds) if k != QUANT]
        new_q = pool.quant.allocate(len(src_q))
        try:
            new_w = pool.window.allocate(len(src_w))
        except MemoryError:
            for page in new_q:
                pool.quant.release(page)
            raise
        q_it, w_it = iter(new_q), iter(new_w)
        seq.pages = [next(q_it) if k == QUANT else next(w_it) for k in kinds]
        seq.int2_pages, seq.num_computed = src.int2_pages, src.num_computed
        self.runner.copy_pages(WINDOW, src_w, new_w)
        if src_q:
            self.runner.copy_pages(QUANT, src_q, new_q)
        self.scheduler.admit_running(seq)
        self.requests[new_id] = seq
        return seq

    def pause(self, request_id: str) -> None:
        """Stop decoding a running request; it keeps its KV cache (``resume``, or ``abort_request`` to free it)."""
        self.drain()
        self.scheduler.pause(self.requests[request_id])

    def resume(self, request_id: str) -> None:
        self.drain()
        self.scheduler.resume(self.requests[request_id])

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run the engine one step: the outputs of one step's tokens.

        Overlapped (one rank): the step in flight is accounted, the next one is scheduled and queued on the
        device with its new ids read there from the step in flight's sampled tokens, and only then does the host
        wait for the tokens of the step in flight; the GPU goes from one step to the next without waiting for the
        host's scheduling, planning and output handling.  A sequence that stops on a token (EOS, stop string) has
        run one step too many, which is dropped; one that reaches max_tokens is not scheduled again."""
        outputs, self._ready = self._ready, []
        current, self._in_flight = self._in_flight, None
        if not self._live(current):  # nothing of it is wanted: the device finishes it in stream order
            current = None
        if current is None:
            current, rejected = self._launch_next(None)
            outputs += rejected
            if current is None:
                return outputs
        if self._overlaps(current):
            self._account(current)
            self._in_flight, rejected = self._launch_next(current)
            outputs += rejected
            return outputs + self._complete(current, accounted=True)
        return outputs + self._complete(current, accounted=False)

    def drain(self) -> None:
        """Wait for the step in flight and keep its outputs for the next ``step`` (before changing sequences from
        outside a step: fork, pause, resume)."""
        if self._in_flight is not None:
            current, self._in_flight = self._in_flight, None
            self._ready += self._complete(current, accounted=False)

    def _overlaps(self, launched) -> bool:
        return self.config.async_scheduling and self.tp.size == 1

    def _launch_next(self, after) -> tuple[object | None, list[RequestOutput]]:
        """Schedule and queue a step (``after``: the step in flight, whose tokens it reads on the device).
        Returns (the launched step or None, outputs of requests rejected or failed on the way)."""
        batch = self.scheduler.schedule()
        outputs = [self._finish(seq, "error", "the request does not fit into the KV pool") for seq in batch.rejected]
        if not batch.scheduled:
            return None, outputs
        try:
            return self.runner.launch(batch.scheduled, after), outputs
        except Exception as exc:  # a failed forward fails its requests, not the server
            return None, outputs + self._fail(batch.scheduled, exc)

    def _fail(self, steps, exc: Exception) -> list[RequestOutput]:
        """A failed forward ends its requests (those still running) with an error, not the server."""
        log.exception("forward failed")
        return [self._finish(st.seq, "error", f"{type(exc).__name__}: {exc}") for st in steps if not st.seq.finished]

    def _at_length(self, seq: Sequence, more: int = 0) -> bool:
        """``seq`` has reached max_tokens or max_model_len (with ``more`` tokens yet to come)."""
        return len(seq.output_ids) + more >= seq.params.max_tokens or seq.num_tokens + more >= self.max_model_len

    def _account(self, launched) -> None:
        """Before the step's tokens are known: count its computed tokens, and give each sequence it samples a
        PENDING last id (the next step reads it on the device), unless that token ends it by length."""
        for st in launched.steps:
            if not st.seq.finished:  # (aborted while the step was in flight)
                self.scheduler.finish_step(st)
        for seq in launched.sampling:
            if not seq.finished and not self._at_length(seq, more=1):
                seq.output_ids.append(PENDING)

    def _complete(self, launched, accounted: bool) -> list[RequestOutput]:
        """Wait for a launched step's tokens and hand them to their sequences (those still running)."""
        try:
            sampled = self.runner.sampled(launched)
            logprobs, prompt_logprobs = launched.results()
        except Exception as exc:
            return self._fail(launched.steps, exc)
        for seq, first, entries in prompt_logprobs:  # before the tokens: a first output carries them all
            if not seq.finished:
                seq.prompt_logprobs[first:first + len(entries)] = entries
        outputs = []
        now = time.monotonic()
        new_tokens = 0
        for st in launched.steps:
            if st.seq.finished:  # aborted, or stopped by the step before, while this one was in flight
                continue
            if not accounted:
                self.scheduler.finish_step(st)
            token = sampled.get(st.seq)
            if token is None:
                continue
            new_tokens += 1
            outputs.append(self._append_token(st.seq, token, logprobs.get(st.seq)))
        self.generation_tokens += new_tokens
        self._recent.append((now, new_tokens))
        while self._recent and now - self._recent[0][0] > RATE_WINDOW_S:
            self._recent.popleft()
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprob: Logprob | None = None) -> RequestOutput:
        if seq.pending:
            seq.output_ids[-1] = token
        else:
            seq.output_ids.append(token)
        if logprob is not None:
            seq.output_logprobs.append(logprob)
        reason = None
        if token in self.stop_token_ids and not seq.params.ignore_eos:
            reason = "stop"
        elif self._at_length(seq):
            reason = "length"
        text = seq.detokenizer
        grown_from = len(text.text)
        text.update()
        if reason is not None:
            text.flush()
        full = text.text
        # a stop string not found before ends in the new text: search only from where it could start
        start = max(0, grown_from - max((len(s) for s in seq.params.stop), default=0))
        cut = min((i for i in (full.find(s, start) for s in seq.params.stop if s) if i >= 0), default=-1)
        if cut >= 0:
            full, reason = full[:cut], "stop"
        if reason is None:
            full = full[:len(full) - _held_back(full, seq.params.stop)]
        seq.text = full
        if reason is not None:
            return self._finish(seq, reason)
        return self._delta(seq, [token])

    def _delta(self, seq: Sequence, token_ids: list[int]) -> RequestOutput:
        delta = seq.text[seq.sent_chars:]
        seq.sent_chars = len(seq.text)
        out = RequestOutput(seq.request_id, delta, token_ids, seq.finished, seq.finish_reason,
                            len(seq.prompt_ids), len(seq.output_ids))
        if seq.params.logprobs is not None:  # token_ids are the newest tokens (one, or none)
            out.logprobs = seq.output_logprobs[len(seq.output_logprobs) - len(token_ids):]
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            out.prompt_logprobs, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
        return out

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> RequestOutput:
        if seq.pending:  # ended while its next token was being sampled: that token is dropped
            seq.output_ids.pop()
        self.scheduler.remove(seq)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        self.requests.pop(seq.request_id, None)
        self.finished[reason] = self.finished.get(reason, 0) + 1
        out = self._delta(seq, seq.output_ids[-1:] if reason in ("stop", "length") else [])
        out.error = error
        return out

    # ---- introspection -------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        pool, plan = self.pool, self.plan
        now = time.monotonic()
        while self._recent and now - self._recent[0][0] > RATE_WINDOW_S:  # no steps run while idle: forget here too
            self._recent.popleft()
        window = sum(n for _, n in self._recent)
        span = (now - self._recent[0][0]) if len(self._recent) > 1 else 0.0
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            pool_used_tokens=pool.used_tokens, pool_capacity_tokens=plan.capacity_tokens,
            pool_used_bytes=pool.used_bytes, pool_capacity_bytes=plan.total_bytes,
            window_pages_used=pool.window.used, window_pages=plan.window_pages,
            quant_pages_used=pool.quant.used, quant_pages=plan.quant_pages,
            cached_pages=pool.window.cached + pool.quant.cached, prefix_hit_rate=pool.hit_rate,
            prefix_hit_tokens=pool.hit_tokens, prefix_queried_tokens=pool.queried_tokens,
            prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens,
            preemptions=self.scheduler.num_preemptions,
            tokens_per_second=window / span if span > 0 else 0.0, finished=dict(self.finished))


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of ``text`` not to stream yet: a partial UTF-8 character, or a prefix of a stop string."""
    hold = 1 if text.endswith("\ufffd") else 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold


class EngineThread:
    """Runs an ``LLMEngine`` in a daemon thread; thread-safe ``submit`` / ``abort`` / ``stats``."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._callbacks: dict[str, Callable[[RequestOutput], None]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="oscar-kv-engine", daemon=True)
        self._lock = threading.Lock()

    def start(self) -> "EngineThread":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               callback: Callable[[RequestOutput], None]) -> None:
        """Validate (ValueError for the client) and queue a request; outputs go to ``callback``."""
        self.engine.validate(prompt_ids, params)
        self._inbox.put(("add", request_id, prompt_ids, params, callback))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def abort_all(self, error: str) -> None:
        """End every request submitted so far with finish reason "error" and ``error`` (graceful shutdown)."""
        self._inbox.put(("abort_all", error))
        self._wake.set()

    def stats(self) -> EngineStats:
        with self._lock:
            return self.engine.stats()

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop.is_set():
            self._drain()
            if not self.engine.has_work():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            with self._lock:
                outputs = self.engine.step()
            for out in outputs:
                self._emit(out)

    def _drain(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            with self._lock:
                if item[0] == "add":
                    _, rid, prompt, params, callback = item
                    try:
                        self.engine.add_request(rid, prompt, params)
                        self._callbacks[rid] = callback
                    except ValueError as exc:
                        callback(RequestOutput(rid, "", [], True, "error", len(prompt), 0, str(exc)))
                elif item[0] == "abort":
                    out = self.engine.abort_request(item[1])
                    if out is not None:
                        self._emit(out)
                else:
                    for rid in list(self.engine.requests):
                        self._emit(self.engine.abort_request(rid, item[1]))

    def _emit(self, out: RequestOutput) -> None:
        callback = self._callbacks.get(out.request_id)
        if out.finished:
            self._callbacks.pop(out.request_id, None)
        if callback is not None:
            try:
                callback(out)
            except Exception:  # a closed client must not stop the engine
                log.exception("output callback failed for %s", out.request_id)
