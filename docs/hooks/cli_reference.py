"""MkDocs hook: the pages that are generated from the code, so that they cannot drift.

- ``reference/cli.md``: its ``<!-- cli-reference -->`` marker becomes every command's
  ``--help``, rendered from the argparse parsers (``oomguard.engine.cli.main``) at a fixed
  width (88 columns, whatever the terminal says). ``tests/test_docs_cli.py`` renders it too.
- ``reference/api.md``: its ``<!-- api-reference -->`` marker becomes one mkdocstrings
  block per public name: the top level's ``_EXPORTS`` and every namespace's ``__all__``.
- The package as it installs (``oomguard/`` plus ``engine/``, ``metrics/``, ``probes/``,
  ``reports/`` mapped under it by setup.cfg) is staged into ``build/docs-api`` for
  mkdocstrings' static analysis (griffe reads files; it cannot follow the editable
  install's import hook into the mapped folders).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import re
import shutil
from pathlib import Path

from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parents[2]
STAGE = ROOT / "build" / "docs-api"
WIDTH = 88
CLI_MARK = "<!-- cli-reference -->"
API_MARK = "<!-- api-reference -->"
NAMESPACES = ("errors", "results", "strategies", "retry", "memory", "training", "integrations")


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """``{"oomguard": top, "oomguard bench": ..., "oomguard cache": ...}``: every
    parser of the command line in the order of ``oomguard --help``, each command's options
    added (its module imported)."""
    from oomguard.engine.cli.main import COMMANDS, build_parser

    found = {"oomguard": build_parser([])}
    for name in COMMANDS:
        sub = _subcommands(build_parser([name]))[name]
        found[f"oomguard {name}"] = sub
        found.update(_nested(sub, f"oomguard {name}"))
    return found


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return {name: sub for action in parser._actions
            if isinstance(action, argparse._SubParsersAction)
            for name, sub in action.choices.items()}


def _nested(parser: argparse.ArgumentParser, prog: str) -> dict[str, argparse.ArgumentParser]:
    out: dict[str, argparse.ArgumentParser] = {}
    for name, sub in _subcommands(parser).items():
        out[f"{prog} {name}"] = sub
        out.update(_nested(sub, f"{prog} {name}"))
    return out


def help_text(parser: argparse.ArgumentParser) -> str:
    """``parser``'s ``--help`` at :data:`WIDTH` columns, whatever ``COLUMNS`` says."""
    formatter_class = parser.formatter_class
    parser.formatter_class = functools.partial(formatter_class, width=WIDTH)
    try:
        return parser.format_help().rstrip() + "\n"
    finally:
        parser.formatter_class = formatter_class


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string (``--budget``, ``-h``) the parser accepts."""
    return {s for action in parser._actions for s in action.option_strings}


def render_cli() -> str:
    parts = []
    for prog, parser in command_parsers().items():
        anchor = prog.replace(" ", "-")
        parts.append(f"## `{prog}` {{ #{anchor} }}\n\n```text\n{help_text(parser)}```\n")
    return "\n".join(parts)


def public_names() -> list[str]:
    """The dotted names the API reference documents: the top level's, then each namespace's."""
    top = importlib.import_module("oomguard")
    names = [f"oomguard.{n}" for n in sorted(top._EXPORTS, key=str.lower)]
    for ns in NAMESPACES:
        module = importlib.import_module(f"oomguard.{ns}")
        names += [f"oomguard.{ns}.{n}" for n in sorted(module.__all__, key=str.lower)
                  if f"oomguard.{n}" not in names]
    return names


def render_api() -> str:
    parts, section = [], None
    for dotted in public_names():
        where = dotted.rsplit(".", 1)[0]
        if where != section:
            section = where
            title = "The top level: `import oomguard`" if where == "oomguard" else f"`{where}`"
            parts.append(f"## {title}\n")
        parts.append(f"::: {dotted}\n")
    return "\n".join(parts)


def stage_package() -> None:
    shutil.rmtree(STAGE, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "oomguard", STAGE / "oomguard", ignore=ignore)
    for folder in ("engine", "metrics", "probes", "reports"):
        shutil.copytree(ROOT / folder, STAGE / "oomguard" / folder, ignore=ignore)


@event_priority(100)  # before mkdocstrings' on_config, which fixes its search paths
def on_config(config):
    stage_package()
    return config


def on_post_build(config):
    shutil.rmtree(STAGE, ignore_errors=True)
    if STAGE.parent.is_dir() and not any(STAGE.parent.iterdir()):
        STAGE.parent.rmdir()


# Docstrings use Sphinx roles (:class:`~a.b.C`); griffe keeps them as text. Shown as code.
_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):<code>([^<]*)</code>")


def on_page_content(html, page, config, files):
    def code(match):
        name = match.group(1)
        return f"<code>{name.rsplit('.', 1)[-1] if name.startswith('~') else name}</code>"
    return _ROLE.sub(code, html)


def on_page_markdown(markdown, page, config, files):
    if CLI_MARK in markdown:
        markdown = markdown.replace(CLI_MARK, render_cli())
    if API_MARK in markdown:
        markdown = markdown.replace(API_MARK, render_api())
    return markdown
