"""MkDocs hook: the pages that are generated from the code, so that they cannot drift.

- ``reference/cli.md``: its ``<!-- cli-reference -->`` marker becomes every command's
  ``--help``, rendered from the argparse parsers (``oomguard.engine.cli.main``) at a fixed
  width (88 columns, whatever the terminal says). ``tests/test_docs_cli.py`` renders it too.
- ``reference/api.md``: its ``<!-- api-reference -->`` marker becomes one mkdocstrings
  block per public name: the top level's ``_EXPORTS`` and every namespace's ``__all__``,
  then the names the guides use from deeper modules (:data:`BEYOND`). A name whose docstring
  cites its module's docstring is followed by that docstring, so no entry points at text
  the reader cannot see. A public name that is also a submodule's name (``oomguard.probe``:
  the function, and ``probes/probe.py``) is rendered from the module that defines it, so
  it is not rendered as the module.
- ``changelog.md``: its ``<!-- changelog -->`` marker becomes the repository's
  ``CHANGELOG.md``, which lives at the top where packagers look for it.
- The package as it installs (``oomguard/`` plus ``engine/``, ``metrics/``, ``probes/``,
  ``reports/`` mapped under it by setup.cfg) is staged into ``build/docs-api`` for
  mkdocstrings' static analysis (griffe reads files; it cannot follow the editable
  install's import hook into the mapped folders).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import re
import shutil
from pathlib import Path

from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parents[2]
STAGE = ROOT / "build" / "docs-api"
WIDTH = 88
CLI_MARK = "<!-- cli-reference -->"
API_MARK = "<!-- api-reference -->"
CHANGELOG_MARK = "<!-- changelog -->"
NAMESPACES = ("errors", "results", "strategies", "retry", "memory", "training", "integrations")
# Names the guides use that live below the public face: (section title, dotted names).
BEYOND = (
    ("Your own metrics and workloads", (
        "oomguard.metrics.metric", "oomguard.metrics.base.get_metric",
        "oomguard.metrics.models.build_model", "oomguard.metrics.models.make_batch",
        "oomguard.engine.core.workload.Workload", "oomguard.engine.core.workload.RebuiltInChild")),
    ("What an OOM left behind", ("oomguard.engine.core.memory.forensics.OomEvent",)),
    ("Jobs from Python", ("oomguard.engine.jobs.spec.load_job", "oomguard.engine.jobs.runner.run_job",
                          "oomguard.engine.jobs.ray_job.OnRay")),
)
_CITES_MODULE = re.compile(r"module docstring")


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
    """Every option string (``--budget``, ``-h``) the parser shows in its help: an old
    spelling kept for one release (``help=argparse.SUPPRESS``) is accepted but not shown."""
    return {s for action in parser._actions if action.help != argparse.SUPPRESS
            for s in action.option_strings}


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


def _defining_path(dotted: str) -> str | None:
    """Where the object ``dotted`` is defined, when a package on the way to it has a submodule
    of the same name that griffe would render instead (``oomguard.probe``: the function, and
    ``probes/probe.py``); else None."""
    where, name = dotted.rsplit(".", 1)
    obj = getattr(importlib.import_module(where), name)
    module = getattr(obj, "__module__", None)
    if not module or getattr(obj, "__qualname__", None) != name:
        return None
    parts = module.split(".")
    packages = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    shadowed = any(hasattr(importlib.import_module(p), "__path__")
                   and importlib.util.find_spec(f"{p}.{name}") is not None for p in packages)
    return f"{module}.{name}" if shadowed else None


def _cited_module(dotted: str) -> str | None:
    """The module whose docstring ``dotted``'s docstring (or a public method's) cites."""
    where, name = dotted.rsplit(".", 1)
    obj = getattr(importlib.import_module(where), name)
    docs = [obj.__doc__ or ""]
    if isinstance(obj, type):
        docs += [getattr(v, "__doc__", None) or "" for k, v in vars(obj).items()
                 if not k.startswith("_")]
    if any(_CITES_MODULE.search(d) for d in docs):
        return getattr(obj, "__module__", None)
    return None


def _block(dotted: str, shown: set[str], defined: bool = False) -> str:
    """``dotted``'s mkdocstrings block; ``defined``: rendered from the module that defines it
    (a name resolved on first use, which griffe cannot follow), headed by ``dotted``."""
    real = _defining_path(dotted)
    if defined and real is None:
        obj = getattr(importlib.import_module(dotted.rsplit(".", 1)[0]), dotted.rsplit(".", 1)[1])
        real = f"{obj.__module__}.{obj.__qualname__}"
        real = None if real == dotted else real
    text = f"::: {real}\n    options:\n      heading: \"{dotted}\"\n" if real else f"::: {dotted}\n"
    module = _cited_module(dotted)
    if module and module not in shown:
        shown.add(module)
        text += (f"\n::: {module}\n    options:\n      members: false\n"
                 f"      heading: \"The module {module}\"\n"
                 f"      heading_level: 4\n      show_root_toc_entry: false\n")
    elif module:
        text += f"\nThe module docstring it cites is shown [above](#{module}).\n"
    return text


def render_api() -> str:
    parts, section, shown = [], None, set()
    for dotted in public_names():
        where = dotted.rsplit(".", 1)[0]
        if where != section:
            section = where
            title = "The top level: `import oomguard`" if where == "oomguard" else f"`{where}`"
            parts.append(f"## {title}\n")
        parts.append(_block(dotted, shown))
    parts.append("## Beyond the public face\n\nNames the guides use from the modules that "
                 "define them; they may move between releases, the names above may not.\n")
    for title, names in BEYOND:
        parts.append(f"### {title}\n")
        parts += [_block(dotted, shown, defined=True) for dotted in names]
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


# A private base class (strategies' ``_PositiveFields``) is an implementation detail.
_PRIVATE_BASE = re.compile(r"(?:, )?<code>(?:<span[^>]*>)?_\w+(?:</span>)?</code>")


def on_page_content(html, page, config, files):
    def code(match):
        name = match.group(1)
        return f"<code>{name.rsplit('.', 1)[-1] if name.startswith('~') else name}</code>"

    return _ROLE.sub(code, html)


@event_priority(-100)  # after autorefs has resolved the cross-references
def on_post_page(output, page, config):
    def bases(match):
        kept = _PRIVATE_BASE.sub("", match.group(2)).lstrip(", ")
        return f"{match.group(1)}{kept}</p>" if kept else ""
    return re.sub(r"(<p class=\"doc doc-class-bases\">\s*Bases: )(.*?)</p>", bases, output,
                  flags=re.S)


def on_page_markdown(markdown, page, config, files):
    if CLI_MARK in markdown:
        markdown = markdown.replace(CLI_MARK, render_cli())
    if API_MARK in markdown:
        markdown = markdown.replace(API_MARK, render_api())
    if CHANGELOG_MARK in markdown:
        changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
        markdown = markdown.replace(CHANGELOG_MARK, changelog.split("\n", 1)[1])
    return markdown
