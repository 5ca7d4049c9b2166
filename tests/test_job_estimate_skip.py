"""A job's first run skips the size search where the estimate already fits every sample
(engine/jobs/sizing.py ``estimated_fit``): the size is the sample count, recorded as
"estimated: fits all samples", and the report says so; where it does not fit, the search
runs as before. Only where the job asks (``[search] estimate = true``); by default a job
searches (tests/golden/job). Real CPU budgets, each job in a fresh process."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomguard.engine.core.search.seed import FITS_ALL
from oomguard.engine.jobs.runner import run_job
from oomguard.engine.jobs.spec import load_job
from tests.conftest import in_fresh_process


def _job(tmp_path: str, budget: str, n_samples: int) -> dict:
    """``loss`` on the tiny GPT-2 over ``n_samples`` generated samples of 32 tokens under
    ``budget``, with a size cache of its own: its result's sizes and search, and the report."""
    path = Path(tmp_path) / "job.toml"
    path.write_text(f'output = "{Path(tmp_path) / "out"}"\nbudget = "{budget}"\n'
                    f'models = ["tiny-gpt2"]\n[data]\nseq_len = 32\nn_samples = {n_samples}\n'
                    '[search]\nestimate = true\n[[metrics]]\nname = "loss"\n',
                    encoding="utf-8")
    outcome = run_job(load_job(path), cache_path=Path(tmp_path) / "cache.json", progress=False)
    result = outcome.results["loss"]
    report = (Path(outcome.out) / "report.md").read_text()
    return {"code": outcome.exit_code, "sizes": result.sizes, "search": result.search,
            "report": report}


@pytest.mark.slow
def test_a_job_whose_samples_all_fit_by_the_estimate_skips_the_search(tmp_path: Path) -> None:
    got = in_fresh_process(_job, str(tmp_path), "256MiB", 16)  # 16 samples: ~7 MiB
    assert got["code"] == 0
    assert got["sizes"]["source"] == FITS_ALL
    assert got["sizes"]["start"] == {"micro_batch_size": 16}
    assert got["search"]["trials"] == 0 and got["search"]["source"] == FITS_ALL
    assert "## Search cost" in got["report"] and FITS_ALL in got["report"]


@pytest.mark.slow
def test_a_job_whose_samples_do_not_all_fit_searches(tmp_path: Path) -> None:
    got = in_fresh_process(_job, str(tmp_path), "32MiB", 256)  # 256 samples: ~105 MiB
    assert got["code"] == 0
    assert got["sizes"]["source"] == "search" and got["search"]["trials"] >= 1
    assert "## Search cost" in got["report"]  # trials and seconds against the run

