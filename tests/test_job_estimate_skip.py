"""A job's first run skips the size search where the estimate already fits every sample
(engine/jobs/sizing.py ``estimated_fit``): the size is the sample count, recorded as
"estimated: fits all samples", and the report says so; where it does not fit, the search
runs as before. Real CPU budgets, each job in a fresh process."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomguard.engine.core.search.seed import FITS_ALL
from oomguard.engine.jobs.runner import run_job
from oomguard.engine.jobs.spec import load_job
from tests.conftest import in_fresh_process


def _job(tmp_path: str, budget: str) -> dict:
    """``loss`` on the tiny GPT-2 over 16 generated samples of 32 tokens under ``budget``:
    its result's sizes and search, and the report."""
    path = Path(tmp_path) / "job.toml"
    path.write_text(f'output = "{Path(tmp_path) / "out"}"\nbudget = "{budget}"\n'
                    'models = ["tiny-gpt2"]\n[data]\nseq_len = 32\nn_samples = 16\n'
                    '[[metrics]]\nname = "loss"\n', encoding="utf-8")
    outcome = run_job(load_job(path), progress=False)
    result = outcome.results["loss"]
    report = (Path(outcome.out) / "report.md").read_text()
    return {"code": outcome.exit_code, "sizes": result.sizes, "search": result.search,
            "report": report}


@pytest.mark.slow
def test_a_job_whose_samples_all_fit_by_the_estimate_skips_the_search(tmp_path: Path) -> None:
    got = in_fresh_process(_job, str(tmp_path), "256MiB")  # loss at 16 samples: ~7 MiB
    assert got["code"] == 0
    assert got["sizes"]["source"] == FITS_ALL
    assert got["sizes"]["start"] == {"micro_batch_size": 16}
    assert got["search"]["trials"] == 0 and got["search"]["source"] == FITS_ALL
    assert FITS_ALL in got["report"]


@pytest.mark.slow
def test_a_job_whose_samples_do_not_all_fit_searches(tmp_path: Path) -> None:
    got = in_fresh_process(_job, str(tmp_path), "4MiB")  # loss at 16 samples: ~7 MiB
    assert got["code"] == 0
    assert got["sizes"]["source"] == "search" and got["search"]["trials"] >= 1
    assert "search cost" in got["report"]
