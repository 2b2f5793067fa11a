"""Everything distributed, in one place: DDP set-up from torchrun's environment and collectives.

:func:`setup` reads torchrun's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT and
picks the device (``cuda:LOCAL_RANK`` where CUDA is) and backend (NCCL on GPUs, gloo on CPU);
without torchrun every function here is a no-op, so the rest of ``mt`` calls them freely.
Control collectives (a stop signal, the wall time, rank 0's decisions, barriers) run on a gloo
group beside NCCL's, on CPU tensors: read back from the GPU they would synchronise the device.

Example (8 GPUs; two machines: ``--nnodes=2 --node_rank=i --rdzv_backend=c10d
--rdzv_endpoint=HOST:PORT`` on each):
    torchrun --standalone --nproc_per_node=8 $(which mt-train) experiment=wmt14_en_de_base
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def resolve_device(device: str = "auto", local_rank: int = 0) -> torch.device:
    """``auto`` -> ``cuda:LOCAL_RANK`` if CUDA is available else ``cpu``; ``cuda`` -> the same
    GPU selection; anything else (``cpu``, ``cuda:1``) as given."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device(device)


_CONTROL = None  # the gloo group of the control collectives (None: the default group)


def setup(device: str = "auto", timeout_minutes: float = 30.0) -> DistInfo:
    """Join the process group torchrun describes (if any) and pick this process's device
    (:func:`resolve_device`); ``timeout_minutes``: how long a rank waits for the others in a
    collective (``train.dist_timeout_minutes``)."""
    check_launcher(os.environ)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # Batches of varying lengths make the caching allocator's fixed segments fragment; growable
    # ones ("expandable segments") keep the reserved memory near the peak that is used. Read
    # when the allocator starts, so set before the first CUDA allocation; a user's setting wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        timeout = datetime.timedelta(minutes=timeout_minutes)
        store = round_store(os.environ, rank, world_size, timeout)
        extra = {} if store is None else {"store": store, "rank": rank, "world_size": world_size}
        dist.init_process_group(
            backend=backend, timeout=timeout, device_id=dev if dev.type == "cuda" else None,
            **extra,
        )  # fmt: skip
        init_control_group(timeout)
        log.info("DDP: rank %d/%d (local %d) on %s, %s", rank, world_size, local_rank, dev, backend)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=dev)


_ROUND_STORE = None  # rank 0's store server of this round (kept alive with the group)
STORE_KEY = "mt/round_store"  # where rank 0 publishes that server's address in torchrun's store
CONNECT_SECONDS = 5.0  # one try at a published address (a dead one is refused at once)


def round_store(env, rank: int, world_size: int, timeout: datetime.timedelta):
    """A store of this rendezvous round only, or None where torch's own ``env://`` one is safe.

    With torch's default c10d rendezvous, torchrun's agent keeps one TCP store for the whole job
    (``TORCHELASTIC_USE_AGENT_STORE=True``) and each restart's workers meet in it under the same
    keys as the round before. A restarted rank can then read the address a dead worker of the
    last round published there (gloo's full-mesh connect, NCCL's unique id) and fail with
    "Connection refused": ``--max-restarts`` never recovers (torchrun's
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` also avoids it; ``TORCHELASTIC_RESTART_COUNT``
    cannot serve as a prefix: each node counts its own restarts). So rank 0 starts a fresh store
    on a free port and publishes its address under :data:`STORE_KEY` in the agent's store; the
    other ranks connect to it, reading the key again while the address they find is refused
    (a stale one, of a worker the agent has stopped).
    """
    global _ROUND_STORE
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    agent = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    if rank == 0:
        _ROUND_STORE = dist.TCPStore(
            host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        agent.set(STORE_KEY, f"{host}:{_ROUND_STORE.port}")
        return _ROUND_STORE
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        address = agent.get(STORE_KEY).decode()  # waits until some round has written it
        where, _, num = address.rpartition(":")
        try:
            # A plain connect first: a dead address is refused at once, without the C++
            # client's retries and the stack trace it logs for each.
            socket.create_connection((where, int(num)), timeout=CONNECT_SECONDS).close()
            store = dist.TCPStore(where, int(num), world_size, is_master=False,
                                  timeout=datetime.timedelta(seconds=CONNECT_SECONDS))  # fmt: skip
        except (OSError, RuntimeError, ValueError) as err:  # DistNetworkError: RuntimeError
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"rank {rank}: no store of this restart round at {address} (published by "
                    f"rank 0 under {STORE_KEY!r} in torchrun's store {host}:{port}) within "
                    f"train.dist_timeout_minutes={timeout.total_seconds() / 60:g}: {err}"
                ) from err
            log.debug("rank %d: %s is not this round's store (%s); reading it again", rank,
                      address, err)  # fmt: skip
            time.sleep(0.2)
            continue
        store.set_timeout(timeout)  # the short one was for connecting only
        return store


# Variables by which a launcher other than torchrun says "you are one of N tasks".
TASK_COUNTS = ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")


class LauncherError(RuntimeError):
    """Several tasks were started without torchrun: each would train alone on one run_dir."""


def check_launcher(env) -> None:
    """Refuse to start as one of several tasks that torchrun did not launch (a
    :class:`LauncherError` with the torchrun command to use instead).

    ``srun -n 4 mt-train`` or ``mpirun -np 4 mt-train`` start 4 processes without torchrun's
    RANK / WORLD_SIZE, each a single-process run on the same run directory.
    ``SLURM_STEP_NUM_TASKS`` is set for ``srun`` steps only, so a batch script that runs
    ``mt-train`` once is accepted.
    """
    if "WORLD_SIZE" in env or "RANK" in env:
        return
    for name in TASK_COUNTS:
        try:
            tasks = int(env.get(name, "1"))
        except ValueError:
            continue
        if tasks > 1:
            raise LauncherError(
                f"{name}={tasks}: {tasks} tasks were started without torchrun, and each would "
                "train alone on the same run_dir. Start one task per node that runs torchrun: "
                "srun --ntasks-per-node=1 torchrun --nnodes=$SLURM_NNODES "
                "--nproc_per_node=GPUS_PER_NODE --rdzv_backend=c10d --rdzv_id=$SLURM_JOB_ID "
                "--rdzv_endpoint=$HEAD_NODE:29500 -m mt train ... (one machine: torchrun "
                "--standalone --nproc_per_node=N -m mt train ...)"
            )


def init_control_group(timeout: datetime.timedelta) -> None:
    """After ``init_process_group``: a gloo group for the control collectives when the default
    backend is not gloo (NCCL); under gloo the default group serves. Every rank must call it."""
    global _CONTROL
    _CONTROL = None
    if dist.get_backend() != "gloo":
        _CONTROL = dist.new_group(backend="gloo", timeout=timeout)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    """Wait for every rank (no-op in a single process); host-side, on the control group."""
    if is_initialized():
        dist.barrier(group=_CONTROL)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over ranks in place and return it (no-op in a single process)."""
    if is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather_object(obj: object) -> list:
    """``[obj of rank 0, obj of rank 1, ...]`` on every rank (``[obj]`` in a single process)."""
    if not is_initialized():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=_CONTROL)
    return out


class RankError(RuntimeError):
    """Another rank failed a check that every rank had to pass (its message is included)."""


def check_all(error: BaseException | None, what: str) -> None:
    """Stop every rank together when any rank failed ``what``: each passes its own outcome
    (None: passed); a rank that failed raises its error, the others a :class:`RankError` with
    every failed rank's message, instead of hanging at the next collective until the timeout."""
    errors = all_gather_object(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    if failed:
        raise RankError(f"{what} failed on another rank: " + " | ".join(failed))


def decide_on_rank0(decide: Callable[[], T], what: str = "rank 0's decision") -> T:
    """``decide()`` run on rank 0 alone, and its result (picklable) on every rank: one choice
    (a lock taken, a precision measured, the checkpoint to resume) every rank follows. Where it
    raises on rank 0, the other ranks raise a :class:`RankError` quoting it (``what`` names the
    decision) instead of waiting at the next collective until the timeout."""
    if not is_initialized():
        return decide()
    error, outcome = None, None
    if dist.get_rank() == 0:
        try:
            outcome = ("ok", decide())
        except Exception as err:  # every rank stops, not only rank 0
            error, outcome = err, ("error", f"{type(err).__name__}: {err}")
    box = [outcome]
    dist.broadcast_object_list(box, src=0, group=_CONTROL)
    status, value = box[0]
    if error is not None:
        raise error
    if status == "error":
        raise RankError(f"{what} failed on rank 0: {value}")
    return value


def max_over_ranks(values: list[float]) -> list[float]:
    """Each value's maximum over ranks, in one host-side collective on the control group (no
    GPU synchronisation: the training loop calls it every update)."""
    if not is_initialized():
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_CONTROL)
    return t.tolist()


def wrap(model: torch.nn.Module, info: DistInfo) -> torch.nn.Module:
    """Wrap the model in DistributedDataParallel when there are several ranks.

    No buffer sync before each forward: the model's only buffers are constants (the sinusoidal
    positions) (``forward_sync_buffers=False`` since torch 2.13, ``broadcast_buffers=False``
    before it, which 2.13 deprecates). ``gradient_as_bucket_view``: gradients live in DDP's
    all-reduce buckets instead of being copied into them and back.
    """
    if not info.distributed:
        return model
    import inspect

    from torch.nn.parallel import DistributedDataParallel as DDP

    no_sync = "forward_sync_buffers"
    if no_sync not in inspect.signature(DDP.__init__).parameters:  # torch before 2.13
        no_sync = "broadcast_buffers"
    ids = [info.device.index] if info.device.type == "cuda" else None
    return DDP(model, device_ids=ids, gradient_as_bucket_view=True, **{no_sync: False})


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside the DDP wrapper (:func:`wrap`) and ``torch.compile``'s, if any."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    while True:
        if isinstance(model, DDP):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):  # compiled
            model = model._orig_mod
        else:
            return model


def no_sync(model: torch.nn.Module, skip: bool):
    """``model.no_sync()`` when ``skip`` and the model is DDP (accumulation steps before the
    last one need no gradient all-reduce); otherwise a null context."""
    if skip and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


def cleanup() -> None:
    """Leave the process group (safe to call twice or without one).

    What still holds the group should be let go first (a DDP wrapper's reducer does): its
    objects are collected here before the group is destroyed. Freed after it, gloo's
    destructor once hung joining its thread (a test that wrapped a model in one process)."""
    global _CONTROL
    _CONTROL = None
    if is_initialized():
        import gc

        gc.collect()  # unreachable wrappers (in reference cycles) release the group now
        dist.destroy_process_group()
