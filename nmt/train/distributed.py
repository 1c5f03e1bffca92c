"""Process-group setup for `torchrun` and the self-relaunch behind `nmt train --gpus N`.

One node, N processes: `nmt train DATA --gpus N` (or `--nproc N` on CPU) re-executes itself
under `torch.distributed.run` with `--nproc_per_node N`. Multi-node: start the same command
on every node through torchrun's rendezvous flags, e.g. on each of 2 nodes

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d \\
        --rdzv_endpoint HOST0:29500 --rdzv_id myrun -m nmt.cli.main train DATA -o RUN ...

(or `nmt train ... --gpus 8 --nnodes 2 --rdzv-endpoint HOST0:29500`, which passes them
on). torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; `init_distributed` reads them and picks
NCCL on CUDA, gloo on CPU. Rank 0 alone writes RUN and takes every decision that depends on
its files (resume or not, from which update); the other ranks follow its broadcast, so ranks
never diverge into different collectives. A resume needs every rank to read the checkpoint
rank 0 chose: RUN must be on a file system shared by every node.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import hashlib
import inspect
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from nmt.config import ModelConfig, TrainConfig
from nmt.errors import DistributedError, Preempted

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from nmt.data.dataset import ParallelData


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0 alone writes checkpoints and logs."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        """True when a process group with more than one member is running."""
        return self.world_size > 1


@contextlib.contextmanager
def peer_failures_as_errors() -> Iterator[None]:
    """Under torchrun, turn a collective that fails because a peer died (gloo/NCCL raise
    DistBackendError or RuntimeError "Connection closed by peer") into one DistributedError
    line instead of a traceback; the launcher then names the dead rank."""
    try:
        yield
    except RuntimeError as err:
        text = str(err)
        backend_error = getattr(torch.distributed, "DistBackendError", ())
        if under_torchrun() and (isinstance(err, backend_error) or any(
                marker in text for marker in _PEER_FAILURE_MARKERS)):
            rank = os.environ.get("RANK", "?")
            first = text.strip().splitlines()[0][:200] if text.strip() else type(err).__name__
            raise DistributedError(f"rank {rank}: a peer process died or stopped answering "
                                   f"({first})") from err
        raise


_PEER_FAILURE_MARKERS = ("Connection closed by peer", "Connection reset by peer",
                         "NCCL communicator was aborted", "Broken pipe")


def under_torchrun() -> bool:
    """True inside a process started by torchrun / torch.distributed.run."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def init_distributed(device_type: str, timeout_minutes: float = 30.0) -> DistEnv:
    """Join the process group torchrun set up (no-op for a single process)."""
    if not under_torchrun() or int(os.environ["WORLD_SIZE"]) == 1:
        return DistEnv()
    env = DistEnv(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                  int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        # torch._dynamo (imported by the first optimizer) keeps references to a process
        # group that exists when it is first imported, so destroy_process_group could not
        # free it: gloo's worker threads then outlived Python and aborted the process at
        # exit now and then (SIGABRT, "terminate called without an active exception").
        # Imported first, it holds none and `shutdown` ends the threads.
        import torch._dynamo
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(env.local_rank)
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes))
        except Exception as err:  # RuntimeError / DistNetworkError variants
            raise DistributedError(f"rank {env.rank}: cannot join the process group "
                                   f"({str(err).splitlines()[0]}); check MASTER_ADDR/PORT "
                                   "and that every rank started") from err
    return env


def shutdown(env: DistEnv) -> None:
    """Leave the process group and free it, which ends gloo's worker threads.

    A process group still referenced at interpreter exit keeps those threads alive while
    Python finalizes; one that is just releasing a finished collective's tensors then needs
    the GIL and aborts the process ("terminate called without an active exception",
    pytorch issue 190489). The callers drop their own references (DDP) first; the
    collection frees any left in reference cycles.
    """
    if env.active and dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()


def broadcast_object(env: DistEnv, obj: Any) -> Any:
    """Rank 0's `obj` on every rank (a decision taken once, e.g. whether to resume)."""
    if not env.active:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(env: DistEnv, obj: Any) -> list[Any]:
    """Every rank's `obj` (e.g. RNG states) on every rank, in rank order."""
    if not env.active:
        return [obj]
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def fingerprint(model_cfg: ModelConfig, cfg: TrainConfig, precision: str,
                device: torch.device, deferred: bool, train: ParallelData,
                valid: ParallelData | None, vocab_proto: bytes) -> dict[str, Any]:
    """What every rank must see alike: resolved settings and precision, data sizes,
    vocabulary. Another DATA, recipe, flag or GPU type on one node would otherwise take
    a different sequence of collectives (a hang until the timeout) or mix fp16 and
    bf16 gradients silently."""

    def sizes(data: ParallelData | None) -> list[int] | None:
        if data is None:
            return None
        return [len(data), int(data.src.lengths.sum()), int(data.tgt.lengths.sum())]

    return {
        "model config": model_cfg.to_dict(), "settings": cfg.to_dict(),
        "precision": precision, "device type": device.type,
        # The two read-backs order their collectives differently (nmt/train/readback.py).
        "statistics read": "deferred" if deferred else "in-line",
        "train split (pairs, source tokens, target tokens)": sizes(train),
        "valid split (pairs, source tokens, target tokens)": sizes(valid),
        "vocabulary sha256": hashlib.sha256(vocab_proto).hexdigest(),
    }


def check_ranks_agree(env: DistEnv, mine: dict[str, Any]) -> None:
    """Compare every rank's `fingerprint` with rank 0's; the first difference stops every
    rank at once with one line naming the rank and what differs (exit 8)."""
    prints = gather_objects(env, mine)
    for rank, other in enumerate(prints[1:], start=1):
        for key, value in other.items():
            first = prints[0][key]
            if value == first:
                continue
            if isinstance(value, dict) and isinstance(first, dict):
                field_ = next(k for k in sorted(set(value) | set(first))
                              if value.get(k) != first.get(k))
                key, value, first = f"{key}: {field_}", value.get(field_), first.get(field_)
            raise DistributedError(
                f"rank {rank} differs from rank 0 in its {key} ({value!r} vs {first!r}); "
                "every rank must see the same DATA, recipe, flags and GPU type")


def data_parallel(model: torch.nn.Module, env: DistEnv, device: torch.device
                  ) -> torch.nn.Module:
    """`model` itself in a single process, else wrapped in DDP. The only buffers are the
    fixed sinusoid tables (and cached masks): nothing to broadcast every forward.
    Gradients live in DDP's buckets (no second copy)."""
    if not env.active:
        return model
    ids = [device.index] if device.type == "cuda" else None
    # `forward_sync_buffers` where torch has it (it deprecated `broadcast_buffers` in 2.13,
    # with a FutureWarning on every rank), else `broadcast_buffers` (asked of the class
    # itself, not of whatever wraps the name). Buffers still agree at start either way:
    # every rank builds the same sinusoid tables.
    params = inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
    no_sync = "forward_sync_buffers" if "forward_sync_buffers" in params \
        else "broadcast_buffers"
    return DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True,
                                   **{no_sync: False})


LAUNCH_FLAGS = ("--gpus", "--nproc", "--nnodes", "--rdzv-endpoint")


def strip_launch_flags(argv: list[str]) -> list[str]:
    """ARGV without the flags only the launcher needs (`--gpus 2`, `--nproc=2`, ...):
    the children run under torchrun already, and torchrun's own parser would otherwise
    take `--nproc` for its `--nproc-per-node`."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in LAUNCH_FLAGS:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def relaunch(nproc: int, argv: list[str], nnodes: int = 1, rdzv_endpoint: str | None = None,
             rdzv_id: str = "nmt") -> int:
    """Run `python -m nmt.cli.main ARGV` under torch.distributed.run with `nproc` per node.

    The children see WORLD_SIZE and so do not relaunch again. Returns torchrun's exit code;
    SIGTERM (or SIGUSR1) to this launcher reaches every rank, which saves and stops
    (nmt.train.preempt), and raises Preempted here.
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = ["--nproc_per_node", str(nproc), "--nnodes", str(nnodes)]
    if rdzv_endpoint:
        args += ["--rdzv_backend", "c10d", "--rdzv_endpoint", rdzv_endpoint, "--rdzv_id", rdzv_id]
    else:
        args += ["--standalone"]
    args += ["-m", "nmt.cli.main", *strip_launch_flags(argv)]
    try:
        torchrun.main(args)
    except SystemExit as exc:  # torchrun exits on child failure
        return int(exc.code or 0)
    except ChildFailedError as err:
        return _child_failure_code(err)
    except SignalException as err:  # torchrun passed the signal on and waited for the ranks
        raise Preempted(f"the launcher got {err.sigval.name}: every rank saved at its next "
                        "update and stopped (see above); run the same command to "
                        "resume") from err
    except Exception as err:
        raise DistributedError(f"a training process failed: {str(err).splitlines()[0]}; "
                               "see its traceback above") from err
    sys.stderr.flush()
    return 0


def _child_failure_code(err: ChildFailedError) -> int:
    """The launcher's exit code when a rank failed; raises DistributedError when it died.

    A rank that exited by itself with a code (an nmt error: it printed its own one-line
    message; 1: a bug, with its traceback) passes that code on. A rank killed by a signal
    (OOM killer, kill -9, a node going away) could say nothing, so the launcher names it.
    torchrun's agent has already stopped the other ranks (SIGTERM, then SIGKILL), so none
    is left waiting in a collective.
    """
    dead = {rank: f for rank, f in err.failures.items() if f.exitcode < 0}
    if not dead:  # prefer an nmt error code (2-8) over a peer's follow-on crash (1)
        codes = sorted(int(f.exitcode) for f in err.failures.values())
        return next((c for c in codes if c != 1), codes[0])
    rank = min(dead, key=lambda r: dead[r].timestamp)
    failure = dead[rank]
    others = sorted(r for r in err.failures if r != rank)
    stopped = f" (rank(s) {', '.join(map(str, others))} failed too)" if others else ""
    raise DistributedError(f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) "
                           f"died from {failure.signal_name()}{stopped}; the other ranks were "
                           "stopped; resume with the same command (the last checkpoint is "
                           "intact)")
