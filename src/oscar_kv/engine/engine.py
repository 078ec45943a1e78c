"""The engine: scheduler + paged pool + model runner, single-threaded.

``LLMEngine`` is built from a model, its tokenizer and a calibration artifact (sizing the pool, choosing the
attention backend and the model forward), takes requests (``add_request`` / ``abort_request``; ``fork`` /
``pause`` / ``resume`` for benchmarks) and runs the step loop (``step``: schedule, launch, and turn the sampled
tokens into outputs, overlapping one step's host work with the previous step on the device).

Beside it: describe.py, the start-up lines (a mixin of ``LLMEngine``); outputs.py, what it hands back
(``RequestOutput``, ``EngineStats``, stop strings); thread.py, ``EngineThread``, which drives it for the HTTP
server.  Those names are imported here too, where callers have always found them.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import replace

import torch

from ..codec import layer_codecs, shared_ropes, validated_artifact
from ..config import EngineConfig
from ..errors import ConfigError, RequestError
from ..folding import fold_values
from ..kernels.int2_cuda import split_error
from ..kernels.layout import PoolGeometry
from ..memory import free_bytes
from ..models import layer_windows
from ..models.executor import executor_support, make_executor
from ..parallel import SINGLE, TensorParallel, is_sharded, shard_model
from .block_pool import PagePool, plan_pool
from .describe import GB, EngineDescription
from .detokenize import IncrementalText
from .kernel_attention import PoolView, kernel_support
from .outputs import EngineStats, RequestOutput, held_back, stop_at
from .runner import ATTENTION_KEY, ModelForward, ModelRunner, register_paged_attention
from .scheduler import Scheduler
from .sequence import PENDING, Logprob, SamplingParams, Sequence, SeqStatus
from .thread import EngineThread

__all__ = ["EngineConfig", "EngineStats", "EngineThread", "LLMEngine", "RequestOutput", "default_kv_cache_memory"]

log = logging.getLogger(__name__)

WARM_UP_ID = "oscar-kv-warm-up"  # the throwaway request of LLMEngine.warm_up
RATE_WINDOW_S = 10.0  # tokens/s is measured over this many seconds


def default_kv_cache_memory(device: torch.device) -> float:
    """GB: 80% of free device memory (after the model is loaded), or 10% of available RAM on CPU."""
    return (0.8 if device.type == "cuda" else 0.1) * free_bytes(device) / GB


class LLMEngine(EngineDescription):
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
                                     v_bits=tuple(codec.v_bits for codec in self.codecs),
                                     k_split=tuple(codec.k_split for codec in self.codecs))
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
        slow = [s for s in pool_geometry.k_split if split_error(s, pool_geometry.head_dim)]
        if slow and self.kernel_status is None and self.device.type == "cuda":
            # never a silent slow path: these split widths are outside the CUDA decode kernel
            log.warning("%d of %d layers store split keys the CUDA decode kernel does not read (%s): their decode "
                        "attention runs the Triton kernel, 3.4-4.8x the CUDA INT2 kernel's time and slower than BF16's "
                        "on an H200 (benchmarks/NOTES.md, run S2)", len(slow), pool_geometry.num_layers,
                        split_error(slow[0], pool_geometry.head_dim))
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
        return None, ModelForward(model, make_executor(model, self.max_model_len + 1))

    def _check_plan(self, memory: float) -> None:
        plan = self.plan
        if not plan.holds(self.max_model_len):
            raise ConfigError(
                f"kv_cache_memory {memory:.3f} GB holds {plan.capacity_tokens} tokens "
                f"({plan.window_pages} window + {plan.quant_pages} quantized pages), not one sequence of "
                f"max_model_len {self.max_model_len} tokens; raise kv_cache_memory or lower max_model_len",
                "kv_cache_memory", "max_model_len")

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
        self._forget_rates(now)
        return outputs

    def _forget_rates(self, now: float) -> None:
        """Drop the step counts older than the tokens/s window."""
        while self._recent and now - self._recent[0][0] > RATE_WINDOW_S:
            self._recent.popleft()

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
        cut = stop_at(full, grown_from, seq.params.stop)
        if cut >= 0:
            full, reason = full[:cut], "stop"
        if reason is None:
            full = full[:len(full) - held_back(full, seq.params.stop)]
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
        self._forget_rates(now)  # no steps run while idle: forget here too
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


