"""Knob granularity: captum's ``internal_batch_size`` changes what runs only at
multiples of the examples per call, so a search proposes only those multiples, stops
at the largest useful size, and reports real sizes."""

from __future__ import annotations

import json

import pytest

from oomguard.engine.cli.main import main
from oomguard.engine.core.search.strategies import Doubling, ExpandBisect
from oomguard.engine.core.search.trial import Trial
from oomguard.metrics.workload import InUnits, MetricTrial


def _drive(strategy, fits, max_size: int = 65536) -> list[int]:
    """The sizes ``strategy`` proposes against synthetic trial outcomes."""
    trials: list[Trial] = []
    while (size := strategy.next(trials, max_size)) is not None:
        assert size not in [t.size for t in trials]
        ok = fits(size)
        trials.append(Trial(size=size, ok=ok, peak_bytes=size if ok else None, seconds=0))
    return [t.size for t in trials]


def test_in_units_proposes_only_multiples_and_closes_one_unit_apart():
    e10 = _drive(InUnits(ExpandBisect(start=1, step=1), 64), lambda s: s <= 700)
    assert e10 == [64 * k for k in range(1, 12)]  # 640 fits, 704 is the first OOM
    doubling = _drive(InUnits(Doubling(start=1), 64), lambda s: s <= 700)
    assert doubling == [64, 128, 256, 512, 1024, 768, 640, 704]
    capped = _drive(InUnits(ExpandBisect(start=1, step=1), 64), lambda s: True, max_size=1024)
    assert capped == [64 * k for k in range(1, 17)]


@pytest.mark.slow
def test_internal_batch_size_unit_is_where_captum_changes_its_rows():
    trial = MetricTrial("integrated_gradients", "internal_batch_size", n_samples=3, seq_len=8,
                        params={"n_steps": 4})
    assert trial.unit() == 3 and trial.max_size() == 12  # examples, examples x n_steps
    trial.warmup()
    rows: list[int] = []
    hook = trial._state["model"].get_input_embeddings().register_forward_hook(
        lambda mod, inp, out: rows.append(int(out.shape[0])))
    most = {}
    try:
        for size in (1, 2, 3, 5, 6, 8, 9, 11, 12, 20):
            rows.clear()
            trial(size)
            most[size] = max(rows)
    finally:
        hook.remove()
    for size, n in most.items():  # constant between multiples, one unit at least
        assert n == most[min(12, max(3, size // 3 * 3))], (size, most)
    assert most[3] < most[6] < most[9] < most[12]  # and it does change at each multiple


@pytest.mark.slow
def test_search_of_internal_batch_size_runs_only_multiples_and_ends_with_an_answer(tmp_path,
                                                                                   capsys):
    code = main(["search", "--metric", "integrated_gradients", "--knob", "internal_batch_size",
                 "--samples", "6", "--seq-len", "8", "--budget", "256MiB", "--json",
                 "--out", str(tmp_path / "rep")])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    sizes = [t["size"] for t in result["trials"]]
    assert sizes and all(s % 6 == 0 for s in sizes), sizes
    assert result["max_ok"] % 6 == 0 and result["recommendation"]["safe"] % 6 == 0
    # a real answer: a closed bracket one unit wide, or every step in one forward (6 x 16)
    assert (result["first_oom"] == result["max_ok"] + 6
            or result["stopped_because"] == "max_size (96) reached"), result["stopped_because"]
    assert len(sizes) <= 17
