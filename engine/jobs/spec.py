"""Job files: a TOML description of an unattended analysis, parsed and checked up front.

Everything that can be checked before a job starts is checked here, before any output
folder exists: TOML syntax, field types, metric names, their parameters, model specs,
the data file. A problem is a :class:`JobError` whose one-line message names the field
(``metrics[2].params.n_points``) and, where it can be found, the line of the file.

Each table (the top level, ``[data]``, ``[search]``, every ``[[metrics]]``) is declared
once, as a tuple of :class:`_Field`, and read by one loop, :meth:`_Reader.read`; what
spans tables (a data file's size, a model's positions against ``seq_len``, a metric
that does not support a model, repeated ids) is checked after it. ``EXAMPLE`` is the
commented example file (:func:`~oomguard.engine.jobs.example.example_text`); the records
(:class:`Job`, :class:`DataSpec`, ...) live in :mod:`oomguard.engine.jobs.records`.
"""

from __future__ import annotations

import math
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):  # why: module level, by Python version (tomllib is 3.11+)
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from oomguard.engine.core.execute.remedies import parse_on_oom
from oomguard.engine.core.memory.budget import MIN_CPU_BUDGET
from oomguard.engine.core.search.config import SearchConfig
from oomguard.engine.errors import JobError, UsageError, first_line
from oomguard.engine.jobs.data import (
    check_data,
    check_samples,
    check_seq_len_floor,
    check_size,
    check_vocab,
)
from oomguard.engine.jobs.example import example_text
from oomguard.engine.jobs.plugins import import_plugin, load_plugin
from oomguard.engine.jobs.records import DataSpec, Job, MetricSpec, SearchSpec
from oomguard.engine.util.atomic import path_part_problem
from oomguard.engine.util.units import fmt_bytes, parse_size
from oomguard.metrics.base import get_metric
from oomguard.metrics.models import DTYPES, check_seq_len, model_config

__all__ = ["DataSpec", "Job", "JobError", "MetricSpec", "SearchSpec", "example_text",
           "import_plugin", "line_of", "load_job", "model_label", "parse_duration", "parse_job"]

_DURATION = re.compile(r"^\s*(?:(\d+(?:\.\d+)?)\s*h)?\s*(?:(\d+(?:\.\d+)?)\s*m)?\s*"
                       r"(?:(\d+(?:\.\d+)?)\s*s?)?\s*$")
_DATA_SOURCES = ("generated", "text", "tokens", "bytes")
_SECTIONS = ("data", "search", "metrics")  # tables of their own, read after the top level
_ABSENT = object()  # no default: the record's own applies
# Deeper than any job file needs (a metric's params table holds plain values: 4 levels):
# nesting beyond it is refused before Python's parser recurses into it (its time grows with
# the square of the depth: docs/measurements.md#hostile-files).
MAX_DEPTH = 32
# A table header or a dotted key, the part that can nest (tomllib takes time quadratic in
# a header's depth: 3,000 nested headers took 8 s to parse).
_KEY_PATH = re.compile(r"^[ \t]*(?:\[{1,2}([^\]\n#]*)\]|([^=#\[\n]+)=)", re.MULTILINE)
_ID = re.compile(r"^(?!\.+$)[A-Za-z0-9_.-]+$")  # a file-name part (results/<id>.json), not "."


def parse_duration(value: Any) -> float:
    """Seconds from a number or a string like ``"90"``, ``"90s"``, ``"20m"``, ``"1h30m"``."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration, got {value!r}; give seconds such as 90, "
                         "or \"20m\"")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value)) and any(m.groups()):
        h, mi, s = (float(g) if g else 0.0 for g in m.groups())
        seconds = h * 3600 + mi * 60 + s
    else:
        raise ValueError(f"expected a duration like 90, \"90s\", \"20m\" or \"1h30m\", "
                         f"got {value!r}; give one of those")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"a duration must be a positive, finite number of seconds, got "
                         f"{value!r}; give one such as 90 or \"20m\"")
    return seconds


def line_of(text: str, where: str) -> int | None:
    """Best-effort line of the field ``where`` names (``budget``, ``data.seq_len``,
    ``metrics[2].params.x``; ``metrics[2]``: its ``name``): its ``key = ...`` line in its
    table, else the table's header line."""
    table, index, key = re.match(r"^([^.\[]+)(?:\[(\d+)\])?(?:\.([^.]+))?", where).groups()
    lines, start = text.splitlines(), 0
    if index is None and key is None:  # a top-level field
        table, key = None, table
    if table is not None:
        header = re.compile(r"^\s*\[\[?\s*" + re.escape(table) + r"\s*\]\]?\s*(#.*)?$")
        starts = [i + 1 for i, line in enumerate(lines) if header.match(line)]
        if int(index or 0) >= len(starts):
            return None
        start = starts[int(index or 0)]
    pattern = re.compile(r"^\s*" + re.escape(key or "name") + r"\s*=")
    for i in range(start, len(lines)):
        if re.match(r"^\s*\[", lines[i]):  # the next table
            break
        if pattern.match(lines[i]):
            return i + 1
    return start or None  # a table's header line


class _Bad(ValueError):
    """A converter's complaint about part ``at`` of its field (``models[1]``, ``params.zz``)."""

    def __init__(self, message: str, at: str) -> None:
        super().__init__(message)
        self.at = at


@dataclass(frozen=True)
class _Field:
    """A field of a job file's table: its TOML types (``expected`` names them; None: the
    converter checks), its default (``_ABSENT``: the record's), ``convert(value, fields
    read before it)`` (the value kept; a ValueError's message follows ``field:``), and
    the message when a required field is ``missing``."""

    key: str
    kinds: tuple[type, ...] | None
    expected: str = ""
    default: Any = _ABSENT
    convert: Callable[[Any, dict[str, Any]], Any] | None = None
    missing: str | None = None


def _must(test: Callable[[Any], Any], message: str) -> Callable[[Any, dict[str, Any]], Any]:
    """A converter that keeps a value passing ``test``; else ``message`` (``{v}``: the value)."""
    def check(value: Any, _: dict[str, Any]) -> Any:
        if not test(value):
            raise ValueError(message.format(v=value))
        return value
    return check


def _output(value: str, _: dict[str, Any]) -> str:
    if not value.strip():
        raise ValueError('is empty; give a folder ("." is the current one, if it is empty or '
                         "holds this job's results)")
    return value


def _job_name(value: str, _: dict[str, Any]) -> str:
    """A name that can label a folder (``moved-aside/<time>-<name>``); see path_part_problem."""
    if (why := path_part_problem(value)) is not None:
        raise ValueError(f"{why}; give a name without '/', '\\' and '..'")
    return value


def _seq_len(value: int) -> int:
    check_seq_len_floor(value, "a sequence length")
    return value


def _result_knobs(metric: str) -> list[str]:
    return sorted(k.name for k in get_metric(metric).result_knobs())


def _budget(value: str | int, got: dict[str, Any]) -> int:
    nbytes = parse_size(value)
    if got["device"] == "cpu" and nbytes < MIN_CPU_BUDGET:  # larger than the device: plan.py
        raise ValueError(f"{value!r} is too small for a CPU budget: thread pools need about "
                         f"20 MiB of headroom; use at least {fmt_bytes(MIN_CPU_BUDGET)}")
    return nbytes


def _models(value: list | str, _: dict[str, Any]) -> dict[str, Any]:
    """``{spec: transformers config}`` of each model, in order."""
    specs = [value] if isinstance(value, str) else value
    if not specs:
        raise ValueError("give at least one model")
    configs = {}
    for i, spec in enumerate(specs):
        if not isinstance(spec, str):
            raise _Bad(f"expected a string, got {spec!r}; give a quoted model spec",
                       f"models[{i}]")
        try:
            configs[spec] = model_config(spec)
        except (ValueError, OSError, KeyError) as exc:
            raise _Bad(first_line(exc), f"models[{i}]") from None
    if len({model_label(m) for m in specs}) != len(specs):
        raise ValueError("two models have the same label; list each model once")
    return configs


def _plugins(value: list, got: dict[str, Any]) -> tuple[str, ...]:
    """Each plugin imported (a ``.py`` path resolved against the job file's folder); two
    that define one metric name are refused."""
    plugins, defined = [], {}
    for i, plug in enumerate(value):
        if not isinstance(plug, str):
            raise _Bad(f"expected a string, got {plug!r}; give a quoted path or module",
                       f"plugins[{i}]")
        try:
            plugins.append(load_plugin(plug, got["base"], defined))
        except ValueError as exc:
            raise _Bad(str(exc), f"plugins[{i}]") from None
    return tuple(plugins)


def _params(value: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    """Result-defining parameters only: a memory knob belongs under ``sizes``."""
    metric = get_metric(got["name"])
    memory, result = {k.name for k in metric.memory_knobs()}, _result_knobs(got["name"])
    for key in value:
        if key in memory:
            raise _Bad("is a memory knob (tuned, result-invariant): put it under sizes to pin "
                       "it", f"params.{key}")
        if key not in result:
            raise _Bad(f"unknown parameter of {got['name']!r}; its result-defining parameters "
                       f"are {', '.join(result) or '(none)'}: remove it, or use one of them",
                       f"params.{key}")
    return value


def _sizes(value: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    """Pinned memory knobs only (their values are checked with the parameters')."""
    memory = sorted(k.name for k in get_metric(got["name"]).memory_knobs())
    for key in value:
        if key not in memory:
            raise _Bad(f"not a memory knob of {got['name']!r}; its memory knobs are "
                       f"{', '.join(memory) or '(none)'}: remove it, or use one of them", f"sizes.{key}")
    return value


_STR, _TABLE = (str,), (dict,)
_POSITIVE = {"kinds": (int,), "expected": "a positive integer",
             "convert": _must(lambda v: v > 0, "expected a positive integer, got {v!r}; give 1 or more")}
_DURATION_FIELD = {"kinds": None, "convert": lambda v, _: parse_duration(v)}
_LADDER = {"kinds": None, "default": None, "convert": lambda v, _: parse_on_oom(v)}
# The tables of a job file, each in the order its fields are read.
_JOB = (
    _Field("device", _STR, "a string", "cpu", _must(
        lambda v: re.match(r"^(cpu|mps|cuda(:\d+)?)$", v),
        "unknown device {v!r}: use cpu, cuda, cuda:N or mps")),
    _Field("dtype", _STR, "a string", "float32", _must(
        lambda v: v in DTYPES, "unknown dtype {v!r}: use one of " + ", ".join(DTYPES))),
    _Field("seed", (int,), "an integer", 0, _must(  # torch's generators take 64-bit seeds
        lambda v: 0 <= v < 2**63, "{v} is out of range: use 0 <= seed < 2**63")),
    _Field("output", _STR, "a string", "oomguard-job", _output),
    _Field("name", _STR, "a string", convert=_job_name),  # default: the file's name
    _Field("budget", (str, int), 'a size like "1GiB"', None, _budget),
    _Field("time_limit", default=1200.0, **_DURATION_FIELD),
    _Field("models", (list, str), "a list of strings", ["tiny-gpt2"], _models),
    _Field("plugins", (list,), "a list of strings", [], _plugins),
    _Field("on_oom", **_LADDER))
_DATA = (
    _Field("source", _STR, "a string", convert=_must(lambda v: v in _DATA_SOURCES,
           "unknown source {v!r}: use one of " + ", ".join(_DATA_SOURCES))),
    _Field("path", _STR, "a string"),
    _Field("seq_len", (int,), "a positive integer", convert=lambda v, _: _seq_len(v)),
    _Field("n_samples", **_POSITIVE))
_BOOL = {"kinds": (bool,), "expected": "true or false"}
_MARGIN = {"kinds": (int, float, str), "expected": 'a fraction or "measured"'}
# Any SearchConfig field, by its name, with SearchConfig's defaults (none given here).
_SEARCH = (_Field("enabled", **_BOOL), _Field("strategy", _STR, "a string"),
           _Field("start", **_POSITIVE), _Field("size_step", **_POSITIVE),
           _Field("max_size", **_POSITIVE), _Field("max_trials", **_POSITIVE),
           _Field("max_seconds", **_DURATION_FIELD), _Field("margin", **_MARGIN),
           _Field("isolate", **_BOOL), _Field("confirm", **_BOOL),
           _Field("steps_per_trial", **_POSITIVE), _Field("trial_timeout", **_DURATION_FIELD))
# Old [search] fields, accepted for one release: step (now size_step), estimate (removed).
_SEARCH_OLD = (_Field("step", **_POSITIVE), _Field("estimate", **_BOOL))
_METRIC = (
    _Field("name", _STR, "a string", convert=lambda v, _: get_metric(v) and v,
           missing="missing: every [[metrics]] needs a name; add one, such as name = \"loss\""),
    _Field("id", _STR, "a string", convert=_must(lambda v: _ID.match(v),
           "{v!r}: use letters, digits, '_', '-', '.'")),
    _Field("params", _TABLE, "a table", {}, _params),
    _Field("sizes", _TABLE, "a table", {}, _sizes),
    _Field("time_limit", **_DURATION_FIELD), _Field("on_oom", **_LADDER))


class _Reader:
    """Reads a job file's tables by their fields; every problem is a :class:`JobError`
    naming the field and its line."""

    def __init__(self, path: str, text: str) -> None:
        self.path, self.text = path, text

    def error(self, where: str, message: str, line_at: str | None = None) -> JobError:
        """``message`` about ``where``, at the line of ``line_at`` (default: ``where``)."""
        line = line_of(self.text, line_at or where)
        return JobError(f"{self.path}{f', line {line}' if line else ''}: {where}: {message}")

    def table(self, doc: dict[str, Any], key: str) -> dict[str, Any]:
        value = doc.get(key, {})
        if not isinstance(value, dict):
            raise self.error(key, f"expected a table [{key}], got {type(value).__name__}; "
                             f"write it as a [{key}] table")
        return value

    def read(self, table: dict[str, Any], fields: tuple[_Field, ...], prefix: str,
             valid: str | None = None, **got: Any) -> dict[str, Any]:
        """Every field of ``table`` (``prefix``: ``data.``, ``metrics[2].``) checked and
        converted, or its default; ``got`` seeds what converters read and defaults from
        elsewhere (the job file's folder, the job's time limit). ``valid``: how an unknown
        field's message lists the valid ones."""
        extra = sorted(set(table) - {f.key for f in fields} - set(() if prefix else _SECTIONS))
        if extra:
            valid = valid or "valid: " + ", ".join(sorted(f.key for f in fields))
            raise self.error(prefix + extra[0], f"unknown field (remove it, or fix its name); {valid}")
        for f in fields:
            if f.key in table:
                got[f.key] = self._value(table[f.key], f, got, prefix)
            elif f.missing:
                raise self.error(prefix + f.key, f.missing)
            elif f.default is not _ABSENT and f.key not in got:  # a default is converted too
                got[f.key] = None if f.default is None else self._value(f.default, f, got, prefix)
        return got

    def _value(self, value: Any, f: _Field, got: dict[str, Any], prefix: str) -> Any:
        where = prefix + f.key
        if f.kinds is not None and (not isinstance(value, f.kinds)
                                    or (isinstance(value, bool) and bool not in f.kinds)):
            raise self.error(where, f"expected {f.expected}, got {type(value).__name__} "
                                    f"{value!r}; give {f.expected}")
        try:
            return f.convert(value, got) if f.convert else value
        except _Bad as exc:  # about part of the field: at the field's own line
            raise self.error(prefix + exc.at, str(exc), where) from None
        except ValueError as exc:  # said once: "on_oom: on_oom: ..." reads as a stutter
            raise self.error(where, str(exc).removeprefix(f"{f.key}: ")) from None


def __getattr__(name: str) -> Any:
    if name == "EXAMPLE":  # the example job file's text, read when first asked for
        return example_text()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def model_label(spec: str) -> str:
    """A file-name-safe label for a model spec (a checkpoint folder's name, ``gpt2_n_layer_4``)."""
    base = Path(spec).name if ("/" in spec or Path(spec).is_dir()) else spec
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", base).strip("_") or "model"


def load_job(path: str | Path, *, output: str | None = None) -> Job:
    """Read, parse and check a job file; ``output`` overrides its ``output`` field.
    Raises :class:`JobError` (one line) for anything wrong, before any side effect."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise JobError(f"{path}: job file not found; check the path, or write one with "
                       "`oomguard run --example > job.toml`") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise JobError(f"{path}: cannot read the job file: {exc}; check its permissions, "
                       "and save it as UTF-8") from None
    return parse_job(text, path=str(p), base=p.resolve().parent, output=output)


def parse_job(text: str, *, path: str = "<job>", base: Path | None = None,
              output: str | None = None) -> Job:
    """Parse job-file text; relative paths are resolved against ``base`` (data, plugins)
    and the current directory (output)."""
    r = _Reader(path, text)
    too_deep = JobError(f"{path}: nested more than {MAX_DEPTH} levels deep; write a job file "
                        "of plain tables (a [[metrics]] table's params are 3 levels down)")
    if any((m[1] or m[2]).count(".") >= MAX_DEPTH for m in _KEY_PATH.finditer(text)):
        raise too_deep
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:  # the message carries "(at line L, column C)"
        raise JobError(f"{path}: not valid TOML: {exc}; fix the line it names") from None
    except RecursionError:  # arrays or inline tables nested ~900 deep: the parser recurses
        doc = None
    if doc is None or _deeper_than(doc, MAX_DEPTH):
        raise too_deep
    base = base or Path.cwd()
    stem = Path(path).stem
    if "name" not in doc and path_part_problem(stem) is not None:
        raise r.error("name", f"the file's name {stem!r} cannot label a folder; give a name")
    top = r.read(doc, _JOB, "", "valid top-level fields are " + ", ".join(
        sorted([*(f.key for f in _JOB), *_SECTIONS])), name=stem, base=base)
    if output is not None and not output.strip():
        raise JobError('--out: the output folder is empty; give a folder ("." is the current '
                       "one, if it is empty or holds this job's results)")
    data = _data(r, doc, base)
    for i, config in enumerate(top["models"].values()):
        try:
            check_seq_len(config, data.seq_len)
        except ValueError as exc:
            raise r.error("data.seq_len", f"models[{i}]: {exc}") from None
    table = r.table(doc, "search")
    old = r.read({k: table.pop(k) for k in ("step", "estimate") if k in table}, _SEARCH_OLD,
                 "search.")
    search = _search(r, r.read(table, _SEARCH, "search."), old, top["budget"])
    metrics = _metrics(r, doc, top["time_limit"])
    _check_fits(r, top, data, search, metrics)
    for i, (spec, config) in enumerate(top["models"].items()):
        for index, m in enumerate(metrics):
            if reason := get_metric(m.name).unsupported(config):
                raise r.error(f"metrics[{index}]", f"{m.name} does not support models[{i}] "
                              f"({model_label(spec)}): {reason}; remove one of them",
                              f"metrics[{index}].name")
    return Job(path=str(Path(path).resolve()) if path != "<job>" else path, text=text,
               name=top["name"], output=_resolved_output(r, output, top["output"]),
               device=top["device"], dtype=top["dtype"], seed=top["seed"],
               models=tuple(top["models"]), data=data, search=search, metrics=metrics,
               budget_bytes=top["budget"], plugins=top["plugins"], on_oom=top["on_oom"])


def _deeper_than(doc: Any, limit: int) -> bool:
    """Whether tables and arrays in ``doc`` nest more than ``limit`` levels (the document is
    level 1); iterative, so that no depth makes it recurse."""
    stack = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
    return False


def _resolved_output(r: _Reader, given: str | None, field: str) -> str:
    """The output folder, absolute: ``--out`` (``given``) or the job file's ``output``."""
    where = "--out" if given is not None else "output"
    try:
        return str(Path(given if given is not None else field).expanduser().resolve())
    except (OSError, RuntimeError) as exc:  # a symlink loop: RuntimeError before Python 3.13
        raise (JobError(f"--out: {given}: {first_line(exc)}; give another folder")
               if given is not None else r.error(where, f"{field}: {first_line(exc)}; give "
                                                 "another folder")) from None


def _search(r: _Reader, got: dict[str, Any], old: dict[str, Any],
            budget: int | None) -> SearchSpec:
    """``[search]``: checked by building the SearchConfig it describes (a bad strategy name, or
    an option the strategy does not take, is one line naming the field); ``old``: the
    deprecated fields given."""
    if "step" in old:
        warnings.warn("[search] step is deprecated: use size_step", FutureWarning, stacklevel=2)
        got.setdefault("size_step", old["step"])
    if "estimate" in old:
        warnings.warn("[search] estimate is removed (estimate seeding did not pay): it is "
                      "ignored", FutureWarning, stacklevel=2)
    enabled = got.pop("enabled", True)
    try:
        SearchConfig.from_options(**got, budget=budget)  # linear-jump aims at the budget
    except UsageError as exc:
        raise r.error(f"search.{next(iter(got), 'strategy')}", str(exc)) from None
    return SearchSpec(enabled=enabled, options=got)


def _data(r: _Reader, doc: dict[str, Any], base: Path) -> DataSpec:
    """``[data]``; a file source's path resolved against ``base`` and its size checked."""
    data = DataSpec(**r.read(r.table(doc, "data"), _DATA, "data.",
                             "valid: " + ", ".join(f.key for f in _DATA)))
    if data.source == "generated":
        return data
    if data.path is None:
        raise r.error("data.path", f"source {data.source!r} needs a path", "data.source")
    full = (base / Path(data.path).expanduser()).resolve()
    if not full.is_file():
        raise r.error("data.path", f"data file not found: {full}")
    data = DataSpec(data.source, str(full), data.seq_len, data.n_samples)
    try:
        check_data(data)
    except ValueError as exc:
        raise r.error("data.path", str(exc)) from None
    return data


def _check_fits(r: _Reader, top: dict[str, Any], data: DataSpec, search: SearchSpec,
                metrics: tuple[MetricSpec, ...]) -> None:
    """What no model can run, refused before the job starts: token ids outside a model's
    vocabulary, and sizes whose batch no device holds (:mod:`~oomguard.engine.jobs.data`)."""
    try:
        check_samples(data.n_samples, data.seq_len, "data.n_samples", "data.seq_len")
    except ValueError as exc:
        raise r.error("data.n_samples", str(exc)) from None
    for i, config in enumerate(top["models"].values()):
        try:
            check_vocab(data, getattr(config, "vocab_size", None), top["seed"])
        except ValueError as exc:
            raise r.error("data.path", f"models[{i}]: {exc}") from None
    sizes = [(f"search.{k}", search.options[k]) for k in ("start", "max_size")
             if k in search.options]
    sizes += [(f"metrics[{i}].sizes.{k}", v) for i, m in enumerate(metrics)
              for k, v in m.sizes.items()]
    for where, size in sizes:
        try:
            check_size(size, data.seq_len, where.rpartition(".")[2])
        except ValueError as exc:
            raise r.error(where, str(exc)) from None


def _metrics(r: _Reader, doc: dict[str, Any], time_limit: float) -> tuple[MetricSpec, ...]:
    """Every ``[[metrics]]`` table (``time_limit``: the job's, for those without their own);
    each id once."""
    raw = doc.get("metrics")
    if raw is None:
        raise r.error("metrics", "no metrics: add at least one [[metrics]] table with a name")
    if not isinstance(raw, list) or not all(isinstance(m, dict) for m in raw) or not raw:
        raise r.error("metrics", "expected [[metrics]] tables")
    out = []
    for i, table in enumerate(raw):
        got = r.read(table, _METRIC, f"metrics[{i}].", time_limit=time_limit)
        try:  # every knob: the pinned sizes with the parameters, the defaults filled in
            full = get_metric(got["name"]).validate({**got["params"], **got["sizes"]})
        except ValueError as exc:
            raise r.error(f"metrics[{i}].params", str(exc)) from None
        if "id" not in got and not _ID.match(got["name"]):  # a plugin's name: its files' names
            raise r.error(f"metrics[{i}].name", f"{got['name']!r} cannot name the metric's "
                          "files (results/<id>.json); give this entry an id of letters, "
                          "digits, '_', '-', '.'")
        out.append(MetricSpec(**{"id": got["name"], **got, "sizes": {
            k: int(full[k]) for k in got["sizes"]}, "params": {
            k: full[k] for k in _result_knobs(got["name"])}}))
    ids = [m.id for m in out]
    for i, ident in enumerate(ids):
        if ids.index(ident) != i:
            raise r.error(f"metrics[{i}].id", f"{ident!r} appears twice: give each entry a "
                          "distinct id", f"metrics[{i}].name")
    return tuple(out)
