"""Windows and macOS, through fakes of what this Linux machine cannot be.

The subprocess tests hide ``resource`` (Windows), ``/proc`` and glibc, give Windows its
``signal`` (no SIGKILL) and macOS its spawn default, make ``platform.system()`` and
``sys.platform`` say Windows or macOS, then import every module of oomguard, run
``oomguard probe --json`` and ``oomguard metrics``, and start isolated trials' children
(real Linux processes: a fitting trial and one that dies) (tests/fakes/fake_platform.py
says what each fake follows). The others call oomguard in this process with one OS piece
replaced.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from fakes.fake_platform import WINDOWS_MISSING, darwin_resource, darwin_tools, windows_signal

from oomguard.engine.core import child as launcher
from oomguard.probes import host

TESTS = Path(__file__).parent
MiB = 1024**2
# One worker runs this module, so the module fixture that makes the fake OSes' reports
# (both OSes, every module imported: ~29 s of a core) runs once, not once per worker.
pytestmark = pytest.mark.xdist_group("fake_os")


@pytest.fixture(scope="module")
def fake_os_reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Both fake OSes, run at the same time (each takes ~2.5 s, mostly importing torch)."""
    root = tmp_path_factory.mktemp("fake_os")
    (root / "proc").mkdir()
    args = {"Windows": [str(root / "proc")],
            "Darwin": [str(root / "proc"), str(root / "bin")]}
    procs = {name: subprocess.Popen(
        [sys.executable, str(TESTS / "fakes" / "fake_platform.py"), name, *rest],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=root)
        for name, rest in args.items()}
    reports = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        line = next((ln for ln in out.splitlines() if ln.startswith("FAKE-REPORT ")), None)
        assert line is not None, f"{name}: no report (exit {proc.returncode}):\n{err[-3000:]}"
        reports[name] = json.loads(line.removeprefix("FAKE-REPORT "))
    return reports


def _cpu_row(report: dict) -> dict:
    assert report["probe"]["code"] == 0, report["probe"]["stderr"]
    rows = json.loads(report["probe"]["stdout"])
    return next(r for r in rows if r["device"] == "cpu")


@pytest.mark.slow
@pytest.mark.parametrize("os_name", ["Windows", "Darwin"])
def test_fake_os_imports_every_module_and_runs_probe_and_metrics(
        fake_os_reports: dict[str, dict], os_name: str) -> None:
    report = fake_os_reports[os_name]
    assert report["failed_imports"] == {}
    assert report["metrics"]["code"] == 0, report["metrics"]["stderr"]
    assert "fisher_diagonal:" in report["metrics"]["stdout"]
    cpu = _cpu_row(report)
    assert cpu["available"]
    # Measured figures of a real machine (the fakes pass this host's own), never 0 or None.
    assert 0 < cpu["free_bytes"] <= cpu["total_bytes"]
    assert cpu["process_bytes"] > 10 * MiB
    # The host says what it cannot enforce, and how it measures peaks.
    assert "not available" in report["host"]["budget"]
    assert "estimated, not enforced" in report["host"]["budget"]
    assert report["host"]["peak"] > 10 * MiB
    assert not report["host"]["peak_resettable"]
    assert cpu["extra"]["budget"] == report["host"]["budget"]
    assert cpu["extra"]["peak"] == report["host"]["peak_source"]


@pytest.mark.slow
@pytest.mark.parametrize("os_name", ["Windows", "Darwin"])
def test_fake_os_search_without_budget_runs_under_an_estimated_ram_guard(
        fake_os_reports: dict[str, dict], os_name: str) -> None:
    found = fake_os_reports[os_name]["search"]
    assert found["max_ok"] == 8  # 32 MiB at most: far below the guard
    limit = found["limit"]
    assert limit["kind"] == "ram-guard" and limit["enforced"] is False
    assert 0 < limit["limit_bytes"] < limit["available_bytes"]
    assert "estimated, not enforced" in found["first_line"]
    assert "not available" in found["first_line"]  # and it says why there is no budget


@pytest.mark.slow
def test_fake_windows_reads_win32_memory_apis(fake_os_reports: dict[str, dict]) -> None:
    report = fake_os_reports["Windows"]
    cpu = _cpu_row(report)
    assert cpu["sources"]["total"] == "GlobalMemoryStatusEx ullTotalPhys"
    assert cpu["sources"]["free"] == "GlobalMemoryStatusEx ullAvailPhys"
    assert report["host"]["budget"].startswith("CPU budgets are not available on Windows")
    assert "PeakWorkingSetSize" in report["host"]["peak_source"]


@pytest.mark.slow
def test_fake_macos_reads_sysctl_vm_stat_and_ru_maxrss(fake_os_reports: dict[str, dict]) -> None:
    report = fake_os_reports["Darwin"]
    cpu = _cpu_row(report)
    assert cpu["sources"]["total"] == "sysctl hw.memsize"
    assert cpu["sources"]["free"].startswith("estimate: vm_stat")
    assert "only sbrk" in report["host"]["budget"]
    assert report["host"]["peak_source"].startswith("getrusage ru_maxrss (bytes")


@pytest.mark.slow
def test_dead_isolated_child_is_child_crashed_fake_windows(fake_os_reports: dict[str, dict]) -> None:
    # Windows' signal has no SIGKILL: reading it for the death's evidence raised AttributeError.
    dies = fake_os_reports["Windows"]["children"]["dies"]
    assert dies.get("raised") == "ChildCrashed", dies
    assert "exited with code 3" in dies["message"] and "SIGKILL" not in dies["message"]


@pytest.mark.slow
@pytest.mark.parametrize("os_name", ["Windows", "Darwin"])
def test_children_spawn_and_run_a_trial_fake_windows_fake_macos(
        fake_os_reports: dict[str, dict], os_name: str) -> None:
    children = fake_os_reports[os_name]["children"]
    # Isolated searches (an MPS one too), jobs' tasks and reference rows: all spawn.
    assert children["isolated"] == {"cpu": "spawn", "mps": "spawn"}
    assert children["start_method"] == {"cpu": "spawn", "mps": "spawn", "cuda": "spawn"}
    assert children["context"] == "spawn"
    fits = children["fits"]
    assert fits.get("ok") is True, fits  # a spawned child ran the trial
    assert fits["peak"] > 0


# --- in this process ---------------------------------------------------------


def test_windows_signal_has_only_windows_names_fake_windows() -> None:
    sig = windows_signal()
    assert not any(hasattr(sig, name) for name in WINDOWS_MISSING)
    assert sig.SIGTERM == 15 and sig.SIGBREAK == 21 and sig.CTRL_BREAK_EVENT == 1
    with pytest.raises(ValueError, match="invalid signal value"):
        sig.signal(9, sig.SIG_DFL)


def test_a_death_without_sigkill_has_evidence_or_none_fake_windows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "signal", windows_signal())
    # -9 is no signal Windows has: never "killed by SIGKILL under a memory limit".
    assert launcher.oom_evidence(-9, "", budgeted=True) is None
    assert launcher.oom_evidence(3, "", budgeted=True) is None
    assert not launcher.killed_by_sigkill(-9)
    assert "std::bad_alloc" in launcher.oom_evidence(
        3, "terminate called after throwing an instance of 'std::bad_alloc'", budgeted=False)
    assert launcher.how_it_ended(-15) == "was killed by SIGTERM"  # TerminateProcess's code


def test_children_spawn_on_macos_fake_macos(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    for device in ("cpu", "mps", "cuda"):
        assert launcher.start_method(device) == "spawn"
    assert launcher.start_forkserver().get_start_method() == "spawn"  # no server started
    assert launcher.context(launcher.start_method("cpu")).get_start_method() == "spawn"




def test_host_budgets_are_enforceable_on_linux_with_proc(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert host.host_budget_unavailable() is None
    monkeypatch.setattr(host, "PROC", tmp_path)
    assert "VmData" in host.host_budget_unavailable()


def test_fake_macos_peak_is_ru_maxrss_in_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host, "system", lambda: "Darwin")
    monkeypatch.setattr(host, "resource", darwin_resource())
    monkeypatch.setattr(host, "PROC", tmp_path)  # macOS has no procfs
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = host.read_peak()
    # Darwin's ru_maxrss is already bytes: not multiplied by 1024 again.
    assert kib * 1024 <= peak <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert host.peak_method() == host.PeakMethod("getrusage ru_maxrss (bytes; process lifetime)",
                                                 resettable=False)


@pytest.mark.slow
def test_fake_macos_host_memory_from_sysctl_and_vm_stat(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    darwin_tools(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(host, "system", lambda: "Darwin")
    monkeypatch.setattr(host, "resource", darwin_resource())
    monkeypatch.setattr(host, "PROC", tmp_path)
    mem = host.host_memory()
    with open("/proc/meminfo") as f:
        total_kib = int(next(ln for ln in f if ln.startswith("MemTotal:")).split()[1])
    assert mem["total"] == total_kib * 1024
    assert 0 < mem["free"] <= mem["total"]
    assert mem["limited_by"] == "available physical RAM (estimated)"
    assert abs(mem["process"] - _vm_rss()) < 64 * MiB
    assert "only sbrk" in mem["budget"]
    assert host.memory_limits() == {}  # macOS rlimits do not bound malloc


def _vm_rss() -> int:
    with open("/proc/self/status") as f:
        return int(next(ln for ln in f if ln.startswith("VmRSS:")).split()[1]) * 1024


def test_fake_windows_without_win32_api_says_unknown_never_zero(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host, "system", lambda: "Windows")
    monkeypatch.setattr(host, "resource", None)
    monkeypatch.setattr(host, "PROC", tmp_path)
    assert host.read_peak() is None
    assert host.reset_peak() is None
    method = host.peak_method()
    assert method.source is None and "K32GetProcessMemoryInfo" in method.reason
    mem = host.host_memory()
    assert mem["total"] is None and mem["free"] is None and mem["process"] is None
    assert mem["sources"]["free"].startswith("unknown:")
    assert mem["peak"].startswith("unknown:")
    assert host.host_budget_unavailable().startswith("CPU budgets are not available on Windows")
    assert host.data_limit() is None and host.memory_limits() == {}


def test_vm_stat_text_gives_free_speculative_and_inactive_bytes() -> None:
    text = ("Mach Virtual Memory Statistics: (page size of 16384 bytes)\n"
            "Pages free:                                    9436.\n"
            "Pages active:                                774260.\n"
            "Pages inactive:                              915780.\n"
            "Pages speculative:                             1639.\n"
            "Pages throttled:                                  0.\n"
            "Pages wired down:                            184732.\n"
            "Pages purgeable:                              22877.\n"
            '"Translation faults":                      37287533.\n')
    assert host.parse_vm_stat(text) == (9436 + 1639 + 915780) * 16384
    assert host.parse_vm_stat("vm_stat: command not found") is None
