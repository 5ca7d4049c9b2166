"""Workloads for bench/peers.py: module-level and picklable, so every search and every
fresh-process check can rebuild them in a child process.

Two workloads are defined here; the others come from oomguard itself:

- :class:`AttentionStep`: one self-attention layer, forward and backward, where the
  searched size is the *sequence length*. The attention scores and probabilities are
  materialised (no fused kernel), so memory grows with ``seq_len ** 2``: a curve that a
  straight line through small sizes underestimates.
- :class:`RnnLmStep`: one training step of an LSTM (or GRU) language model; the
  searched size is the batch size. Its memory is the embedding, every time step's
  gates and hidden states kept for backward, the logits and Adam's update.

:func:`workloads` lists every workload with the CPU budget (bytes above the warmed-up
process) it is searched under, the largest useful size, and the size a peer that only
goes down is given to start from.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from oomguard.engine.core.trial import RebuiltInChild

MiB = 1024**2


@dataclass
class AttentionStep(RebuiltInChild):
    """``AttentionStep()(seq_len)``: one attention layer's forward and backward on
    ``batch`` generated sequences of ``seq_len`` vectors; returns the loss.

    Peak memory (bytes) ~ ``batch * heads * seq_len**2 * 4`` times the number of
    ``seq x seq`` tensors alive at once (scores, probabilities, their gradients).
    """

    batch: int = 8
    heads: int = 8
    d_model: int = 128
    seed: int = 0
    name: str = "attention-seq"
    knob: str = "seq_len"
    preload: tuple[str, ...] = ()
    _state: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def warmup(self) -> None:
        """Build the projections and run one step at a short length (not budgeted)."""
        if self._state:
            return
        torch.manual_seed(self.seed)
        self._state.update(qkv=torch.nn.Linear(self.d_model, 3 * self.d_model),
                           out=torch.nn.Linear(self.d_model, self.d_model))
        self(8)

    def __call__(self, seq_len: int) -> float:
        if not self._state:
            self.warmup()
        qkv, out = self._state["qkv"], self._state["out"]
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
class RnnLmStep(RebuiltInChild):
    """``RnnLmStep()(batch_size)``: one training step (forward, backward, Adam) of a
    byte-level recurrent language model on generated tokens; returns the loss."""

    cell: str = "lstm"
    vocab: int = 256
    embed: int = 128
    hidden: int = 256
    layers: int = 1
    seq_len: int = 64
    seed: int = 0
    name: str = "rnn-lm-step"
    preload: tuple[str, ...] = ()
    _state: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def warmup(self) -> None:
        """Build the model and Adam, and take one step at batch size 1 (not budgeted), so
        that the weights, gradients and Adam's moments exist before a budget applies."""
        if self._state:
            return
        torch.manual_seed(self.seed)
        rnn = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}[self.cell]
        model = torch.nn.ModuleDict({
            "emb": torch.nn.Embedding(self.vocab, self.embed),
            "rnn": rnn(self.embed, self.hidden, self.layers, batch_first=True),
            "head": torch.nn.Linear(self.hidden, self.vocab)})
        self._state.update(model=model, opt=torch.optim.Adam(model.parameters(), lr=1e-3))
        self(1)

    def __call__(self, batch_size: int) -> float:
        if not self._state:
            self.warmup()
        model, opt = self._state["model"], self._state["opt"]
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

    ``budget_bytes``: the CPU budget every search and check runs under (bytes above the
    warmed-up process). ``max_size``: the largest useful size (a dataset's length for
    Lightning, the cap of every search). ``peer_start``: the size given to the peers
    that only go down (accelerate, toma): their ``starting_batch_size`` / initial size.
    """

    key: str
    label: str
    make: Callable[[], Any]
    budget_bytes: int
    max_size: int = 65536
    peer_start: int = 128


def _e10_line(scale: float) -> Callable[[], Any]:
    def make() -> Any:
        from oomguard.metrics.synthetic import e10_line

        return e10_line(scale)
    return make


def _e10_budget(scale: float) -> int:
    """Bytes between the line's 114 and 115 items, as in bench/bench_search.py."""
    line = _e10_line(scale)()
    return (line.bytes_at(114) + line.bytes_at(115)) // 2


def _gpt2(seq: int) -> Callable[[], Any]:
    def make() -> Any:
        from oomguard.metrics.train_step import TrainStep

        return TrainStep(seq_len=seq)
    return make


def _loss_metric(n_samples: int, seq_len: int) -> Callable[[], Any]:
    def make() -> Any:
        from oomguard.metrics.workload import MetricTrial

        return MetricTrial(metric="loss", n_samples=n_samples, seq_len=seq_len)
    return make


def _rnn(seq_len: int, hidden: int) -> Callable[[], Any]:
    def make() -> Any:
        return RnnLmStep(seq_len=seq_len, hidden=hidden)
    return make


def workloads(quick: bool) -> dict[str, Workload]:
    """Every workload of the bench, by key. ``quick``: shorter sequences and smaller
    budgets (same shapes of memory curve), so that a trial takes well under a second."""
    if quick:
        items = [
            # Not scaled down further: at /400 the budget's slack above 114 items (0.47 MB)
            # is within a fresh child's start-up noise, and 114 ran in-process, not fresh.
            Workload("e10", "E10 line /100", _e10_line(0.01), _e10_budget(0.01)),
            Workload("gpt2", "GPT-2 step seq 16", _gpt2(16), 64 * MiB),
            Workload("loss", "loss metric seq 32, micro-batch", _loss_metric(64, 32),
                     28 * MiB, max_size=64),
            Workload("attention", "attention, seq_len", AttentionStep, 32 * MiB),
            Workload("rnn", "LSTM LM step seq 32", _rnn(32, 128), 48 * MiB),
        ]
    else:
        items = [
            Workload("e10", "E10 line /100", _e10_line(0.01), _e10_budget(0.01)),
            Workload("gpt2", "GPT-2 step seq 128", _gpt2(128), 512 * MiB),
            Workload("loss", "loss metric seq 128, micro-batch", _loss_metric(384, 128),
                     160 * MiB, max_size=384),
            Workload("attention", "attention, seq_len", AttentionStep, 128 * MiB),
            Workload("rnn", "LSTM LM step seq 64", _rnn(64, 256), 192 * MiB),
        ]
    return {w.key: w for w in items}


# What forked children may import first (the forkserver's preload list is set once).
PRELOAD: tuple[str, ...] = ("transformers", "transformers.models.gpt2.modeling_gpt2",
                            "oomguard.metrics.models", "oomguard.metrics.common",
                            "oomguard.metrics.loss", "oomguard.metrics.train_step",
                            "oomguard.metrics.workload", "oomguard.metrics.synthetic",
                            "oomguard.engine.core.search")
