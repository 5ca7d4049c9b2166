"""An estimate runs once the steps a metric repeats identically (``shortcut``), and counts
the target device's memory only (``host_device``).

A shortcut must not change the estimated peak: each test estimates the tiny GPT-2 with and
without shortcuts (cheap there) and compares, so a metric whose steps stopped holding the
same would fail here.
"""

from __future__ import annotations

import pytest
import torch

from oomguard.engine.core.estimate.estimate import estimate
from oomguard.engine.core.workload import host_device, shortcut
from oomguard.metrics.workload import MetricTrial

# One layer, 16 wide: fake tensors cost ~1 ms an operation, so the fewer the better.

SMALL = "gpt2:vocab_size=64,n_embd=16,n_layer=1,n_head=2,n_positions=16"


def _trial(metric: str, knob: str | None = None, **params) -> MetricTrial:
    return MetricTrial(metric, knob=knob, model=SMALL, n_samples=1, seq_len=8, params=params)


def _both(trial: MetricTrial, device: str) -> tuple[int, int, list[str]]:
    """(peak with shortcuts, peak without, notes with) of size 1, bytes."""
    (cut,) = estimate(trial, [1], device=device, workspace=False)
    (full,) = estimate(trial, [1], device=device, workspace=False, shortcuts=False)
    return cut.peak_bytes, full.peak_bytes, cut.notes


@pytest.mark.slow
def test_two_lanczos_steps_hold_what_every_step_holds_on_a_gpu():
    cut, full, notes = _both(_trial("hessian_eigenvalues", iterations=4, k=1), "cuda")
    assert cut == full and any("2 Lanczos steps of 4" in n for n in notes)


@pytest.mark.slow
def test_on_the_cpu_every_lanczos_step_runs():
    # there the basis is the device's memory: it grows with the steps, so none is cut
    (e,) = estimate(_trial("ggn_eigenvalues", iterations=3, k=1), [1], workspace=False)
    assert not any("Lanczos" in n for n in e.notes)


@pytest.mark.slow
def test_one_landscape_point_holds_what_every_point_holds():
    trial = _trial("loss_landscape", grid=2)
    for device in ("cpu", "cuda"):
        cut, full, notes = _both(trial, device)
        assert any("1 point of 2x2" in n for n in notes)
        # on the cpu, the host's float64 losses (2x2) and axis (2) are the difference
        assert 0 <= full - cut <= ((4 + 2 - 2) * 8 if device == "cpu" else 0)


@pytest.mark.slow
def test_two_vjp_blocks_hold_what_every_block_holds():
    cut, full, notes = _both(_trial("position_jacobian", "micro_batch_size", vjp_block=4),
                             "cuda")
    assert cut == full and any("2 VJP blocks of" in n for n in notes)


def test_no_shortcut_outside_an_estimate_and_host_is_meta_only_for_cuda_on_cpu():
    seen = []

    def work(size: int) -> None:
        seen.append((host_device(), shortcut("a note", devices=("cuda",))))

    estimate(work, [1], device="cpu", workspace=False)
    (e,) = estimate(work, [1], device="cuda", workspace=False)
    # cuda on a torch build without CUDA runs on cpu, so the host's part must go elsewhere
    host = "cpu" if torch.backends.cuda.is_built() else "meta"
    assert seen == [("cpu", False), (host, True)] and "a note" in e.notes
    assert host_device() == "cpu" and not shortcut("outside", devices=("cpu", "cuda"))


@pytest.mark.slow
@pytest.mark.parametrize("metric", ["hessian_eigenvalues", "loss_landscape"])
def test_shortcuts_never_change_a_real_result(metric):
    params = {"iterations": 3, "k": 1} if metric == "hessian_eigenvalues" else {"grid": 2}
    got = _trial(metric, **params)(1)
    assert (got["lanczos_steps"] == 3) if metric == "hessian_eigenvalues" else (
        torch.tensor(got["losses"]).shape == (2, 2))
