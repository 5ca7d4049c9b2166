"""Golden files of what users and scripts read, on small fixed runs: a redesign of the
code behind them changes none of these files unless it means to.

Update: ``OOMGUARD_UPDATE_GOLDEN=1 python -m pytest -n 0 -p no:randomly tests/test_golden.py``
rewrites every file under ``tests/golden/`` from the current code (and passes); review the
diff (``git diff tests/golden``) before committing it. Without the variable a test fails
with a unified diff against its golden.

What each golden protects (``tests/golden/<file>``):

- ``search/report.json``, ``search/report.md``, ``search/output.txt``: ``oomguard search
  --metric loss`` (the schema and every key of report.json, the Markdown sections, the
  summary line on stdout and the progress lines on stderr).
- ``bench/report.json``, ``bench/report.md``, ``bench/stdout.json``: ``oomguard bench
  --json`` on the training step (its report and the JSON a script reads on stdout).
- ``job/results.json``, ``job/results/<task>.json``, ``job/files.txt``: ``oomguard run`` on a
  job of three metrics, one searched (``loss``), one with sizes pinned in the job file
  (``attention_stats``) and one that raises (``boom``, a plugin): every key of the result
  records, the sizes and where they came from, the failure record, the output folder's
  files.
- ``job/journal.jsonl``: the job's journal events, in order, with their keys.
- ``job/report.md``, ``job/stdout.txt``, ``job/stderr.txt``, ``job/job.log``: what the job
  shows a person.
- ``job/cache.json``: the size-cache entry a job's search writes (its key, device, workload
  and history).
- ``reference/reference.json``, ``reference/reference.md``, ``reference/sizes.toml``,
  ``reference/stdout.txt``, ``reference/stderr.txt``: ``oomguard reference`` on two metrics
  (``loss``; ``integrated_gradients`` with its two knobs).
- ``reference/cache.json``, ``reference/cache-show.txt``: the cache entries a reference
  writes (per knob, and per metric under the key a job looks up) and ``oomguard cache
  show``.
- ``errors.json``: the command line's answer to bad input: argv -> exit code, stdout and
  stderr (the one line; for argparse's own errors, its last line after ``<usage>``).

Every run is fixed so its answer does not depend on the machine or its load: a tiny GPT-2
built from a config (random weights, seed 0), generated data, budgets far above the work,
and sizes capped by the sample count, ``--max-size`` or the job file, so no search meets
its memory limit. What still varies from run to run is normalised by value, keeping every
key and the structure: times and dates, seconds and rates, measured bytes and utilisation,
pids, run ids, the host, the device's name and total memory, the torch and oomguard
versions, the number of threads and the temporary folder. Floats (metric results) are
rounded to 6 significant digits. Hashes that are deterministic (model config, cache keys,
file digests) are kept: a change to them invalidates users' caches. A change of the
transformers version that changes a config's defaults changes those hashes too.

The goldens were written before issue 24's redesign and rewritten once after it, for the
defects it fixed: answers capped by the sample count or a knob's largest useful size are
marked as capped (``capped_by``, ``cap``, the cache entry's ``capped``), every knob is
sized for a job (``integrated_gradients``' ``internal_batch_size`` 32, where it stayed at
its default 8), and a search's record carries the same keys in results, the journal and
the cache; ``search --dtype float8``, which started the search and left its report folder
behind, is refused before any work.

Cost: one job and one reference, run side by side once per run as a user runs them
(``oomguard run`` and ``oomguard reference`` in processes of their own, forked from the
worker's forkserver); the search and the bench run in a fresh process each, the error
table calls the command line in this process.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import in_fresh_process, in_fresh_processes, once_per_run, oomguard_here

from oomguard.engine.cli.main import main
from oomguard.metrics.base import METRICS, load_all

UPDATE = os.environ.get("OOMGUARD_UPDATE_GOLDEN") == "1"
GOLDEN = Path(__file__).parent / "golden"
REPO = Path(__file__).resolve().parent.parent

# A tiny GPT-2 whose special tokens are inside its vocabulary (no transformers warning);
# 32 positions, so a longer --seq-len is a one-line error.
TINY = ("gpt2:n_layer=1,n_embd=32,n_head=2,vocab_size=64,n_positions=32,bos_token_id=0,"
        "eos_token_id=0")

# ----------------------------------------------------------------------------------------
# Normalisation: volatile values replaced, keys and structure kept.

# JSON keys whose values change from run to run, and what stands in for them.
_VOLATILE_KEYS = {
    **dict.fromkeys(("generated_at", "created", "finished", "updated", "t"), "<time>"),
    **dict.fromkeys(("seconds", "total_seconds", "seconds_per_item", "seconds_at_max",
                     "trial_seconds", "step_seconds"), "<seconds>"),
    "items_per_second": "<rate>",
    **dict.fromkeys(("peak_bytes", "peak_at_safe_bytes", "peak_at_max_bytes", "headroom_bytes",
                     "limit_peak_bytes", "margin_left_bytes", "step_peaks",
                     "checked_peak_bytes",
                     # The margin is kept of what grows above the fixed part, which is fitted
                     # to the measured peaks: these follow them.
                     "fixed_bytes", "margin_bytes", "limit_bytes", "safe_line_bytes",
                     "recommended_limit_bytes"), "<bytes>"),
    "utilisation": "<fraction>",
    "pid": "<pid>", "run": "<run-id>", "threads": "<threads>",
    "oomguard_version": "<version>", "oomguard": "<version>",
    "fingerprint": "<hash>",  # a result's inputs, the plugin's (temporary) path among them
}
# Keys of a device identity (a dict under "device") that belong to the machine.
_DEVICE_KEYS = {"name": "<device-name>", "host": "<host>", "torch": "<torch>",
                "total_bytes": "<bytes>", "driver": "<driver>", "uuid": "<uuid>"}

_TIME = re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:\d{2})?")
_DEVICE_KEY = re.compile(r"[^\s'\"|/`(]+/\d+(?:/mig=[^/|\s]+)?(?:/driver=[^/|\s]+)?"
                         r"/torch=[^/|\s'\"]+")
_RUN_ID = re.compile(r"\brun [0-9a-f]{12}\b")
_LONG_FLOAT = re.compile(r"-?\d+\.\d{7,}(?:e[-+]?\d+)?")
_BYTES = re.compile(r"-?\d[\d,]*(?:\.\d+)? (?:B|KiB|MiB|GiB|TiB)\b")
_BYTE_COUNT = re.compile(r"\b\d{1,3}(?:,\d{3})+ bytes\b")
_SECONDS = re.compile(r"\b\d+(?:\.\d+)? ?(?:s|ms)\b")
_RATE = re.compile(r"\b\d[\d,]*(?:\.\d+)?(?= items/s|/s\b)")  # 1,234.5 too
_PERCENT = re.compile(r"\b\d+\.\d+%")
_THREADS = re.compile(r"\b\d+ thread\(s\)")
_HOST = re.compile(r"host `[^`]*`")
_LOG_PID = re.compile(r"^<time> \d+ ", re.MULTILINE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_ALWAYS_KEPT = ("sampled every 0.5 ms",)  # a constant, not a measurement


@dataclass(frozen=True)
class Norm:
    """How one run's outputs are normalised: ``literals`` (exact strings of this run, such
    as its temporary folder or its device's name) become placeholders; ``keep`` are
    deterministic amounts (the budget) that the byte rule must not touch."""

    literals: Mapping[str, str]
    keep: tuple[str, ...] = ()

    def text(self, text: str) -> str:
        """Normalise free text: a log line, a Markdown report, a TOML file."""
        text = _DEVICE_KEY.sub("<device-key>", text)
        for value, placeholder in sorted(self.literals.items(), key=lambda kv: -len(kv[0])):
            if value:
                text = re.sub(rf"(?<![\w.]){re.escape(value)}(?![\w])", placeholder, text)
        text = _TIME.sub("<time>", text)
        text = _LOG_PID.sub("<time> <pid> ", text)
        text = _RUN_ID.sub("run <run-id>", text)
        text = _LONG_FLOAT.sub(lambda m: _round_text(m.group()), text)
        kept = {f"\0{i}\0": k for i, k in enumerate(self.keep + _ALWAYS_KEPT)}
        for token, value in kept.items():
            text = text.replace(value, token)
        text = _BYTE_COUNT.sub("<bytes> bytes", text)
        text = _BYTES.sub("<bytes>", text)
        text = _SECONDS.sub("<seconds>", text)
        text = _RATE.sub("<rate>", text)
        text = _PERCENT.sub("<percent>", text)
        text = _THREADS.sub("<threads> thread(s)", text)
        text = _HOST.sub("host `<host>`", text)
        for token, value in kept.items():
            text = text.replace(token, value)
        return _tables(text)

    def json(self, obj: Any, key: str | None = None) -> Any:
        """Normalise a JSON document: volatile values by key, strings as text, floats
        rounded; keys (paths, cache keys) as text too."""
        if isinstance(obj, dict):
            return {self.text(k): self._value(k, v, key) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.json(v, key) for v in obj]
        if isinstance(obj, str):
            return self.text(obj)
        if isinstance(obj, float):
            return _round(obj)
        return obj

    def _value(self, key: str, value: Any, parent: str | None) -> Any:
        placeholder = _VOLATILE_KEYS.get(key)
        if parent == "device" and key in _DEVICE_KEYS:
            placeholder = _DEVICE_KEYS[key]
        if placeholder is None or value is None or isinstance(value, bool):
            return self.json(value, key)  # a flag ("finished": true) is kept, not a time
        return [placeholder] * len(value) if isinstance(value, list) else placeholder


def _round(x: float) -> float | str:
    """6 significant digits: a result's last bits depend on how sums are split."""
    return x if not math.isfinite(x) else float(f"{x:.6g}")


def _round_text(text: str) -> str:
    return repr(_round(float(text)))


def _tables(text: str) -> str:
    """In Markdown tables, bare numbers under a column named for seconds, and the value of
    a row named for seconds, are measured times."""
    out, header = [], None
    for line in text.splitlines(keepends=True):
        if not line.startswith("|"):
            header = None
            out.append(line)
            continue
        cells = line.rstrip("\n").split("|")
        if header is None:
            header = [c.strip().lower() for c in cells]
        elif not set(line.strip()) <= set("|-: "):
            for i, cell in enumerate(cells[1:-1], start=1):
                timed = "seconds" in (header[i] if i < len(header) else "") or (
                    i == 2 and "seconds" in cells[1].lower())
                if timed and _NUMBER.fullmatch(cell.strip()):
                    cells[i] = " <seconds> "
            line = "|".join(cells) + ("\n" if line.endswith("\n") else "")
        out.append(line)
    return "".join(out)


def _json_text(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def check(name: str, text: str) -> None:
    """Compare ``text`` with ``tests/golden/<name>`` (or write it, under
    ``OOMGUARD_UPDATE_GOLDEN=1``)."""
    path = GOLDEN / name
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return
    assert path.exists(), f"no golden {path}: write it with OOMGUARD_UPDATE_GOLDEN=1"
    expected = path.read_text(encoding="utf-8")
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True),
                                            f"golden/{name}", "this run"))
        pytest.fail(f"{name} differs from its golden (if the change is intended, "
                    f"OOMGUARD_UPDATE_GOLDEN=1 rewrites it):\n{diff}", pytrace=False)


def check_json(name: str, doc: Any, norm: Norm) -> None:
    check(name, _json_text(norm.json(doc)))


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _device_literals(device: Mapping[str, Any]) -> dict[str, str]:
    """The machine's device name and total memory, wherever text shows them."""
    return {str(device["name"]): "<device-name>", str(device["total_bytes"]): "<bytes>"}


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``oomguard ARGV`` in this process: exit code, stdout, stderr."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code if isinstance(exc.code, int) else 2
    out, err = capsys.readouterr()
    return code, out, err


def _fresh_cli(argv: list[str]) -> tuple[int, str, str]:
    """A search under a budget in a fresh process: in a process that ran other tests, free
    heap left behind is reused without counting against the budget (a warning, and peaks
    of 0 bytes), so the report would depend on which tests ran before."""
    return in_fresh_process(oomguard_here, argv, None, {})


# ----------------------------------------------------------------------------------------
# A search and a bench, each in a fresh process.

@pytest.mark.slow
def test_search_report(tmp_path: Path) -> None:
    out = tmp_path / "rep"
    code, stdout, stderr = _fresh_cli(["search", "--metric", "loss", "--model", TINY,
                                       "--samples", "4", "--seq-len", "8", "--budget", "64MiB",
                                       "--out", str(out)])
    assert code == 0, stderr
    norm = Norm({str(tmp_path): "<tmp>"}, keep=("64.00 MiB",))
    check_json("search/report.json", _read_json(out / "report.json"), norm)
    check("search/report.md", norm.text((out / "report.md").read_text(encoding="utf-8")))
    check("search/output.txt", norm.text(f"exit code {code}\n--- stdout\n{stdout}"
                                         f"--- stderr\n{stderr}"))
    assert sorted(p.name for p in out.iterdir()) == [
        "memory.png", "report.json", "report.md", "throughput.png"]


@pytest.mark.slow
def test_bench_report(tmp_path: Path) -> None:
    out = tmp_path / "rep"
    code, stdout, stderr = _fresh_cli(["bench", "--model", TINY, "--seq-len", "16", "--budget",
                                       "48MiB", "--start", "2", "--max-size", "2", "--out",
                                       str(out), "--json"])
    assert code == 0, stderr
    norm = Norm({str(tmp_path): "<tmp>"}, keep=("48.00 MiB",))
    check_json("bench/stdout.json", json.loads(stdout), norm)
    check_json("bench/report.json", _read_json(out / "report.json"), norm)
    check("bench/report.md", norm.text((out / "report.md").read_text(encoding="utf-8")))


# ----------------------------------------------------------------------------------------
# A job and a reference, each in its own process, side by side, once per module.

BOOM = '''\
from oomguard.metrics.base import Knob, Metric, register


@register
class Boom(Metric):
    name = "boom"
    description = "raises a ValueError: a bug, not memory"
    knobs = (Knob("micro_batch_size", "memory", 2),)

    def compute(self, model, data, **params):
        raise ValueError("boom: a bug in the metric")
'''

JOB = f'''\
output = "out"
models = ["{TINY}"]
budget = "256MiB"
plugins = ["boom.py"]

[data]
seq_len = 8
n_samples = 4

[[metrics]]
name = "loss"

[[metrics]]
name = "attention_stats"
sizes = {{ chunk_size = 2 }}

[[metrics]]
name = "boom"
sizes = {{ micro_batch_size = 1 }}
'''

REFERENCE = ["reference", "--model", TINY, "--metric", "loss,integrated_gradients",
             "--samples", "2", "--seq-len", "8", "--budget", "256MiB", "--cache", "cache.json",
             "--out", "ref"]


@dataclass(frozen=True)
class Done:
    """A finished command: its folder, exit code and output."""

    cwd: Path
    code: int
    stdout: str
    stderr: str


# Once per run: a session fixture is set up by each pytest-xdist worker that needs it, and
# pytest tears a module's fixture down whenever a worker's shuffled order leaves the module.
@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Done]:
    """``oomguard run job.toml`` and ``oomguard reference ...``, run together, each as a
    command of its own (:func:`oomguard_here` in a fresh child): ``{"job": Done,
    "reference": Done}``."""
    return once_per_run(tmp_path_factory, "golden-runs", lambda: _run_both(
        tmp_path_factory.mktemp("golden")))


def _run_both(root: Path) -> dict[str, Done]:
    commands = {"job": ["run", "job.toml", "--cache", "cache.json"], "reference": REFERENCE}
    (root / "job").mkdir()
    (root / "job" / "boom.py").write_text(BOOM, encoding="utf-8")
    (root / "job" / "job.toml").write_text(JOB, encoding="utf-8")
    (root / "reference").mkdir()
    ended = in_fresh_processes(oomguard_here, [[argv, str(root / name), {}]
                                          for name, argv in commands.items()], workers=2)
    return {name: Done(root / name, *got) for name, got in zip(commands, ended, strict=True)}


def _job_norm(done: Done) -> Norm:
    device = _read_json(done.cwd / "out" / "results.json")["job"]["device"]
    return Norm({str(done.cwd): "<tmp>", str(REPO): "<repo>", **_device_literals(device)},
                keep=("256.00 MiB",))


@pytest.mark.slow
def test_job_results(runs: dict[str, Done]) -> None:
    job = runs["job"]
    assert job.code == 1, job.stderr  # boom failed; the other two are done
    out, norm = job.cwd / "out", _job_norm(job)
    check_json("job/results.json", _read_json(out / "results.json"), norm)
    for path in sorted((out / "results").glob("*.json")):
        check_json(f"job/results/{path.name}", _read_json(path), norm)
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*")
                   if p.is_file() and not any(part.startswith(".") for part in
                                              p.relative_to(out).parts))
    check("job/files.txt", "".join(f"{f}\n" for f in files))
    traceback = (out / "tracebacks" / "boom.txt").read_text(encoding="utf-8").splitlines()
    assert traceback[0] == "Traceback (most recent call last):"
    assert traceback[-1] == "ValueError: boom: a bug in the metric"


@pytest.mark.slow
def test_job_journal(runs: dict[str, Done]) -> None:
    job = runs["job"]
    norm = _job_norm(job)
    lines = (job.cwd / "out" / "journal.jsonl").read_text(encoding="utf-8").splitlines()
    events = [norm.json(json.loads(line)) for line in lines]
    check("job/journal.jsonl", "".join(json.dumps(e, sort_keys=True, ensure_ascii=False) + "\n"
                                       for e in events))


@pytest.mark.slow
def test_job_report_and_what_it_prints(runs: dict[str, Done]) -> None:
    job = runs["job"]
    norm = _job_norm(job)
    out = job.cwd / "out"
    check("job/report.md", norm.text((out / "report.md").read_text(encoding="utf-8")))
    check("job/job.log", norm.text((out / "job.log").read_text(encoding="utf-8")))
    check("job/stdout.txt", norm.text(job.stdout))
    check("job/stderr.txt", norm.text(job.stderr))


@pytest.mark.slow
def test_job_cache(runs: dict[str, Done]) -> None:
    job = runs["job"]
    check_json("job/cache.json", _read_json(job.cwd / "cache.json"), _job_norm(job))


def _reference_norm(done: Done) -> Norm:
    device = _read_json(done.cwd / "ref" / "reference.json")["device"]
    return Norm({str(done.cwd): "<tmp>", **_device_literals(device)}, keep=("256.00 MiB",))


@pytest.mark.slow
def test_reference_outputs(runs: dict[str, Done]) -> None:
    ref = runs["reference"]
    assert ref.code == 0, ref.stderr
    norm, out = _reference_norm(ref), ref.cwd / "ref"
    check_json("reference/reference.json", _read_json(out / "reference.json"), norm)
    check("reference/reference.md", norm.text((out / "reference.md").read_text(encoding="utf-8")))
    check("reference/sizes.toml", norm.text((out / "sizes.toml").read_text(encoding="utf-8")))
    check("reference/stdout.txt", norm.text(ref.stdout))
    check("reference/stderr.txt", norm.text(ref.stderr))


@pytest.mark.slow
def test_reference_cache_and_cache_show(runs: dict[str, Done],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    ref = runs["reference"]
    norm, cache = _reference_norm(ref), ref.cwd / "cache.json"
    check_json("reference/cache.json", _read_json(cache), norm)
    code, stdout, stderr = _cli(["cache", "show", "--cache", str(cache)], capsys)
    assert (code, stderr) == (0, "")
    # The table's columns are as wide as the machine's device key: one gap, whatever it is.
    check("reference/cache-show.txt", re.sub(r" {2,}", "  ", norm.text(stdout)))


# ----------------------------------------------------------------------------------------
# Bad input: one line and an exit code, before any work.

_JOB_HEAD = 'output = "o"\nmodels = ["tiny-gpt2"]\n'
_JOB_DATA = '[data]\nseq_len = 8\nn_samples = 2\n'
_LOSS = '[[metrics]]\nname = "loss"\n'
FILES = {
    "job-not-toml.toml": _JOB_HEAD + "[data\nseq_len = 8\n",
    "job-samples-0.toml": _JOB_HEAD + "[data]\nseq_len = 8\nn_samples = 0\n" + _LOSS,
    "job-unknown-metric.toml": _JOB_HEAD + _JOB_DATA + '[[metrics]]\nname = "nope"\n',
    "job-small-budget.toml": _JOB_HEAD + 'budget = "1MiB"\n' + _JOB_DATA + _LOSS,
    "job-big-seed.toml": _JOB_HEAD + "seed = 9223372036854775808\n" + _JOB_DATA + _LOSS,
    "job-time-limit-0.toml": _JOB_HEAD + 'time_limit = "0"\n' + _JOB_DATA + _LOSS,
    "job-long-seq.toml": _JOB_HEAD + "[data]\nseq_len = 4096\nn_samples = 2\n" + _LOSS,
    "job-size-0.toml": _JOB_HEAD + _JOB_DATA + _LOSS + "sizes = { micro_batch_size = 0 }\n",
    "job-dtype.toml": _JOB_HEAD + 'dtype = "float8"\n' + _JOB_DATA + _LOSS,
    "job-device.toml": _JOB_HEAD + 'device = "tpu"\n' + _JOB_DATA + _LOSS,
    "job-param.toml": _JOB_HEAD + _JOB_DATA + _LOSS + "params = { bogus = 1 }\n",
    "job-ok.toml": _JOB_HEAD + _JOB_DATA + _LOSS,
    "sizes-not-toml.toml": "[reference\n",
    "cache-corrupt.json": "{not json",
    "cache-size-0.json": json.dumps({"version": 1, "entries": {"k": {
        "sizes": {"micro_batch_size": 0}, "source": "edited by hand"}}}),
}

ERRORS: dict[str, list[str]] = {
    # sizes <= 0
    "bench --start 0": ["bench", "--start", "0"],
    "bench --size-step -8": ["bench", "--size-step", "-8"],
    "bench --max-size 0": ["bench", "--max-size", "0"],
    "bench --max-trials 0": ["bench", "--max-trials", "0"],
    "bench --start over --max-size": ["bench", "--start", "64", "--max-size", "32"],
    "search --samples 0": ["search", "--metric", "loss", "--samples", "0"],
    "estimate --sizes 0": ["estimate", "--sizes", "0"],
    "estimate --sizes a,b": ["estimate", "--sizes", "a,b"],
    # budgets
    "bench --budget 2XB": ["bench", "--budget", "2XB"],
    "bench --budget 0": ["bench", "--budget", "0"],
    "bench --budget=-1GiB": ["bench", "--budget=-1GiB"],
    "bench --budget 1KiB": ["bench", "--model", TINY, "--seq-len", "8", "--budget", "1KiB"],
    # unknown metric, knob, model, dtype, device, workload, GPU
    "search --metric nope": ["search", "--metric", "nope"],
    "search --knob nope": ["search", "--metric", "loss", "--knob", "nope"],
    "search unknown model": ["search", "--metric", "loss", "--model", "nosuchtype:n_layer=1"],
    "search --dtype float8": ["search", "--metric", "loss", "--dtype", "float8"],
    "search unsupported model": ["search", "--metric", "attention_stats", "--model",
                                 "mamba:num_hidden_layers=1,hidden_size=16,vocab_size=64"],
    "bench --device tpu": ["bench", "--device", "tpu"],
    "probe --device tpu": ["probe", "--device", "tpu"],
    "probe --device cuda:x": ["probe", "--device", "cuda:x"],
    "bench model key": ["bench", "--model", "gpt2:n_layr=1"],
    "bench model value": ["bench", "--model", "gpt2:n_layer=abc"],
    "metrics unknown model": ["metrics", "--model", "nosuch:x=1"],
    "estimate --metric nope": ["estimate", "--sizes", "1", "--metric", "nope"],
    "reference --metric nope": ["reference", "--metric", "nope"],
    "reference --metric ,": ["reference", "--metric", ","],
    "reference --gpu without --estimate": ["reference", "--gpu", "H100 80GB"],
    "reference --estimate alone": ["reference", "--estimate"],
    "reference --estimate --gpu Z80": ["reference", "--estimate", "--gpu", "Z80"],
    # --seq-len over the model's positions
    "bench --seq-len 5000": ["bench", "--seq-len", "5000"],
    "search --seq-len 64": ["search", "--metric", "loss", "--model", TINY, "--seq-len", "64"],
    "reference --seq-len 64": ["reference", "--model", TINY, "--seq-len", "64"],
    "estimate --seq-len 64": ["estimate", "--sizes", "1", "--model", TINY, "--seq-len", "64"],
    # other options
    "bench --strategy doubling --size-step": ["bench", "--strategy", "doubling", "--size-step",
                                              "16"],
    "bench --margin 1.5": ["bench", "--margin", "1.5"],
    "bench --trial-timeout nan": ["bench", "--isolate", "--trial-timeout", "nan"],
    "verify no report": ["verify", "/nonexistent/rep"],
    # job files
    "run no job": ["run"],
    "run missing job": ["run", "/nonexistent/job.toml"],
    "run job not TOML": ["run", "job-not-toml.toml"],
    "run job n_samples 0": ["run", "job-samples-0.toml"],
    "run job unknown metric": ["run", "job-unknown-metric.toml"],
    "run job budget 1MiB": ["run", "job-small-budget.toml"],
    "run job seed 2**63": ["run", "job-big-seed.toml"],
    "run job time_limit 0": ["run", "job-time-limit-0.toml"],
    "run job seq_len 4096": ["run", "job-long-seq.toml"],
    "run job size 0": ["run", "job-size-0.toml"],
    "run job dtype float8": ["run", "job-dtype.toml"],
    "run job device tpu": ["run", "job-device.toml"],
    "run job unknown param": ["run", "job-param.toml"],
    "run --sizes-file not TOML": ["run", "job-ok.toml", "--sizes-file", "sizes-not-toml.toml"],
    # the size cache: a warning, never an error
    "cache show corrupt file": ["cache", "show", "--cache", "cache-corrupt.json"],
    "cache show size 0": ["cache", "show", "--cache", "cache-size-0.json"],
}


def _stderr(err: str) -> str:
    """argparse's usage lines (their layout follows the options) as ``<usage>``, then its
    error line; anything else as it is."""
    if err.startswith("usage:"):
        return "<usage>\n" + err.rstrip("\n").splitlines()[-1] + "\n"
    return err


def test_one_line_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                         capsys: pytest.CaptureFixture[str]) -> None:
    # The catalogue a fresh ``oomguard`` has: other test modules in this process register
    # metrics of their own (test_remedies when it is imported), and the errors list them.
    load_all()
    for name, metric in list(METRICS.items()):
        if not type(metric).__module__.startswith("oomguard.metrics."):
            monkeypatch.delitem(METRICS, name)
    for name, text in FILES.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    monkeypatch.chdir(tmp_path)  # the messages name the files as given
    table = {}
    for case, argv in ERRORS.items():
        code, out, err = _cli(argv, capsys)
        # What the command left in the folder: nothing, where it checks before any work.
        made = sorted(p.name for p in tmp_path.iterdir() if p.name not in FILES)
        for name in made:
            shutil.rmtree(tmp_path / name)
        table[case] = {"argv": argv, "exit": code, "stdout": out, "stderr": _stderr(err),
                       "made": made}
        assert "Traceback" not in err, (case, err)
    check("errors.json", _json_text(table))

