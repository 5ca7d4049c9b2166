"""The size cache: keys, put/lower, concurrent writers in real processes, corrupt files
(ignored on reading, moved aside by a write), entries with bad sizes, reads that change
nothing on disk, a cache that cannot be read or written (a warning and a job that still
computes its metric; a one-line error from ``oomguard cache show|clear``), and the journal."""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing as mp
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from oomguard.engine.cli.jobs import JobLog
from oomguard.engine.cli.main import main
from oomguard.engine.errors import CacheError, UsageError, check_positive_int
from oomguard.engine.jobs.cache import (
    SizeCache,
    default_cache_path,
    entry_key,
    format_entries,
    workload_hash,
)
from oomguard.engine.jobs.journal import Journal, replay
from oomguard.engine.jobs.records import Job, TaskResult
from oomguard.engine.jobs.runner import device_identity, plan, run_job
from oomguard.engine.jobs.sizing import Request, Slot, choose_sizes
from oomguard.engine.jobs.spec import load_job
from oomguard.metrics.base import Knob, Metric, get_metric

DEVICE = {"device": "cpu", "name": "test-cpu", "total_bytes": 1 << 30, "budget_bytes": None}


def _workload(metric: str = "loss", seq_len: int = 16) -> dict:
    return {"model_config": "abc", "dtype": "float32", "seq_len": seq_len, "metric": metric,
            "params": {}}


def test_keys_separate_devices_budgets_and_workloads() -> None:
    keys = {entry_key(DEVICE, _workload()), entry_key({**DEVICE, "budget_bytes": 1 << 26},
                                                      _workload()),
            entry_key({**DEVICE, "total_bytes": 2 << 30}, _workload()),
            entry_key(DEVICE, _workload(seq_len=32)), entry_key(DEVICE, _workload("fisher"))}
    assert len(keys) == 5
    assert entry_key(DEVICE, _workload()) == entry_key(dict(DEVICE), _workload())
    # The key format of existing cache files: device, then the sorted-JSON SHA-256 prefix.
    old = hashlib.sha256(json.dumps(_workload(), sort_keys=True).encode()).hexdigest()[:16]
    assert workload_hash(_workload()) == old
    assert entry_key(DEVICE, _workload()) == f"test-cpu/{1 << 30}|{old}"


def test_put_get_lower(tmp_path: Path) -> None:
    cache = SizeCache(tmp_path / "sub" / "sizes.json")
    key = entry_key(DEVICE, _workload())
    assert cache.get(key) is None
    cache.put(key, {"micro_batch_size": 16}, source="search", device=DEVICE, workload=_workload())
    assert cache.get(key)["sizes"] == {"micro_batch_size": 16}
    cache.lower(key, {"micro_batch_size": 8}, reason="OOM at 16")
    cache.lower(key, {"micro_batch_size": 12}, reason="never raises a size")
    entry = SizeCache(cache.path).get(key)
    assert entry["sizes"] == {"micro_batch_size": 8} and entry["source"] == "lowered after OOM"
    assert [h["sizes"]["micro_batch_size"] for h in entry["history"]] == [16, 8]
    assert cache.clear() == 1 and cache.entries() == {}


def test_default_path_is_user_cache_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OOMGUARD_CACHE", raising=False)
    path = default_cache_path()
    assert path.name == "sizes.json" and "oomguard" in str(path)
    monkeypatch.setenv("OOMGUARD_CACHE", "/tmp/x/sizes.json")
    assert default_cache_path() == Path("/tmp/x/sizes.json")


def _writer(path: str, worker: int, n: int) -> None:
    cache = SizeCache(path)
    for i in range(n):
        key = entry_key(DEVICE, _workload(f"m{worker}", seq_len=i))
        cache.put(key, {"micro_batch_size": i + 1}, source="search")


@pytest.mark.slow
def test_concurrent_processes_keep_valid_json_with_every_entry(tmp_path: Path) -> None:
    path = str(tmp_path / "sizes.json")
    ctx = mp.get_context("fork")  # real processes; the writer runs no torch code
    procs = [ctx.Process(target=_writer, args=(path, w, 15)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    doc = json.loads(Path(path).read_text())
    assert len(doc["entries"]) == 45
    assert not list(tmp_path.glob(".sizes.json.*"))  # no temporary files left behind


# What Python's json parser cannot read without a RecursionError, and what it can but every
# recursive walk after it (the sanitiser, the next write, deep in a task's stack) may not.
NESTED = b'{"version": 1, "entries": {"k": {"sizes": {"n": 1}, "history": ' + b"[" * 5000
DEEP = (b'{"version": 1, "entries": {"k": {"sizes": {"n": 1}, "history": ' + b"[" * 150
        + b"]" * 150 + b"}}}")


@pytest.mark.parametrize("content", [b"{not json", b'{"entries": []}', b"\xff\xfe", b"",
                                     NESTED + b"]" * 5000 + b"}}}", DEEP])
def test_corrupt_cache_ignored_on_read_and_moved_aside_on_write(
        tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "sizes.json"
    path.write_bytes(content)
    cache = SizeCache(path)
    with caplog.at_level(logging.WARNING, logger="oomguard.cache"):
        assert cache.entries() == {} and cache.get("k") is None
    assert caplog.text.count("not a valid cache file") == 2
    # Reading moved nothing and created nothing: the file is where it was, as it was.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sizes.json"]
    assert path.read_bytes() == content
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="oomguard.cache"):
        assert cache.put("k", {"n": 1}, source="search")  # the first write moves it aside
    assert "moved it aside" in caplog.text
    aside = list(tmp_path.glob("sizes.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == content
    assert json.loads(path.read_text())["entries"]["k"]["sizes"] == {"n": 1}


def _unwritable(tmp_path: Path) -> Path:
    """A cache path nobody can write. A read-only folder, except for root, who writes
    anywhere: then a path through a regular file, which no one can create."""
    if os.geteuid() != 0:
        folder = tmp_path / "read-only"
        folder.mkdir()
        folder.chmod(0o500)
        return folder / "sizes.json"
    (tmp_path / "file").write_text("not a folder")
    return tmp_path / "file" / "sizes.json"


@pytest.fixture
def unwritable(tmp_path: Path) -> Iterator[Path]:
    path = _unwritable(tmp_path)
    yield path
    path.parent.chmod(0o700)  # let pytest remove it


def test_unwritable_cache_costs_a_warning_never_an_error(
        unwritable: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = SizeCache(unwritable)
    key = entry_key(DEVICE, _workload())
    with caplog.at_level(logging.WARNING, logger="oomguard.cache"):
        assert cache.get(key) is None
        assert cache.put(key, {"micro_batch_size": 8}, source="search") is False
        assert cache.lower(key, {"micro_batch_size": 4}, reason="OOM at 8") is False
    writes = [r.getMessage() for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(writes) == 2 and all("sizes not cached; the run goes on" in m for m in writes)
    assert not unwritable.exists()
    if unwritable.parent.is_dir():  # no lock file, no temporary file left behind
        assert list(unwritable.parent.iterdir()) == []


def test_readable_cache_read_without_a_lock(tmp_path: Path) -> None:
    """Reading takes no lock: it creates no lock file, so a read-only cache reads."""
    path = tmp_path / "sizes.json"
    SizeCache(path).put("k", {"micro_batch_size": 4}, source="search")
    (tmp_path / "sizes.json.lock").unlink(missing_ok=True)
    assert SizeCache(path).get("k")["sizes"] == {"micro_batch_size": 4}
    assert list(SizeCache(path).entries()) == ["k"]
    assert main(["cache", "show", "--cache", str(path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sizes.json"]


def test_bad_sizes_are_an_absent_entry_with_a_warning(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "sizes.json"
    good = {"sizes": {"micro_batch_size": 8}, "source": "search"}
    bad = {"neg": {"sizes": {"micro_batch_size": -5}}, "zero": {"sizes": {"chunk": 0}},
           "bool": {"sizes": {"micro_batch_size": True}}, "text": {"sizes": {"n": "8"}},
           "float": {"sizes": {"n": 2.5}}, "list": {"sizes": [8]}, "none": None}
    path.write_text(json.dumps({"version": 1, "entries": {"good": good, **bad}}))
    cache = SizeCache(path)
    with caplog.at_level(logging.WARNING, logger="oomguard.cache"):
        assert cache.get("neg") is None
    with pytest.raises(UsageError) as why:  # the one check of every size says why
        check_positive_int("micro_batch_size", -5)
    assert caplog.messages == [f"size cache {path}: entry neg ignored: {why.value}"]
    assert cache.get("good") == good  # the other entries stay usable
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="oomguard.cache"):
        assert cache.entries() == {"good": good}
    assert sorted(m.split()[4] for m in caplog.messages) == sorted(bad)
    assert "micro_batch_size must be a positive integer, got True" in caplog.text
    # A write stores valid sizes over a bad entry, and drops the other bad ones.
    assert cache.lower("neg", {"micro_batch_size": 2}, reason="OOM")
    entries = json.loads(path.read_text())["entries"]
    assert sorted(entries) == ["good", "neg"] and entries["neg"]["sizes"] == {
        "micro_batch_size": 2}


def test_show_on_a_missing_folder_creates_nothing(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "missing" / "deeper" / "sizes.json"
    assert main(["cache", "show", "--cache", str(path)]) == 0
    assert capsys.readouterr().out == f"{path}: empty\n"
    assert main(["cache", "show", "--cache", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"path": str(path), "entries": {}}
    assert main(["cache", "clear", "--cache", str(path)]) == 0
    assert capsys.readouterr().out == f"cleared 0 entries from {path}\n"
    assert SizeCache(path).get("k") is None and SizeCache(path).entries() == {}
    assert list(tmp_path.iterdir()) == []


def test_cli_cache_it_cannot_use_is_one_line(tmp_path: Path, unwritable: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    # A folder where the file should be: it can be neither read nor written, even by root.
    folder = tmp_path / "folder.json"
    folder.mkdir()
    for action, verb in (("show", "read"), ("clear", "write")):
        assert main(["cache", action, "--cache", str(folder)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"oomguard: error: cannot {verb} the size cache {folder}: ")
        assert len(err.splitlines()) == 1
    # Nothing to clear in an unwritable place is not an error; a write there is.
    assert main(["cache", "clear", "--cache", str(unwritable)]) == 0
    with pytest.raises(CacheError, match=r"^cannot write the size cache .*writable --cache PATH$"):
        SizeCache(unwritable).update(lambda entries: None)


def _console(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "oomguard", *args], capture_output=True,
                          text=True, timeout=60)


@pytest.mark.slow
def test_console_cache_commands_never_print_a_traceback(tmp_path: Path) -> None:
    folder = tmp_path / "folder.json"
    folder.mkdir()
    for action, verb in (("show", "read"), ("clear", "write")):
        run = _console("cache", action, "--cache", str(folder))
        assert (run.returncode, run.stdout) == (2, "")
        assert run.stderr.splitlines() == [
            f"oomguard: error: cannot {verb} the size cache {folder}: Is a directory; "
            "give a writable --cache PATH" if verb == "write" else
            f"oomguard: error: cannot {verb} the size cache {folder}: Is a directory; give a "
            "cache file you can read (--cache PATH)"]
    # A corrupt file: show warns and shows nothing, and moves nothing; clear moves it aside.
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{not json")
    before = sorted(p.name for p in tmp_path.iterdir())
    run = _console("cache", "show", "--cache", str(corrupt))
    assert (run.returncode, run.stdout) == (0, f"{corrupt}: empty\n")
    assert "not a valid cache file" in run.stderr and "Traceback" not in run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert corrupt.read_text() == "{not json"
    run = _console("cache", "clear", "--cache", str(corrupt))
    assert (run.returncode, run.stdout) == (0, f"cleared 0 entries from {corrupt}\n")
    assert "moved it aside" in run.stderr and "Traceback" not in run.stderr
    assert json.loads(corrupt.read_text())["entries"] == {}
    assert [p.read_text() for p in tmp_path.glob("corrupt.json.corrupt-*")] == ["{not json"]


def test_cache_cli_show_and_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "sizes.json"
    SizeCache(path).put(entry_key(DEVICE, _workload()), {"micro_batch_size": 4}, source="search",
                        device=DEVICE, workload=_workload())
    entries = SizeCache(path).entries()
    assert main(["cache", "show", "--cache", str(path)]) == 0
    assert capsys.readouterr().out == f"{path}: 1 entries\n{format_entries(entries)}\n"
    assert "micro_batch_size=4" in format_entries(entries)
    assert main(["cache", "show", "--cache", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"path": str(path), "entries": entries}
    assert main(["cache", "clear", "--cache", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"cleared": 1, "path": str(path)}
    assert main(["cache", "show", "--cache", str(path)]) == 0
    assert capsys.readouterr().out == f"{path}: empty\n"
    assert main(["cache", "bogus"]) == 2
    assert "invalid choice: 'bogus'" in capsys.readouterr().err


def test_journal_is_append_only_and_survives_a_torn_line(tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "journal.jsonl"
    j = Journal(path)
    j.append("start", task="a")
    j.append("success", task="a", seconds=1.5, peak=float("nan"), out=tmp_path)
    with path.open("ab") as fh:
        fh.write(b'{"event": "start", "ta')  # what kill -9 mid-write can leave
    Journal(path).append("start", task="b")  # the next run's records stay whole
    with caplog.at_level(logging.WARNING, logger="oomguard.journal"):
        events = replay(path)
    assert [e["event"] for e in events] == ["start", "success", "start"] and "torn" in caplog.text
    assert events[-1]["task"] == "b"
    # One line per record, through the one sanitiser: nan as "nan", a path as text.
    assert (events[1]["peak"], events[1]["out"]) == ("nan", str(tmp_path))
    assert path.read_bytes().count(b"\n") == 4  # three records and the torn line, ended


def _tiny_job(tmp_path: Path, search: str, out: str = "out") -> Job:
    """One ``loss`` on the tiny GPT-2 over 2 generated samples of 8 tokens: seconds."""
    path = tmp_path / f"{out}.toml"
    path.write_text(f'output = "{tmp_path / out}"\nmodels = ["tiny-gpt2"]\n'
                    f'[data]\nseq_len = 8\nn_samples = 2\n[search]\n{search}\n'
                    '[[metrics]]\nname = "loss"\n', encoding="utf-8")
    return load_job(path)


def _run(job: Job, cache: Path) -> tuple[TaskResult, str]:
    """Run ``job`` with ``cache``; its one result and job.log (the metric's process's records)."""
    job_log = JobLog()
    try:
        outcome = run_job(job, cache_path=cache, progress=False, log_setup=job_log)
    finally:
        job_log.close()
    assert outcome.exit_code == 0, outcome.results
    return outcome.results["loss"], (Path(outcome.out) / "job.log").read_text()


@pytest.mark.slow
def test_job_computes_its_metric_with_an_unwritable_cache(tmp_path: Path,
                                                          unwritable: Path) -> None:
    job = _tiny_job(tmp_path, "max_trials = 2\nstart = 1\nstep = 2")
    result, log_text = _run(job, unwritable)
    assert result.status == "ok" and result.summary
    assert result.sizes["source"] == "search" and result.search["trials"] >= 1
    assert f"cannot write the size cache {unwritable}" in log_text
    assert "sizes not cached; the run goes on" in log_text
    assert not unwritable.exists()


def _cached(job: Job, tmp_path: Path, entry: dict) -> tuple[str, Path]:
    """A cache file holding ``entry`` for the job's one task: (its key, the file)."""
    (task,) = plan(job)
    key = entry_key(device_identity(job), task.workload)
    cache = tmp_path / "sizes.json"
    cache.write_text(json.dumps({"version": 1, "entries": {key: entry}}))
    return key, cache


@pytest.mark.slow
def test_job_ignores_a_bad_cached_size(tmp_path: Path) -> None:
    job = _tiny_job(tmp_path, "enabled = false")
    key, cache = _cached(job, tmp_path, {"sizes": {"micro_batch_size": -5},
                                         "source": "edited by hand"})
    result, log_text = _run(job, cache)
    assert result.status == "ok" and result.sizes["source"] == "metric default"
    assert result.sizes["start"]["micro_batch_size"] > 0
    assert f"entry {key} ignored: micro_batch_size must be a positive integer, got -5" in log_text


def test_cli_cache_show_on_a_nested_cache_is_one_warning(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "sizes.json"
    path.write_bytes(NESTED + b"]" * 5000 + b"}}}")
    assert main(["cache", "show", "--cache", str(path)]) == 0
    out, err = capsys.readouterr()
    assert out == f"{path}: empty\n"
    assert err.splitlines() == [
        f"WARNING oomguard.cache: size cache {path} is not a valid cache file (nested deeper "
        "than 100 levels); ignored it: `oomguard cache clear` moves it aside (so does the "
        "next write)"]


def _entry(job: Job, cache: Path) -> dict:
    """The job's one task's cache entry, as the file holds it."""
    (task,) = plan(job)
    return json.loads(cache.read_text())["entries"][entry_key(device_identity(job),
                                                              task.workload)]


@pytest.mark.slow
def test_job_searches_past_a_nested_cache_and_moves_it_aside(tmp_path: Path) -> None:
    job = _tiny_job(tmp_path, "max_trials = 4\nstart = 1\nsize_step = 1")
    cache = tmp_path / "sizes.json"
    cache.write_bytes(NESTED + b"]" * 5000 + b"}}}")
    result, log_text = _run(job, cache)
    assert result.status == "ok" and result.summary and result.sizes["source"] == "search"
    assert "not a valid cache file (nested deeper than 100 levels)" in log_text
    assert [p.read_bytes()[:20] for p in tmp_path.glob("sizes.json.corrupt-*")] == [NESTED[:20]]
    assert _entry(job, cache)["sizes"] == result.sizes["start"]


@pytest.mark.slow
def test_job_refuses_an_absurd_cached_size_and_searches_again(tmp_path: Path) -> None:
    job = _tiny_job(tmp_path, "max_trials = 4\nstart = 1\nsize_step = 1")
    key, cache = _cached(job, tmp_path, {"sizes": {"micro_batch_size": 10**12},
                                         "source": "search"})
    result, log_text = _run(job, cache)
    assert result.status == "ok" and result.sizes["source"] == "search"
    # Two samples: the search's cap, and no record says the metric ran at 10**12.
    assert result.sizes["start"] == result.sizes["final"] == {"micro_batch_size": 2}
    assert str(10**12) not in json.dumps(result.to_dict())
    assert (f"size cache entry {key}: micro_batch_size = {10**12} is above the sample count "
            "(2) and no search of it measured it; ignored it and searching again") in log_text
    assert _entry(job, cache)["sizes"] == {"micro_batch_size": 2}


@pytest.mark.slow
def test_a_search_cut_short_is_cached_as_unfinished_and_never_served(tmp_path: Path) -> None:
    cache = tmp_path / "sizes.json"
    # max_seconds well below one trial's 100 steps: the search stops after its first trial,
    # at 1 of 2 samples (it checks the clock before each trial).
    short = _tiny_job(tmp_path, "max_seconds = 0.05\nsteps_per_trial = 100\nstart = 1\n"
                      "size_step = 1", "short")
    result, _ = _run(short, cache)
    assert result.sizes["source"] == "search" and result.search["capped_by"] == "max_seconds"
    entry = _entry(short, cache)
    assert entry["finished"] is False and entry["sizes"] == {"micro_batch_size": 1}
    assert "search (unfinished)" in format_entries({"k": entry})
    # The next job on the same workload searches again, to the end; the one after reuses it.
    full = _tiny_job(tmp_path, "start = 1\nsize_step = 1", "full")
    result, log_text = _run(full, cache)
    assert result.sizes["source"] == "search" and result.sizes["start"] == {"micro_batch_size": 2}
    assert "its search was cut short (max_trials or max_seconds); searching again" in log_text
    assert _entry(full, cache)["finished"] is True
    again = _tiny_job(tmp_path, "start = 1\nsize_step = 1", "again")
    result, _ = _run(again, cache)
    assert result.sizes["source"] == "cache" and result.sizes["start"] == {"micro_batch_size": 2}


def _sized(tmp_path: Path, entry: dict, n_samples: int = 4) -> tuple[dict, str]:
    """What :func:`choose_sizes` makes of a cache file holding ``entry`` for ``loss`` on
    ``n_samples`` samples, with no search to fall back on: (sizes, source)."""
    path = tmp_path / "sizes.json"
    path.write_text(json.dumps({"version": 1, "entries": {"k": entry}}))
    got = choose_sizes(Request(get_metric("loss"), {}, n_samples, None),
                       slot=Slot(SizeCache(path), "k", DEVICE, _workload()))
    return got.sizes, got.source


RECORD = {"metric": "loss", "knob": "micro_batch_size", "max_ok": 64, "first_oom": 72,
          "safe": 48, "capped_by": None}


@pytest.mark.parametrize("entry, served", [
    ({"sizes": {"micro_batch_size": 3}, "finished": True}, {"micro_batch_size": 3}),
    ({"sizes": {"micro_batch_size": 3}, "finished": False}, None),
    # Written before the field: its records say whether a bound on the effort stopped it.
    ({"sizes": {"micro_batch_size": 3}}, {"micro_batch_size": 3}),
    ({"sizes": {"micro_batch_size": 3}, "search": [{**RECORD, "capped_by": "max_trials"}]},
     None),
    ({"sizes": {"micro_batch_size": 3}, "search": [{**RECORD, "capped_by": "max_seconds"}]},
     None),
    # Above the request's cap (4 samples): lowered to it where a search measured it...
    ({"sizes": {"micro_batch_size": 48}, "search": [RECORD]}, {"micro_batch_size": 4}),
    # ...refused where nothing did (a hand-edited size, or one above what was measured).
    ({"sizes": {"micro_batch_size": 10**12}}, None),
    ({"sizes": {"micro_batch_size": 10**12}, "search": [RECORD]}, None),
])
def test_only_a_finished_and_sane_entry_answers(tmp_path: Path, entry: dict,
                                                served: dict | None,
                                                caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="oomguard.cache"):
        sizes, source = _sized(tmp_path, entry)
    assert (sizes, source) == ((served, "cache") if served else (
        {"micro_batch_size": 32}, "metric default"))
    if entry["sizes"]["micro_batch_size"] == 10**12:
        assert ("micro_batch_size = 1000000000000 is above the sample count (4) and no search "
                "of it measured it; ignored it and searching again") in caplog.text


class _FourAtLeast(Metric):
    """A plugin's metric whose memory knob starts at 4 (not registered: nothing global)."""

    name = "test_four_at_least"
    knobs = (Knob("chunk", "memory", 8, 4),)


def test_a_cached_size_the_metric_refuses_is_searched_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "sizes.json"
    path.write_text(json.dumps({"version": 1, "entries": {"k": {"sizes": {"chunk": 2}}}}))
    with caplog.at_level(logging.WARNING, logger="oomguard.cache"):
        got = choose_sizes(Request(_FourAtLeast(), {}, 4, None),
                           slot=Slot(SizeCache(path), "k", DEVICE, _workload()))
    assert (got.sizes, got.source) == ({"chunk": 8}, "metric default")
    assert "size cache entry k ignored: test_four_at_least.chunk must be >= 4, got 2" in (
        caplog.text)
