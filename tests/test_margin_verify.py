"""The margin derived from measured step peaks, and verification after a search
(``oomguard.engine.core.search.search.verify`` and ``oomguard verify REPORT``).

Real allocations under real CPU budgets; sizes far from any boundary, so no test here
depends on what earlier tests left in the heap.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Started, cli_in_child, in_fresh_process
from test_full_disk import _free, small_disk  # noqa: F401 - small_disk: the fixture, by name

from oomguard import search
from oomguard.engine.cli.main import main
from oomguard.engine.core.search.fit import (
    DEFAULT_MARGIN,
    MIN_MEASURED_MARGIN,
    choose_margin,
    steady_spread,
)
from oomguard.engine.core.search.search import verify
from oomguard.engine.errors import UsageError
from oomguard.engine.util.units import fmt_bytes
from oomguard.results import Trial
from oomguard.strategies import Guided

MiB = 1024**2


class AlternatingSteps:
    """Each call holds ``size`` MiB, every second call ``size * (1 + extra)`` MiB: a step
    peak that varies across steps by ``extra / (1 + extra)``."""

    def __init__(self, extra: float) -> None:
        self.extra, self.calls = extra, 0

    def __call__(self, size: int) -> float:
        self.calls += 1
        mib = size * (1 + self.extra) if self.calls % 2 == 0 else size
        block = torch.ones(int(mib * MiB) // 4)
        return float(block[0])


def _search(extra: float, margin: Any = "measured"):
    # Each search in a fresh process: resident free heap left by earlier tests would
    # serve some steps' allocations unseen by the peak meter and fake a spread.
    return in_fresh_process(_search_here, extra, margin)


def _search_here(extra: float, margin: Any):
    # Three steps: the first may allocate what a run allocates once; two steady ones after it.
    return search(AlternatingSteps(extra), strategy=Guided(start=8), max_size=32,
                  budget=512 * MiB, steps_per_trial=3, margin=margin)


@pytest.mark.slow
def test_measured_margin_is_twice_the_spread_of_steady_step_peaks_in_bytes() -> None:
    result = _search(1.0)
    rec = result.recommendation
    spreads = [s for t in result.trials if (s := steady_spread(t)) is not None]
    # Steady steps hold 32 and 64 MiB in turn at the largest size: the spread sees 32 MiB.
    assert max(spreads) == pytest.approx(32 * MiB, rel=0.05)
    assert rec.margin_bytes == pytest.approx(2 * max(spreads), rel=0.01)
    assert rec.margin == pytest.approx(rec.margin_bytes / (512 * MiB - rec.fixed_bytes), rel=0.01)
    assert "measured, 2 x the largest spread of a trial's steady step peaks" in rec.margin_source
    assert f"({fmt_bytes(max(spreads))} at size 32" in rec.margin_source
    # The fitted fixed part is what the line puts at size 0: a few MiB of torch's own
    # state, or nothing when the trials' noise puts the intercept at or below 0.
    grows = fmt_bytes(512 * MiB - rec.fixed_bytes)
    said = (f"of the {grows} that grows above the fixed {fmt_bytes(rec.fixed_bytes)}"
            if rec.fixed_bytes > 0 else f"of the {grows} that grows with the size (no fixed part")
    assert said in rec.margin_source
    assert result.to_dict()["recommendation"]["margin_source"] == rec.margin_source


@pytest.mark.slow
def test_steady_steps_measure_a_smaller_margin_than_a_configured_one() -> None:
    measured = _search(0.0).recommendation
    fixed = _search(0.0, margin=0.15).recommendation
    assert measured.margin == MIN_MEASURED_MARGIN  # the floor: steps agreed
    assert "raised to the 3% floor" in measured.margin_source
    assert fixed.margin == 0.15 and fixed.margin_source.endswith("(as configured)")
    assert measured.safe >= fixed.safe


def test_measured_margin_without_two_steady_steps_falls_back_and_says_why() -> None:
    # Two steps: the second is steady, the first may allocate the optimizer's state.
    trials = [Trial(size=8, ok=True, peak_bytes=9 * MiB, seconds=0.1, steps=2,
                    step_peaks=[8 * MiB, 9 * MiB])]
    margin = choose_margin("measured", trials, grows=64 * MiB, fixed=16 * MiB)
    assert margin.fraction == DEFAULT_MARGIN
    assert margin.source.startswith(f"{DEFAULT_MARGIN:.0%} of the 64.00 MiB that grows above "
                                    "the fixed 16.00 MiB")
    assert "no trial ran three steps or more" in margin.source


@pytest.mark.parametrize("bad", ["estimated", 1.0, -0.1, float("nan")])
def test_a_bad_margin_is_one_usage_error(bad: Any) -> None:
    with pytest.raises(UsageError, match="margin must be a fraction in .0, 1. or 'measured'"):
        search(lambda n: n, margin=bad, max_size=2)


def _verify_alternating() -> dict:
    return verify(AlternatingSteps(0.5), 4, 3, budget=256 * MiB)


@pytest.mark.slow
def test_verify_runs_the_steps_and_reports_an_oom_instead_of_raising() -> None:
    # A fresh process: resident free heap left by earlier tests would serve the steps'
    # allocations unseen by the peak meter.
    fits = in_fresh_process(_verify_alternating)
    assert fits["ok"] and fits["steps"] == 3 and len(fits["step_peaks"]) == 3
    # One step holds 1.5x the next: 4 MiB and 6 MiB, measured (which comes first depends on
    # the warm-up call at size 1 before the budget, the workload's first call).
    assert abs(fits["step_peaks"][1] - fits["step_peaks"][0]) > 1.5 * MiB
    fails = verify(AlternatingSteps(0.0), 1024, 2, budget=128 * MiB)
    assert fails["ok"] is False and "memory" in fails["error"].lower()
    with pytest.raises(UsageError, match="steps must be a positive integer"):
        verify(AlternatingSteps(0.0), 4, 0)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("bench")
    assert main(["bench", "--seq-len", "16", "--start", "2", "--max-size", "4",
                 "--budget", "1GiB", "--out", str(out)]) == 0
    return out


@pytest.mark.slow
def test_cli_verify_reruns_the_reports_workload_and_writes_verify_json(report, capsys) -> None:
    assert json.loads((report / "report.json").read_text())["result"]["mode"] == "forked"
    assert main(["verify", str(report), "--steps", "2"]) == 0
    out, err = capsys.readouterr()
    assert "verify: 2 steps at batch size 4: ok" in out
    # A run after a search is in the searching process, not in a fork as the trials were.
    assert "in this process, as a run after the search; the report's trials ran in forks" in err
    check = json.loads((report / "verify.json").read_text())
    assert check["ok"] and check["size"] == 4 and len(check["step_peaks"]) == 2
    # Far beyond the 1 GiB budget the report's trials ran under: a real OOM, exit 1.
    assert main(["verify", str(report / "report.json"), "--steps", "1", "--size", "100000"]) == 1
    assert "OUT OF MEMORY" in capsys.readouterr().out
    assert json.loads((report / "verify.json").read_text())["ok"] is False


@pytest.mark.slow
def test_cli_no_fork_runs_the_trials_in_this_process_and_the_report_says_so(tmp_path) -> None:
    assert main(["bench", "--seq-len", "16", "--start", "2", "--max-size", "4", "--budget",
                 "1GiB", "--no-fork", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "report.json").read_text())["result"]
    assert result["mode"] == "in-process" and {t["mode"] for t in result["trials"]} == {"in-process"}


def test_cli_verify_refuses_a_corrupt_or_foreign_report_in_one_line(tmp_path, capsys) -> None:
    (tmp_path / "report.json").write_text('{"result": {"recommendation": {"safe": 4')
    assert main(["verify", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "is not a readable oomguard report" in err and len(err.splitlines()) == 1
    doc = {"result": {"recommendation": {"safe": 4}, "device": "cpu"}, "context": {}}
    (tmp_path / "report.json").write_text(json.dumps(doc))
    assert main(["verify", str(tmp_path)]) == 2
    assert "search(..., verify_steps=N)" in capsys.readouterr().err
    assert main(["verify", str(tmp_path / "nowhere")]) == 2
    assert "no report at" in capsys.readouterr().err


# ------------------------------------------------------------------- verify against the safe line
# A real bench and real verify runs, each `oomguard verify` a process of its own (a fresh
# process: a peak is a memory boundary). The measured peaks are never edited; only the lines
# the report promised are moved around them, far from the peak (half, twice), so run-to-run
# noise in the peak (a few percent) cannot change a verdict.
@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict, int]:
    out = tmp_path_factory.mktemp("bench-lines")
    done = cli_in_child("bench", "--seq-len", "16", "--start", "2", "--max-size", "4",
                        "--budget", "1GiB", "--out", str(out))
    assert done.returncode == 0, done.stderr
    first = cli_in_child("verify", str(out), "--steps", "2", "--json")
    assert first.returncode == 0, first.stdout + first.stderr
    check = json.loads(first.stdout)
    return out, json.loads((out / "report.json").read_text()), max(check["step_peaks"])


def _with_lines(tmp: Any, doc: dict, line: float, limit: float | None) -> Any:
    """A copy of the report whose safe line (through its margin) and recommended limit are
    ``line`` and ``limit`` bytes; the rest, the workload included, as the bench wrote it."""
    doc = json.loads(json.dumps(doc))
    cap = doc["result"]["capacity_bytes"]
    doc["result"]["recommendation"] |= {"margin_bytes": cap - line, "safe_line_bytes": line}
    doc["summary"] |= {"safe_line_bytes": line, "recommended_limit_bytes": limit or line,
                       "recommended_limit_against": "the fitted peak at the first OOM (5)"}
    (tmp / "report.json").write_text(json.dumps(doc))
    return tmp


def _verified(folder: Any) -> tuple[int, str, dict]:
    done = cli_in_child("verify", str(folder), "--steps", "2")
    out = [line for line in done.stdout.splitlines() if line.startswith("verify:")]
    assert len(out) == 1, done.stdout  # one line says what happened
    return done.returncode, out[0], json.loads((folder / "verify.json").read_text())


@pytest.mark.slow
def test_verify_fails_saying_by_how_much_when_a_peak_crosses_the_safe_line(measured, tmp_path):
    _, doc, peak = measured
    code, line, check = _verified(_with_lines(tmp_path, doc, peak / 2, None))
    top, safe = max(check["step_peaks"]), check["lines"]["safe_line_bytes"]
    assert code == 1 and check["ok"] and check["verdict"] == "over the safe line"
    assert safe == pytest.approx(peak / 2) and top > safe
    assert line.startswith(f"verify: 2 steps at batch size 4: OVER THE SAFE LINE by "
                           f"{fmt_bytes(top - safe)}: peak {fmt_bytes(top)} against the safe "
                           f"line {fmt_bytes(safe)} (capacity 1.00 GiB less the "
                           f"{fmt_bytes(2**30 - safe)} margin); {fmt_bytes(2**30 - top)} of the "
                           "capacity left free where the report promised "
                           f"{fmt_bytes(2**30 - safe)}")


@pytest.mark.slow
def test_verify_fails_when_the_margin_the_report_promised_is_not_kept(measured, tmp_path):
    # Under the safe line, but above the tighter limit the report held its size to.
    _, doc, peak = measured
    code, line, check = _verified(_with_lines(tmp_path, doc, 2 * peak, peak / 2))
    top = max(check["step_peaks"])
    assert code == 1 and check["verdict"] == "margin not kept"
    assert check["held_to_bytes"] == pytest.approx(peak / 2) and peak / 2 < top < 2 * peak
    assert line.startswith(f"verify: 2 steps at batch size 4: MARGIN NOT KEPT by "
                           f"{fmt_bytes(top - peak / 2)}: peak {fmt_bytes(top)} above "
                           f"{fmt_bytes(peak / 2)}, the limit the report held the recommended "
                           "size to (")
    assert line.endswith("the fitted peak at the first OOM (5))")


@pytest.mark.slow
def test_verify_passes_under_the_lines_and_says_by_how_much(measured, tmp_path):
    _, doc, peak = measured
    code, line, check = _verified(_with_lines(tmp_path, doc, 2 * peak, None))
    top = max(check["step_peaks"])
    assert code == 0 and check["verdict"] == "ok"
    assert line.endswith(f"; {fmt_bytes(2 * peak - top)} under the report's line "
                         f"({fmt_bytes(2 * peak)})")


# ------------------------------------------------------------- a folder verify cannot write
# A real small disk (a tmpfs, test_full_disk's fixture): made read-only with a remount, or
# filled with a file, before verify starts or while its steps run.
def _report_on(disk: Path, measured: tuple[Any, dict, int]) -> Path:
    shutil.copy(measured[0] / "report.json", disk / "report.json")
    return disk


def _fill(disk: Path) -> None:
    """Leave no page free on ``disk``."""
    with open(disk / "filler", "wb") as f:
        f.write(bytes(_free(disk)))
    assert _free(disk) == 0


@pytest.mark.slow
@pytest.mark.parametrize("how", ["read-only", "full"])
def test_verify_refuses_a_folder_it_cannot_write_before_any_step(how, measured, request):
    disk = request.getfixturevalue("small_disk")
    folder = _report_on(disk, measured)
    if how == "read-only":
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    else:
        _fill(disk)
    done = cli_in_child("verify", str(folder), "--steps", "2")
    assert done.returncode == 2 and not done.stdout, (done.stdout, done.stderr)
    (line,) = done.stderr.splitlines()  # one line, no "verifying" line: no step ran
    why = "Read-only file system" if how == "read-only" else "No space left on device"
    assert line == (f"oomguard: error: {folder}: cannot write the output folder ({why}); verify "
                    "writes verify.json beside report.json: free space there, or copy the "
                    "report folder somewhere writable and verify the copy")


@pytest.mark.slow
def test_a_disk_full_after_the_steps_prints_the_whole_result_and_one_line(measured, request):
    disk = request.getfixturevalue("small_disk")
    folder = _report_on(disk, measured)
    running = Started("verify", str(folder), "--steps", "20")
    # The command's stderr is a file (Started captures it): read it while the command runs,
    # and fill the disk once it says it is verifying (the check is behind it, the steps ahead).
    deadline, said = time.monotonic() + 120, ""
    while "oomguard: verifying" not in said and running.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
        with contextlib.suppress(OSError):  # the process may be between fork and its dup2
            said = Path(f"/proc/{running.pid}/fd/2").read_text()
    assert running.poll() is None, running.communicate()
    _fill(disk)
    out, err = running.communicate(timeout=300)
    assert running.returncode == 1, (out, err)
    assert not (folder / "verify.json").exists()
    assert err.splitlines()[-1] == (
        f"oomguard: cannot write {folder}/verify.json (No space left on device): the result is "
        "on stdout above, in full; save it from there, or free space and run verify again")
    assert "Traceback" not in err
    verdict, _, text = out.partition("\n")
    assert verdict.startswith("verify: 20 steps at batch size 4: ok, peak per step")
    check = json.loads(text)  # everything verify.json would have held
    assert check["verdict"] == "ok" and len(check["step_peaks"]) == 20
    assert check["report"] == f"{folder}/report.json"
