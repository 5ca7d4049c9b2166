"""CPU work without a budget runs to the limit the kernel enforces, not to 80% of it.

Under an ``RLIMIT_DATA`` someone else set, an allocation past it is a real, catchable
error: a search goes up to it. Under a cgroup limit the kernel kills instead, so the
search sets its own ``RLIMIT_DATA`` budget just under the cgroup's room and runs to
that. The 80% RAM guard is for physical RAM only. Each boundary is asserted in a fresh
process, with real allocations; the cgroup is a real one where this machine lets root
create it, and a faked cgroup reading (files laid out as the kernel's) elsewhere.
"""

from __future__ import annotations

import os
import resource
import time
import uuid
from pathlib import Path

import pytest
import torch
from conftest import in_fresh_process
from test_guided_curve import MOST_TRIALS, SquareBlock

from oomguard import search
from oomguard.engine.core.memory.budget import active_budget
from oomguard.engine.core.memory.host_limit import CGROUP_SLACK_MIN, HostLimit
from oomguard.engine.core.search.isolate import IsolatedRunner
from oomguard.engine.core.search.limit import limit_budget, unbudgeted_limit
from oomguard.engine.core.search.ramguard import RamGuard
from oomguard.engine.errors import BudgetError
from oomguard.metrics.synthetic import e10_line
from oomguard.probes import host

MiB = 1024**2
LINE = e10_line()  # 26.2 MB + 3.75 MB per item, real touched allocations
# Between 114 and 115 items of the line: the E10 report's answer.
ROOM_114 = (LINE.bytes_at(114) + LINE.bytes_at(115)) // 2


def _largest_under(room: int) -> int:
    return (room - LINE.base_bytes) // LINE.per_item_bytes


def _search_under_rlimit(isolate: bool) -> dict:
    LINE(1)  # warm up as the search will, then set the limit around this process
    torch.ones(1 << 20).sum()
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (host.proc_status("VmData") + ROOM_114, hard))
    try:
        return search(LINE, isolate=isolate).to_dict()
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


@pytest.mark.slow
def test_search_without_budget_reaches_the_maximum_under_an_rlimit_set_around_the_process() -> None:
    got = in_fresh_process(_search_under_rlimit, False)
    # The RAM guard at 80% of the room stopped at 90 here; the limit itself is at 114.
    assert (got["max_ok"], got["first_oom"]) == (114, 115)
    assert got["limit"]["kind"] == "RLIMIT_DATA" and got["limit"]["enforced"] is True
    assert not any(t["guarded"] for t in got["trials"])  # every OOM was a real allocation's
    oom = next(t for t in got["trials"] if t["outcome"] == "oom")
    assert "can't allocate memory" in oom["error"]


@pytest.mark.slow
def test_isolated_search_under_an_rlimit_is_bounded_by_it_not_by_the_guard() -> None:
    got = in_fresh_process(_search_under_rlimit, True)
    assert got["limit"]["kind"] == "RLIMIT_DATA"
    assert not any(t["guarded"] for t in got["trials"]) and got["first_oom"] is not None
    # A child's data segment differs from this process's (what the forkserver imported),
    # so its room under the same limit does too: the answer is the child's maximum, what the
    # limit left the trial at its start (``headroom_bytes``), to within an item or two.
    best = next(t for t in got["trials"] if t["size"] == got["max_ok"])
    most = _largest_under(best["headroom_bytes"])
    assert most - 2 <= got["max_ok"] <= most


@pytest.mark.slow
def test_the_line_under_an_rlimit_answers_its_true_maximum_in_every_run() -> None:
    # One of two quiet runs answered 113 before (the guided fit was not used under an enforced
    # limit); three fresh processes now answer 114 each.
    runs = [in_fresh_process(_search_under_rlimit, False) for _ in range(3)]
    assert [(r["max_ok"], r["first_oom"]) for r in runs] == [(114, 115)] * 3
    assert all(len(r["trials"]) <= 5 for r in runs), [len(r["trials"]) for r in runs]


def _square_under_rlimit(isolate: bool) -> dict:
    """A guided search of :class:`SquareBlock` under an RLIMIT_DATA set around this process (as
    ``ulimit -d`` or a scheduler sets it), with no budget; with ``isolate``, also whether the
    answer and the size above it run in fresh children under the same limit."""
    SquareBlock()(4)
    torch.ones(1 << 20).sum()
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (host.proc_status("VmData") + 160 * MiB, hard))
    try:
        got = search(SquareBlock(), isolate=isolate, max_size=4096).to_dict()
        if isolate:
            limit = unbudgeted_limit()
            with IsolatedRunner(SquareBlock(), limit=limit) as run:
                got["fresh"] = [run(got["max_ok"] + k, 1).ok for k in (0, 1)]
        return got
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


@pytest.mark.slow
@pytest.mark.parametrize("isolate", [False, True], ids=["in-process", "isolated"])
def test_a_curve_under_an_enforced_rlimit_closes_in_six_or_seven_trials_as_under_a_budget(
        isolate: bool) -> None:
    got = in_fresh_process(_square_under_rlimit, isolate)
    seen = [(t["size"], t["outcome"]) for t in got["trials"]]
    assert got["limit"]["kind"] == "RLIMIT_DATA", got["limit"]
    assert got["first_oom"] == got["max_ok"] + 1 and len(got["trials"]) <= MOST_TRIALS, seen
    assert not any(t["guarded"] for t in got["trials"])
    if isolate:  # exact: the answer runs in a fresh child under the limit, the size above not
        assert got["fresh"] == [True, False], (got["max_ok"], got["fresh"])


# --- cgroups -------------------------------------------------------------------------------

def _new_cgroup(limit: int) -> Path | None:
    """A memory cgroup of ``limit`` bytes this test may use (v1 or v2), or None where this
    machine does not let the test create one (not root, read-only, no memory controller)."""
    name = f"oomguard-test-{uuid.uuid4().hex[:8]}"
    for base, limit_file in ((Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
                             (Path("/sys/fs/cgroup"), "memory.max")):
        if not (base / "cgroup.procs").exists():
            continue
        try:
            (base / name).mkdir()
        except OSError:
            continue
        try:
            (base / name / limit_file).write_text(str(limit))
            return base / name
        except OSError:
            (base / name).rmdir()
    return None


def _remove_cgroup(path: Path) -> None:
    for _ in range(50):  # the child's exit reaches the cgroup a moment after its result
        try:
            path.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def _kills(path: Path) -> int:
    for name in ("memory.oom_control", "memory.events"):
        try:
            lines = (path / name).read_text().splitlines()
        except OSError:
            continue
        return next(int(line.split()[1]) for line in lines if line.startswith("oom_kill "))
    raise AssertionError(f"no OOM-kill counter under {path}")


def _search_in_cgroup(procs: str) -> dict:
    Path(procs).write_text(str(os.getpid()))  # from here on, what this process adds is charged
    return search(LINE).to_dict()


@pytest.mark.slow
def test_search_without_budget_in_a_real_cgroup_sets_its_own_rlimit_and_is_never_killed() -> None:
    group = _new_cgroup(600 * MiB)
    if group is None:
        pytest.skip("this machine does not let the test create a memory cgroup; "
                    "test_a_faked_cgroup_reading_sets_a_budget_under_its_room covers the rest")
    try:
        got = in_fresh_process(_search_in_cgroup, str(group / "cgroup.procs"))
        kills = _kills(group)
    finally:
        _remove_cgroup(group)
    assert got["limit"]["kind"] == "cgroup" and got["limit"]["enforced"] is True
    assert kills == 0  # every OOM was an exception in the search, none the kernel's kill
    assert not any(t["guarded"] for t in got["trials"]) and got["first_oom"] is not None
    # The search ran to the budget it set (what it left each trial: ``headroom_bytes``), just
    # under the room the cgroup left after the warm-up; the RAM guard stopped at 79% of it.
    best = next(t for t in got["trials"] if t["size"] == got["max_ok"])
    most = _largest_under(best["headroom_bytes"])
    assert most - 2 <= got["max_ok"] <= most
    room = got["limit"]["room_bytes"]
    assert room - 2 * max(CGROUP_SLACK_MIN, 0.02 * room) <= best["headroom_bytes"] < room


def _fake_cgroup(tmp_path: Path, limit: int, usage: int, inactive_file: int) -> tuple[Path, Path]:
    """A /proc and cgroup v2 tree as the kernel lays them out (proc(5): ``0::/path`` in
    /proc/self/cgroup; cgroup-v2.rst: memory.max, memory.current, memory.stat's
    ``inactive_file``), with this process's real status and statm."""
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    for name in ("status", "statm", "clear_refs"):
        (proc / "self" / name).symlink_to(f"/proc/self/{name}")
    (proc / "meminfo").symlink_to("/proc/meminfo")
    (proc / "self" / "cgroup").write_text("0::/box\n")
    (root / "box").mkdir(parents=True)
    (root / "box" / "memory.max").write_text(f"{limit}\n")
    (root / "box" / "memory.current").write_text(f"{usage}\n")
    (root / "box" / "memory.stat").write_text(f"anon {usage - inactive_file}\n"
                                              f"inactive_file {inactive_file}\nfile_mapped 0\n")
    return proc, root


def _faked_cgroup_search(proc: str, root: str) -> dict:
    host.PROC, host.CGROUP_ROOT = Path(proc), Path(root)
    limit = unbudgeted_limit()
    entered = []
    with limit_budget(None, "cpu", limit) as b:
        entered.append((b.nbytes, resource.getrlimit(resource.RLIMIT_DATA)[0] - b.limit))
    return {"limit": limit, "entered": entered, "after": active_budget(),
            "search": search(LINE).to_dict()}


@pytest.mark.slow
def test_a_faked_cgroup_reading_sets_a_budget_under_its_room(tmp_path: Path) -> None:
    # 300 MiB in use of which 100 MiB inactive file pages the kernel reclaims first: 200 MiB
    # of working set under a 200 MiB + ROOM_114 + slack limit.
    room = ROOM_114 + CGROUP_SLACK_MIN
    proc, root = _fake_cgroup(tmp_path, limit=200 * MiB + room, usage=300 * MiB,
                              inactive_file=100 * MiB)
    got = in_fresh_process(_faked_cgroup_search, str(proc), str(root))
    assert got["limit"] == HostLimit("cgroup", 200 * MiB + room, room)
    assert got["entered"] == [(ROOM_114, 0)] and got["after"] is None
    s = got["search"]
    assert s["limit"]["kind"] == "cgroup" and (s["max_ok"], s["first_oom"]) == (114, 115)
    assert not any(t["guarded"] for t in s["trials"])


def test_the_ram_guard_binds_where_enforced_limits_leave_more_room(monkeypatch) -> None:
    guard = RamGuard(limit_bytes=100 * MiB)
    roomy = host.EnforcedLimit("cgroup", 10**12, 200 * MiB)
    tight = host.EnforcedLimit("RLIMIT_DATA", 10**12, 50 * MiB)
    monkeypatch.setattr(host, "enforced_limits", lambda: [roomy])
    assert unbudgeted_limit("cpu", guard) is guard
    monkeypatch.setattr(host, "enforced_limits", lambda: [roomy, tight])
    assert unbudgeted_limit("cpu", guard) == HostLimit("RLIMIT_DATA", 10**12, 50 * MiB)
    assert unbudgeted_limit("cuda", guard) is None  # a GPU has its own limit


# A metric whose memory is its knob: `chunk` blocks of 8 MiB, touched; its result does not
# depend on the knob (a search checks that first).
GROW_PLUGIN = '''
import torch
from oomguard.metrics.base import Knob, Metric, register

@register
class Grow(Metric):
    name = "test_grow"
    knobs = (Knob("chunk", "memory", 64, 1),)
    def compute(self, model, data, chunk=64):
        blocks = [torch.ones(2**20, dtype=torch.float64) for _ in range(chunk)]
        return {"mean": float(sum(b.sum() for b in blocks)) / chunk}
'''


def _job_in_cgroup(procs: str, job_path: str) -> dict:
    from oomguard.engine.jobs.runner import run_job
    from oomguard.engine.jobs.spec import load_job

    Path(procs).write_text(str(os.getpid()))
    outcome = run_job(load_job(job_path), progress=False)
    return {key: (r.status, r.reason, (r.sizes or {}).get("final"))
            for key, r in outcome.results.items()}


@pytest.mark.slow
@pytest.mark.parametrize("where", ["own", "parent"], ids=["its-own-group", "a-parents-limit"])
def test_a_job_without_budget_in_a_real_cgroup_retries_an_oom_instead_of_being_killed(
        tmp_path: Path, where: str) -> None:
    group = _new_cgroup(1024 * MiB)
    if group is None:
        pytest.skip("this machine does not let the test create a memory cgroup")
    # "parent": the job runs in an unlimited child of the limited group (Slurm's job and step
    # layout); its task was killed there and recorded as a crash, never retried.
    inner = group / "step_0" if where == "parent" else group
    (tmp_path / "grow_plugin.py").write_text(GROW_PLUGIN, encoding="utf-8")
    job = tmp_path / "job.toml"
    job.write_text(f'output = "{tmp_path / "out"}"\nplugins = ["{tmp_path / "grow_plugin.py"}"]\n'
                   'models = ["tiny-gpt2"]\n[data]\nseq_len = 8\nn_samples = 2\n'
                   '[search]\nenabled = false\n[[metrics]]\nname = "test_grow"\n'
                   'sizes = { chunk = 128 }\n', encoding="utf-8")
    try:
        inner.mkdir(exist_ok=True)
        got = in_fresh_process(_job_in_cgroup, str(inner / "cgroup.procs"), str(job))
        kills = _kills(group) + (_kills(inner) if inner != group else 0)
    finally:
        if inner != group:
            _remove_cgroup(inner)
        _remove_cgroup(group)
    # 128 blocks (1 GiB) cannot fit in 1 GiB beside the job's processes: an OOM the executor
    # answers at half, and the kernel kills no process of the job.
    status, reason, final = got["test_grow"]
    assert (status, kills) == ("ok", 0), reason
    assert final["chunk"] <= 64


def test_a_cgroup_that_leaves_too_little_room_is_a_one_line_error_before_any_work(
        tmp_path: Path, monkeypatch) -> None:
    proc, root = _fake_cgroup(tmp_path, limit=500 * MiB, usage=495 * MiB, inactive_file=0)
    monkeypatch.setattr(host, "PROC", proc)
    monkeypatch.setattr(host, "CGROUP_ROOT", root)
    before = resource.getrlimit(resource.RLIMIT_DATA)
    ran = []
    with pytest.raises(BudgetError) as err:
        search(lambda n: ran.append(n))
    assert "cgroup limit of 500.00 MiB leaves 5.00 MiB to this work" in str(err.value)
    assert "give the container or job more memory" in str(err.value)
    # no trial ran, and no warm-up call here: forked trials warm up in their forks
    assert "\n" not in str(err.value) and ran == []
    assert resource.getrlimit(resource.RLIMIT_DATA) == before


def test_reports_and_records_name_the_enforced_limit_that_bound_the_search(tmp_path: Path) -> None:
    from oomguard.engine.core.search.fit import fit_line
    from oomguard.engine.core.search.record import record_of
    from oomguard.engine.core.search.search import SearchResult
    from oomguard.reports import write_report
    from oomguard.results import Trial

    limit = HostLimit("cgroup", 1200 * MiB, 1000 * MiB)
    trials = [Trial(4, True, 40 * MiB, 0.1), Trial(8, True, 80 * MiB, 0.1),
              Trial(9, False, None, 0.1, error="RuntimeError: can't allocate memory")]
    result = SearchResult(workload="grow", device="cpu", mode="in-process", strategy="guided",
                          strategy_description="guided", max_ok=8, first_oom=9, trials=trials,
                          fit=fit_line(trials), recommendation=None, capacity_bytes=900 * MiB,
                          budget_bytes=None, stopped_because="bracket closed", seconds=1.0,
                          limit=limit.to_dict())
    write_report(result, tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert ("- **Memory budget**: none; trials were bounded by the cgroup memory limit "
            "1.17 GiB (1000.00 MiB left; enforced:") in text
    assert "estimated, not enforced" not in text
    assert record_of(result, metric="loss").limit == limit.describe()


# --- limits on a parent cgroup, and the CLI's default budget inside one ---------------------

def _fake_tree(tmp_path: Path, own: str, groups: dict[str, tuple[int | None, int]],
               v1: bool = False) -> tuple[Path, Path]:
    """A /proc and cgroup tree as the kernel lays them out, this process in group ``own``:
    ``groups`` maps each folder (relative, "" the root) to (limit or None for none, working set)
    in bytes, with no inactive file pages; v2 (``0::/own``, memory.max, "max" for none) or v1
    (``4:memory:/own``, memory.limit_in_bytes, ~2**63 for none, the ``memory`` mount)."""
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    for name in ("status", "statm", "clear_refs", "smaps_rollup"):
        (proc / "self" / name).symlink_to(f"/proc/self/{name}")
    (proc / "meminfo").symlink_to("/proc/meminfo")
    (proc / "self" / "cgroup").write_text(f"4:memory:/{own}\n" if v1 else f"0::/{own}\n")
    mount = root / "memory" if v1 else root
    for rel, (limit, used) in groups.items():
        where = mount / rel
        where.mkdir(parents=True, exist_ok=True)
        if v1:
            (where / "memory.limit_in_bytes").write_text(f"{limit or 9223372036854771712}\n")
            (where / "memory.usage_in_bytes").write_text(f"{used}\n")
            (where / "memory.stat").write_text(f"total_inactive_file 0\nrss {used}\n")
        else:
            (where / "memory.max").write_text(f"{limit or 'max'}\n")
            (where / "memory.current").write_text(f"{used}\n")
            (where / "memory.stat").write_text(f"inactive_file 0\nanon {used}\n")
    return proc, root


@pytest.mark.parametrize("v1", [False, True], ids=["v2", "v1"])
def test_a_limit_on_an_ancestor_cgroup_binds_the_process_in_an_unlimited_child(
        tmp_path: Path, monkeypatch, v1: bool) -> None:
    # Slurm's layout: the job's group limited, the step's (this process's) not; a roomier
    # limit on the grandparent, none on the root.
    proc, root = _fake_tree(tmp_path, "slurm/job_7/step_0", {
        "": (None, 20 * 1024 * MiB), "slurm": (4096 * MiB, 3500 * MiB),
        "slurm/job_7": (1024 * MiB, 300 * MiB), "slurm/job_7/step_0": (None, 200 * MiB)}, v1)
    monkeypatch.setattr(host, "PROC", proc)
    monkeypatch.setattr(host, "CGROUP_ROOT", root)
    # the grandparent's limit is larger, but leaves less room (596 MiB against 724): it binds
    assert host.cgroup_limit() == (4096 * MiB, 3500 * MiB)
    (root / ("memory/slurm" if v1 else "slurm") / ("memory.usage_in_bytes" if v1 else
                                                   "memory.current")).write_text(f"{500 * MiB}\n")
    assert host.cgroup_limit() == (1024 * MiB, 300 * MiB)
    snap = host.host_memory()
    assert (snap["total"], snap["free"], snap["limited_by"]) == (1024 * MiB, 724 * MiB, "cgroup")


def test_a_container_without_a_cgroup_namespace_reads_its_own_group_at_the_mount(
        tmp_path: Path, monkeypatch) -> None:
    # /proc/self/cgroup names the host's path, while the container sees its own group at the
    # mount point: the folders that do not exist are skipped.
    proc, root = _fake_tree(tmp_path, "docker/0123abcd", {"": (768 * MiB, 100 * MiB)}, v1=True)
    monkeypatch.setattr(host, "PROC", proc)
    monkeypatch.setattr(host, "CGROUP_ROOT", root)
    assert host.cgroup_limit() == (768 * MiB, 100 * MiB)


def test_the_default_cpu_budget_is_lowered_inside_a_cgroup_and_a_given_one_is_refused(
        tmp_path: Path, monkeypatch) -> None:
    import argparse

    from oomguard.engine.cli import options
    from oomguard.engine.cli.main import build_parser
    from oomguard.engine.core.memory.budget import check_budget

    proc, root = _fake_tree(tmp_path, "job/step", {"job": (1024 * MiB, 200 * MiB),
                                                   "job/step": (None, 100 * MiB)})
    monkeypatch.setattr(host, "PROC", proc)
    monkeypatch.setattr(host, "CGROUP_ROOT", root)
    cpu = torch.device("cpu")
    assert options.default_budget(cpu, None) is None  # was 2 GiB: past the 824 MiB room, a kill
    why = options.lowered_default(cpu)
    assert why is not None and "default 2.00 GiB budget" in why and "1.00 GiB" in why
    assert options.default_budget(cpu, 512 * MiB) == 512 * MiB
    with pytest.raises(BudgetError) as err:  # given, it is the user's: refused, not lowered
        check_budget(2048 * MiB, "cpu")
    assert "\n" not in str(err.value) and "choose a smaller --budget" in str(err.value)
    argv = ["bench", "--budget", "none"]
    args = build_parser(argv).parse_args(argv)
    assert isinstance(args, argparse.Namespace) and options.default_budget(cpu, args.budget) is None
    assert options.search_config(args, cpu).budget is None


def test_a_budget_entered_inside_a_cgroup_never_passes_the_room_it_leaves(
        tmp_path: Path, monkeypatch) -> None:
    from oomguard.engine.core.memory.budget import budget

    vm_data = host.proc_status("VmData")
    proc, root = _fake_tree(tmp_path, "box", {"box": (vm_data + 400 * MiB, vm_data)})
    monkeypatch.setattr(host, "PROC", proc)
    monkeypatch.setattr(host, "CGROUP_ROOT", root)
    before = resource.getrlimit(resource.RLIMIT_DATA)
    with budget(300 * MiB, "cpu") as small:  # fits: as asked
        assert small.limit - host.proc_status("VmData") <= 300 * MiB
    # 1 GiB checked elsewhere (another process, before a warm-up) is lowered under the room
    with budget(1024 * MiB, "cpu") as large:
        room = large.limit - host.proc_status("VmData")
        assert 300 * MiB < room <= 400 * MiB - CGROUP_SLACK_MIN  # was 1 GiB: past it, a kill
        assert resource.getrlimit(resource.RLIMIT_DATA)[0] == large.limit
    assert resource.getrlimit(resource.RLIMIT_DATA) == before


def _probe_and_search_in_cgroup(procs: str) -> dict:
    from oomguard.probes import probe

    Path(procs).write_text(str(os.getpid()))
    return {"cgroup": host.cgroup_limit(), "total": probe("cpu").total_bytes,
            "search": search(LINE).to_dict()}


@pytest.mark.slow
def test_an_unlimited_child_of_a_limited_real_cgroup_probes_its_parents_limit_and_is_never_killed(
        ) -> None:
    parent = _new_cgroup(1024 * MiB)
    if parent is None:
        pytest.skip("this machine does not let the test create a memory cgroup; "
                    "test_a_limit_on_an_ancestor_cgroup_binds_... covers the reading")
    child = parent / "step_0"
    try:
        child.mkdir()  # no limit of its own, as a Slurm step's or a container's inner group
        got = in_fresh_process(_probe_and_search_in_cgroup, str(child / "cgroup.procs"))
        kills = _kills(parent) + _kills(child)
    finally:
        _remove_cgroup(child)
        _remove_cgroup(parent)
    assert got["cgroup"][0] == 1024 * MiB and got["total"] == 1024 * MiB  # was the host's RAM
    s = got["search"]
    assert s["limit"]["kind"] == "cgroup" and s["limit"]["limit_bytes"] == 1024 * MiB
    assert kills == 0 and s["first_oom"] is not None
    assert not any(t["guarded"] for t in s["trials"])


def _cli_in_cgroup(procs: str, argv: list[str], cwd: str) -> tuple[int, str, str]:
    from conftest import oomguard_here

    Path(procs).write_text(str(os.getpid()))
    return oomguard_here(argv, cwd, {})


@pytest.mark.slow
def test_search_with_the_default_budget_or_none_in_a_1gib_cgroup_is_never_killed(
        tmp_path: Path) -> None:
    group = _new_cgroup(1024 * MiB)
    if group is None:
        pytest.skip("this machine does not let the test create a memory cgroup; "
                    "test_the_default_cpu_budget_is_lowered_inside_a_cgroup_... covers the rest")
    (tmp_path / "grow_plugin.py").write_text(GROW_PLUGIN, encoding="utf-8")
    argv = ["search", "--plugin", "grow_plugin.py", "--metric", "test_grow", "--samples", "2",
            "--seq-len", "8"]
    procs = str(group / "cgroup.procs")
    try:
        # The default 2 GiB budget was entered as given: the kernel killed the search (137)
        # after its first trial, with nothing written.
        default = in_fresh_process(_cli_in_cgroup, procs, [*argv, "--out", "default"],
                                   str(tmp_path))
        none = in_fresh_process(_cli_in_cgroup, procs, [*argv, "--budget", "none", "--out",
                                                        "none"], str(tmp_path))
        given = in_fresh_process(_cli_in_cgroup, procs, [*argv, "--budget", "2GiB", "--out",
                                                         "given"], str(tmp_path))
        # reference refused its own default: "2.00 GiB is more than cpu's 1.00 GiB in total"
        reference = in_fresh_process(_cli_in_cgroup, procs, [
            "reference", "--metric", "loss", "--samples", "2", "--seq-len", "8", "--cache",
            "sizes.json", "--out", "ref"], str(tmp_path))
        kills = _kills(group)
    finally:
        _remove_cgroup(group)
    assert kills == 0
    code, out, err = default
    assert code == 0, err
    assert "maximum chunk:" in out and (tmp_path / "default" / "report.md").exists()
    first = err.splitlines()[0]
    assert "under the cgroup memory limit 1.00 GiB" in first and "default 2.00 GiB" in first
    report = (tmp_path / "default" / "report.md").read_text()
    assert "- **Default budget**: the default 2.00 GiB budget is more than the" in report
    # 128 MiB of blocks plus the process fit the room, not 2 GiB
    assert 32 < int(out.split("maximum chunk: ")[1].split()[0]) < 128
    code, out, err = none
    assert code == 0 and "maximum chunk:" in out, err
    assert "under the cgroup memory limit 1.00 GiB" in err.splitlines()[0]
    assert "default" not in err.splitlines()[0]  # none was given: nothing was lowered
    code, out, err = given  # the user's own budget past the room: one line, before any work
    assert code != 0 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "budget 2.00 GiB is more than the" in err and "choose a smaller --budget" in err
    assert not (tmp_path / "given").exists()
    code, out, err = reference
    assert code == 0 and (tmp_path / "ref" / "sizes.toml").exists(), err
    assert "the default 2.00 GiB budget is more than the" in err.splitlines()[0]
