"""The search: what each strategy proposes (fast and pure: strategies are driven
with trial records), what ``search()`` accepts and records and how it ends (on a
workload that never runs out of memory), and the E10 sequence, the linear jump,
"nothing fits" and brute-force agreement on real OOMs under a CPU budget
(slow, each in a fresh process)."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import pytest
import torch
from conftest import RaisesAt, in_fresh_process, once_per_run

from oomguard.engine.core.memory.budget import MIN_CPU_BUDGET, BudgetError, budget
from oomguard.engine.core.memory.heap import free_heap_bytes, return_freed_memory_to_os
from oomguard.engine.core.search.search import SearchConfig, search
from oomguard.engine.core.search.strategies import Doubling, ExpandBisect, LinearJump
from oomguard.engine.core.search.trial import Trial, run_trial
from oomguard.engine.errors import NoSizeFits, TrialFailed, UsageError
from oomguard.metrics.synthetic import LinearAlloc, e10_line
from oomguard.metrics.train_step import TrainStep
from oomguard.probes.host import proc_status

MiB = 1024**2
E10_TABLE = [(s, True) for s in range(32, 113, 8)] + [
    (120, False), (116, False), (114, True), (115, False)]


@dataclass
class Echo:
    """A workload that fits every size (returns it): for what ``search()`` accepts,
    records and how it stops; it never runs out of memory."""

    name: str = "echo"

    def __call__(self, size: int) -> int:
        return size


def _ran(result) -> list[tuple[int, bool]]:
    return [(t.size, t.ok) for t in result.trials]


# ------------------------------------------------------------------ strategies (fast)


def _drive(strategy, peak, fits, max_size: int = 65536) -> list[int]:
    """The sizes ``strategy`` proposes against synthetic trials with exact peaks."""
    trials: list[Trial] = []
    while (size := strategy.next(trials, max_size)) is not None:
        assert size not in [t.size for t in trials]
        ok = fits(size)
        trials.append(Trial(size=size, ok=ok, peak_bytes=peak(size) if ok else None, seconds=0))
    return [t.size for t in trials]


def _flat(size: int) -> int:
    return 10 * MiB + MiB * size


def test_e10_sequence_and_answer():
    sizes = _drive(ExpandBisect(), _flat, lambda s: s <= 114)
    assert [(s, s <= 114) for s in sizes] == E10_TABLE


def test_doubling_sequence_reaches_the_same_answer_in_fewer_trials():
    assert _drive(Doubling(start=32), _flat, lambda s: s <= 114) == [
        32, 64, 128, 96, 112, 120, 116, 114, 115]


def test_start_that_does_not_fit_halves_then_bisects():
    assert _drive(ExpandBisect(start=32, step=8), _flat, lambda s: s <= 13) == [32, 16, 8, 12, 14, 13]


def test_nothing_fitting_halves_down_to_one_and_stops():
    assert _drive(ExpandBisect(), _flat, lambda s: False) == [32, 16, 8, 4, 2, 1]


def test_linear_jump_fits_two_points_then_jumps_to_the_predicted_maximum():
    base, per = 10 * MiB, 4 * MiB
    capacity = base + per * 114 + per // 2
    sizes = _drive(LinearJump(capacity_bytes=capacity), lambda s: base + per * s,
                   lambda s: s <= 114)
    assert sizes == [8, 16, 114, 115]


def test_linear_jump_bisects_when_the_prediction_is_too_high():
    base, per = 10 * MiB, 4 * MiB
    capacity = base + per * 114  # the line says 114; the real limit is 100
    sizes = _drive(LinearJump(capacity_bytes=capacity), lambda s: base + per * s,
                   lambda s: s <= 100)
    # A failed jump leaves the bracket (16, 114): bisected, never walked down one by one.
    assert sizes == [8, 16, 114, 65, 89, 101, 95, 98, 99, 100]


# ------------------------------------------------------------------ limits and failures


def test_limits_terminate_and_only_sizes_that_ran_are_returned():
    result = search(Echo(), start=4, size_step=4, max_size=30)
    assert _ran(result) == [(s, True) for s in (4, 8, 12, 16, 20, 24, 28, 30)]
    assert (result.max_ok, result.first_oom) == (30, None)
    assert result.stopped_because == "max_size (30) reached"
    result = search(Echo(), start=4, size_step=4, max_trials=3)
    assert _ran(result) == [(4, True), (8, True), (12, True)] and result.max_ok == 12
    assert result.stopped_because == "max_trials (3) reached"


def test_max_seconds_stops_the_search():
    def slow(size: int) -> int:
        time.sleep(0.05)
        return size

    result = search(slow, max_seconds=0.01)
    assert [t.size for t in result.trials] == [32]
    assert result.stopped_because == "max_seconds (0.01) reached"


def test_non_oom_error_mid_search_is_trial_failed_with_the_partial_result():
    with pytest.raises(TrialFailed) as info:
        search(RaisesAt(48), start=32, size_step=8)
    exc = info.value
    assert isinstance(exc.__cause__, ValueError)
    assert str(exc.__cause__) == "not a memory problem at 48"
    assert _ran(exc.result) == [(32, True), (40, True)]
    assert exc.result.max_ok == 40 and exc.result.recommendation is None
    assert exc.result.stopped_because == "trial at size 48 failed: ValueError"
    assert str(exc) == ("raises-at: the trial at size 48 failed (ValueError: not a memory "
                        "problem at 48); 2 trial(s) ran before it, largest that fit: 40")


def test_the_old_step_keyword_still_works_for_one_release_and_says_its_new_name():
    with pytest.warns(FutureWarning, match=r"search\(step=\) is now search\(size_step=\)"):
        result = search(Echo(), start=16, step=8, max_size=40)
    assert result.strategy == "expand-bisect"
    assert [t.size for t in result.trials] == [16, 24, 32, 40]


def test_on_trial_sees_every_trial_in_order():
    seen: list[int] = []
    result = search(Echo(), start=16, size_step=8, max_size=40, on_trial=lambda t: seen.append(t.size))
    assert seen == [t.size for t in result.trials] == [16, 24, 32, 40]


# ------------------------------------------------------------------ the API keeps its word


@pytest.mark.parametrize(("call", "config"), [
    (dict(), {"strategy": "guided", "start": 32, "misses": 2}),
    (dict(start=64, size_step=16), {"strategy": "expand-bisect", "start": 64, "step": 16}),
    # start alone chooses as --start does: guided from there, not expand-bisect
    (dict(start=64), {"strategy": "guided", "start": 64, "misses": 2}),
    (dict(strategy=Doubling(start=64)), {"strategy": "doubling", "start": 64, "factor": 2}),
    (dict(strategy=LinearJump(capacity_bytes=10**9, start=4)),
     {"strategy": "linear-jump", "capacity_bytes": 10**9, "start": 4}),
])
def test_result_config_is_exactly_what_ran(call, config):
    result = search(Echo(), max_size=128, max_trials=40, margin=0.2, **call)
    assert result.config == {**config, "max_size": 128, "max_trials": 40, "max_seconds": None,
                             "margin": 0.2, "steps_per_trial": None, "verify_steps": 0}
    assert result.trials[0].size == config["start"]
    if "step" in config:  # the step the report quotes is the one the trials took
        assert result.trials[1].size - result.trials[0].size == config["step"]


def test_search_config_object_and_overrides():
    cfg = SearchConfig(strategy=Doubling(start=8), max_size=64)
    result = search(Echo(), cfg, max_trials=5)
    assert result.config == {"strategy": "doubling", "start": 8, "factor": 2, "max_size": 64,
                             "max_trials": 5, "max_seconds": None, "margin": "measured",
                             "steps_per_trial": None, "verify_steps": 0}
    assert [t.size for t in result.trials] == [8, 16, 32, 64]
    assert result.stopped_because == "max_size (64) reached"
    assert cfg.max_trials == 64  # frozen: the override made a new config
    with pytest.raises(Exception, match="cannot assign"):
        cfg.max_size = 1  # type: ignore[misc]


@pytest.mark.parametrize(("kwargs", "expected"), [
    (dict(start=64, size_step=16, strategy=Doubling()),
     "write strategy=Doubling(start=64, factor=2) (Doubling has no size_step)"),
    (dict(start=64, strategy=Doubling()), "write strategy=Doubling(start=64, factor=2)"),
    (dict(size_step=4, strategy=ExpandBisect(start=16)),
     "write strategy=ExpandBisect(start=16, step=4)"),
])
def test_start_or_step_with_a_strategy_is_a_usage_error_saying_how(kwargs, expected):
    with pytest.raises(UsageError) as info:
        search(Echo(), **kwargs)
    assert str(info.value).endswith(expected) and "\n" not in str(info.value)


@dataclass(frozen=True)
class LabelledE10(ExpandBisect):
    """A user's strategy: E10 with a field of its own that is not a size."""

    label: str = "mine"


def test_a_strategy_subclass_keeps_its_own_fields_and_the_built_in_checks():
    assert LabelledE10(start=4).label == "mine"
    with pytest.raises(UsageError, match="start must be a positive integer, got 0"):
        LabelledE10(start=0)


def test_start_and_step_with_a_config_strategy_is_a_usage_error():
    with pytest.raises(UsageError, match=r"Doubling\(start=64, factor=2\)"):
        search(Echo(), SearchConfig(strategy=Doubling()), start=64)


@pytest.mark.parametrize(("kwargs", "words"), [
    (dict(start=0), "start must be a positive integer, got 0"),
    (dict(start=True), "start must be a positive integer, got True"),
    (dict(start=2.5), "start must be a positive integer, got 2.5"),
    (dict(size_step=-1), "step must be a positive integer, got -1"),
    (dict(max_size=0), "max_size must be a positive integer, got 0"),
    (dict(max_trials=0), "max_trials must be a positive integer, got 0"),
    (dict(start=64, max_size=32), "start (64) is larger than max_size (32)"),
    (dict(strategy=Doubling(start=64), max_size=32), "start (64) is larger than max_size (32)"),
    (dict(budget=0), "budget must be a positive integer, got 0"),
    (dict(budget=True), "budget must be a positive integer, got True"),
    (dict(margin=1.0), "margin must be a fraction in [0, 1) or 'measured', got 1.0"),
    (dict(margin=1.5), "margin must be a fraction in [0, 1) or 'measured', got 1.5"),
    (dict(margin=float("nan")), "margin must be a fraction in [0, 1) or 'measured', got nan"),
    (dict(margin=-0.5), "margin must be a fraction in [0, 1) or 'measured', got -0.5"),
    (dict(margin=float("inf")), "margin must be a fraction in [0, 1) or 'measured', got inf"),
    (dict(max_seconds=0), "max_seconds must be a positive number or None, got 0"),
    (dict(max_seconds=float("inf")), "max_seconds must be a positive number or None, got inf"),
    (dict(max_seconds=float("nan")), "max_seconds must be a positive number or None, got nan"),
    (dict(max_size=-1), "max_size must be a positive integer, got -1"),
    (dict(max_trials=2.0), "max_trials must be a positive integer, got 2.0"),
    (dict(budget=-5), "budget must be a positive integer, got -5"),
    (dict(trial_timeout=0), "trial_timeout must be a positive number of seconds, got 0"),
    (dict(trial_timeout=-1.0), "trial_timeout must be a positive number of seconds, got -1.0"),
    (dict(trial_timeout=float("inf")), "trial_timeout must be a positive number of seconds"),
    (dict(trial_timeout=True), "trial_timeout must be a positive number of seconds, got True"),
    (dict(device="tpu"), "unknown device 'tpu'"),
    (dict(strategy="expand-bisect"), "strategy must be Guided(), ExpandBisect(), Doubling(), LinearJump(capacity)"),
])
def test_bad_options_are_one_line_usage_errors(kwargs, words):
    calls: list[int] = []
    with pytest.raises(UsageError) as info:
        search(lambda size: calls.append(size), **kwargs)
    assert words in str(info.value) and "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)
    assert calls == []  # refused before any trial ran
    if not {"start", "size_step"} & set(kwargs):  # the same check when a config is built
        with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)")
                           .replace("[", r"\[")):
            SearchConfig(**kwargs)


@pytest.mark.parametrize(("make", "words"), [
    (lambda: ExpandBisect(start=0), "start must be a positive integer, got 0"),
    (lambda: Doubling(factor=1), "factor must be at least 2, got 1"),
    (lambda: Doubling(start=-2), "start must be a positive integer, got -2"),
    (lambda: LinearJump(capacity_bytes=0), "capacity_bytes must be a positive integer, got 0"),
])
def test_bad_strategy_parameters_are_usage_errors(make, words):
    with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)")):
        make()


def test_old_positional_start_and_unknown_options_are_refused():
    with pytest.raises(UsageError, match=r"did you mean start=64\?"):
        search(Echo(), 64)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unexpected keyword argument.*stategy"):
        search(Echo(), stategy=Doubling())


def test_a_bad_budget_is_refused_before_any_trial():
    calls: list[int] = []
    with pytest.raises(BudgetError, match="too small"):
        search(lambda s: calls.append(s), budget=MIN_CPU_BUDGET - 1)
    assert calls == []


def test_a_strategy_proposing_an_impossible_size_is_a_usage_error():
    class Zero:
        name = "zero"

        def describe(self) -> str:
            return "always 0"

        def next(self, trials, max_size):
            return 0

    with pytest.raises(UsageError, match="strategy zero proposed size 0"):
        search(Echo(), strategy=Zero())


# ------------------------------------------------------------------ real OOMs (slow)


def _warm() -> None:
    """One parallel matmul (thread pools exist before the budget); freeze what the fresh
    process imported, so each trial's gc.collect() is quick."""
    torch.ones(256, 256).matmul(torch.ones(256, 256)).sum()
    gc.freeze()


def _between(w: LinearAlloc, lo: int) -> int:
    """A budget halfway between the bytes at ``lo`` and at ``lo + 1``."""
    return (w.bytes_at(lo) + w.bytes_at(lo + 1)) // 2


def _e10_search(strategy_name: str | None = None):
    w = e10_line()
    nbytes = _between(w, 114)
    strategy = {None: None, "linear": LinearJump(capacity_bytes=nbytes)}[strategy_name]
    _warm()
    if strategy is None:
        return search(w, start=32, size_step=8, budget=nbytes)
    return search(w, strategy=strategy, budget=nbytes)


@pytest.mark.slow
def test_e10_report_search_table_is_reproduced_under_a_real_budget():
    w = e10_line()
    result = in_fresh_process(_e10_search)
    assert _ran(result) == E10_TABLE
    assert (result.max_ok, result.first_oom) == (114, 115)
    assert all("can't allocate memory" in t.error for t in result.trials if not t.ok)
    # The fitted line recovers the allocation line it measured (resident bytes).
    assert result.fit is not None and result.fit.r2 > 0.99
    assert result.fit.per_item_bytes == pytest.approx(w.per_item_bytes, rel=0.05)
    rec = result.recommendation
    assert rec is not None and rec.maximum == 114 and rec.conservative <= rec.safe <= 114


@pytest.mark.slow
def test_linear_jump_finds_the_e10_answer_in_fewer_trials_under_a_real_budget():
    result = in_fresh_process(_e10_search, "linear")
    assert (result.max_ok, result.first_oom) == (114, 115)
    assert all(t.ok for t in result.trials if t.size <= 114)
    assert len(result.trials) <= 8  # the E10 routine needs 15 here


def _search_that_fits_nothing() -> tuple[list[tuple[int, bool]], str]:
    w = LinearAlloc(base_bytes=64 * MiB, per_item_bytes=1 * MiB)
    _warm()
    try:
        search(w, start=8, budget=32 * MiB)
    except NoSizeFits as exc:
        return _ran(exc.result), exc.result.stopped_because
    return [], "no NoSizeFits"


@pytest.mark.slow
def test_nothing_fits_under_a_real_budget():
    assert in_fresh_process(_search_that_fits_nothing) == (
        [(8, False), (4, False), (2, False), (1, False)], "nothing fits")


GPT2 = dict(model="gpt2:n_embd=64,n_layer=2,n_head=4,vocab_size=256,n_positions=512,"
                  "bos_token_id=0,eos_token_id=0", seq_len=512)


def _calibrate() -> int:
    """A budget halfway between the step's needs at batch 6 and at batch 7, in the units
    a CPU budget counts: growth of the virtual size over the warmed-up process.

    Sizes run in ascending order, so the virtual high-water mark (VmPeak) after size
    ``s`` is the need of ``s``; the line through sizes 3-5 (above the warm-up's own peak)
    is extended to 6.5. A fit of resident peaks instead lands within a MiB of the need
    at 7 (about 33 MiB per item; resident and virtual bytes differ by allocator slack),
    where either side of the comparison may fall.
    """
    return_freed_memory_to_os()
    step = TrainStep(**GPT2)
    step.warmup()
    base = proc_status("VmSize")  # VmPeak is the high-water mark of VmSize
    needs = []
    for size in (3, 4, 5):
        run_trial(step, size)
        needs.append(proc_status("VmPeak") - base)
    per_item = (needs[2] - needs[0]) / 2
    return int(needs[2] + 1.5 * per_item)


# Once per run (shared by the xdist workers), not once per visit of a worker's shuffled
# order to this module.
@pytest.fixture(scope="session")
def gpt2_boundary(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, int]:
    """(budget, brute-force maximum): the largest size before the first OOM,
    trying 1, 2, 3, ... in order in a fresh process under that budget; once per run."""
    return once_per_run(tmp_path_factory, "gpt2-boundary", _gpt2_boundary)


def _gpt2_boundary() -> tuple[int, int]:
    nbytes = in_fresh_process(_calibrate)
    return nbytes, in_fresh_process(_brute_in_fresh_process, nbytes)


def _brute_in_fresh_process(nbytes: int) -> int:
    # As an isolated child and search(budget=...) do: glibc's threshold set before the
    # warm-up, else the warm-up leaves 27-47 MiB of free heap (a different amount each
    # run) that trials reuse unseen by the budget, and this side's boundary moves by up to
    # one item (docs/measurements.md#free-heap-at-budget-entry).
    return_freed_memory_to_os()
    step = TrainStep(**GPT2)
    step.warmup()
    with budget(nbytes):
        best = 0
        for size in range(1, 65):
            if not run_trial(step, size).ok:
                break
            best = size
    return best


def _search_in_fresh_process(nbytes: int) -> tuple[int | None, int | None]:
    # One step per trial, as the brute force runs it: the subject is the bracket.
    result = search(TrainStep(**GPT2), start=4, size_step=4, budget=nbytes, steps_per_trial=1)
    return result.max_ok, result.first_oom


@dataclass
class FragmentingWarmup:
    """A warm-up that, under glibc's default threshold, leaves 32 MiB of free heap
    between the blocks it keeps (1 MiB blocks, every other one kept, as a model build
    can); each trial returns the free heap bytes it sees inside the budget."""

    name: str = "fragmenting-warmup"
    _kept: list = field(default_factory=list, repr=False)

    def __getstate__(self) -> dict:
        return {"name": self.name, "_kept": []}

    def warmup(self) -> None:
        torch.empty(1 << 20, dtype=torch.uint8)  # a freed mmapped block raises glibc's threshold
        blocks = [torch.empty(1 << 20, dtype=torch.uint8) for _ in range(64)]
        self._kept[:] = blocks[1::2]

    def __call__(self, size: int) -> int:
        return free_heap_bytes() or 0


def _free_heap_seen_by_a_trial(isolate: bool) -> int:
    result = search(FragmentingWarmup(), start=1, max_trials=1, budget=64 * MiB,
                    isolate=isolate)
    return result.trials[0].value


@pytest.mark.slow
def test_a_warm_up_leaves_no_free_heap_for_budgeted_trials_to_reuse():
    # Free heap is counted in the budget's baseline yet serves a trial's allocations, so
    # each MiB of it is a MiB more budget; in-process (fresh process, as a user runs it)
    # and isolated, the warm-up must leave none of it.
    assert in_fresh_process(_free_heap_seen_by_a_trial, False) < 4 * MiB
    assert _free_heap_seen_by_a_trial(True) < 4 * MiB


@pytest.mark.slow
def test_gpt2_step_search_matches_brute_force_in_process(gpt2_boundary):
    # In-process answers depend on the process's history, so each side starts
    # from the same state: its own fresh process, model built, one warm-up step.
    nbytes, brute = gpt2_boundary
    assert 5 <= brute <= 8  # the budget sits between the fitted peaks at 6 and 7
    assert in_fresh_process(_search_in_fresh_process, nbytes) == (brute, brute + 1)


@pytest.mark.slow
def test_gpt2_step_search_isolated_matches_brute_force(gpt2_boundary):
    # Every isolated trial is a fresh process, so the bracket it closes is the
    # fresh-process boundary; with the same heap preparation on both sides and the
    # half-item of slack on each side of the budget it is the same as brute force in
    # one process.
    nbytes, brute = gpt2_boundary
    result = search(TrainStep(**GPT2), start=4, size_step=4, budget=nbytes, isolate=True,
                    steps_per_trial=1)
    assert result.mode == "isolated" and all(t.mode == "isolated" for t in result.trials)
    assert (result.max_ok, result.first_oom) == (brute, brute + 1)


def test_a_search_stopped_before_any_trial_does_not_claim_every_size_ran_out():
    with pytest.raises(NoSizeFits, match=r"no trial ran \(.*max_seconds") as info:
        search(lambda size: None, max_seconds=1e-9)
    assert info.value.result.trials == [] and "ran out of memory" not in str(info.value)
