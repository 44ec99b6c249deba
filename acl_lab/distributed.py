"""torch.distributed in one place: who am I, and the global batch for the contrastive terms.

Under ``torchrun`` (or ``accelerate launch``) each process holds a shard of the
batch. SCL, ACL-Embed and ACL-CL are losses over *sets* of items, so computed on a
shard they are different losses from the single-process ones. :func:`gather_with_grad`
concatenates every rank's tensor in rank order and keeps the autograd path back to
the local shard (``torch.distributed.nn.functional.all_gather``), so the loss over
the gathered set is the global-batch loss and each rank's backward gives its share
of its gradient. Without an initialised process group every function is the
identity / a no-op, so single-process code calls them unconditionally.

This module knows only tensors and the process group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


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

        return torch.cat(all_gather(tensor), dim=0)
    parts = [torch.empty_like(tensor) for _ in range(world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts, dim=0)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place and return it (identity in one process)."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor



def all_reduce_mean(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The mean over ranks of every tensor in ``tensors``, from ONE coalesced all-reduce (the inputs in one process).

    The tensors are flattened into one buffer of their promoted dtype (so a whole gradient set costs one
    collective, not one per parameter), summed over ranks and divided by the world size; the results are
    views into that buffer, in the inputs' shapes and dtypes. The inputs are not modified (gradients from
    ``autograd.grad`` may be expanded views that cannot be written in place). Every rank must pass the
    same shapes in the same order.
    """
    if not is_distributed() or not tensors:
        return list(tensors)
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    flat = torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= world_size()
    out, offset = [], 0
    for t in tensors:
        out.append(flat[offset:offset + t.numel()].view(t.shape).to(t.dtype))
        offset += t.numel()
    return out
