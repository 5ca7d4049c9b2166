"""Agreement between ranks on an adaptive size: one collective per attempt.

Under ``torch.distributed`` an OOM on one rank must move *every* rank to the
same smaller size, or the ranks run different batches (and, with gradient
synchronisation, wait on each other forever). After each attempt of an
adaptive call, every rank calls :func:`agree` exactly once with

- the size it proposes next (the size it just ran after a success, the
  policy's smaller size after an OOM, ``0`` when it has nothing smaller), and
- whether it ran out of memory,

and one ``all_reduce(MIN)`` over the two int64 values ``[proposal, -oom]``
returns the smallest proposal and whether *any* rank ran out of memory. All
ranks then take the same decision: done, retry at the agreed size, or give up
together. That is the one collective oomguard adds per attempt (16 bytes); on
the path without an OOM it is one collective per call. An adaptive object
also agrees once on its starting size the first time it runs under
``torch.distributed`` (so ranks started with different sizes converge).

Requirements: every rank calls the adaptive function the same number of
times, and the function itself runs no collective (an OOM on one rank between
two collectives would leave the others waiting). With DDP, run the
micro-batches under ``model.no_sync()`` with ``broadcast_buffers=False`` and
synchronise gradients afterwards with :func:`all_reduce_gradients`.

When ``torch.distributed`` is not available or not initialised, :func:`agree`
returns its inputs and costs nothing.

:class:`RankAgreement` is how this plugs into the core's
:class:`~oomguard.engine.core.controller.SizeController`: it is the controller's
``agreement`` strategy (the core's default, for one process, agrees with
nobody).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

Sizes = dict[str, int]


@dataclass(frozen=True)
class Agreement:
    """What all ranks agreed on: the smallest proposed size and whether any rank hit an OOM."""

    size: int
    any_oom: bool


def is_active() -> bool:
    """True when ``torch.distributed`` is available and a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def _collective_device(group: Any = None) -> torch.device:
    """NCCL reduces CUDA tensors only; every other backend takes CPU tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(proposed: int, oom: bool, group: Any = None) -> Agreement:
    """Agree with every rank of ``group`` on the next size: one ``all_reduce(MIN)``.

    ``proposed`` is this rank's next size in items (0: it cannot go lower);
    ``oom`` whether its last attempt ran out of memory. Without an initialised
    process group this returns ``Agreement(proposed, oom)`` and communicates
    nothing.
    """
    if not is_active():
        return Agreement(proposed, oom)
    size, flag = _min_over_ranks([proposed, -int(oom)], group)
    return Agreement(size, flag < 0)


def _min_over_ranks(values: list[int], group: Any) -> list[int]:
    """The element-wise minimum of ``values`` over the ranks: one ``all_reduce(MIN)``."""
    tensor = torch.tensor(values, dtype=torch.int64, device=_collective_device(group))
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return [int(v) for v in tensor.tolist()]


class RankAgreement:
    """The ranks of ``group`` agree on a size after every attempt: one ``all_reduce(MIN)``.

    The agreement strategy of a
    :class:`~oomguard.engine.core.controller.SizeController` under
    ``torch.distributed``: the reduced vector is the proposed sizes and
    ``-oom`` (16 bytes for one size). Inactive, and free, while no process
    group is initialised.
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group

    def active(self) -> bool:
        return is_active()

    def agree(self, proposal: Mapping[str, int], oom: bool) -> tuple[Sizes, bool]:
        *sizes, flag = _min_over_ranks([*proposal.values(), -int(oom)], self.group)
        return dict(zip(proposal, sizes, strict=True)), flag < 0


def all_reduce_gradients(params: Iterable[torch.Tensor], group: Any = None,
                         average: bool = True) -> None:
    """Sum (or average, the DDP convention) the ``.grad`` of ``params`` over all ranks.

    The gradients are flattened into one buffer so this is one collective,
    whatever the number of parameters. A parameter without a gradient counts
    as zeros (every rank must contribute the same buffer). A no-op outside
    ``torch.distributed``.
    """
    if not is_active():
        return
    params = [p for p in params if p.requires_grad]
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads]).to(_collective_device(group))
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    if average:
        flat /= dist.get_world_size(group)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n
