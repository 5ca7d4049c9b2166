"""The one sizing routine (:mod:`oomguard.engine.jobs.sizing`): pinned, then the cache,
then a search, then the default, for every memory knob, in the knob's unit; answers capped
by something other than memory recorded as capped, and searched again by a request they
do not bound; ``vjp_block`` searched only up to the hidden width.

The unit tests drive the routine with small evaluators: no child process, no budget. The
one slow test runs a real job after a capped cache entry.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from oomguard.engine.core.search.search import SearchConfig
from oomguard.engine.core.search.strategies import Guided
from oomguard.engine.jobs.cache import SizeCache, entry_key
from oomguard.engine.jobs.sizing import (
    Request,
    SearchRecord,
    Slot,
    choose_sizes,
    measure,
    minimums,
)
from oomguard.engine.jobs.spec import load_job
from oomguard.metrics.base import get_metric
from oomguard.metrics.models import model_config
from oomguard.metrics.workload import MetricTrial

DEVICE = {"device": "cpu", "name": "test-cpu", "total_bytes": 1 << 30, "budget_bytes": None}
WORKLOAD = {"model_config": "abc", "dtype": "float32", "seq_len": 16, "params": {}}
CONFIG = model_config("tiny-gpt2")  # n_embd 128: vjp_block's largest useful size


class Fits:
    """An evaluator whose knob fits up to ``limit`` (per knob; None: everything), as a
    bracketed search would answer; it records every call."""

    def __init__(self, **limits: int | None) -> None:
        self.limits, self.calls = limits, []

    def __call__(self, knob: str, sizes: dict[str, int], unit: int, cap: int) -> SearchRecord:
        self.calls.append((knob, dict(sizes), unit, cap))
        limit = self.limits.get(knob)
        top = cap if limit is None else min(limit, cap)
        top = top // unit * unit
        if top < unit:  # nothing fits
            return SearchRecord(metric="m", knob=knob, max_ok=None, first_oom=unit, unit=unit)
        return SearchRecord(metric="m", knob=knob, max_ok=top, safe=top, trials=3, unit=unit,
                            first_oom=None if limit is None or limit >= cap else top + unit)


def _request(metric: str, n_samples: int = 8, **kw: Any) -> Request:
    return Request(get_metric(metric), {}, n_samples, CONFIG, **kw)


def _slot(tmp_path: Path, metric: str = "loss") -> Slot:
    workload = {**WORKLOAD, "metric": metric}
    return Slot(SizeCache(tmp_path / "sizes.json"), entry_key(DEVICE, workload), DEVICE,
                workload)


def test_pinned_then_cache_then_search_then_default(tmp_path: Path) -> None:
    slot = _slot(tmp_path)
    never = Fits()
    got = choose_sizes(_request("loss", pinned={"micro_batch_size": 3}), evaluate=never,
                       slot=slot)
    assert (got.sizes, got.source, never.calls) == ({"micro_batch_size": 3}, "job file", [])
    assert slot.cache.get(slot.key) is None  # pins are not what the key describes

    found = choose_sizes(_request("loss", 64), evaluate=Fits(micro_batch_size=5), slot=slot)
    assert (found.sizes, found.source) == ({"micro_batch_size": 5}, "search")
    entry = slot.cache.get(slot.key)
    assert entry["sizes"] == {"micro_batch_size": 5} and entry["max_ok"] == 5
    assert entry["trials"] == 3 and entry["capped"] == {}
    assert [SearchRecord.from_dict(d) for d in entry["search"]] == found.records

    cached = choose_sizes(_request("loss", 64), evaluate=never, slot=slot)
    assert (cached.sizes, cached.source, never.calls) == ({"micro_batch_size": 5}, "cache", [])
    assert [r.source for r in cached.records] == ["cache"] and cached.entry is not None

    default = choose_sizes(_request("loss"), evaluate=None, slot=_slot(tmp_path, "other"))
    assert (default.sizes, default.source) == ({"micro_batch_size": 32}, "metric default")


def test_every_knob_is_sized_each_with_the_earlier_ones_at_their_chosen_sizes() -> None:
    fits = Fits(micro_batch_size=4, vjp_block=16)
    got = choose_sizes(_request("position_jacobian", 64), evaluate=fits)
    assert got.sizes == {"micro_batch_size": 4, "vjp_block": 16} and got.source == "search"
    (k1, sizes1, _, cap1), (k2, sizes2, _, cap2) = fits.calls
    assert (k1, sizes1, cap1) == ("micro_batch_size", {"micro_batch_size": 32, "vjp_block": 8}, 64)
    assert (k2, sizes2, cap2) == ("vjp_block", {"micro_batch_size": 4, "vjp_block": 8}, 128)
    assert [r.others for r in got.records] == [{"vjp_block": 8}, {"micro_batch_size": 4}]
    # captum's second knob too (a job used to leave internal_batch_size at its default)
    captum = Fits(chunk_size=2, internal_batch_size=4)
    got = choose_sizes(_request("integrated_gradients", 8), evaluate=captum)
    assert [c[0] for c in captum.calls] == ["chunk_size", "internal_batch_size"]
    assert got.sizes == {"chunk_size": 2, "internal_batch_size": 4}
    # a knob where nothing fits takes its minimum, and the next knob is searched from there
    nothing = Fits(micro_batch_size=0, vjp_block=2)
    got = choose_sizes(_request("position_jacobian", 8), evaluate=nothing)
    assert got.sizes == {"micro_batch_size": 1, "vjp_block": 2}
    assert nothing.calls[1][1]["micro_batch_size"] == minimums(get_metric(
        "position_jacobian"))["micro_batch_size"]
    assert got.source == "search (nothing fit; minimum) + search"


def test_sizes_are_in_the_knobs_unit() -> None:
    # internal_batch_size changes memory only at multiples of min(chunk_size, samples): 3
    got = choose_sizes(_request("integrated_gradients", 3))
    assert got.sizes["internal_batch_size"] == 6  # the default 8 runs as 6: rounded down
    fits = Fits(internal_batch_size=10)
    got = choose_sizes(_request("integrated_gradients", 3), evaluate=fits)
    assert [(c[0], c[2], c[3]) for c in fits.calls] == [
        ("chunk_size", 1, 3), ("internal_batch_size", 3, 3 * 16)]  # cap: examples x n_steps
    assert got.sizes["internal_batch_size"] == 9


def test_a_capped_answer_is_recorded_as_capped_and_a_larger_request_searches(
        tmp_path: Path) -> None:
    slot = _slot(tmp_path)
    got = choose_sizes(_request("loss", 8), evaluate=Fits(), slot=slot)  # no OOM up to 8
    (rec,) = got.records
    assert (rec.max_ok, rec.first_oom, rec.cap, rec.capped_by) == (8, None, 8, "samples")
    assert "capped by the sample count (8), not by memory" in rec.note
    assert slot.cache.get(slot.key)["capped"] == {"micro_batch_size": 8}
    # A request the cap bounds too (as few samples or fewer) takes it ...
    for n in (8, 4):
        again = Fits()
        assert choose_sizes(_request("loss", n), evaluate=again, slot=slot).source == "cache"
        assert again.calls == []
    # ... one it does not bound (64 samples; the key has no sample count) searches.
    more = Fits(micro_batch_size=20)
    got = choose_sizes(_request("loss", 64), evaluate=more, slot=slot)
    assert (got.source, got.sizes, len(more.calls)) == ("search", {"micro_batch_size": 20}, 1)
    assert got.records[0].capped_by is None and slot.cache.get(slot.key)["capped"] == {}
    # max_size caps too: a later request with a larger max_size searches again
    capped = choose_sizes(_request("loss", 1000, max_size=16), evaluate=Fits(),
                          slot=_slot(tmp_path, "m2"))
    assert capped.records[0].capped_by == "max_size"
    wider = Fits(micro_batch_size=100)
    assert choose_sizes(_request("loss", 1000, max_size=512), evaluate=wider,
                        slot=_slot(tmp_path, "m2")).sizes == {"micro_batch_size": 100}


def test_a_job_with_more_samples_than_a_capped_reference_answer_searches(tmp_path: Path) -> None:
    # The cache key a reference on 8 samples and a job on 64 look up is the same one.
    def job(n: int) -> Any:
        path = tmp_path / f"job{n}.toml"
        path.write_text(f'output = "out"\nmodels = ["tiny-gpt2"]\n[data]\nseq_len = 16\n'
                        f'n_samples = {n}\n[[metrics]]\nname = "loss"\n', encoding="utf-8")
        return load_job(path)

    from oomguard.engine.jobs.plan import device_identity, plan

    small, large = job(8), job(64)
    dev = device_identity(small)
    ((t8,), (t64,)) = plan(small), plan(large)
    assert entry_key(dev, t8.workload) == entry_key(device_identity(large), t64.workload)
    slot = Slot(SizeCache(tmp_path / "sizes.json"), entry_key(dev, t8.workload), dev,
                t8.workload, source="reference")
    choose_sizes(_request("loss", small.data.n_samples), evaluate=Fits(), slot=slot)
    searched = Fits(micro_batch_size=40)
    got = choose_sizes(_request("loss", large.data.n_samples, max_size=large.search.max_size),
                       evaluate=searched, slot=slot)
    assert got.source == "search" and got.sizes == {"micro_batch_size": 40}


def test_vjp_block_is_searched_only_up_to_the_hidden_width() -> None:
    assert MetricTrial("position_jacobian", "vjp_block").max_size() == 128  # `oomguard search`
    tried: list[int] = []

    class Free:  # memory that stops growing: every size fits
        knob, name = "vjp_block", "free"

        def __call__(self, size: int) -> None:
            tried.append(size)

    def evaluate(knob: str, sizes: dict[str, int], unit: int, cap: int) -> SearchRecord:
        config = SearchConfig(strategy=Guided(start=8), max_size=cap, max_trials=64,
                              ram_guard=False, fork=False)  # in this process: `tried` sees it
        return measure(Free(), config, metric="position_jacobian")

    got = choose_sizes(_request("position_jacobian", 8), evaluate=evaluate)
    rec = got.records[1]
    assert max(tried) == 128 and (rec.max_ok, rec.cap, rec.capped_by) == (
        128, 128, "largest useful size")
    assert len([s for s in tried if s > 8]) <= 5, tried  # 65536 took 9 trials


@pytest.mark.slow
def test_a_real_job_searches_past_a_capped_answer_in_the_cache(tmp_path: Path) -> None:
    from oomguard.engine.jobs.plan import device_identity, plan
    from oomguard.engine.jobs.runner import run_job

    path = tmp_path / "job.toml"
    path.write_text(f'output = "{tmp_path / "out"}"\nmodels = ["tiny-gpt2"]\n'
                    'budget = "384MiB"\n[data]\nseq_len = 8\nn_samples = 4\n'
                    '[search]\nmax_trials = 3\nstart = 1\n[[metrics]]\nname = "loss"\n',
                    encoding="utf-8")
    job = load_job(path)
    (task,) = plan(job)
    dev = device_identity(job)
    cache = SizeCache(tmp_path / "sizes.json")
    # what a reference on 2 samples stores: no OOM up to 2, capped by the sample count
    cache.put(entry_key(dev, task.workload), {"micro_batch_size": 2}, source="reference",
              device=dev, workload=task.workload, capped={"micro_batch_size": 2})
    outcome = run_job(job, cache_path=cache.path, progress=False)
    assert outcome.exit_code == 0, outcome.results
    result = outcome.results["loss"]
    assert result.sizes["source"] == "search" and result.search["trials"] >= 1
    assert result.searches[0] == result.search and result.search["knob"] == "micro_batch_size"
    events = [json.loads(line) for line in
              (Path(outcome.out) / "journal.jsonl").read_text().splitlines()]
    assert [e["knob"] for e in events if e["event"] == "search"] == ["micro_batch_size"]
    assert cache.get(entry_key(dev, task.workload))["source"] == "search"


def test_a_hand_edited_search_record_in_the_cache_leaves_its_sizes_usable(tmp_path: Path) -> None:
    slot = _slot(tmp_path)
    choose_sizes(_request("loss", 64), evaluate=Fits(micro_batch_size=5), slot=slot)
    doc = json.loads(slot.cache.path.read_text())
    (entry,) = [e for e in doc["entries"].values() if "search" in e]
    entry["search"] = ["not a record", 3, {"knob": "micro_batch_size"}]
    slot.cache.path.write_text(json.dumps(doc))
    never = Fits()
    got = choose_sizes(_request("loss", 64), evaluate=never, slot=slot)
    assert (got.sizes, got.source, never.calls) == ({"micro_batch_size": 5}, "cache", [])
    assert "no search record" in got.records[0].note
