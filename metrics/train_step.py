"""The built-in default workload: one training step of a small GPT-2.

Forward, backward and an AdamW step of a randomly initialised causal LM on generated tokens.
``warmup()`` takes one step at size 1, so weights, gradients and AdamW's moments exist before any
budget: the searched memory is what the *batch* costs. Trials run two steps each.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from oomguard.engine.core.workload import RebuiltInChild, fake_module
from oomguard.engine.errors import UsageError
from oomguard.metrics.models import build_model, model_config


def build_for(state: dict[str, Any], spec: str, dtype: str, device: str,
              seed: int) -> torch.nn.Module:
    """``build_model(spec, dtype, device, seed)``; for a copy made by ``for_estimate``
    (``state["fake"]``), the same model with fake tensors on ``device``
    (:func:`~oomguard.engine.core.workload.fake_module`)."""
    if state.get("fake"):
        return fake_module(lambda: build_model(spec, dtype, "meta", seed=seed), device)
    return build_model(spec, dtype, device, seed=seed)


@dataclass
class TrainStep(RebuiltInChild):
    """``TrainStep(...)(batch_size)`` runs one training step and returns the loss;
    picklable (the model is rebuilt by ``warmup`` in the receiving process)."""

    steps_per_trial: ClassVar[int] = 2

    model: str = "tiny-gpt2"
    seq_len: int = 512
    dtype: str = "float32"
    device: str = "cpu"
    lr: float = 1e-4
    seed: int = 0
    name: str = "gpt2-train-step"
    preload: tuple[str, ...] = ("transformers", "transformers.models.gpt2.modeling_gpt2",
                                "oomguard.metrics.models")
    _state: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def warmup(self) -> None:
        """Build model and optimizer, and take one step at batch size 1 (not budgeted)."""
        if "model" in self._state:
            return
        model = build_for(self._state, self.model, self.dtype, self.device, self.seed).train()
        opt = torch.optim.AdamW(model.parameters(), lr=self.lr)
        self._state.update(model=model, opt=opt, vocab=model.config.vocab_size)
        self(1)

    def describe(self) -> dict[str, Any]:
        """Configuration for reports. Counts parameters on the warmed-up model, or else on
        one on the ``meta`` device: isolated children must measure with the parent holding
        nothing on ``device``."""
        if "model" in self._state:
            model = self._state["model"]
        else:
            from transformers import AutoModelForCausalLM  # why: as in build_model

            with torch.device("meta"):  # from_config: a checkpoint's weights are not needed
                model = AutoModelForCausalLM.from_config(model_config(self.model))
        cfg = model.config
        return {
            "model": f"{self.model} ({cfg.model_type}, random init from config)",
            "parameters": sum(p.numel() for p in model.parameters()),
            "architecture": {k: getattr(cfg, k) for k in ("n_embd", "n_layer", "n_head",
                                                           "vocab_size") if hasattr(cfg, k)},
            "dtype": self.dtype,
            "step": "forward + backward + AdamW step",
            "data": {"source": "generated uniform random tokens (seeded)",
                     "vocabulary": cfg.vocab_size, "sequence_length": self.seq_len,
                     "lengths": "every sample at the full sequence length (the worst case)"},
        }

    def for_estimate(self, device: str) -> TrainStep:
        """A copy with nothing built, for :func:`oomguard.engine.core.estimate.estimate.estimate`
        on ``device`` (its ``warmup()`` builds fake tensors)."""
        return dataclasses.replace(self, device=device, _state={"fake": True})

    def worst_case_batch(self, batch_size: int, seq_len: int | None = None) -> torch.Tensor:
        """The batch a step at ``batch_size`` uses: token ids ``[batch_size, seq_len]`` (int64, on
        ``device``, no padding; ``seq_len`` None: the step's own), uniform over the vocabulary,
        seeded by ``seed + batch_size``."""
        self.warmup()  # builds once
        g = torch.Generator().manual_seed(self.seed + batch_size)
        shape = (batch_size, self.seq_len if seq_len is None else seq_len)
        ids = torch.randint(0, self._state["vocab"], shape, generator=g)
        return ids.to(self.device)

    def at_length(self, batch_size: int, seq_len: int) -> float:
        """One training step at ``batch_size`` rows of ``seq_len`` tokens (the shape
        :func:`oomguard.search_shapes` varies); the loss."""
        return self(batch_size, self.worst_case_batch(batch_size, seq_len))

    def __call__(self, batch_size: int, batch: torch.Tensor | None = None) -> float:
        """One training step on ``batch`` (token ids ``[batch_size, length]``), or on
        :meth:`worst_case_batch` built here when None; returns the loss (nats per token)."""
        self.warmup()
        model, opt = self._state["model"], self._state["opt"]
        ids = self.worst_case_batch(batch_size) if batch is None else batch
        if ids.dim() != 2 or ids.shape[0] != batch_size:
            raise UsageError(f"{self.name}: a batch of {batch_size} must be token ids of shape "
                             f"[{batch_size}, length], got {list(ids.shape)}; give it such a "
                             "batch")
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())
