"""Workloads for bench/peers.py: module-level and picklable, so every search and every
fresh-process check can rebuild them in a child process.

Three come from oomguard itself (the E10 line of real allocations, the tiny GPT-2
training step, the loss metric); two are defined here:

- :class:`AttentionStep`: one self-attention layer, forward and backward, where the
  searched size is the *sequence length*. The attention scores and probabilities are
  materialised (no fused kernel), so memory grows with ``seq_len ** 2``: a curve that a
  straight line through small sizes underestimates.
- :class:`RnnLmStep`: one training step of an LSTM (or GRU) language model; the
  searched size is the batch size. Its memory is the embedding, every time step's
  gates and hidden states kept for backward, the logits and Adam's update. In-process
  searches of it drift: every trial leaves ~1 MiB more ``VmData`` behind, so later
  trials have less headroom than a fresh process.

:func:`workloads` lists every workload with the CPU budget (bytes above the warmed-up
process) it is searched under, the largest useful size, and the size a peer that only
goes down is given to start from.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar

import torch

from oomguard.engine.core.workload import RebuiltInChild
from oomguard.metrics.synthetic import e10_line
from oomguard.metrics.train_step import TrainStep
from oomguard.metrics.workload import MetricTrial

MiB = 1024**2


@dataclass
class _Built(RebuiltInChild):
    """A workload whose ``warmup()`` builds its modules (seeded) into ``_state`` and runs
    one step at ``warm_size`` outside any budget; ``step(size, **state)`` is one call."""

    seed: int = 0
    preload: tuple[str, ...] = ()
    _state: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    warm_size: ClassVar[int] = 1

    def build(self) -> dict[str, Any]:
        raise NotImplementedError

    def step(self, size: int, **state: Any) -> float:
        raise NotImplementedError

    def warmup(self) -> None:
        if self._state:
            return
        torch.manual_seed(self.seed)
        self._state.update(self.build())
        self(self.warm_size)

    def __call__(self, size: int) -> float:
        if not self._state:
            self.warmup()
        return self.step(size, **self._state)


@dataclass
class AttentionStep(_Built):
    """``AttentionStep()(seq_len)``: one attention layer's forward and backward on
    ``batch`` generated sequences of ``seq_len`` vectors; returns the loss.

    Peak memory (bytes) ~ ``batch * heads * seq_len**2 * 4`` times the number of
    ``seq x seq`` tensors alive at once (scores, probabilities, their gradients).
    """

    batch: int = 8
    heads: int = 8
    d_model: int = 128
    name: str = "attention-seq"
    knob: str = "seq_len"
    warm_size: ClassVar[int] = 8

    def build(self) -> dict[str, Any]:
        return {"qkv": torch.nn.Linear(self.d_model, 3 * self.d_model),
                "out": torch.nn.Linear(self.d_model, self.d_model)}

    def step(self, seq_len: int, **state: Any) -> float:
        qkv, out = state["qkv"], state["out"]
        b, h, d = self.batch, self.heads, self.d_model
        g = torch.Generator().manual_seed(self.seed + seq_len)
        x = torch.randn(b, seq_len, d, generator=g)
        q, k, v = qkv(x).view(b, seq_len, 3, h, d // h).permute(2, 0, 3, 1, 4)
        # Written out rather than scaled_dot_product_attention: a fused kernel would keep
        # memory linear in seq_len, and this workload is here for its quadratic curve.
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // h)
        y = out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, seq_len, d))
        loss = y.pow(2).mean()
        loss.backward()
        qkv.zero_grad(set_to_none=True)
        out.zero_grad(set_to_none=True)
        return float(loss.detach())


@dataclass
class RnnLmStep(_Built):
    """``RnnLmStep()(batch_size)``: one training step (forward, backward, Adam) of a
    byte-level recurrent language model on generated tokens; returns the loss. The
    warm-up's step at batch size 1 creates Adam's moments before any budget applies."""

    cell: str = "lstm"
    vocab: int = 256
    embed: int = 128
    hidden: int = 256
    layers: int = 1
    seq_len: int = 64
    name: str = "rnn-lm-step"

    def build(self) -> dict[str, Any]:
        rnn = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}[self.cell]
        model = torch.nn.ModuleDict({
            "emb": torch.nn.Embedding(self.vocab, self.embed),
            "rnn": rnn(self.embed, self.hidden, self.layers, batch_first=True),
            "head": torch.nn.Linear(self.hidden, self.vocab)})
        return {"model": model, "opt": torch.optim.Adam(model.parameters(), lr=1e-3)}

    def step(self, batch_size: int, **state: Any) -> float:
        model, opt = state["model"], state["opt"]
        g = torch.Generator().manual_seed(self.seed + batch_size)
        ids = torch.randint(0, self.vocab, (batch_size, self.seq_len), generator=g)
        hidden, _ = model["rnn"](model["emb"](ids))
        logits = model["head"](hidden[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, self.vocab),
                                                 ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())


@dataclass(frozen=True)
class Workload:
    """One row group of the peer table.

    ``make()`` builds the workload (in whichever process runs it). ``budget_bytes``: the
    CPU budget every search and check runs under (bytes above the warmed-up process).
    ``max_size``: the largest useful size (a dataset's length for Lightning, the cap of
    every search). ``peer_start``: the size given to the peers that only go down
    (accelerate, toma): their ``starting_batch_size`` / initial size. ``linear``: memory
    grows linearly in the size (the issue's "linear ones": the E10 line, the GPT-2 step).
    """

    key: str
    label: str
    make: Callable[[], Any]
    budget_bytes: int
    max_size: int = 65536
    peer_start: int = 128
    linear: bool = False


def e10_budget(scale: float = 0.01) -> int:
    """Bytes between the scaled E10 line's 114 and 115 items, as in bench/bench_search.py."""
    line = e10_line(scale)
    return (line.bytes_at(114) + line.bytes_at(115)) // 2


def workloads(quick: bool = False, small: bool = False) -> dict[str, Workload]:
    """Every workload of the bench, by key.

    ``quick``: shorter sequences and smaller budgets (same shapes of memory curve), so
    that a trial takes well under a second. ``small``: smaller still, for the tests (a
    few seconds per workload with isolated trials). The E10 line is the same in all
    three: at 1/400 scale the budget's slack above 114 items (0.47 MB) is within a fresh
    child's start-up noise.
    """
    size = 2 if small else 1 if quick else 0  # index into the (full, quick, small) triples

    def pick(full: Any, quick_value: Any, small_value: Any) -> Any:
        return (full, quick_value, small_value)[size]

    seq = pick(128, 16, 16)
    n, loss_seq = pick(384, 64, 64), pick(128, 32, 32)
    rnn_seq, rnn_hidden = pick(64, 32, 32), pick(256, 128, 128)
    items = [
        Workload("e10", "E10 line /100", e10_line, e10_budget(), linear=True),
        Workload("gpt2", f"GPT-2 step seq {seq}", partial(TrainStep, seq_len=seq),
                 pick(512, 64, 48) * MiB, linear=True),
        Workload("loss", f"loss metric seq {loss_seq}, micro-batch",
                 partial(MetricTrial, metric="loss", n_samples=n, seq_len=loss_seq),
                 pick(160, 28, 28) * MiB, max_size=n),
        Workload("attention", "attention, seq_len", AttentionStep, pick(128, 32, 26) * MiB),
        Workload("rnn", f"LSTM LM step seq {rnn_seq}",
                 partial(RnnLmStep, seq_len=rnn_seq, hidden=rnn_hidden),
                 pick(192, 48, 32) * MiB),
    ]
    return {w.key: w for w in items}


# What forked children may import first (the forkserver's preload list is set once).
PRELOAD: tuple[str, ...] = ("transformers", "transformers.models.gpt2.modeling_gpt2",
                            "oomguard.metrics.models", "oomguard.metrics.common",
                            "oomguard.metrics.loss", "oomguard.metrics.train_step",
                            "oomguard.metrics.workload", "oomguard.metrics.synthetic",
                            "oomguard.engine.core.search.search", "peer_workloads")
