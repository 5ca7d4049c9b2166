"""Every one-line error says what to do.

A user who mistypes an option or a job field gets one line. That line must name the problem
*and* the way out ("give a whole number such as 16", "use one of ..."), so nobody has to read
the source to recover. The test reads every place the package raises a user error (the
:class:`~oomguard.engine.errors.UsageError` family, argparse's type errors and
``parser.error``) and fails on a message with no instruction in it.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("oomguard", "engine", "metrics", "probes", "reports")

# The constructors of one-line user errors (errors.py's UsageError family, the job parser's
# private _Bad, and argparse's two ways of refusing an option).
RAISERS = {"UsageError", "JobError", "BudgetError", "CacheError", "_Bad", "PluginClash",
           "ArgumentTypeError"}

# An instruction: an imperative verb at the start of a clause ("...; give ...", "(use ...",
# ", or pass ...", "... then run ...").
_VERBS = ("give|use|pass|set|unset|run|rerun|re-run|remove|delete|install|rename|fix|choose|"
          "lower|raise|add|move|check|free|drop|try|start|write|edit|make|call|put|wait|omit|"
          "define|see|stop|restart|upgrade|update|reduce|shorten|replace|correct|export|leave|"
          "build|create|change|declare|wrap|split|keep|return|point|mount|open|load|select|"
          "quote|name|list|ask|pick|take|subclass|convert|cast|shrink|report|file|size|save")
INSTRUCTION = re.compile(rf"(^|[;:(—]\s*|,\s*(or|and|then)?\s*|\b(or|then|and|to)\s+)"
                         rf"({_VERBS}|do not|don't|never)\b", re.IGNORECASE)

# Modules whose plain ValueErrors reach the user as one line (the job parser and the checks of
# data and plugins it calls turn them into JobError, naming the field).
VALUE_ERRORS_ARE_USER_ERRORS = {"engine/jobs/spec.py", "engine/jobs/data.py",
                                "engine/jobs/plugins.py", "engine/util/units.py"}

# Raise sites whose message is computed, or a prefix (file, field) around another message:
# each passes on a message built, and checked by this test, elsewhere. A new one must be added
# here with the reason it is safe.
DYNAMIC = {
    ("engine/jobs/output.py", "f'{out}: cannot write the output folder ({exc.strerror or exc}); "
     "{fix}'"): "fix= is an instruction: 'give a writable --out' or verify's own",
    ("engine/jobs/plugins.py", "f'cannot import {spec!r}: {exc}'"): "a PluginClash, scanned",
    ("engine/jobs/reference.py", "f'{p}: metrics[{i}]: {exc}'"): "get_metric's UsageError, "
    "scanned",
    ("engine/jobs/reference.py", "f'{source}: {exc}'"): "check_size's ValueError (jobs/data.py), "
    "scanned",
    ("engine/jobs/spec.py", "f\"{self.path}{(f', line {line}' if line else '')}: {where}: "
     "{message}\""): "the job parser's error(where, message): its messages are scanned",
    ("engine/jobs/spec.py", "str(exc).removeprefix(f'{f.key}: ')"): "a field converter's "
    "ValueError: the converters' messages (spec.py, data.py, remedies.py, base.py) are scanned",
    ("engine/jobs/spec.py", "f.missing"): "the _Field(missing=...) texts, scanned",
    ("engine/core/search/config.py", "message"): "_require(ok, message): its callers are scanned",
    ("engine/cli/options.py", "f'--plugin {exc}'"): "load_plugin's ValueError (jobs/plugins.py), "
    "scanned",
    ("engine/cli/options.py", "str(exc)"): "parse_size (units.py) and the data checks "
    "(jobs/data.py), both scanned",
    ("engine/core/memory/budget.py", "str(exc)"): "resolve_device's UsageError, scanned",
    ("engine/jobs/spec.py", "message.format(v=value)"): "_must(test, message): its callers "
    "are scanned",
    ("engine/jobs/spec.py", "first_line(exc)"): "model_config's UsageError (metrics/models.py), "
    "scanned",
    ("engine/jobs/spec.py", "str(exc)"): "load_plugin's ValueError (jobs/plugins.py), scanned",
}


def _literal(node: ast.expr, constants: dict[str, str]) -> str | None:
    """The text of a message argument with ``{}`` for each interpolated value (a module's own
    string constant, such as an install hint, is read in); None when the message is computed
    (a variable, a call)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name) and node.id in constants:
        return constants[node.id]
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant)
                       else _literal(v.value, constants) or "{}" for v in node.values)
    if isinstance(node, ast.IfExp):  # both branches must say what to do: return the worse
        branches = [_literal(node.body, constants), _literal(node.orelse, constants)]
        return next((b for b in branches if b is None or not INSTRUCTION.search(b)), branches[0])
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _literal(node.left, constants), _literal(node.right, constants)
        return None if left is None and right is None else (left or "{}") + (right or "{}")
    return None


def _constants(tree: ast.Module) -> dict[str, str]:
    """The module-level ``NAME = "text"`` assignments of a module."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            text = _literal(node.value, out)
            if text is not None:
                out[node.targets[0].id] = text
    return out


def raise_sites() -> Iterator[tuple[str, int, str | None, str]]:
    """(file relative to the root, line, message text or None, message source) of every user
    error raised."""
    for where, line, arg, constants in _sites():
        yield where, line, _literal(arg, constants), ast.unparse(arg)


def _sites() -> Iterator[tuple[str, int, ast.expr, dict[str, str]]]:
    for part in PARTS:
        for path in sorted((ROOT / part).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            constants = _constants(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.keyword) and node.arg == "missing":  # _Field(missing=)
                    yield str(path.relative_to(ROOT)), node.value.lineno, node.value, constants
                if not isinstance(node, ast.Call) or not node.args:
                    continue
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                where = str(path.relative_to(ROOT))
                is_parser_error = (name == "error" and isinstance(func, ast.Attribute)
                                   and getattr(func.value, "id", None) in {"parser", "p"})
                if name in {"_require", "_must"} and len(node.args) == 2:  # (test, message)
                    yield where, node.lineno, node.args[1], constants
                elif name == "error" and getattr(func.value, "id", None) == "self" \
                        and len(node.args) >= 2:  # the job parser's error(where, message)
                    yield where, node.lineno, node.args[1], constants
                elif (name in RAISERS or is_parser_error or name == "ValueError"
                      and where in VALUE_ERRORS_ARE_USER_ERRORS):
                    yield where, node.lineno, node.args[0], constants


def test_the_scan_finds_the_user_errors_it_is_meant_to_check() -> None:
    sites = list(raise_sites())
    assert len(sites) > 150
    files = {where for where, *_ in sites}
    assert {"engine/errors.py", "engine/cli/options.py", "engine/jobs/spec.py",
            "metrics/base.py"} <= files


@pytest.mark.parametrize("message,says_what_to_do", [
    ("'1e30' is not an integer", False),
    ("--samples must be a positive integer, got 0", False),
    ("unknown metric 'x': valid metrics are a, b", False),
    ("'1e30' is not an integer; give a whole number such as 16", True),
    ("unknown metric 'x': use one of a, b", True),
    ("cannot write out/ (read-only); give a writable --out", True),
    ("the job uses a budget", False),
])
def test_the_rule_tells_an_instruction_from_a_statement(message: str,
                                                        says_what_to_do: bool) -> None:
    assert bool(INSTRUCTION.search(message)) is says_what_to_do


def test_every_user_error_message_says_what_to_do() -> None:
    silent, unexplained = [], []
    for where, line, text, source in raise_sites():
        if (where, source) in DYNAMIC:
            continue
        if text is None:
            unexplained.append(f"{where}:{line}: {source}")
        elif not INSTRUCTION.search(text):
            silent.append(f"{where}:{line}: {text}")
    assert not unexplained, ("computed messages this test cannot read; add each to DYNAMIC "
                             "with the reason it is checked elsewhere:\n" + "\n".join(unexplained))
    assert not silent, "messages that do not say what to do:\n" + "\n".join(silent)


def test_every_error_the_commands_print_in_the_golden_runs_says_what_to_do() -> None:
    # tests/golden/errors.json holds what real commands printed for bad options, job files
    # and caches (test_golden.py runs them): the messages as users read them, composed.
    cases = json.loads((ROOT / "tests" / "golden" / "errors.json").read_text(encoding="utf-8"))
    lines = [(name, line) for name, case in cases.items()
             for line in case["stderr"].splitlines() if " error: " in line or "WARNING" in line]
    assert len(lines) > 40
    silent = [f"{name}: {line}" for name, line in lines
              if not INSTRUCTION.search(line.partition(" error: ")[2] or line)]
    assert not silent, "errors that do not say what to do:\n" + "\n".join(silent)
