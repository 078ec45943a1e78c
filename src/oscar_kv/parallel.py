"""Tensor parallelism: one process per GPU, the KV heads split across them in contiguous blocks.

The processes are started by ``--tp N`` itself (:func:`relaunch`, with the environment torchrun would set), or by
torchrun; over several hosts (``--nnodes``, ``--node-rank``, ``--master-addr``, ``--master-port``) the same command
on each host starts that host's share, and they meet at node 0's rendezvous (torch.distributed's env:// store).
torch.distributed carries everything: NCCL between GPUs (gloo on the CPU) for the model's all-reduces, and a
gloo group for the small Python messages rank 0 sends the others (the step plans, see engine/runner.py).
The model is sharded with transformers' own tensor-parallel plan (``config.base_model_tp_plan``): q/k/v and
the MLP's gate/up column-wise, o_proj and down_proj row-wise followed by an all-reduce.  Rank r therefore
computes KV heads [r H/N, (r+1) H/N) and their query heads; its attention calls see only those heads, so
its cache layers, pool and kernels hold only those heads (:meth:`TensorParallel.heads`).
Embeddings, norms and lm_head stay whole on every rank (the logits are computed on rank 0 only).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import ConfigError
from .models import AttentionGeometry

# the styles of transformers' plans that matter for inference; others (replicated norms) are no-ops here
_SHARDING_STYLES = ("colwise", "rowwise")


class TensorParallelError(ConfigError):
    """Tensor parallelism cannot run as asked; the message says what to change."""


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group (size 1: no parallelism, no process group)."""

    rank: int = 0
    size: int = 1
    control: object = None  # gloo process group for Python objects

    @property
    def is_driver(self) -> bool:
        """Rank 0 schedules, samples and talks to clients; the others follow its steps."""
        return self.rank == 0

    def heads(self, count: int, what: str = "KV heads") -> slice:
        """This rank's contiguous block of ``count`` heads."""
        if count % self.size:
            raise TensorParallelError(f"tp {self.size} must divide the model's {count} {what}", "tp")
        per = count // self.size
        return slice(self.rank * per, (self.rank + 1) * per)

    def broadcast(self, obj=None):
        """Rank 0's ``obj`` on every rank (pickled over the gloo group)."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def smallest(self, value: float) -> float:
        """The minimum of ``value`` over the ranks (e.g. free memory: every rank's pool must be the same)."""
        if self.size == 1:
            return value
        t = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return float(t)

    def gather_heads(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along ``dim`` in rank order (their head blocks -> all heads),
        on every rank; the tensors travel over the gloo group on the CPU."""
        if self.size == 1:
            return tensor
        local = tensor.detach().cpu().contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local, group=self.control)
        return torch.cat(parts, dim).to(tensor.device)


SINGLE = TensorParallel()


def launched() -> bool:
    """Whether this process was started by torchrun (or another launcher that sets RANK / WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def local_device(device: str, tp: int) -> str:
    """The device of this rank: ``cuda:LOCAL_RANK`` for a CUDA run under tensor parallelism."""
    if tp > 1 and device.startswith("cuda"):
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return device


def init(tp: int, device: str) -> TensorParallel:
    """Join the process group of ``tp`` ranks (torchrun's environment); ``tp == 1``: no group."""
    if tp < 1:
        raise TensorParallelError(f"tp must be at least 1, got {tp}", "tp")
    if tp == 1:
        return SINGLE
    if not launched():
        raise TensorParallelError(f"tp {tp} needs one process per rank: run under torchrun "
                                  f"(torchrun --nproc-per-node {tp} -m oscar_kv.cli ...) or let tp start it", "tp")
    world = int(os.environ["WORLD_SIZE"])
    if world != tp:
        raise TensorParallelError(f"tp {tp} but {world} processes were started (WORLD_SIZE)", "tp")
    cuda = device.startswith("cuda")
    if cuda:
        here = int(os.environ.get("LOCAL_WORLD_SIZE", tp))  # several hosts: this host's share of the ranks
        if torch.cuda.device_count() < here:
            raise TensorParallelError(f"tp {tp} needs {here} GPUs on this host; it has {torch.cuda.device_count()}",
                                      "tp")
        torch.cuda.set_device(torch.device(local_device(device, tp)))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    control = dist.new_group(backend="gloo") if cuda else dist.group.WORLD
    return TensorParallel(dist.get_rank(), world, control)


def shutdown(tp: TensorParallel) -> None:
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def check_geometry(geometry: AttentionGeometry, tp: TensorParallel) -> None:
    """Refuse head counts that do not split evenly (transformers loads them and fails inside the forward)."""
    tp.heads(geometry.num_kv_heads, "KV heads")
    tp.heads(geometry.num_attention_heads, "query heads")


def check_model(spec: str, size: int) -> None:
    """Before any process starts: the model's heads (read from its config) must split into ``size`` blocks."""
    from transformers import AutoConfig

    from .models import resolve_model

    check_geometry(AttentionGeometry.of(AutoConfig.from_pretrained(resolve_model(spec))), TensorParallel(0, size))


def shard_plan(model) -> dict[str, str]:
    """transformers' plan for ``model``'s decoder layers, expanded to module names: {module: style}."""
    plan = getattr(model.config, "base_model_tp_plan", None) or {}
    prefix = model.base_model_prefix
    modules = dict(model.named_modules())
    out = {}
    for pattern, style in plan.items():
        if style not in _SHARDING_STYLES or not pattern.startswith("layers.*."):
            continue
        tail = pattern[len("layers.*."):]
        for i in range(model.config.num_hidden_layers):
            name = f"{prefix}.layers.{i}.{tail}"
            if name in modules:
                out[name] = style
    return out


def shard_model(model, tp: TensorParallel, device: torch.device | str | None = None) -> None:
    """Keep this rank's slices of a whole model's attention and MLP weights (transformers' plan, in place);
    with ``device``, the slices are moved there (one whole weight at a time passes through it)."""
    if tp.size == 1:
        return
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    check_geometry(AttentionGeometry.of(model.config), tp)
    plan = shard_plan(model)
    if not any(style == "rowwise" for style in plan.values()):
        raise TensorParallelError(f"{type(model).__name__} has no tensor-parallel plan in transformers")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    mesh = init_device_mesh(device.type, (tp.size,))
    modules = dict(model.named_modules())
    # what transformers' loader does per parameter and module (apply_tensor_parallelism's signature changed
    # between 5.17 and 5.23; the styles' methods did not): slice the weights, then install the forward that
    # all-reduces after a row-wise layer
    for name, style_name in plan.items():
        style, module = ALL_PARALLEL_STYLES[style_name], modules[name]
        for param in ("weight", "bias"):
            if module._parameters.get(param) is not None:
                style.validate_param(module, param, mesh, parameter_name=f"{name}.{param}")
                style.shard_param(module, param, mesh)
        style.install_forward(module, mesh)
    model.oscar_tensor_parallel = tp.size  # see is_sharded
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the whole weights are gone


def is_sharded(model) -> bool:
    """Whether ``model`` was sharded by :func:`shard_model` (its weights are slices: it cannot be folded again)."""
    return getattr(model, "oscar_tensor_parallel", 1) > 1


@dataclass(frozen=True)
class Nodes:
    """Where this host's ranks sit among several hosts (torchrun's static rendezvous: every host is told the
    number of hosts, its own index and node 0's address; ranks are numbered host by host)."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None on one host: any free port


def relaunch(tp: int, argv: list[str], nodes: Nodes = Nodes()) -> int:
    """Run ``python -m oscar_kv.cli <argv>`` as this host's share of ``tp`` processes (all of them on one host;
    tp / nnodes on each of several, ranks ``node_rank * tp / nnodes`` on), with the environment torchrun sets,
    and return the exit status of this host's first rank.  SIGINT / SIGTERM go to that rank alone: on node 0 it
    is rank 0, which shuts down and releases the others, on every host (a clean stop, no tracebacks); if any
    rank fails, the others here are stopped."""
    port = nodes.master_port
    if port is None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    local = tp // nodes.nnodes
    base = dict(os.environ, MASTER_ADDR=nodes.master_addr, MASTER_PORT=str(port), WORLD_SIZE=str(tp),
                LOCAL_WORLD_SIZE=str(local), GROUP_RANK=str(nodes.node_rank),
                OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, "-m", "oscar_kv.cli", *argv]
    first = nodes.node_rank * local
    # own sessions: a terminal's Ctrl-C reaches this process only, which hands it to rank 0
    ranks = [subprocess.Popen(cmd, env=dict(base, RANK=str(first + r), LOCAL_RANK=str(r)), start_new_session=True)
             for r in range(local)]
    stopping = []

    def forward(signum, _frame):
        stopping.append(signum)
        if ranks[0].poll() is None:
            ranks[0].send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            codes = [p.poll() for p in ranks]
            failed = [c for c in codes if c not in (None, 0)]
            if failed and not stopping:  # a rank died: the others would wait for it forever
                break
            if codes[0] is not None:  # rank 0 is done: the others follow it out
                break
            time.sleep(0.2)
        deadline = time.monotonic() + 30
        while any(p.poll() is None for p in ranks) and time.monotonic() < deadline and not failed:
            time.sleep(0.2)
        code = ranks[0].poll()
        if stopping and code in (0, -stopping[0]):
            return 0  # stopped as asked
        if not code:  # rank 0 fine (or still running): a failure elsewhere decides
            return 1 if any(p.poll() not in (None, 0) for p in ranks) else 0
        return code if code > 0 else 128 - code  # killed by signal n: 128 + n, as a shell reports it
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
