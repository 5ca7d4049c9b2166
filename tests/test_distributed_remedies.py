"""Two ranks on gloo price remedies under different real CPU budgets and train in one
configuration at one micro-batch (engine/training/distributed.py ``agree_remedy``).

Rank 0 has room: its plain step fits the whole batch, so it chooses plain accumulation and
needs nothing else. Rank 1 is tight: a checkpointed step fits far more rows than a plain
one, and it chooses checkpointing. Left alone, the ranks would run different
configurations and different numbers of backward passes per step, which a data-parallel
step waits for on every rank. Agreed, both run rank 1's choice: rank 0 did not need
checkpointing, so its rows bound nothing there.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_distributed import _exit_now, free_port, run_ranks
from test_remedies_priced import WORKLOADS, Net

from oomguard.engine.core.execute.priced import choose_remedy
from oomguard.engine.integrations.sizing import priced_split

MiB = 1024**2
BUDGETS_MIB = (256, 28)  # rank 0: room for the whole batch; rank 1: test_remedies_priced's


def rank_prices(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        vocab, width, length, rows, wait_s, blocks, head = WORKLOADS["loader"]
        torch.manual_seed(0)
        model = Net(vocab, width, blocks(width), head)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        ids = torch.randint(0, vocab, (rows, length))

        def micro_step(n: int) -> torch.Tensor:
            time.sleep(wait_s)
            loss = model(ids[:n])
            loss.backward()
            return loss

        options = {"budget": BUDGETS_MIB[rank] * MiB}
        remedies = ("accumulate", "checkpoint")
        # this rank's own choice (remembered: priced_split's pricing answers from it)
        own = choose_remedy(micro_step, rows, model, optimizer=optimizer, remedies=remedies,
                            name="loader", **options)
        split = priced_split(micro_step, rows, rows, model, optimizer, remedies, "loader",
                             "test", **options)
        (Path(out) / f"rank{rank}.json").write_text(json.dumps({
            "own": [own.chosen.name, own.micro_batch],
            "agreed": [split.remedy.chosen.name, split.remedy.micro_batch],
            "sizes": list(split.sizes),
            "chosen_rows": [r.configuration for r in split.remedy.table
                            if r.status == "chosen"]}))
    finally:
        dist.destroy_process_group()
    _exit_now()


@pytest.mark.slow
def test_ranks_that_price_differently_train_in_one_configuration(tmp_path: Path) -> None:
    run_ranks(rank_prices, (free_port(), str(tmp_path)), 240)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["own"] == ["accumulate", 128], r0  # the plain step fits rank 0's whole batch
    assert r1["own"][0].startswith("checkpoint"), r1  # checkpointing is faster on rank 1
    assert r0["agreed"] == r1["agreed"] and r0["sizes"] == r1["sizes"], (r0, r1)
    # rank 0 did not need checkpointing, so it bounds nothing there: rank 1's choice holds
    assert r0["agreed"] == r1["own"], (r0, r1)
    assert r0["chosen_rows"] == r1["chosen_rows"] == [r0["agreed"][0]]
