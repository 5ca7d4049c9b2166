"""``hessian_eigenvalues`` / ``ggn_eigenvalues``: top eigenvalues of the loss curvature by Lanczos.

The ``k`` largest eigenvalues of the Hessian (or Gauss-Newton matrix) of the token-weighted mean
loss over *all* data, in nats/token per unit parameter squared, estimated as Ritz values of
``iterations`` Lanczos steps (float64, full reorthogonalisation, seeded start); ``residuals`` bound
each one's error. Each matrix-vector product is summed over micro-batches by token share.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from oomguard.engine.core.workload import host_device, shortcut
from oomguard.engine.errors import UsageError
from oomguard.metrics.base import Knob, register
from oomguard.metrics.common import (
    JsonMetric,
    labels_of,
    mean_loss_hvp,
    model_inputs,
    n_samples,
    token_weighted_sum,
    total_tokens,
    trainable,
)

MatVec = Callable[[torch.Tensor], torch.Tensor]


def lanczos(matvec: MatVec, dim: int, iterations: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Lanczos with full reorthogonalisation on a symmetric operator of size ``dim``:
    ``eigenvalues`` (descending), ``residuals`` and ``steps``; the basis lives on the host."""
    m = min(iterations, dim)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(dim, generator=g, dtype=torch.float64, device=host_device())
    q /= q.norm()
    basis = [q]
    alphas: list[float] = []
    betas: list[float] = []  # the last one is the residual's, outside T
    for j in range(m):
        w = matvec(basis[j]).to(torch.float64)
        alphas.append(float(w @ basis[j]))
        Q = torch.stack(basis)
        for _ in range(2):  # full reorthogonalisation, twice is enough
            w -= Q.T @ (Q @ w)
        betas.append(float(w.norm()))
        if j == m - 1 or betas[-1] <= 1e-12 * (max(abs(a) for a in alphas) or 1.0):
            break
        basis.append(w / betas[-1])
    off = torch.tensor(betas[:-1], dtype=torch.float64)
    T = torch.diag(torch.tensor(alphas, dtype=torch.float64)) + off.diag(1) + off.diag(-1)
    evals, evecs = torch.linalg.eigh(T)
    order = torch.argsort(evals, descending=True)
    return {"eigenvalues": evals[order], "residuals": (betas[-1] * evecs[-1, order]).abs(),
            "steps": torch.tensor(len(alphas))}


def mean_loss_ggnvp(model: torch.nn.Module, data: Mapping[str, torch.Tensor],
                    micro_batch_size: int, vec: Sequence[torch.Tensor],
                    params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Gauss-Newton-vector product ``J^T H_z J v`` of the token-weighted mean loss (``z``:
    the logits, ``H_z``: the softmax cross-entropy Hessian per scored token; ``J v`` by the
    double-VJP trick, no forward-mode AD), reduced by :func:`token_weighted_sum`."""
    v = [x.to(p.dtype) for x, p in zip(vec, params, strict=True)]

    def ggnvp(mb: Mapping[str, torch.Tensor], ps: list[torch.Tensor]) -> Sequence[Any]:
        logits = model(**model_inputs(mb)).logits
        u = torch.zeros_like(logits, requires_grad=True)
        jtu = torch.autograd.grad(logits, ps, grad_outputs=u, create_graph=True,
                                  allow_unused=True)
        pairs = [(a, b) for a, b in zip(jtu, v, strict=True) if a is not None]
        jv = torch.autograd.grad([a for a, _ in pairs], u, grad_outputs=[b for _, b in pairs])[0]
        work = torch.promote_types(logits.dtype, torch.float32)  # up-cast low precision only
        probs = torch.softmax(logits.detach().to(work), dim=-1)
        jvf = jv.detach().to(work)
        hjv = probs * (jvf - (probs * jvf).sum(-1, keepdim=True))
        scored = torch.zeros(logits.shape[:-1], dtype=torch.bool, device=logits.device)
        scored[:, :-1] = labels_of(mb)[:, 1:] != -100  # position t predicts label t+1
        hjv = hjv * scored[..., None]
        return torch.autograd.grad(logits, ps, grad_outputs=hjv.to(logits.dtype),
                                   allow_unused=True)

    return token_weighted_sum(model, data, micro_batch_size, ggnvp, params)


class _CurvatureEigenvalues(JsonMetric):
    """Top-k eigenvalues of a curvature matrix of the full-data mean loss, by Lanczos."""

    matrix = "hessian"
    # No: bfloat16 Hessian-vector products would break the residual bounds.
    tolerates_lower_precision = False
    # No: the double backward of a Hessian- or Gauss-Newton-vector product keeps every block's
    # recomputed activations until its second backward, so checkpointing lowered the peak by
    # 13% at most, for 36-47% more time (measured: docs/measurements.md#recompute-for-metrics).
    recomputes = False
    knobs = (
        Knob("micro_batch_size", "memory", 16, 1,
             "micro_batch_size x seq_len x activations (double backward)",
             "samples per matrix-vector product slice; the result does not depend on it"),
        Knob("k", "result", 5, 1, "", "number of top eigenvalues reported"),
        Knob("iterations", "result", 20, 1, "iterations x parameters (Lanczos basis)",
             "Lanczos steps (capped at the parameter count)"),
        Knob("seed", "result", 0, 0, "", "seed of the Lanczos start vector"),
    )

    def validate(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """As the base, and ``k`` may not exceed ``iterations``."""
        out = super().validate(params)
        if out["k"] > out["iterations"]:
            raise UsageError(f"{self.name}: k ({out['k']}) must be <= iterations "
                             f"({out['iterations']}); lower k or raise iterations")
        return out

    def compute(self, model: torch.nn.Module, data: Mapping[str, torch.Tensor],
                micro_batch_size: int = 16, k: int = 5, iterations: int = 20,
                seed: int = 0) -> dict[str, Any]:
        if shortcut(f"{self.name}: 2 Lanczos steps of {iterations} estimated: each step holds "
                    "the same on the device; the basis, which grows with the steps, stays on "
                    "the host", devices=("cuda",)):
            iterations, k = min(iterations, 2), min(k, 2)
        params = trainable(model)
        product = mean_loss_hvp if self.matrix == "hessian" else mean_loss_ggnvp
        dim = sum(p.numel() for p in params)

        def matvec(x: torch.Tensor) -> torch.Tensor:
            vec = [v.view_as(p).to(p.device)
                   for v, p in zip(x.split([p.numel() for p in params]), params, strict=True)]
            return torch.cat([t.reshape(-1).to(device=x.device, dtype=torch.float64)
                              for t in product(model, data, micro_batch_size, vec, params)])

        out = lanczos(matvec, dim, iterations, seed)
        return {"eigenvalues": out["eigenvalues"][:k].tolist(),
                "residuals": out["residuals"][:k].tolist(), "lanczos_steps": int(out["steps"]),
                "matrix": self.matrix, "n_params": dim, "n_tokens": total_tokens(data),
                "n_samples": n_samples(data)}


@register
class HessianEigenvalues(_CurvatureEigenvalues):
    name = "hessian_eigenvalues"
    description = ("top-k eigenvalues of the Hessian of the full-data token-weighted mean loss "
                   "(Lanczos, full reorthogonalisation)")


@register
class GGNEigenvalues(_CurvatureEigenvalues):
    name = "ggn_eigenvalues"
    description = ("top-k eigenvalues of the Gauss-Newton matrix (J^T H_logits J) of the "
                   "full-data token-weighted mean loss (Lanczos, full reorthogonalisation)")
    matrix = "ggn"
