"""Job files: a TOML description of an unattended analysis, parsed and checked up front.

Everything that can be checked before a job starts is checked here, before
any output folder exists: TOML syntax, field types, metric names, their
parameters, model specs, the data file. A problem is a :class:`JobError`
whose one-line message names the field (``metrics[2].params.n_points``) and,
where it can be found, the line of the file.

``oomguard run --example`` prints every field, with comments
(:func:`~oomguard.engine.jobs.example.example_text`; ``EXAMPLE`` here is the same text).
The records a job parses into (:class:`Job`, :class:`DataSpec`, ...) live in
:mod:`oomguard.engine.jobs.records`.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):  # why: module level, by Python version (tomllib is 3.11+)
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from oomguard.engine.core.execute.remedies import parse_on_oom
from oomguard.engine.core.memory.budget import MIN_CPU_BUDGET
from oomguard.engine.errors import JobError, UsageError
from oomguard.engine.jobs.data import check_data
from oomguard.engine.jobs.example import example_text
from oomguard.engine.jobs.records import DataSpec, Job, MetricSpec, SearchSpec
from oomguard.engine.util.units import fmt_bytes, parse_size
from oomguard.metrics.base import get_metric
from oomguard.metrics.models import DTYPES, check_seq_len, model_config

__all__ = ["DataSpec", "Job", "JobError", "MetricSpec", "SearchSpec", "example_text",
           "import_plugin", "line_of", "load_job", "model_label", "parse_duration",
           "parse_job"]

_DATA_SOURCES = ("generated", "text", "tokens", "bytes")
_TOP = {"output", "device", "dtype", "seed", "models", "time_limit", "budget", "plugins", "data",
        "search", "metrics", "name", "on_oom"}
_DURATION = re.compile(r"^\s*(?:(\d+(?:\.\d+)?)\s*h)?\s*(?:(\d+(?:\.\d+)?)\s*m)?\s*"
                       r"(?:(\d+(?:\.\d+)?)\s*s?)?\s*$")


def parse_duration(value: Any) -> float:
    """Seconds from a number or a string like ``"90"``, ``"90s"``, ``"20m"``, ``"1h30m"``."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value)) and any(m.groups()):
        h, mi, s = (float(g) if g else 0.0 for g in m.groups())
        seconds = h * 3600 + mi * 60 + s
    else:
        raise ValueError(f"expected a duration like 90, \"90s\", \"20m\" or \"1h30m\", "
                         f"got {value!r}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"a duration must be a positive, finite number of seconds, got {value!r}")
    return seconds


def line_of(text: str, key: str, section: str | None = None, index: int = 0) -> int | None:
    """Best-effort line number of ``key = ...`` in ``section`` (``[[section]]`` number ``index``)."""
    lines = text.splitlines()
    start, seen = 0, -1
    if section is not None:
        header = re.compile(r"^\s*\[\[?\s*" + re.escape(section) + r"\s*\]\]?\s*(#.*)?$")
        for i, line in enumerate(lines):
            if header.match(line):
                seen += 1
                if seen == index:
                    start = i + 1
                    break
        else:
            return None
    pattern = re.compile(r"^\s*" + re.escape(key) + r"\s*=")
    for i in range(start, len(lines)):
        if section is not None and re.match(r"^\s*\[", lines[i]):
            break
        if section is None and re.match(r"^\s*\[", lines[i]):
            break
        if pattern.match(lines[i]):
            return i + 1
    if section is not None and start:
        return start  # the table's header line
    return None


class _Reader:
    """Typed field access that raises :class:`JobError` naming the field and line."""

    def __init__(self, path: str, text: str) -> None:
        self.path, self.text = path, text

    def fail(self, where: str, message: str, line: int | None = None) -> JobError:
        at = f", line {line}" if line else ""
        return JobError(f"{self.path}{at}: {where}: {message}")

    def line(self, where: str) -> int | None:
        parts = where.split(".")
        m = re.match(r"^(\w+)\[(\d+)\]$", parts[0])
        if m:  # metrics[2].params.x -> key after [[metrics]] number 2
            return line_of(self.text, parts[1] if len(parts) > 1 else "name", m.group(1),
                           int(m.group(2)))
        if len(parts) >= 2:
            return line_of(self.text, parts[1], parts[0])
        return line_of(self.text, parts[0])

    def get(self, table: dict[str, Any], key: str, where: str, kinds: tuple[type, ...],
            default: Any, type_name: str) -> Any:
        if key not in table:
            return default
        value = table[key]
        ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
        if not ok:
            raise self.fail(where, f"expected {type_name}, got {type(value).__name__} {value!r}",
                            self.line(where))
        return value

    def positive_int(self, table: dict[str, Any], key: str, where: str, default: int) -> int:
        value = self.get(table, key, where, (int,), default, "a positive integer")
        if value <= 0:
            raise self.fail(where, f"expected a positive integer, got {value!r}", self.line(where))
        return value

    def on_oom(self, table: dict[str, Any], where: str) -> tuple[str, ...] | None:
        """A remedy ladder (``on_oom``), checked; None where the table has none."""
        try:
            return parse_on_oom(table["on_oom"]) if "on_oom" in table else None
        except UsageError as exc:
            raise self.fail(where, str(exc).removeprefix("on_oom: "), self.line(where)) from None

    def duration(self, table: dict[str, Any], key: str, where: str, default: float) -> float:
        if key not in table:
            return default
        try:
            return parse_duration(table[key])
        except ValueError as exc:
            raise self.fail(where, str(exc), self.line(where)) from None


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

    Raises :class:`JobError` (one line) for anything wrong, before any side effect.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise JobError(f"{path}: job file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise JobError(f"{path}: cannot read the job file: {exc}") from None
    return parse_job(text, path=str(p), base=p.resolve().parent, output=output)


def parse_job(text: str, *, path: str = "<job>", base: Path | None = None,
              output: str | None = None) -> Job:
    """Parse job-file text; relative paths are resolved against ``base`` (data, plugins)
    and the current directory (output)."""
    base = base or Path.cwd()
    r = _Reader(path, text)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:  # the message carries "(at line L, column C)"
        raise JobError(f"{path}: not valid TOML: {exc}") from None
    unknown = sorted(set(doc) - _TOP)
    if unknown:
        raise r.fail(unknown[0], f"unknown field; valid top-level fields are {', '.join(sorted(_TOP))}",
                     line_of(text, unknown[0]))

    device = r.get(doc, "device", "device", (str,), "cpu", "a string")
    dtype = r.get(doc, "dtype", "dtype", (str,), "float32", "a string")
    if dtype not in DTYPES:
        raise r.fail("dtype", f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}",
                     r.line("dtype"))
    if not re.match(r"^(cpu|mps|cuda(:\d+)?)$", device):
        raise r.fail("device", f"unknown device {device!r}: use cpu, cuda, cuda:N or mps",
                     r.line("device"))
    seed = r.get(doc, "seed", "seed", (int,), 0, "an integer")
    if not 0 <= seed < 2**63:  # torch's generators take a 64-bit seed
        raise r.fail("seed", f"{seed} is out of range: use 0 <= seed < 2**63", r.line("seed"))
    out = output or r.get(doc, "output", "output", (str,), "oomguard-job", "a string")
    name = r.get(doc, "name", "name", (str,), Path(path).stem, "a string")
    budget = None
    if "budget" in doc:
        raw = r.get(doc, "budget", "budget", (str, int), None, "a size like \"1GiB\"")
        try:
            budget = parse_size(raw)
        except ValueError as exc:
            raise r.fail("budget", str(exc), r.line("budget")) from None
        if device == "cpu" and budget < MIN_CPU_BUDGET:  # larger than the device: plan.py
            raise r.fail("budget", f"{raw!r} is too small for a CPU budget: thread pools need "
                         f"about 20 MiB of headroom; use at least {fmt_bytes(MIN_CPU_BUDGET)}",
                         r.line("budget"))
    time_limit = r.duration(doc, "time_limit", "time_limit", 1200.0)

    models_raw = r.get(doc, "models", "models", (list, str), ["tiny-gpt2"], "a list of strings")
    models_raw = [models_raw] if isinstance(models_raw, str) else models_raw
    if not models_raw:
        raise r.fail("models", "give at least one model", r.line("models"))
    configs = []
    for i, spec in enumerate(models_raw):
        if not isinstance(spec, str):
            raise r.fail(f"models[{i}]", f"expected a string, got {spec!r}", r.line("models"))
        try:
            configs.append(model_config(spec))
        except (ValueError, OSError, KeyError) as exc:
            raise r.fail(f"models[{i}]", str(exc).splitlines()[0], r.line("models")) from None
    labels = [model_label(m) for m in models_raw]
    if len(set(labels)) != len(labels):
        raise r.fail("models", "two models have the same label; list each model once",
                     r.line("models"))

    plugins_raw = r.get(doc, "plugins", "plugins", (list,), [], "a list of strings")
    plugins = []
    for i, plug in enumerate(plugins_raw):
        if not isinstance(plug, str):
            raise r.fail(f"plugins[{i}]", f"expected a string, got {plug!r}", r.line("plugins"))
        if plug.endswith(".py"):
            plug = str((base / plug).resolve())
        try:
            import_plugin(plug)
        except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix
            raise r.fail(f"plugins[{i}]", f"cannot import {plug!r}: {exc}",
                         r.line("plugins")) from None
        plugins.append(plug)

    data = _parse_data(r, doc, base)
    for i, config in enumerate(configs):
        try:
            check_seq_len(config, data.seq_len)
        except ValueError as exc:
            raise r.fail("data.seq_len", f"models[{i}]: {exc}", r.line("data.seq_len")) from None
    search = _parse_search(r, doc)
    metrics = _parse_metrics(r, doc, time_limit)
    for i, config in enumerate(configs):
        for index, m in enumerate(metrics):
            reason = get_metric(m.name).unsupported(config)
            if reason:
                raise r.fail(f"metrics[{index}]", f"{m.name} does not support models[{i}] "
                             f"({labels[i]}): {reason}; remove one of them",
                             r.line(f"metrics[{index}].name"))
    return Job(path=str(Path(path).resolve()) if path != "<job>" else path, text=text, name=name,
               output=str(Path(out).expanduser().resolve()), device=device, dtype=dtype,
               seed=seed, models=tuple(models_raw), data=data, search=search, metrics=metrics,
               budget_bytes=budget, plugins=tuple(plugins), on_oom=r.on_oom(doc, "on_oom"))


def import_plugin(spec: str) -> None:
    """Import a plugin: a module name, or the path of a ``.py`` file (registers its metrics)."""
    if spec.endswith(".py"):
        name = "oomguard_plugin_" + re.sub(r"\W", "_", Path(spec).stem)
        if name in sys.modules:
            return
        mod_spec = importlib.util.spec_from_file_location(name, spec)
        if mod_spec is None or mod_spec.loader is None:
            raise ImportError(f"no Python module at {spec}")
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[name] = module
        try:
            mod_spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
    else:
        importlib.import_module(spec)


def _table(r: _Reader, doc: dict[str, Any], key: str) -> dict[str, Any]:
    value = doc.get(key, {})
    if not isinstance(value, dict):
        raise r.fail(key, f"expected a table [{key}], got {type(value).__name__}", r.line(key))
    return value


def _parse_data(r: _Reader, doc: dict[str, Any], base: Path) -> DataSpec:
    t = _table(r, doc, "data")
    for key in sorted(set(t) - {"source", "path", "seq_len", "n_samples"}):
        raise r.fail(f"data.{key}", "unknown field; valid: source, path, seq_len, n_samples",
                     r.line(f"data.{key}"))
    source = r.get(t, "source", "data.source", (str,), "generated", "a string")
    if source not in _DATA_SOURCES:
        raise r.fail("data.source", f"unknown source {source!r}: use one of "
                     f"{', '.join(_DATA_SOURCES)}", r.line("data.source"))
    seq_len = r.positive_int(t, "seq_len", "data.seq_len", 32)
    n = r.positive_int(t, "n_samples", "data.n_samples", 8)
    path = r.get(t, "path", "data.path", (str,), None, "a string")
    if source != "generated":
        if path is None:
            raise r.fail("data.path", f"source {source!r} needs a path", r.line("data.source"))
        full = (base / Path(path).expanduser()).resolve()
        if not full.is_file():
            raise r.fail("data.path", f"data file not found: {full}", r.line("data.path"))
        path = str(full)
        try:
            check_data(DataSpec(source, path, seq_len, n))
        except ValueError as exc:
            raise r.fail("data.path", str(exc), r.line("data.path")) from None
    return DataSpec(source=source, path=path, seq_len=seq_len, n_samples=n)


def _parse_search(r: _Reader, doc: dict[str, Any]) -> SearchSpec:
    t = _table(r, doc, "search")
    valid = {"enabled", "max_trials", "max_seconds", "start", "step", "max_size"}
    for key in sorted(set(t) - valid):
        raise r.fail(f"search.{key}", f"unknown field; valid: {', '.join(sorted(valid))}",
                     r.line(f"search.{key}"))
    d = SearchSpec()
    return SearchSpec(
        enabled=r.get(t, "enabled", "search.enabled", (bool,), d.enabled, "true or false"),
        max_trials=r.positive_int(t, "max_trials", "search.max_trials", d.max_trials),
        max_seconds=r.duration(t, "max_seconds", "search.max_seconds", d.max_seconds),
        start=r.positive_int(t, "start", "search.start", d.start),
        step=r.positive_int(t, "step", "search.step", 1) if "step" in t else None,
        max_size=r.positive_int(t, "max_size", "search.max_size", d.max_size),
    )


def _parse_metrics(r: _Reader, doc: dict[str, Any], time_limit: float) -> tuple[MetricSpec, ...]:
    raw = doc.get("metrics")
    if raw is None:
        raise r.fail("metrics", "no metrics: add at least one [[metrics]] table with a name", None)
    if not isinstance(raw, list) or not all(isinstance(m, dict) for m in raw) or not raw:
        raise r.fail("metrics", "expected [[metrics]] tables", r.line("metrics"))
    out: list[MetricSpec] = []
    for i, m in enumerate(raw):
        w = f"metrics[{i}]"
        valid = {"name", "id", "params", "sizes", "time_limit", "on_oom"}
        for key in sorted(set(m) - valid):
            raise r.fail(f"{w}.{key}", f"unknown field; valid: {', '.join(sorted(valid))}",
                         r.line(f"{w}.{key}"))
        if "name" not in m:
            raise r.fail(f"{w}.name", "missing: every [[metrics]] needs a name", r.line(f"{w}.name"))
        name = r.get(m, "name", f"{w}.name", (str,), None, "a string")
        try:
            metric = get_metric(name)
        except ValueError as exc:
            raise r.fail(f"{w}.name", str(exc), r.line(f"{w}.name")) from None
        ident = r.get(m, "id", f"{w}.id", (str,), name, "a string")
        if not re.match(r"^[A-Za-z0-9_.-]+$", ident):
            raise r.fail(f"{w}.id", f"{ident!r}: use letters, digits, '_', '-', '.'",
                         r.line(f"{w}.id"))
        params = r.get(m, "params", f"{w}.params", (dict,), {}, "a table")
        sizes = r.get(m, "sizes", f"{w}.sizes", (dict,), {}, "a table")
        memory = {k.name for k in metric.memory_knobs()}
        result = {k.name for k in metric.result_knobs()}
        for key in params:
            if key in memory:
                raise r.fail(f"{w}.params.{key}", "is a memory knob (tuned, result-invariant): "
                             "put it under sizes to pin it", r.line(f"{w}.params"))
            if key not in result:
                raise r.fail(f"{w}.params.{key}", f"unknown parameter of {name!r}; its "
                             f"result-defining parameters are {', '.join(sorted(result)) or '(none)'}",
                             r.line(f"{w}.params"))
        for key in sizes:
            if key not in memory:
                raise r.fail(f"{w}.sizes.{key}", f"not a memory knob of {name!r}; its memory "
                             f"knobs are {', '.join(sorted(memory)) or '(none)'}",
                             r.line(f"{w}.sizes"))
        try:
            full = metric.validate({**params, **sizes})
        except ValueError as exc:
            raise r.fail(f"{w}.params", str(exc), r.line(f"{w}.params")) from None
        limit = r.duration(m, "time_limit", f"{w}.time_limit", time_limit)
        out.append(MetricSpec(id=ident, name=name,
                              params={k: full[k] for k in sorted(result)},
                              sizes={k: int(full[k]) for k in sizes}, time_limit=limit,
                              on_oom=r.on_oom(m, f"{w}.on_oom")))
    ids = [m.id for m in out]
    for i, ident in enumerate(ids):
        if ids.index(ident) != i:
            raise r.fail(f"metrics[{i}].id", f"{ident!r} appears twice: give each entry a "
                         "distinct id", r.line(f"metrics[{i}].name"))
    return tuple(out)
