"""Two ranks on gloo, one under a tighter budget: both take the same micro-batch size.

Each rank is a spawned process that warms up (a small step and one collective),
then enters its own CPU budget: rank 0 has plenty, rank 1 runs out of memory
on the whole batch and on half of it. The agreement (one all_reduce per
attempt) must move rank 0 to rank 1's size; both finish, and their parameters
equal a single-process reference of the same data-parallel steps.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import budget_after_warmup
from test_accumulate import mlp, regression_step, rows

from oomguard.engine.training.accumulate import Accumulator
from oomguard.engine.training.adaptive import stats
from oomguard.engine.training.distributed import agree, all_reduce_gradients

MiB = 1024**2
STEPS, ROWS = 3, 64
BUDGETS = (512 * MiB, 32 * MiB)  # per rank; 64 and 32 long rows (~1.5 MiB each) do not fit in 32 MiB
TIMEOUT_S = 90


def batch_for(rank: int, step: int) -> dict:
    return rows(0, ROWS, seed=100 * rank + step)


def worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        acc = Accumulator(regression_step(model), model)

        def warm_up() -> None:
            regression_step(model)(rows(0, 2)).backward()
            agree(1, False)
            all_reduce_gradients(model.parameters())

        sizes = []
        with budget_after_warmup(BUDGETS[rank], warm_up):
            for step in range(STEPS):
                acc(batch_for(rank, step))
                all_reduce_gradients(model.parameters())
                optimizer.step()
                sizes.append(acc.micro_batch_size)
        s = stats()[acc.size.name]  # the registry and the controller's own record agree
        assert s.peer_ooms == acc.size.stats.peer_ooms and s.ooms == acc.size.stats.ooms
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        torch.save(flat, Path(out) / f"params{rank}.pt")
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(
            {"sizes": sizes, "ooms": s.ooms, "peer_ooms": s.peer_ooms}))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference_params() -> torch.Tensor:
    """The same data-parallel steps in one process, whole batches, no budget."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        summed = None
        for rank in range(len(BUDGETS)):
            model.zero_grad(set_to_none=True)
            regression_step(model)(batch_for(rank, step)).backward()
            g = [p.grad.clone() for p in model.parameters()]
            summed = g if summed is None else [a + b for a, b in zip(summed, g, strict=True)]
        for p, g in zip(model.parameters(), summed, strict=True):
            p.grad = g / len(BUDGETS)
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.integration
def test_two_ranks_agree_on_the_size_and_the_parameters(tmp_path):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.spawn(worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=False)
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise AssertionError(f"the ranks did not finish within {TIMEOUT_S} s (a hang?)")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["sizes"] == r1["sizes"]  # every step, both ranks ran the same micro-batch size
    assert r1["sizes"][0] < ROWS // 2  # rank 1 really ran out of memory at 64 and 32
    assert r1["ooms"] >= 2 and r0["ooms"] == 0 and r0["peer_ooms"] >= 2
    p0, p1 = (torch.load(tmp_path / f"params{r}.pt") for r in (0, 1))
    assert torch.equal(p0, p1)
    ref = reference_params()
    assert float((p0 - ref).norm() / ref.norm()) <= 1e-5
