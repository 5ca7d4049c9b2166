"""Agreement between ranks on an adaptive size: one collective per attempt.

An OOM on one rank must move *every* rank to the same smaller size, or the ranks run different
batches and wait on each other forever. After each attempt one ``all_reduce(MIN)`` over
``[proposal, -oom]`` gives every rank the same decision. The calls are collective: every rank
makes them in the same order, and the wrapped function runs no collective itself.
``sync_ranks=False`` makes none (each rank keeps its own size).

A call made on some ranks only would block until the backend's timeout, so the first call of
each adaptive object checks through the store, not a collective, that every rank makes it
(:func:`check_every_rank_calls`; why: docs/measurements.md#rank-presence-check).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from oomguard.engine.core.execute.priced import RemedyChoice, configuration
from oomguard.engine.errors import CollectiveMismatch
from oomguard.engine.util.faster import fastest

log = logging.getLogger("oomguard.distributed")

Sizes = dict[str, int]

# Seconds the first call of an adaptive object waits for every rank to make it too; raise it when
# the work before a first call (loading data) differs between ranks by more.
FIRST_CALL_TIMEOUT_S = 60.0

# Per process group: first calls made so far, the same count on every rank (as a collective's order).
_first_calls: dict[str, int] = {}


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
    """Agree with every rank of ``group`` on the next size: ``proposed`` is this rank's next size in
    items (0: it cannot go lower), ``oom`` whether its last attempt ran out of memory."""
    if not is_active():
        return Agreement(proposed, oom)
    size, flag = _min_over_ranks([proposed, -int(oom)], group)
    return Agreement(size, flag < 0)


# A rate no rank measured because its plain step fit the whole batch ("not needed"): it
# does not bound the agreed rate (milli-samples per second).
_UNBOUNDED = 2**62


def agree_remedy(choice: RemedyChoice, group: Any = None) -> RemedyChoice:
    """One configuration and one micro-batch for every rank of ``group``, from each rank's
    :class:`~oomguard.engine.core.execute.priced.RemedyChoice` (the same remedies, so the
    same rows): per configuration, the smallest micro-batch any rank found safe, the
    slowest rank's rate (a row a rank did not need, its plain step fitting the whole batch,
    fits there at the whole batch and bounds nothing) and the largest spread of any rank's
    timings, so that every rank compares the same numbers; the choice then follows
    :func:`~oomguard.engine.util.faster.fastest`, as each rank's own did. Ranks that chose
    alike change nothing but, where smaller elsewhere, the micro-batch. Ranks whose choices
    differ would run different numbers of backward passes per step, and a data-parallel
    step waits for each one on every rank. One ``all_reduce(MIN)``; outside
    ``torch.distributed``, ``choice`` itself."""
    if not is_active():
        return choice
    table = choice.table
    micro = [r.micro_batch or 0 if r.status != "not needed" else choice.rows for r in table]
    rate = [_UNBOUNDED if r.status == "not needed" else round(1000 * r.samples_per_second)
            if r.samples_per_second and r.status in ("chosen", "measured") else 0 for r in table]
    spread = [-round(1e6 * (r.spread or 0.0)) for r in table]
    n = len(table)
    agreed = _min_over_ranks([n, -n, *micro, *rate, *spread], group)
    if agreed[0] != -agreed[1]:
        raise CollectiveMismatch("ranks priced different remedies; give every rank the same "
                                 "remedies=")
    micro, rate = agreed[2:2 + n], agreed[2 + n:2 + 2 * n]
    spread = [-s / 1e6 for s in agreed[2 + 2 * n:]]
    candidates = [i for i in range(n) if micro[i] > 0 and 0 < rate[i] < _UNBOUNDED]
    best = fastest([rate[i] / 1000 for i in candidates], [spread[i] for i in candidates])
    if best is None:
        raise CollectiveMismatch("no configuration was measured safe on every rank: run "
                                 "every rank on the same device and budget, or without "
                                 "remedies=")
    row = table[candidates[best]]
    if row.configuration == choice.chosen.name and micro[candidates[best]] == choice.micro_batch:
        return choice
    table = [dataclasses.replace(r, status="measured" if r.status == "chosen" else r.status)
             for r in table]  # copies: the choice remembered for this rank stays as it was
    row = table[candidates[best]]
    row.status, row.why = "chosen", f"agreed by {dist.get_world_size(group)} ranks"
    log.info("%s: ranks agreed on %s at micro-batch %d (this rank chose %s at %d)",
             choice.workload, row.configuration, micro[candidates[best]], choice.chosen.name,
             choice.micro_batch)
    return dataclasses.replace(choice, table=table, chosen=configuration(row.configuration),
                               micro_batch=micro[candidates[best]])


def _min_over_ranks(values: list[int], group: Any) -> list[int]:
    """The element-wise minimum of ``values`` over the ranks: one ``all_reduce(MIN)``."""
    tensor = torch.tensor(values, dtype=torch.int64, device=_collective_device(group))
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return [int(v) for v in tensor.tolist()]


def check_every_rank_calls(what: str, group: Any = None) -> None:
    """Return once every rank of ``group`` has made this call, within
    :data:`FIRST_CALL_TIMEOUT_S` seconds: each rank sets one key in the default process
    group's store and waits for the others'. A rank that waits in vain withdraws its key
    and raises :class:`~oomguard.engine.errors.CollectiveMismatch` naming ``what`` and the
    missing ranks; the process group stays usable."""
    if not is_active():
        return
    pg = group if group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(pg)
    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, ValueError, KeyError):  # a private function: absent in some torch
        return
    if len(ranks) < 2:
        return
    me = dist.get_rank()
    n = _first_calls.get(pg.group_name, 0)
    prefix = f"oomguard/first-call/{pg.group_name}/{n}/"
    store.set(prefix + str(me), b"1")
    try:
        store.wait([prefix + str(r) for r in ranks], timedelta(seconds=FIRST_CALL_TIMEOUT_S))
    except RuntimeError:  # DistStoreError: a timeout (any other store failure re-raises below)
        missing = [r for r in ranks if not store.check([prefix + str(r)])]
        if missing:
            # Withdraw, so that a later call made by every rank pairs up again.
            store.delete_key(prefix + str(me))
            raise CollectiveMismatch(
                f"{what}: oomguard's adaptive sizes are collective under torch.distributed: "
                f"every rank of the process group must make this call, but rank(s) "
                f"{', '.join(map(str, missing))} did not within {FIRST_CALL_TIMEOUT_S:g} s (rank {me} did). "
                "Call it on every rank, or pass sync_ranks=False so that each rank keeps "
                "its own size; the process group is untouched (no collective was made)"
            ) from None
    _first_calls[pg.group_name] = n + 1


class RankAgreement:
    """A size controller's ``agreement`` between the ranks of ``group`` (every size at once);
    the first :meth:`active` under ``torch.distributed`` runs :func:`check_every_rank_calls`."""

    def __init__(self, group: Any = None, what: str = "an adaptive size") -> None:
        self.group = group
        self.what = what
        self.checked = False

    def active(self) -> bool:
        if not is_active():
            return False
        if not self.checked:
            check_every_rank_calls(self.what, self.group)
            self.checked = True
        return True

    def agree(self, proposal: Mapping[str, int], oom: bool) -> tuple[Sizes, bool]:
        *sizes, flag = _min_over_ranks([*proposal.values(), -int(oom)], self.group)
        return dict(zip(proposal, sizes, strict=True)), flag < 0


def all_reduce_gradients(params: Iterable[torch.Tensor], group: Any = None,
                         average: bool = True) -> None:
    """Sum (or average, the DDP convention) the ``.grad`` of ``params`` over all ranks, in one
    collective over one flat buffer. A parameter without a gradient counts as zeros (every
    rank must contribute the same buffer). A no-op outside ``torch.distributed``."""
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
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))
