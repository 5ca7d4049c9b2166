"""Nothing a job writes or moves leaves its output folder, and nothing in it that the job did
not write is touched: ``--force`` moves exactly the files the earlier job's record lists; a
folder that holds other files and no record is refused; a name from a job file, a plugin, a
metric or a record on disk never reaches a path unchecked (``../``, absolute names, ``/`` and
``\\``); a symbolic link loop, an empty output and a job file nested thousands of levels deep
are one line each, before any work; files are written with the user's umask.

The jobs that run are the smallest: the tiny GPT-2, 2 samples of 8 tokens, ``loss``, no
search.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cli_in_child, in_fresh_process, one_usage_error, oomguard_here

from oomguard.engine.errors import JobError
from oomguard.engine.jobs.output import claim, read_result, set_aside, stale_reasons
from oomguard.engine.jobs.plan import plan
from oomguard.engine.jobs.sink import FileSink
from oomguard.engine.jobs.spec import load_job, parse_job
from oomguard.engine.util.atomic import inside

BODY = ('models = ["tiny-gpt2"]\n[data]\nseq_len = 8\nn_samples = 2\n[search]\nenabled = false\n'
        '[[metrics]]\nname = "loss"\n')


def _write_job(folder: Path, name: str, output: str = ".", top: str = "",
               data: str = "") -> Path:
    path = folder / name
    body = BODY.replace("[data]\n", f"[data]\n{data}")
    path.write_text(f'output = "{output}"\n{top}{body}', encoding="utf-8")
    return path


def _tree(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


# --- --force moves only what the earlier job wrote --------------------------------------------


@pytest.mark.slow
def test_force_in_the_current_folder_moves_only_the_earlier_jobs_files_and_the_job_runs(
        tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    data = 'source = "text"\npath = "corpus.txt"\n'  # the data file sits in the folder too
    (work / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog " * 8)
    _write_job(work, "a.toml", data=data)  # output = "." beside its inputs: they alone are there
    first = cli_in_child("run", "a.toml", cwd=work)
    assert first.returncode == 0, first.stderr
    wrote = _tree(work) - {"a.toml", "corpus.txt", ".job.lock"}
    recorded = set(json.loads((work / "job.json").read_text())["files"])
    assert wrote <= recorded, wrote - recorded  # the record lists every file the job wrote
    # The user's own files arrive afterwards: sources, notes, data, another job file.
    (work / "src").mkdir()
    (work / "src" / "model.py").write_text("x = 1\n")
    (work / "notes.md").write_text("notes\n")
    (work / "results" / "mine.csv").write_text("1,2\n")  # even inside the job's folders
    _write_job(work, "b.toml", data=data)
    mine = {"a.toml", "b.toml", "corpus.txt", "src/model.py", "notes.md", "results/mine.csv"}
    before = {name: (work / name).read_bytes() for name in mine}

    forced = cli_in_child("run", "b.toml", "--force", cwd=work)
    assert forced.returncode == 0, forced.stderr
    assert "Traceback" not in forced.stderr
    assert {name: (work / name).read_bytes() for name in mine} == before  # none moved
    (aside,) = (work / "moved-aside").iterdir()
    assert _tree(aside) == wrote  # exactly what job a wrote, each at its place
    assert json.loads((work / "job.json").read_text())["name"] == "b"
    assert json.loads((work / "results.json").read_text())["status"] == "complete"


def test_a_folder_with_other_files_and_no_job_record_is_refused_unless_empty(
        tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    job = load_job(_write_job(out, "job.toml"))  # its own job file does not count
    claim(out, job, force=False)
    (out / "train.py").write_text("print('mine')\n")
    for force in (False, True):
        with pytest.raises(JobError, match=r"holds 1 files or folders \(train.py\) and no "
                           r"oomguard job record \(job.json\): give an empty or new output "):
            claim(out, job, force=force)
    assert (out / "train.py").read_text() == "print('mine')\n"


@pytest.mark.parametrize("output", ['output = ""', 'output = "  "'])
def test_an_empty_output_in_a_job_file_is_an_error(tmp_path: Path, output: str) -> None:
    with pytest.raises(JobError, match=r"output: is empty; give a folder"):
        parse_job(f"{output}\n{BODY}", path=str(tmp_path / "job.toml"))


def test_an_empty_out_option_is_an_error(tmp_path: Path) -> None:
    path = _write_job(tmp_path, "job.toml", output=str(tmp_path / "out"))
    with pytest.raises(JobError, match=r"^--out: the output folder is empty; give a folder"):
        load_job(path, output="")


# --- names never reach a path unchecked -------------------------------------------------------


@pytest.mark.parametrize("rel", ["../escape", "../../../x", "/tmp/abs", "a\\b", "..", ".", "",
                                 "results//x.json", "results/../../x", "results/./x", "a\0b"])
def test_inside_refuses_every_name_that_leaves_the_folder(tmp_path: Path, rel: str) -> None:
    with pytest.raises(ValueError, match="cannot be a path inside"):
        inside(tmp_path, rel)
    assert inside(tmp_path, "results/stale/x.1.json") == tmp_path / "results/stale/x.1.json"


@pytest.mark.parametrize("name", ["../escape", "/tmp/abs", "a/b", "a\\b", ".."])
def test_a_job_name_that_is_a_path_is_refused_when_the_job_is_read(tmp_path: Path,
                                                                    name: str) -> None:
    text = f"name = {json.dumps(name)}\noutput = \"out\"\n{BODY}"
    with pytest.raises(JobError, match=r"job.toml, line 1: name: .*give a name without"):
        parse_job(text, path=str(tmp_path / "job.toml"))


@pytest.mark.parametrize("ident", ["..", "...", "../x", "a/b", "a\\b"])
def test_a_metric_id_that_is_a_path_is_refused(tmp_path: Path, ident: str) -> None:
    text = f'output = "out"\n{BODY}id = {json.dumps(ident)}\n'
    with pytest.raises(JobError, match=r"metrics\[0\]\.id: .*use letters, digits"):
        parse_job(text, path=str(tmp_path / "job.toml"))


PLUGIN = '''
from oomguard.metrics.base import Knob, Metric, register

@register
class Escape(Metric):
    name = "../../../escaped"
    knobs = (Knob("micro_batch_size", "memory", 2, 1),)
    def compute(self, model, data, micro_batch_size=2):
        return {"value": 1.0}
'''


@pytest.mark.slow
def test_a_plugin_metric_whose_name_is_a_path_is_refused_before_any_work(tmp_path: Path) -> None:
    work = tmp_path / "a" / "b" / "c"
    work.mkdir(parents=True)
    (work / "escape_plugin.py").write_text(PLUGIN, encoding="utf-8")
    job = work / "job.toml"
    job.write_text(f'output = "out"\nplugins = ["escape_plugin.py"]\n{BODY}'.replace(
        'name = "loss"', 'name = "../../../escaped"'), encoding="utf-8")
    done = cli_in_child("run", str(job), cwd=work)  # a child: the plugin registers a metric
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert ("metrics[0].name: '../../../escaped' cannot name the metric's files "
            "(results/<id>.json); give this entry an id of letters") in done.stderr
    assert not (work / "out").exists()
    assert sorted(p.name for p in tmp_path.rglob("*escaped*")) == []


def test_a_task_cannot_write_outside_the_output_folder(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    sink = FileSink(out)
    for rel in ("../escaped.json", "results/../../escaped.json", "/tmp/escaped-abs.json"):
        with pytest.raises(ValueError, match="cannot be a path inside"):
            sink.write(rel, "{}")
    assert not (tmp_path / "escaped.json").exists() and not Path("/tmp/escaped-abs.json").exists()
    sink.write("results/ok.json", "{}")
    assert (out / "results" / "ok.json").read_text() == "{}"


def test_force_on_a_record_whose_job_name_climbs_out_keeps_everything_inside(
        tmp_path: Path) -> None:
    out = tmp_path / "deep" / "out"
    (out / "results").mkdir(parents=True)
    # A record on disk (an older oomguard's, or edited): its name is only a label.
    (out / "job.json").write_text(json.dumps({"name": "../../../../escaped", "path": "/x.toml",
                                              "tasks": ["loss"]}))
    (out / "results" / "loss.json").write_text("{}")
    (out / "results.json").write_text("{}")
    job = load_job(_write_job(tmp_path, "mine.toml", output=str(out)))
    claim(out, job, force=True)
    (aside,) = (out / "moved-aside").iterdir()
    assert aside.parent == out / "moved-aside" and aside.name.endswith("-escaped")
    assert _tree(aside) == {"job.json", "results/loss.json", "results.json"}
    assert {f for f in _tree(tmp_path) if not f.startswith("deep/out/")} == {"mine.toml"}


@pytest.mark.parametrize("listed", ["../outside.txt", "/etc/hostname", "results/../../outside.txt"])
def test_force_refuses_a_record_that_lists_a_file_outside_the_folder(tmp_path: Path,
                                                                     listed: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "outside.txt").write_text("keep\n")
    (out / "job.json").write_text(json.dumps({"name": "other", "path": "/other.toml",
                                              "tasks": [], "files": ["job.json", listed]}))
    job = load_job(_write_job(tmp_path, "mine.toml", output=str(out)))
    with pytest.raises(JobError, match="cannot be a path inside .*move the files by hand"):
        claim(out, job, force=True)
    assert (tmp_path / "outside.txt").read_text() == "keep\n"
    assert (out / "job.json").is_file() and not (out / "moved-aside").exists()


def test_a_result_naming_a_tensor_file_outside_the_folder_never_moves_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "results").mkdir(parents=True)
    victim = tmp_path / "victim.pt"
    victim.write_bytes(b"user's tensors")
    job = load_job(_write_job(tmp_path, "job.toml", output=str(out)))
    (task,) = plan(job)
    (out / "results" / "loss.json").write_text(json.dumps({
        "task": "loss", "metric": "loss", "model": "tiny-gpt2", "status": "ok",
        "fingerprint": "not this one", "tensors": "../victim.pt"}))
    done = read_result(out, "loss")
    assert "its tensor file ../victim.pt is missing" in stale_reasons(done, task, out)
    set_aside(out, "loss", done)
    assert victim.read_bytes() == b"user's tensors"
    assert [p.suffix for p in (out / "results" / "stale").iterdir()] == [".json"]


# --- one line, before any work ----------------------------------------------------------------


def _loop(tmp_path: Path) -> Path:
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    return tmp_path / "loop1"


@pytest.mark.parametrize("where", ["--out", "output"])
def test_an_output_through_a_symlink_loop_is_one_line(tmp_path: Path, where: str) -> None:
    loop = _loop(tmp_path)
    path = _write_job(tmp_path, "job.toml",
                      output=str(loop / "out") if where == "output" else "out")
    with pytest.raises(JobError, match=r"Symlink loop from .*; give another folder$"):
        load_job(path, output=str(loop) if where == "--out" else None)


@pytest.mark.parametrize("action", ["clear", "show"])
def test_cache_commands_on_a_symlink_loop_are_an_error(tmp_path: Path, capsys,
                                                        action: str) -> None:
    line = one_usage_error(["cache", action, "--cache", str(_loop(tmp_path))], capsys)
    assert line == (f"oomguard: error: cannot read the size cache {tmp_path / 'loop1'}: Too many "
                    "levels of symbolic links; fix the link or give another --cache PATH")


def _deep(kind: str, n: int) -> str:
    if kind == "tables":  # 3,002 lines: [x], [x.x], [x.x.x], ...
        return "\n".join("[" + ".".join(["x"] * k) + "]" for k in range(1, n + 1))
    if kind == "arrays":
        return f"{BODY}id = \"deep\"\nparams = {{}}\n[[metrics]]\nname = \"loss\"\nsizes = " \
               + "[" * n + "]" * n
    if kind == "inline":
        return "budget = " + "{a = " * n + "1" + "}" * n + "\n" + BODY
    return "[" * n + "]" * n  # a JSON job file: not TOML, nested as deep


@pytest.mark.parametrize("kind, n", [("tables", 3002), ("arrays", 5000), ("inline", 3000),
                                     ("json", 5000), ("arrays", 40)])
def test_a_deeply_nested_job_file_is_refused_in_one_line(tmp_path: Path, kind: str,
                                                         n: int) -> None:
    path = tmp_path / "deep.toml"
    path.write_text(_deep(kind, n), encoding="utf-8")
    with pytest.raises(JobError) as caught:
        load_job(path)
    assert "\n" not in str(caught.value)
    if kind != "json":
        assert str(caught.value) == (f"{path}: nested more than 32 levels deep; write a job "
                                     "file of plain tables (a [[metrics]] table's params are 3 "
                                     "levels down)")


# --- the user's umask -------------------------------------------------------------------------


def _with_umask(mask: int, argv: list[str], cwd: str) -> tuple[int, str, str]:
    os.umask(mask)  # in a fresh child: the process's umask is the user's
    return oomguard_here(argv, cwd, {})


@pytest.mark.parametrize("mask, mode", [(0o027, 0o640), (0o002, 0o664), (0o077, 0o600)])
def test_atomic_write_gives_a_new_file_the_users_umask(tmp_path: Path, mask: int,
                                                       mode: int) -> None:
    # A process of its own, started with the umask (the test's process keeps its own).
    code = "import sys; from oomguard.engine.util.atomic import atomic_write as w; w(sys.argv[1], 'x')"
    for _ in range(2):  # a new file, then one replaced
        subprocess.run([sys.executable, "-c", code, str(tmp_path / "f.json")], check=True,
                       umask=mask)
        assert stat.S_IMODE((tmp_path / "f.json").stat().st_mode) == mode
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]  # no temporary file left


@pytest.mark.slow
def test_a_jobs_files_follow_the_users_umask(tmp_path: Path) -> None:
    _write_job(tmp_path, "job.toml", output="out")
    code, _, err = in_fresh_process(_with_umask, 0o027, ["run", "job.toml"], str(tmp_path))
    assert code == 0, err
    out = tmp_path / "out"
    files = [out / name for name in ("results/loss.json", "results.json", "report.md",
                                     "job.toml", "job.json", "journal.jsonl", "job.log")]
    assert {str(f.relative_to(tmp_path)): oct(stat.S_IMODE(f.stat().st_mode)) for f in files} \
        == {str(f.relative_to(tmp_path)): "0o640" for f in files}


def test_the_size_cache_follows_the_users_umask(tmp_path: Path) -> None:
    code = ("import sys; from oomguard.engine.jobs.cache import SizeCache; "
            "SizeCache(sys.argv[1]).put('k', {'micro_batch_size': 4}, source='search')")
    cache = tmp_path / "sizes.json"
    subprocess.run([sys.executable, "-c", code, str(cache)], check=True, umask=0o027)
    assert oct(stat.S_IMODE(cache.stat().st_mode)) == "0o640"
