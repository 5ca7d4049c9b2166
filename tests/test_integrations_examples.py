"""The examples run as users run them (their ``main(argv)``, each in a fresh process under its
own default CPU budget) and keep the effective batch; with and without the budget they train
the same."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from tests.conftest import in_fresh_process, in_fresh_processes

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run_example(name: str, argv: list[str], cwd: str) -> dict:
    os.chdir(cwd)  # what an example writes (the Trainer's output dir) lands there
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


@pytest.mark.slow
def test_nanogpt_loop_splits_its_step_under_the_budget_and_trains_as_without_it(tmp_path):
    limited, free = in_fresh_processes(_run_example, [
        ("nanogpt_loop", ["--iters", "4"], str(tmp_path)),
        ("nanogpt_loop", ["--iters", "4", "--budget", "0"], str(tmp_path))])
    assert len(limited["sizes"]) > 1 and sum(limited["sizes"]) == 480
    assert max(limited["sizes"]) <= limited["safe"] <= limited["found"] < 480  # 480 do not fit
    assert free["sizes"] == [480]  # nothing to split without a budget
    assert limited["losses"] == pytest.approx(free["losses"], rel=1e-4)


@pytest.mark.slow
def test_trainer_script_splits_the_batch_and_trains_as_without_the_budget(tmp_path):
    limited, free = in_fresh_processes(_run_example, [
        ("trainer_script", ["--steps", "3"], str(tmp_path)),
        ("trainer_script", ["--steps", "3", "--budget", "0"], str(tmp_path))])
    assert len(limited["sizes"]) > 1 and sum(limited["sizes"]) == 512
    assert max(limited["sizes"]) <= limited["found"] and free["sizes"] == [512]
    assert limited["losses"] == pytest.approx(free["losses"], rel=1e-5)
    assert limited["eval_loss"] == pytest.approx(free["eval_loss"], rel=1e-5)


@pytest.mark.slow
def test_lightning_script_keeps_the_effective_batch_under_the_budget(tmp_path):
    got = in_fresh_process(_run_example, "lightning_script", ["--steps", "3"], str(tmp_path))
    assert len(got["sizes"]) > 1 and sum(got["sizes"]) == 512
    assert got["accum"] == len(got["sizes"])
    assert max(got["sizes"]) <= got["found"] < 512 and got["steps"] == 3
