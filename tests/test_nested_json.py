"""Hostile nesting in the JSON files oomguard reads back (its size cache, a job's records, a
report, a digest memo): one reader (:func:`read_json`) refuses arrays and objects nested
deeper than ``MAX_JSON_DEPTH`` as a ValueError, never a RecursionError, and each command
reading such a file says so in one line naming it (the size cache and ``show``: their own
tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomguard.engine.cli.main import main
from oomguard.engine.jobs.fingerprint import Digests
from oomguard.engine.jobs.output import read_result
from oomguard.engine.util.jsonable import MAX_JSON_DEPTH, JSONTooDeep, parse_json, read_json


def nested(depth: int, inner: str = "") -> str:
    return "[" * depth + inner + "]" * depth


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 150, 5000, 200_000])
def test_deeper_than_the_limit_is_a_value_error_never_a_recursion_error(depth: int) -> None:
    with pytest.raises(JSONTooDeep, match=f"^nested deeper than {MAX_JSON_DEPTH} levels$"):
        parse_json(nested(depth))
    assert issubclass(JSONTooDeep, ValueError)  # every reader handles it as bad JSON


def test_up_to_the_limit_reads_as_json_does(tmp_path: Path) -> None:
    text = nested(MAX_JSON_DEPTH - 1, '{"a": 1}')  # MAX_JSON_DEPTH levels with the object
    assert parse_json(text) == parse_json(text.encode()) and read_json_of(tmp_path, text)
    assert parse_json('{"a": [1, {"b": null}], "c": "[[["}') == {"a": [1, {"b": None}],
                                                                  "c": "[[["}
    with pytest.raises(ValueError):
        parse_json(b"\xff\xfe")


def read_json_of(tmp_path: Path, text: str) -> object:
    (tmp_path / "f.json").write_text(text, encoding="utf-8")
    return read_json(tmp_path / "f.json")


def test_verify_on_a_nested_report_is_one_line(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "report.json"
    report.write_text('{"result": ' + nested(5000) + "}", encoding="utf-8")
    assert main(["verify", str(report)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert str(report) in err and f"nested deeper than {MAX_JSON_DEPTH} levels" in err


def test_a_nested_result_file_or_digest_memo_is_absent(tmp_path: Path) -> None:
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "loss.json").write_text(nested(5000), encoding="utf-8")
    assert read_result(tmp_path, "loss") is None  # run again, as for a torn file
    memo = tmp_path / "digests.json"
    memo.write_text('{"x": ' + nested(5000) + "}", encoding="utf-8")
    assert Digests(memo).memo == {}  # files are hashed again
