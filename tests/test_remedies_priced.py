"""Remedies priced by speed (engine/core/execute/priced.py) under real CPU budgets.

Two workloads built to differ, each priced in a fresh process under a real ``RLIMIT_DATA``
budget (the searches' ``budget=``). Each has one fixed cost that decides which way is faster,
a wait (``time.sleep``), so that the outcome does not hang on how busy the machine's cores are
(several test workers share two): the checkpointing, the memory and the budgets are real.

- ``loader``: every micro-batch waits for its data (a loader's delivery) and a large
  embedding's dense gradient takes most of the budget (accumulating needs room for a second
  one); cheap blocks keep large activations. Checkpointing fits the whole batch in one
  micro-batch, accumulation needs four: checkpointing is faster.
- ``costly``: each block's forward waits (a frozen computation that keeps nothing for the
  backward) and a wide head, not the blocks, fills memory: checkpointing fits no more rows and
  recomputes the forwards: accumulation is faster.
"""

from __future__ import annotations

import time

import pytest
import torch
from conftest import in_fresh_process

from oomguard.engine.core.execute.priced import choose_remedy, forget_remedies
from oomguard.engine.errors import UsageError
from oomguard.engine.util.table import text_table
from oomguard.reports.remedies import remedy_rows

MiB = 1024**2


class Cheap(torch.nn.Module):
    """Cheap to recompute, large activations: a norm, a copy four times as wide, a chain of
    elementwise ops on it, and a sum back to the input's width."""

    def __init__(self, width: int, ops: int = 4, wide: int = 4) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.ops, self.wide = ops, wide

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x).repeat(1, 1, self.wide)
        for _ in range(self.ops):
            h = torch.relu(h - 0.01)
        return x + h.unflatten(-1, (self.wide, -1)).sum(-2)


class Costly(torch.nn.Module):
    """Costly to recompute, small activations: a forward that waits ``wait_s`` (a frozen
    computation that keeps nothing for the backward) before one trainable product."""

    def __init__(self, width: int, wait_s: float) -> None:
        super().__init__()
        self.mix = torch.nn.Linear(width, width)
        self.wait_s = wait_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.wait_s)
        return x + torch.tanh(self.mix(x))


class Wide(torch.nn.Module):
    """A head whose activations fill memory: each feature spread over ``spread`` scaled copies
    (cheap to compute, large to keep for the backward)."""

    def __init__(self, spread: int) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, spread))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return (h.unsqueeze(-1) * self.scale).flatten(-2)


class Net(torch.nn.Module):
    """Token ids -> embedding -> blocks -> head -> the mean log-sum-exp of its features."""

    def __init__(self, vocab: int, width: int, blocks: list[torch.nn.Module],
                 head: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(blocks)
        self.head = head if head is not None else torch.nn.Linear(width, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h).logsumexp(-1).mean()


# kind: (vocabulary, width, tokens per row, rows, wait per micro-batch (s), model's blocks)
WORKLOADS = {
    # a 10 MiB embedding: its gradient and, accumulating, a second one take 20 of 28 MiB
    "loader": (40960, 64, 16, 128, 0.12, lambda w: [Cheap(w) for _ in range(8)], None),
    "costly": (256, 16, 32, 4, 0.0, lambda w: [Costly(w, 0.03) for _ in range(4)], Wide(2048)),
}


def priced(kind: str, budget_mib: int) -> dict:
    """In a fresh process: ``kind``'s choice under a budget, the seconds a second call took,
    and whether the model and its gradients are as before."""
    vocab, width, length, rows, wait_s, blocks, head = WORKLOADS[kind]
    torch.manual_seed(0)
    model = Net(vocab, width, blocks(width), head)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    ids = torch.randint(0, vocab, (rows, length))

    def step(n: int) -> None:
        time.sleep(wait_s)  # what every micro-batch costs whatever its rows
        model(ids[:n]).backward()

    before = [p.detach().clone() for p in model.parameters()]
    choice = choose_remedy(step, rows, model, optimizer=optimizer, budget=budget_mib * MiB,
                           name=kind)
    t0 = time.perf_counter()
    again = choose_remedy(step, rows // 2, model, optimizer=optimizer, budget=budget_mib * MiB,
                          name=kind)
    seconds_again = time.perf_counter() - t0
    untouched = all(torch.equal(a, b) and b.grad is None
                    for a, b in zip(before, model.parameters(), strict=True))
    forget_remedies(model)
    return {"choice": choice.to_dict(), "text": text_table(remedy_rows(choice.to_dict())),
            "same": again is choice, "seconds_again": seconds_again, "untouched": untouched}


def _rows(out: dict) -> dict[str, dict]:
    return {r["configuration"]: r for r in out["choice"]["table"]}


@pytest.mark.slow
def test_checkpointing_is_chosen_where_it_is_faster_and_confirmed_and_remembered() -> None:
    out = in_fresh_process(priced, "loader", 28)
    rows, choice = _rows(out), out["choice"]
    assert choice["chosen"].startswith("checkpoint"), out["text"]
    plain, chosen = rows["accumulate"], rows[choice["chosen"]]
    assert plain["samples_per_second"] is not None, out["text"]  # a real comparison
    assert chosen["micro_batch"] == 128 > 4 * plain["micro_batch"] - 4, out["text"]
    assert choice["speedup_over_accumulate"] > 1.2, out["text"]
    assert choice["confirmation"]["ok"] and choice["confirmation"]["peak_bytes"], choice
    # the second call (fewer rows) is answered from memory; the model is as it was
    assert out["same"] and out["seconds_again"] < 0.05
    assert out["untouched"]


@pytest.mark.slow
def test_accumulation_is_chosen_where_recomputing_costs_more() -> None:
    out = in_fresh_process(priced, "costly", 24)
    rows, choice = _rows(out), out["choice"]
    assert choice["chosen"] == "accumulate", out["text"]
    assert rows["accumulate"]["micro_batch"] < 4, out["text"]  # the batch does not fit whole
    for name in ("checkpoint", "checkpoint every 2"):
        assert rows[name]["status"] == "measured", out["text"]
        assert rows[name]["samples_per_second"] < rows["accumulate"]["samples_per_second"]
    assert choice["confirmation"]["ok"]


def test_bad_remedies_are_one_line_before_any_work() -> None:
    net = Net(16, 8, [Cheap(8), Cheap(8)])
    ran = []

    def step(n: int) -> None:
        ran.append(n)

    cases = [
        (dict(remedies=("accumulate", "flash")), "unknown remedy 'flash': use one or more of"),
        (dict(remedies="checkpoint,checkpoint"), "'checkpoint' is given twice"),
        (dict(remedies=()), "no remedy named"),
        (dict(remedies=("bf16",), model=net.double()), "parameters are float64; leave bf16 out"),
        (dict(remedies=("checkpoint",), model=torch.nn.Linear(2, 2)), "has none; leave it out"),
        (dict(remedies=("accumulate",), model=[torch.zeros(1)]), "pass params=model"),
        (dict(remedies=("accumulate",), isolate=True), "pass only budget, margin"),
    ]
    for given, words in cases:
        args = {"model": net} | given
        model = args.pop("model")
        with pytest.raises(UsageError, match=words.replace("(", r"\(")) as info:
            choose_remedy(step, 4, model, **args)
        assert "\n" not in str(info.value)
    assert ran == []


def test_accumulate_and_adaptive_run_the_configuration_chosen() -> None:
    """Where the batch fits whole, one configuration is measured (the others are not needed)
    and the call runs with it: same loss and gradients as without remedies."""
    import oomguard
    from oomguard.engine.training.accumulate import forget

    torch.manual_seed(0)
    net = Net(32, 8, [Cheap(8), Cheap(8)])
    ids = torch.randint(0, 32, (4, 8))
    loss = oomguard.accumulate(lambda mb: net(mb), ids, params=net,
                               remedies=("accumulate", "checkpoint"), name="priced-hook")
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    plain = oomguard.accumulate(lambda mb: net(mb), ids, params=net, name="plain-hook")
    assert torch.allclose(loss, plain)
    for g, p in zip(grads, net.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad)
    forget()
    net.zero_grad(set_to_none=True)

    @oomguard.adaptive(batch_size=4, params=net, remedies=("accumulate", "checkpoint"))
    def train(batch_size: int) -> float:
        value = net(ids[:batch_size])
        value.backward()
        return float(value.detach())

    assert train() == pytest.approx(float(plain))
    assert train.adaptive_size.current == 4
    forget_remedies(net)


def test_one_rule_keeps_the_faster_the_first_within_the_spread_and_never_an_oom() -> None:
    """engine/util/faster.py: what the pricing and a job's plain-or-recomputed choice share."""
    from oomguard.engine.util.faster import fastest, spread

    assert fastest([100.0, 120.0]) == 1  # more samples per second
    assert fastest([100.0, 100.0]) == 0  # a tie keeps the first (plain)
    assert fastest([None, 50.0]) == 1 and fastest([100.0, None]) == 0  # an OOM never chosen
    assert fastest([None, None]) is None and fastest([]) is None
    # within the larger of the two spreads the first stays; beyond it the faster is chosen
    assert fastest([100.0, 108.0], [0.1, 0.02]) == 0
    assert fastest([100.0, 112.0], [0.1, 0.02]) == 1
    assert fastest([100.0, 130.0, 125.0], [0.0, 0.0, 0.0]) == 1
    assert spread([2.0, 2.5]) == pytest.approx(0.25) and spread([2.0]) == 0.0
    with pytest.raises(ValueError, match="one spread per rate"):
        fastest([1.0, 2.0], [0.1])


def test_a_frameworks_gradient_clipping_is_paid_in_every_priced_step() -> None:
    """The Trainer and Lightning clip gradients before each optimizer step: a priced step
    that left it out would time (and size) a step the loop never runs. A clip that waits
    0.25 s caps every configuration's rate at 4 rows / 0.25 s."""
    torch.manual_seed(0)
    net = Net(32, 8, [Cheap(8), Cheap(8)])
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    ids = torch.randint(0, 32, (4, 8))

    def step(n: int) -> None:
        net(ids[:n]).backward()

    def clip() -> None:
        time.sleep(0.25)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)

    rates = {}
    for name, given in (("unclipped", None), ("clipped", clip)):
        choice = choose_remedy(step, 4, net, optimizer=optimizer, remedies=("accumulate",),
                               name=name, clip=given)
        rates[name] = choice.row.samples_per_second
        forget_remedies(net)
    assert rates["clipped"] < 4 / 0.25 < rates["unclipped"], rates
