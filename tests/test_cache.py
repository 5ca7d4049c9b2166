"""The size cache: keys, put/lower, concurrent writers in real processes, corrupt files,
a cache that cannot be written, the journal, and ``oomguard cache show|clear``."""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing as mp
from pathlib import Path

import pytest

from oomguard.engine.cli.jobs import main
from oomguard.engine.errors import CacheError
from oomguard.engine.jobs.cache import (
    SizeCache,
    default_cache_path,
    entry_key,
    format_entries,
    workload_hash,
)
from oomguard.engine.jobs.journal import Journal, replay

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


@pytest.mark.integration
def test_concurrent_processes_keep_valid_json_with_every_entry(tmp_path: Path) -> None:
    path = str(tmp_path / "sizes.json")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, w, 15)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    doc = json.loads(Path(path).read_text())
    assert len(doc["entries"]) == 45
    assert not list(tmp_path.glob(".sizes.json.*"))  # no temporary files left behind


@pytest.mark.parametrize("content", [b"{not json", b'{"entries": []}', b"\xff\xfe", b""])
def test_corrupt_cache_moved_aside_with_warning(tmp_path: Path, content: bytes,
                                                caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "sizes.json"
    path.write_bytes(content)
    cache = SizeCache(path)
    with caplog.at_level(logging.WARNING, logger="oomguard.cache"):
        assert cache.entries() == {}
    assert "not a valid cache file" in caplog.text
    aside = list(tmp_path.glob("sizes.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == content
    cache.put("k", {"n": 1}, source="search")  # and the cache goes on
    assert json.loads(path.read_text())["entries"]["k"]["sizes"] == {"n": 1}


def test_unwritable_cache_is_a_one_line_error(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("not a folder")
    path = tmp_path / "file" / "sizes.json"
    with pytest.raises(CacheError, match=r"cannot use the size cache .*writable --cache PATH"):
        SizeCache(path).put("k", {"n": 1}, source="search")
    assert main(["cache", "show", "--cache", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"oomguard: error: cannot use the size cache {path}: ")
    assert len(err.splitlines()) == 1


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
