"""Estimates of peak memory without running the work (oomguard.engine.core.estimate.estimate).

The estimates of the tiny GPT-2 training step and of two metrics at a small size (where
the matrix multiplies' workspace matters most) are compared with the peak an isolated
search trial measures at that size (a fresh process, warm-up, resident VmHWM above it):
within 2% for the step and 5% for the metrics (docs/measurements.md#estimate-error has the
full table, three sizes each), and two misses fixed for issue 28 likewise: captum's
internal_batch_size (the estimate warms up as the trial does where it replays the workspace)
and cka (its in-place Gram multiplies replayed, on the worst-case data a trial runs). A 0.67B
LLaMA-like training step is estimated with no weights built; plain functions are counted
exactly; bad input is a UsageError.
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch._subclasses import fake_tensor as ft

from oomguard.engine.cli.estimate import parse_sizes
from oomguard.engine.cli.main import build_parser
from oomguard.engine.core.estimate.estimate import LABEL, StorageCounter, estimate
from oomguard.engine.core.estimate.hooks import replays_workspace
from oomguard.engine.core.search.isolate import IsolatedRunner
from oomguard.engine.errors import UsageError
from oomguard.metrics.train_step import TrainStep
from oomguard.metrics.workload import MetricTrial
from oomguard.probes.peak import PeakMeter

MiB = 1024**2
# 2 wide LLaMA-7B layers (hidden 4096, MLP 11008, 32 heads, vocab 32000): 0.67e9 parameters.
LLAMA_2_LAYERS = ("llama:hidden_size=4096,intermediate_size=11008,num_hidden_layers=2,"
                  "num_attention_heads=32,num_key_value_heads=32,vocab_size=32000,"
                  "max_position_embeddings=4096")


def _error(workload, size: int) -> tuple[int, int, int, float]:
    """(estimated, of which workspace, measured, relative error) at ``size``; measured by
    an isolated trial (a fresh process, the workload's warm-up, one step), which runs while
    this process estimates: separate processes, so neither's memory counts in the other's."""
    with ThreadPoolExecutor(1) as pool:
        measuring = pool.submit(IsolatedRunner(workload, "cpu"), size)
        (e,) = estimate(workload, [size])
        trial = measuring.result()
    assert e.kind == LABEL and e.size == size and e.workspace_bytes is not None, e.notes
    assert trial.ok and trial.mode == "isolated", trial.error
    return e.peak_bytes, e.workspace_bytes, trial.peak_bytes, (
        (e.peak_bytes - trial.peak_bytes) / trial.peak_bytes)


@pytest.mark.slow
def test_train_step_estimate_within_2_percent_of_measured():
    est, workspace, meas, err = _error(TrainStep(seq_len=256), 2)
    assert abs(err) < 0.02, f"batch 2: estimated {est}, measured {meas} ({err:+.2%})"
    assert workspace > 0  # batch 2's matrix multiplies are new after the warm-up's batch 1


@pytest.mark.slow
@pytest.mark.parametrize("metric", ["loss", "gradient_stats"])
def test_metric_estimate_within_5_percent_of_measured(metric):
    est, workspace, meas, err = _error(MetricTrial(metric, n_samples=4, seq_len=256), 4)
    assert abs(err) < 0.05, (f"{metric} micro_batch_size 4: estimated {est} ({workspace} "
                             f"workspace), measured {meas} ({err:+.2%})")
    # Here the tensors alone read over 2% low: the bound covers the measured workspace too.
    assert (meas - (est - workspace)) / meas > 0.02


@pytest.mark.slow
def test_internal_batch_size_estimate_warms_up_as_its_trial_does():
    # A trial warms up at internal_batch_size 1 (1 row per forward), so the size's 4-row
    # multiplies grow the BLAS buffers; an estimate warmed up at the largest useful size
    # (8 rows) replayed them as adding nothing: -12.3% measured before, -1.9% now alone,
    # -3.3% and -3.7% after the other estimate and layout tests in one pytest process
    # (replayed 0.73 MB there, 1.20 MB alone). The child's peak, now taken with the heap
    # plugged (docs/measurements.md#free-heap-at-budget-entry), counts its small allocations
    # too: 11.07 MB against 10.44 MB estimated (-5.7%) in a CI run. 8% fails the old -12%.
    work = MetricTrial("integrated_gradients", knob="internal_batch_size", n_samples=4,
                       seq_len=64, params={"n_steps": 8})
    est, workspace, meas, err = _error(work, 4)
    assert workspace > 0, "the size's multiplies are new after the trial's warm-up"
    assert abs(err) < 0.08, f"estimated {est} ({workspace} workspace), measured {meas} ({err:+.2%})"


@pytest.mark.slow
def test_cka_estimate_counts_its_gram_multiplies_on_the_worst_case_data():
    # cka's float64 Gram accumulation (addmm_, in place) keeps 1.6-2.4 MB of MKL buffers that
    # were not replayed (-24.1% at chunk 2 before); on the padded data the estimate would
    # replay four distinct smaller multiplies where the trial's worst case makes one.
    # Measured: +0.2% where the replay kept 2.43 MB, -1.8% where it kept 1.64 MB (its own
    # spread between runs). The child's resident peak, now taken with the 128 KiB threshold
    # and the heap plugged (docs/measurements.md#free-heap-at-budget-entry), read 7.15-7.28 MB
    # with three such tests at once against 6.96 MB estimated (-2.7% to -4.5%): bound 6%,
    # which still fails the -24% of the missing multiplies.
    est, workspace, meas, err = _error(MetricTrial("cka", n_samples=4, seq_len=128), 2)
    assert workspace > MiB, f"{workspace} bytes of workspace"
    assert abs(err) < 0.06, f"estimated {est} ({workspace} workspace), measured {meas} ({err:+.2%})"


class _WorstCase:
    """A workload whose trials run on ``worst_case_batch(size)``: ``size`` rows of 256 floats."""

    def __init__(self) -> None:
        self.batches: list[bool] = []

    def worst_case_batch(self, size: int) -> torch.Tensor:
        return torch.ones(size, 256)

    def __call__(self, size: int, batch: torch.Tensor | None = None) -> torch.Tensor:
        self.batches.append(batch is not None)
        return (torch.ones(1, 256) if batch is None else batch) * 2


def test_estimate_runs_on_the_worst_case_batch_as_a_trial_does():
    work = _WorstCase()
    (e,) = estimate(work, [4], workspace=False)
    assert work.batches == [True]
    assert e.peak_bytes == 2 * 4 * 256 * 4  # the batch (made in the step, as a trial's) and x2


def _gram_in_place(n: int) -> torch.Tensor:
    z = torch.ones(n, 64, dtype=torch.float64)
    gram = torch.zeros(64, 64, dtype=torch.float64)
    return gram.addmm_(z.T, z)


def test_in_place_matrix_multiplies_are_replayed_for_their_workspace():
    counter = StorageCounter(ft.FakeTensorMode(allow_non_fake_inputs=True))
    with counter.fake_mode, counter:
        _gram_in_place(8)
    assert [key[0] for key in counter.gemms] == ["addmm_.default"]
    (multiply_adds,) = [m for _, m in counter.gemms.values()]
    assert multiply_adds == 64 * 64 * 8


class _Warmup:
    """Records whether its warm-up ran inside an estimate that replays the workspace."""

    seen: list[bool] = []

    def warmup(self) -> None:
        self.seen.append(replays_workspace())

    def __call__(self, size: int) -> None:
        pass


@pytest.mark.parametrize("device, workspace, replayed", [
    ("cpu", True, True), ("cpu", False, False), ("cuda", True, False)])
def test_warm_up_knows_when_the_workspace_is_replayed(device, workspace, replayed):
    _Warmup.seen = []
    estimate(_Warmup(), [1], device=device, workspace=workspace)
    assert _Warmup.seen == [replayed]
    assert not replays_workspace()  # a real run


@pytest.mark.slow
def test_llama_training_step_is_estimated_without_its_weights():
    step = TrainStep(model=LLAMA_2_LAYERS, seq_len=64, dtype="bfloat16")
    estimate(_two_buffers, [1])  # the fake mode's one-off imports are not the estimate's
    meter = PeakMeter("cpu")
    meter.reset()
    (e,) = estimate(step, [2])
    grown = meter.read()
    params = 2 * (4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096) + 2 * 32000 * 4096 + 4096
    # bf16 weights alone would be 1.3 GB and AdamW's moments 2.7 GB more: none is built.
    assert grown < 256 * MiB, f"the estimate grew the process by {grown / MiB:.0f} MiB"
    # The step's gradients (bf16, one per parameter) all exist at the end of the backward.
    assert e.peak_bytes >= 2 * params
    assert e.peak_bytes < 2 * params + 1024 * MiB
    assert step._state == {}  # the workload itself was not built or warmed up
    # Its matrix multiplies (~1e11 multiply-adds) are not replayed, and the notes say so.
    assert e.workspace_bytes is None
    assert any("too big to replay" in note for note in e.notes)


def _two_buffers(n: int) -> float:
    a = torch.ones(n, 1024)
    b = a * 2
    del a
    c = b + 1  # a was freed: b and c (and the sum's scalar) at the peak
    return float(c.sum())


def test_plain_function_is_counted_exactly_with_no_memory():
    estimate(_two_buffers, [1])  # the fake mode's one-off imports are not the estimate's
    meter = PeakMeter("cpu")
    meter.reset()
    small, big = estimate(_two_buffers, [1000, 100_000])
    assert meter.read() < 64 * MiB  # 800 MB estimated, nothing allocated
    assert small.peak_bytes == 2 * 1000 * 4096 + 4
    assert big.peak_bytes == 2 * 100_000 * 4096 + 4
    assert big.workspace_bytes == 0  # no matrix multiply: nothing replayed, nothing kept
    assert any("read as 1" in note for note in big.notes)  # float(c.sum()) had no value


def test_cuda_estimate_counts_512_byte_blocks_and_says_where_it_ran():
    (e,) = estimate(_two_buffers, [1000], device="cuda")
    assert e.peak_bytes == 2 * 1000 * 4096 + 512  # the 4-byte scalar takes a 512-byte block
    assert e.device == "cuda"
    if not torch.backends.cuda.is_built():
        assert e.estimated_on == "cpu"
        assert any("estimated on cpu" in note for note in e.notes)


class _OwnEstimate:
    def estimate_peak(self, size: int, device: str) -> int:
        return 10 * size

    def __call__(self, size: int) -> None:
        raise AssertionError("an estimate must not run the work")


def test_a_workload_may_estimate_itself():
    got = estimate(_OwnEstimate(), [1, 3])
    assert [e.peak_bytes for e in got] == [10, 30]
    assert all("estimate_peak" in e.method and e.kind == LABEL for e in got)


def _masked_rows(n: int) -> torch.Tensor:
    x = torch.ones(n, 100_000)  # fake: 400 kB a row
    keep = torch.arange(n) % 2 == 0  # real (data bookkeeping): every other row
    return x[keep].sum()


def test_rows_picked_by_a_real_mask_are_counted():
    (e,) = estimate(_masked_rows, [4])
    # x (4 rows), the 2 rows picked, the mask and the scalar; the arange's bytes are freed
    assert abs(e.peak_bytes - 6 * 400_000) < 100


def _shape_from_values(n: int) -> int:
    return torch.nonzero(torch.ones(n, 100_000)).shape[0]


def test_shape_depending_on_computed_values_cannot_be_estimated():
    with pytest.raises(UsageError, match="cannot estimate"):
        estimate(_shape_from_values, [4])


@pytest.mark.parametrize("sizes, device", [([0], "cpu"), ([], "cpu"), ([-2], "cpu"),
                                            ([True], "cpu"), ([1], "mps"), ([1], "tpu")])
def test_bad_sizes_and_devices_are_usage_errors(sizes, device):
    with pytest.raises(UsageError):
        estimate(_two_buffers, sizes, device=device)


def _cli(*argv: str) -> argparse.Namespace:
    return build_parser(["estimate"]).parse_args(["estimate", *argv])


@pytest.mark.parametrize("argv, words", [
    (["--sizes", "1,0"], "positive"),
    (["--sizes", "1,x"], "not an integer"),
    (["--sizes", "4", "--metric", "no-such-metric"], "train-step"),
    (["--sizes", "4", "--knob", "micro_batch_size"], "for metrics"),
    (["--sizes", "4", "--metric", "loss", "--knob", "nope"], "memory knob"),
    (["--sizes", "4", "--seq-len", "0"], "positive"),
    (["--sizes", "4", "--device", "mps"], "cpu or cuda"),
])
def test_cli_bad_input_is_one_usage_error(argv, words):
    args = _cli(*argv)
    with pytest.raises(UsageError, match=words) as info:
        args.func(args)
    assert "\n" not in str(info.value)


def test_parse_sizes():
    assert parse_sizes("1, 8,32") == [1, 8, 32]


@pytest.mark.slow
def test_cli_prints_estimates_labelled_as_such(capsys):
    args = _cli("--metric", "loss", "--samples", "4", "--seq-len", "16", "--sizes", "2,4",
                "--no-workspace")
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "estimated, not measured" in out
    lines = [line for line in out.splitlines() if line.strip().startswith(("2 ", "4 "))]
    assert len(lines) == 2 and all(LABEL in line for line in lines)
    assert "matrix-multiply workspace not counted (workspace=False" in out
