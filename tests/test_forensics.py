"""Memory forensics at every OOM the executor catches (engine/core/memory/forensics.py).

- CPU, for real: an executor run that runs out of memory under a real budget records one
  event per OOM, measured *before* the failed attempt's memory is released (VmData at the
  OOM still holds the attempt's first block), with the budget's limit and headroom.
- A job end to end (the command line, ``--snapshot-on-oom`` on CPU): ``results.json``
  holds the events, ``report.md`` a row per event; a results file without the field loads.
- CUDA against fakes (this host has no GPU): the allocator's figures from a
  ``memory_stats`` dict and ``memory_snapshot`` segments shaped as torch 2.13 returns them
  (torch/csrc/cuda/Module.cpp ``_memory_snapshot``; c10 ``DeviceStats``), and an executor
  run on tests/fakes/fake_cuda.py under a budget, with a snapshot written at the OOM.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import budget_after_warmup, cli_in_child, in_fresh_process
from fakes.fake_cuda import FakeCuda, GiB, MiB

from oomguard.engine.core.execute.executor import Executor
from oomguard.engine.core.memory import budget as budget_mod
from oomguard.engine.core.memory import forensics
from oomguard.engine.core.memory.budget import budget
from oomguard.engine.core.memory.forensics import HISTORY_MAX_ENTRIES, OomEvent, cuda_view
from oomguard.engine.errors import ExecutionFailed
from oomguard.engine.jobs.records import TaskResult
from oomguard.probes.host import proc_status
from oomguard.reports.job_report import oom_events_section, oom_view

ROOT = Path(__file__).resolve().parents[1]


def two_blocks(batch_size: int) -> float:
    """Two blocks of ``batch_size`` MiB, the first alive while the second is allocated."""
    first = torch.ones(batch_size * MiB // 4)
    second = torch.ones(batch_size * MiB // 4)
    return float(first[0] + second[0])


def _cpu_run(folder: str) -> dict[str, Any]:
    ex = Executor(snapshot_on_oom=folder)
    with budget_after_warmup(100 * MiB) as b:  # 64 + 64 MiB do not fit; 32 + 32 do
        value = ex.run(two_blocks, batch_size=64)
        after = proc_status("VmData")
    with budget_after_warmup(100 * MiB):
        try:
            ex.run(two_blocks, batch_size=64, minimum={"batch_size": 64}, name="no-room")
        except ExecutionFailed as exc:
            gave_up = str(exc)
    return {"value": value, "limit": b.limit, "nbytes": b.nbytes, "after": after,
            "events": [e.to_dict() for e in ex.history[0].events],
            "attempts": ex.history[0].attempts, "gave_up": gave_up,
            "last": [e.to_dict() for e in ex.history[1].events]}


@pytest.mark.slow
def test_cpu_oom_is_measured_before_its_memory_is_released(tmp_path: Path) -> None:
    got = in_fresh_process(_cpu_run, str(tmp_path / "snapshots"))
    assert got["value"] == 2.0 and got["attempts"] == [{"batch_size": 64}, {"batch_size": 32}]
    [ev] = got["events"]  # one OOM, one event
    assert ev["sizes"] == {"batch_size": 64} and ev["device"] == "cpu"
    assert ev["action"] == "retried at batch_size=32"
    assert "DefaultCPUAllocator" in ev["error"]
    for key in ("vm_data_bytes", "rss_bytes", "free_heap_bytes", "budget_headroom_bytes"):
        assert isinstance(ev[key], int) and ev[key] >= 0, key
        assert ev["sources"][key].startswith("measured: "), key
    assert ev["vm_data_bytes"] > 0 and ev["rss_bytes"] > 0
    # Read at the OOM, not after the release: the 64 MiB first block was still alive.
    assert ev["vm_data_bytes"] - got["after"] >= 60 * MiB
    assert ev["budget_bytes"] == got["nbytes"] == 100 * MiB
    assert ev["budget_limit_bytes"] == got["limit"]
    # Headroom is RLIMIT_DATA - VmData at the OOM: too little for the 64 MiB block that failed.
    assert abs(ev["budget_limit_bytes"] - ev["vm_data_bytes"] - ev["budget_headroom_bytes"]) \
        <= MiB
    assert 0 < ev["budget_headroom_bytes"] < 64 * MiB
    for key in ("reserved_bytes", "allocated_bytes", "fragmentation", "num_alloc_retries",
                "largest_free_block_bytes", "snapshot"):
        assert ev[key] is None and ev["sources"][key].startswith("none: "), key
    assert "CUDA only" in ev["sources"]["snapshot"]
    assert not (tmp_path / "snapshots").exists()  # CPU: accepted, nothing written
    [last] = got["last"]
    assert last["action"] == ("gave up: no executable batch size: every size down to 64 ran "
                              "out of memory")
    assert got["gave_up"].startswith("no-room: " + last["action"].removeprefix("gave up: "))


PLUGIN = '''
import torch
from oomguard.metrics.base import Knob, Metric, register

@register
class TwoBlocks(Metric):
    """Two blocks of chunk x 5 MiB: under a 64 MiB budget chunk 8 runs out, 4 fits."""
    name = "test_two_blocks"
    knobs = (Knob("chunk", "memory", 8, 1),)
    def compute(self, model, data, chunk=8):
        first = torch.ones(chunk * 5 * 2**20 // 4)
        second = torch.ones(chunk * 5 * 2**20 // 4)
        return {"sum": float(first.sum() + second.sum())}
'''


@pytest.mark.slow
def test_job_results_and_report_carry_the_oom_events(tmp_path: Path) -> None:
    plugin = tmp_path / "forensics_plugin.py"
    plugin.write_text(PLUGIN, encoding="utf-8")
    out = tmp_path / "out"
    job = tmp_path / "job.toml"
    job.write_text(f'output = "{out}"\nplugins = ["{plugin}"]\nmodels = ["tiny-gpt2"]\n'
                   'budget = "64MiB"\n[data]\nseq_len = 8\nn_samples = 2\n[search]\n'
                   'enabled = false\n[[metrics]]\nname = "test_two_blocks"\n'
                   '[[metrics]]\nname = "loss"\n', encoding="utf-8")
    done = cli_in_child("run", str(job), "--cache", str(tmp_path / "cache.json"),
                        "--snapshot-on-oom", cwd=ROOT)
    assert done.returncode == 0, done.stderr
    tasks = json.loads((out / "results.json").read_text())["tasks"]
    [ev] = tasks["test_two_blocks"]["oom_events"]
    assert tasks["test_two_blocks"]["sizes"]["final"] == {"chunk": 4}
    assert (ev["sizes"], ev["action"], ev["device"]) == ({"chunk": 8}, "retried at chunk=4", "cpu")
    assert ev["vm_data_bytes"] > 0 and ev["budget_limit_bytes"] > ev["vm_data_bytes"]
    assert 0 < ev["budget_headroom_bytes"] < 40 * MiB  # the block that failed
    assert ev["snapshot"] is None and "CUDA only" in ev["sources"]["snapshot"]
    assert tasks["loss"]["oom_events"] == []
    assert not (out / "snapshots").exists()
    assert json.loads((out / "results" / "test_two_blocks.json").read_text())["oom_events"] \
        == [ev]
    report = (out / "report.md").read_text()
    section = report.split("## Out-of-memory events\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| test_two_blocks |")]
    assert len(rows) == 1
    assert "| chunk=8 | cpu | VmData " in rows[0] and "| retried at chunk=4 |" in rows[0]
    assert "headroom " in rows[0] and "under a limit of " in rows[0]
    assert "no snapshot (PyTorch records allocation history for CUDA only, not cpu)" in rows[0]


def _result(**fields: Any) -> dict[str, Any]:
    return TaskResult(task="loss", metric="loss", model="tiny-gpt2", status="ok",
                      **fields).to_dict()


def test_results_without_events_still_load_and_report_none() -> None:
    old = _result()
    del old["oom_events"]  # a result file written before the field existed
    loaded = TaskResult.from_dict(old)
    assert loaded.oom_events is None and loaded.extra == {}
    assert oom_events_section({"loss": old}) == [
        "## Out-of-memory events", "",
        "None: no metric ran out of memory during its run (search trials are not counted "
        "here).", ""]


def test_event_round_trips_through_a_task_result() -> None:
    ev = OomEvent(sizes={"micro_batch_size": 8}, device="cpu", at=1.5, error="MemoryError: ",
                  vm_data_bytes=300 * MiB, sources={"vm_data_bytes": "measured: VmData"})
    ev.settle({"micro_batch_size": 4}, "unused")
    doc = json.loads(json.dumps(_result(oom_events=[ev.to_dict()])))
    assert TaskResult.from_dict(doc).oom_events == [ev.to_dict()]
    rows = oom_events_section({"loss": doc})
    assert rows[2].startswith("| task | sizes |")
    assert rows[4] == ("| loss | micro_batch_size=8 | cpu | VmData 300.00 MiB "
                       "| retried at micro_batch_size=4 |")
    assert ev.settle(None, "no executable size").action == "gave up: no executable size"


# --------------------------------------------------------------------- CUDA, fake
def _block(size: int, state: str) -> dict[str, Any]:
    return {"address": 0, "size": size, "requested_size": size, "state": state, "frames": []}


def _segment(device: int, kind: str, blocks: list[dict[str, Any]]) -> dict[str, Any]:
    total = sum(b["size"] for b in blocks)
    used = sum(b["size"] for b in blocks if b["state"] != "inactive")
    return {"device": device, "address": 0x7F0000000000, "total_size": total,
            "allocated_size": used, "active_size": used, "requested_size": used, "stream": 0,
            "segment_type": kind, "segment_pool_id": (0, 0), "is_expandable": False,
            "frames": [], "blocks": blocks}


def _stats(reserved: int, allocated: int, retries: int, ooms: int) -> dict[str, Any]:
    """``torch.cuda.memory_stats()``'s flattened keys (c10 DeviceStats), the ones read and
    a few beside them."""
    stats: dict[str, Any] = {}
    for stat, current in (("reserved_bytes", reserved), ("allocated_bytes", allocated),
                          ("active_bytes", allocated), ("inactive_split_bytes", 6 * MiB)):
        for pool in ("all", "large_pool", "small_pool"):
            for kind in ("current", "peak", "allocated", "freed"):
                stats[f"{stat}.{pool}.{kind}"] = current if pool != "small_pool" else 0
    return stats | {"num_alloc_retries": retries, "num_ooms": ooms, "num_sync_all_streams": 0,
                    "num_device_alloc": 7, "num_device_free": 2, "max_split_size": -1}


def test_fake_cuda_fragmentation_and_largest_free_block() -> None:
    segments = [
        _segment(0, "large", [_block(12 * MiB, "active_allocated"), _block(8 * MiB, "inactive")]),
        _segment(0, "large", [_block(6 * MiB, "inactive"), _block(50 * MiB, "active_allocated"),
                              _block(30 * MiB, "active_pending_free"),  # not free yet
                              _block(10 * MiB, "inactive")]),
        _segment(0, "small", [_block(512, "active_allocated"),
                              _block(2 * MiB - 512, "inactive")]),
        _segment(1, "large", [_block(900 * MiB, "inactive")]),  # another device
    ]
    reserved = 20 * MiB + 96 * MiB + 2 * MiB
    allocated = 12 * MiB + 50 * MiB + 30 * MiB + 512
    view = cuda_view(_stats(reserved, allocated, retries=3, ooms=1), segments, index=0)
    assert view["reserved_bytes"][0] == reserved and view["allocated_bytes"][0] == allocated
    assert view["fragmentation"][0] == pytest.approx((reserved - allocated) / reserved)
    assert view["num_alloc_retries"][0] == 3
    assert view["largest_free_block_bytes"] == (
        10 * MiB, "measured: largest inactive block in memory_snapshot() (large pool)")
    assert all(source.startswith("measured: ") for _, source in view.values())
    assert cuda_view(_stats(reserved, allocated, 3, 1), segments, 1)[
        "largest_free_block_bytes"][0] == 900 * MiB
    full = cuda_view(_stats(reserved, reserved, 0, 0),
                     [_segment(0, "large", [_block(reserved, "active_allocated")])], 0)
    assert full["largest_free_block_bytes"][0] == 0 and full["fragmentation"][0] == 0.0
    empty = cuda_view(_stats(0, 0, 0, 0), [], 0)
    assert empty["fragmentation"] == (None, "none: nothing reserved")
    mallocasync = cuda_view(_stats(reserved, allocated, 0, 1), None, 0, async_backend=True)
    assert mallocasync["num_alloc_retries"][0] is None
    assert mallocasync["largest_free_block_bytes"][0] is None


def _fake_allocator(gpu: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    """``_dump_snapshot`` for the fake device; ``memory_stats`` and ``memory_snapshot`` are
    the fake allocator's own (tests/fakes/fake_cuda.py, torch's key names)."""
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda filename: Path(
        filename).write_bytes(pickle.dumps({"segments": gpu.memory_snapshot(),
                                            "device_traces": [[]]})))


def test_fake_cuda_executor_records_the_allocator_view_and_a_snapshot(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(budget_mod, "_fractions", {})
    monkeypatch.setattr(forensics, "_history", {"on": False, "why_not": "not started"})
    gpu = FakeCuda(total=16 * GiB).install(monkeypatch)
    _fake_allocator(gpu, monkeypatch)
    recorded: list[dict[str, Any]] = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda **kw: recorded.append(kw))
    live: list[int] = []

    def step(batch_size: int) -> int:
        """A cached 1000 MiB segment, then 10 and 40 MiB per item: at 64 the second block
        needs a new 2560 MiB segment that a 3 GiB cap refuses; at 32 it fits."""
        while live:  # the tensors of the attempt before, released by then
            gpu.free(live.pop())
        gpu.free(gpu.alloc(1000 * MiB))
        live.append(gpu.alloc(batch_size * 10 * MiB))
        live.append(gpu.alloc(batch_size * 40 * MiB))
        return batch_size

    ex = Executor(device="cuda:0", snapshot_on_oom=tmp_path / "snaps")
    with budget(3 * GiB, "cuda:0"):
        assert ex.run(step, batch_size=64, name="fake step") == 32
    assert recorded == [{"max_entries": HISTORY_MAX_ENTRIES}]
    [ev] = [e.to_dict() for e in ex.history[-1].events]
    assert (ev["device"], ev["sizes"], ev["action"]) == (
        "cuda:0", {"batch_size": 64}, "retried at batch_size=32")
    assert "CUDA out of memory" in ev["error"]
    assert (ev["reserved_bytes"], ev["allocated_bytes"]) == (1000 * MiB, 640 * MiB)
    assert ev["fragmentation"] == pytest.approx(0.36)
    assert ev["largest_free_block_bytes"] == 360 * MiB and ev["num_alloc_retries"] == 1
    assert ev["budget_limit_bytes"] == 3 * GiB
    assert ev["budget_headroom_bytes"] == 3 * GiB - 1000 * MiB  # cap - reserved
    assert ev["vm_data_bytes"] > 0  # the host's view is there too
    path = Path(ev["snapshot"])
    assert path == tmp_path / "snaps" / "fake_step-oom1.pickle"
    dumped = pickle.loads(path.read_bytes())  # written at the OOM, before the release
    assert dumped["segments"][0]["allocated_size"] == 640 * MiB
    line = oom_view(ev)
    assert line.startswith("reserved 1000.00 MiB, allocated 640.00 MiB, fragmentation 36.0%, "
                           "largest free block 360.00 MiB, 1 alloc retries, VmData ")
    assert line.endswith(f"snapshot `{path}`")
    assert os.listdir(tmp_path / "snaps") == ["fake_step-oom1.pickle"]
