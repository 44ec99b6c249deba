"""torch.distributed in one place: who am I, and the global batch for the contrastive terms.

Under ``torchrun`` (or ``accelerate launch``) each process holds a shard of the
batch. SCL, ACL-Embed and ACL-CL are losses over *sets* of items, so computed on a
shard they are different losses from the single-process ones. :func:`gather_with_grad`
concatenates every rank's tensor in rank order and keeps the autograd path back to
the local shard (``torch.distributed.nn.functional.all_gather``), so the loss over
the gathered set is the global-batch loss and each rank's backward gives its share
of its gradient. Without an initialised process group every function is the
identity / a no-op, so single-process code calls them unconditionally.

Also here: joining a launcher's process group (:func:`init_from_env`: gloo on CPU, nccl on
CUDA), the per-process share of the global batch (:func:`local_batch_size`, :func:`shard`),
:func:`all_reduce_mean` (the ``reduce`` that ACL-Grad takes), and the small object
collectives the trainer needs (broadcast, gather, barrier, "any rank asked to stop").

This module knows only tensors and the process group.
"""
from __future__ import annotations

import gc
import os
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist

from .config import DIST_BACKENDS as BACKENDS
from .errors import AclLabError, bad_value



def is_distributed() -> bool:
    """True when a process group is initialised with more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    """Number of processes (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main() -> bool:
    """Rank 0: the one process that writes files and shows progress."""
    return rank() == 0


def gather_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0 in rank order, differentiable w.r.t. the local shard.

    Shards must have equal shapes (the sampler gives every rank the same micro-batch size).
    Integer tensors (labels) need no gradient and go through the plain ``all_gather``.
    """
    if not is_distributed():
        return tensor
    if tensor.is_floating_point() and tensor.requires_grad:
        from torch.distributed.nn.functional import all_gather

        with warnings.catch_warnings():
            # deprecated in favour of a private functional API; it is still the public, documented autograd gather
            warnings.simplefilter("ignore", FutureWarning)
            return torch.cat(all_gather(tensor), dim=0)
    parts = [torch.empty_like(tensor) for _ in range(world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts, dim=0)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place and return it (identity in one process)."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """Average ``tensor`` over ranks in place and return it (identity in one process).

    The reduce function ACL-Grad takes (:class:`acl_lab.grad.ACLGrad`, ``reduce=``) so that every
    process decides on the global gradients: the mean of the per-process gradients is the gradient
    of the global-batch loss when every process holds an equal shard (the DDP convention).
    """
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        tensor.div_(world_size())
    return tensor


def local_rank() -> int:
    """This process's index on its machine (``LOCAL_RANK`` set by torchrun / accelerate; 0 otherwise)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def launched_world_size() -> int:
    """The world size a launcher asked for (``WORLD_SIZE`` set by torchrun / accelerate), 1 when not launched."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_from_env(device: torch.device, backend: str = "auto") -> torch.device:
    """Join the process group a launcher set up (torchrun, ``accelerate launch``); return this process's device.

    Without a launcher (``WORLD_SIZE`` unset or 1) nothing happens and ``device`` is returned. Under a
    launcher the backend is ``gloo`` on CPU and ``nccl`` on CUDA (``backend="auto"``); each process takes
    the GPU ``cuda:LOCAL_RANK``. An already initialised group (e.g. by accelerate) is used as it is.
    Raises :class:`AclLabError` for ``nccl`` without a visible GPU, or an unknown backend.
    """
    if launched_world_size() <= 1 and not (dist.is_available() and dist.is_initialized()):
        if backend == "nccl" and not torch.cuda.is_available():
            raise _nccl_without_gpu()
        return device
    if backend not in BACKENDS:
        raise bad_value("dist_backend", backend, BACKENDS, "use 'auto' (gloo on CPU, nccl on CUDA).")
    if backend == "nccl" and (device.type != "cuda" or not torch.cuda.is_available()):
        raise _nccl_without_gpu()
    if device.type == "cuda":
        if local_rank() >= torch.cuda.device_count():
            raise AclLabError(f"LOCAL_RANK {local_rank()} has no GPU of its own ({torch.cuda.device_count()} visible). "
                              "Fix: launch at most one process per GPU (--nproc_per_node <= number of GPUs).")
        device = torch.device("cuda", local_rank())
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise AclLabError(f"Distributed training runs on CPU (gloo) or CUDA (nccl), not on {device.type!r}. "
                          "Fix: pass --device cpu, or launch one process without torchrun.")
    if not dist.is_initialized():
        chosen = backend if backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
        if chosen == "gloo" and device.type == "cuda":
            raise AclLabError("dist_backend 'gloo' with CUDA tensors is not supported by this trainer. "
                              "Fix: use --dist-backend auto (nccl on CUDA) or --device cpu.")
        dist.init_process_group(backend=chosen, device_id=device if device.type == "cuda" else None)
    return device


def _nccl_without_gpu() -> AclLabError:
    return AclLabError("dist_backend 'nccl' needs CUDA GPUs, but none is visible. "
                       "Fix: use --dist-backend auto or gloo on CPU, or run on a machine with GPUs.")


def local_batch_size(global_batch_size: int) -> int:
    """The per-process share of a global batch; :class:`AclLabError` when it does not divide evenly."""
    ws = world_size()
    if global_batch_size % ws:
        raise AclLabError(f"batch_size {global_batch_size} is the global batch and must be divisible by the world "
                          f"size {ws} (each process gets an equal shard). Fix: use --batch-size "
                          f"{max(ws, global_batch_size - global_batch_size % ws)} or launch a number of processes "
                          f"that divides {global_batch_size}.")
    return global_batch_size // ws


def shard(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """This rank's rows of a global batch: rows ``[r * n / W, (r + 1) * n / W)`` of every tensor.

    Every rank iterates the same seeded global batches and keeps its slice, so the rank-ordered
    concatenation of the shards (what :func:`gather_with_grad` returns) is the global batch in the
    single-process order. Returns None for a batch whose size is not divisible by the world size
    (the last, partial batch of an epoch): the caller skips it on every rank alike.
    """
    ws = world_size()
    if ws == 1:
        return batch
    n = len(next(iter(batch.values())))
    if n % ws:
        return None
    size, r = n // ws, rank()
    return {k: v[r * size:(r + 1) * size] for k, v in batch.items()}


def barrier() -> None:
    """Wait for every rank (no-op in one process)."""
    if is_distributed():
        dist.barrier()


def shutdown() -> None:
    """Leave the process group together and close it (no-op without one): a barrier, ``destroy_process_group``,
    then a garbage collection that frees the group object itself.

    ``destroy_process_group`` only drops c10d's own references. The trainers' DDP wrappers and reducers (and the
    Hugging Face Trainer's reference cycles) still hold the gloo group, so without the collection it would be
    destroyed during interpreter finalization, where tearing down gloo's worker threads can abort the process
    ("terminate called without an active exception", exit code -6) after its work is done: seen in CI on
    tests/test_hf.py's torchrun test (pytorch/pytorch#179291 describes the same crash). Measured with a weak
    reference in tests/hf_ddp_worker.py: alive after ``destroy_process_group``, freed by ``gc.collect()``. A group
    that something live still holds gets a warning naming the risk.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size() > 1:
        dist.barrier()
    group = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    if group() is not None:
        warnings.warn("torch.distributed: the process group is still referenced after destroy_process_group, so "
                      "gloo closes it at interpreter exit, where it can abort the process. Fix: drop references "
                      "to trainers and DDP-wrapped models before acl_lab.distributed.shutdown().", RuntimeWarning)


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (identity in one process)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (``[obj]`` in one process)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is True on any (one tiny all-reduce), e.g. a stop request."""
    if not is_distributed():
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
