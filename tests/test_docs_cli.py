"""The command-line reference and the parsers cannot disagree.

``docs/reference/cli.md`` is rendered from the argparse parsers at build time
(``docs/hooks/cli_reference.py``); these tests render it the same way and check that every
command and every option of every (sub)command is in it, and that every option the README
and the guides write after ``oomguard COMMAND`` is one that command accepts.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])


@pytest.fixture(scope="module")
def hook():
    spec = importlib.util.spec_from_file_location("cli_reference",
                                                  ROOT / "docs" / "hooks" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def parsers(hook):
    return hook.command_parsers()


def test_the_cli_page_is_rendered_from_the_parsers(hook):
    assert hook.CLI_MARK in (ROOT / "docs" / "reference" / "cli.md").read_text()
    assert hook.API_MARK in (ROOT / "docs" / "reference" / "api.md").read_text()


def test_every_command_and_option_is_in_the_reference(hook, parsers):
    from oomguard.engine.cli.main import COMMANDS

    page = hook.render_cli()
    assert {f"oomguard {name}" for name in COMMANDS} <= set(parsers)
    sections = re.split(r"^## ", page, flags=re.M)[1:]
    by_prog = {s.split("`")[1]: s for s in sections}
    assert set(by_prog) == set(parsers)
    for prog, parser in parsers.items():
        missing = sorted(o for o in hook.option_strings(parser) if o not in by_prog[prog])
        assert not missing, f"{prog}: {missing} not in the CLI reference"


def test_rendering_ignores_the_terminal_width(hook, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    wide = hook.render_cli()
    monkeypatch.setenv("COLUMNS", "40")
    assert hook.render_cli() == wide
    assert max(len(line) for line in wide.splitlines()) <= hook.WIDTH + 40  # usage lines wrap


_QUOTED = re.compile(r"oomguard ([a-z]+)((?: +[^`\n]*)?)")


def _accepted(parsers, command: str) -> set[str]:
    return {o for prog, p in parsers.items()
            if prog == f"oomguard {command}" or prog.startswith(f"oomguard {command} ")
            for o in p._option_string_actions}


def test_every_option_the_docs_quote_exists(parsers):
    from oomguard.engine.cli.main import COMMANDS

    wrong = []
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for command, rest in _QUOTED.findall(line):
                if command not in COMMANDS:
                    continue
                for option in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest):
                    if option not in _accepted(parsers, command):
                        wrong.append(f"{page.relative_to(ROOT)}:{n}: oomguard {command} {option}")
    assert not wrong, "options the parsers do not have:\n" + "\n".join(wrong)


def test_the_check_sees_a_wrong_option(parsers):
    assert "--budget" in _accepted(parsers, "bench")
    assert "--budgett" not in _accepted(parsers, "bench")
    assert _QUOTED.findall("`oomguard bench --budgett 1GiB`") == [("bench", " --budgett 1GiB")]


def test_the_readmes_links_point_at_pages_that_exist():
    """The README is not part of the site (mkdocs checks the site's links): its own."""
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)", text)
    assert len(links) > 10
    for target, anchor in links:
        if "://" in target:
            continue
        page = ROOT / target
        assert page.exists(), f"README links to {target}, which does not exist"
        if anchor:
            heading = anchor.replace("-", " ")
            assert heading in page.read_text().lower().replace("-", " "), (
                f"README links to {target}#{anchor}, a heading that does not exist")
