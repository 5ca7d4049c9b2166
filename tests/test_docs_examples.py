"""Every example in the README and the documentation (docs/) runs here, so none can rot.

- A ```` ```python ```` block runs with the other Python blocks of its page, in order, in one
  namespace, in a fresh child (forkserver, torch preloaded) whose current folder is a
  temporary one. A page may give them a hidden set-up (a model, an optimizer) in a
  ``<!-- test-setup`` ... ``-->`` comment, which runs first.
- A ```` ```bash ```` block runs line by line, every line an ``oomguard`` command (a
  comment after ``#`` and a ``> FILE`` at the end allowed), in one temporary folder; each
  must exit 0. Identical blocks (the README's and a guide's) run once, and a block whose
  commands are those of console blocks, one whole block after another, runs there.
- A ```` ```console ```` block's ``$ oomguard ...`` lines run, and the lines after each
  must appear in what it printed (stdout and stderr); ``...`` in them stands for any text.
- ``<!-- no-test: REASON -->`` on the line before a block skips it, with its reason (a
  GPU, Slurm, a Ray cluster, a set-up command, a benchmark of minutes); ``<!-- test:
  fast -->`` puts a console block in the fast layer. Everything else is ``slow``: it starts
  a process (console blocks run in-process either way).
"""

from __future__ import annotations

import io
import os
import re
import shlex
import subprocess
import sys
import textwrap
import traceback
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import cli_in_child, in_fresh_process

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
LANGS = ("python", "bash", "console")
_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_MARK = re.compile(r"^\s*<!--\s*(no-test|test):\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    mark: tuple[str, str] | None  # ("no-test", reason) or ("test", "fast")

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` (indented ones too), with the mark on the line before."""
    lines, found, i = page.read_text().splitlines(), [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2), i
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            i += 1
        body = textwrap.dedent("\n".join(s[len(indent):] if s.startswith(indent) else s
                                         for s in lines[start + 1:i]))
        mark = _MARK.match(lines[start - 1]) if start else None
        found.append(Block(page, start + 1, lang, body + "\n",
                           (mark.group(1), mark.group(2)) if mark else None))
        i += 1
    return found


def setup_code(page: Path) -> str:
    """The page's hidden ``<!-- test-setup ... -->`` Python, run before its blocks."""
    return "\n".join(textwrap.dedent(m) for m in
                     re.findall(r"<!--\s*test-setup\s*\n(.*?)-->", page.read_text(), re.S))


ALL = [b for page in PAGES for b in blocks(page) if b.lang in LANGS]
RUN = [b for b in ALL if not (b.mark and b.mark[0] == "no-test")]


def _unique(items: list[Block]) -> list[Block]:
    seen, out = set(), []
    for b in items:
        if (b.lang, b.text) not in seen:
            seen.add((b.lang, b.text))
            out.append(b)
    return out


def test_every_block_runs_or_says_why_not():
    assert PAGES and len(ALL) > 10, "no examples found: the collector is broken"
    for b in ALL:
        if b.mark and b.mark[0] == "no-test":
            assert len(b.mark[1]) >= 8, f"{b.where}: a no-test mark must give its reason"
        elif b.mark:
            assert b.mark == ("test", "fast") and b.lang == "console", (
                f"{b.where}: unknown mark {b.mark}")
        if b.lang == "bash" and b in RUN:
            for line in _commands(b.text):
                assert line[0] == "oomguard", (
                    f"{b.where}: {' '.join(line)!r} is not an oomguard command: "
                    "mark the block <!-- no-test: REASON --> or rewrite it")


def test_the_collector_sees_marks_and_setup(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- test-setup\nx = 1\n-->\n<!-- no-test: needs a GPU -->\n```python\n"
                    "print(x)\n```\n\n- item:\n\n  ```bash\n  oomguard probe  # here\n  ```\n")
    found = blocks(page)
    assert [(b.lang, b.mark) for b in found] == [("python", ("no-test", "needs a GPU")),
                                                  ("bash", None)]
    assert found[1].text == "oomguard probe  # here\n"
    assert _commands(found[1].text) == [["oomguard", "probe"]]
    assert setup_code(page).strip() == "x = 1"


def _commands(text: str) -> list[list[str]]:
    return [words for line in text.splitlines() if (words := shlex.split(line, comments=True))]


def run_python_page(setup: str, codes: list[tuple[str, str]], cwd: str) -> str:
    """In a fresh child: ``setup`` then each block, in one namespace, in ``cwd``. Returns
    what they printed; a block that raises is reported with its place and traceback."""
    import os

    os.chdir(cwd)
    namespace: dict = {"__name__": "__docs_example__"}
    out = io.StringIO()
    with redirect_stdout(out):
        for where, code in [("test-setup", setup), *codes]:
            try:
                exec(compile(code, where, "exec"), namespace)
            except BaseException:  # noqa: B036 -- reported to the parent as text
                raise AssertionError(f"{where} failed:\n{traceback.format_exc()}") from None
    return out.getvalue()


_PY_PAGES = sorted({b.page for b in RUN if b.lang == "python"})


@pytest.mark.slow
@pytest.mark.parametrize("page", _PY_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_examples(page, tmp_path):
    codes = [(b.where, b.text) for b in RUN if b.lang == "python" and b.page == page]
    in_fresh_process(run_python_page, setup_code(page), codes, str(tmp_path))


def _console(block: Block) -> list[tuple[list[str], list[str]]]:
    runs: list[tuple[list[str], list[str]]] = []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            runs.append((shlex.split(line[2:]), []))
        elif line.strip() and runs:
            runs[-1][1].append(line.strip())
    return runs


def _console_commands(block: Block) -> list[list[str]]:
    return [argv for argv, _ in _console(block)]


def _covering(shell: Block) -> list[Block] | None:
    """Console blocks whose commands, one whole block after another, are ``shell``'s (no
    ``> FILE``): the console test runs them, each from a fresh folder and in a fresh child
    as here, and checks that each exits 0; else None."""
    commands, found = _commands(shell.text), []
    consoles = [(b, c) for b in RUN if b.lang == "console" and (c := _console_commands(b))]
    while commands and not any(">" in words for words in commands):
        match = next(((b, c) for b, c in consoles if commands[:len(c)] == c), None)
        if match is None:
            return None
        found.append(match[0])
        commands = commands[len(match[1]):]
    return found or None


_BASH = _unique([b for b in RUN if b.lang == "bash"])
_COVERED = {b: _covering(b) for b in _BASH}
_SHELL = [b for b, by in _COVERED.items() if by is None]
# Console blocks that stand for a shell block: each of their commands must exit 0.
_COVERING = {c.where for by in _COVERED.values() for c in by or []}


def test_a_shell_block_runs_or_its_commands_run_in_console_blocks():
    readme = next(b for b in _BASH if b.where.startswith("README.md") and "bench" in b.text)
    covering = _covering(readme)
    assert covering is not None, "the README's bench example is no longer in a console block"
    assert sum((_console_commands(c) for c in covering), []) == _commands(readme.text)
    # A redirect, or a command no console block runs, keeps the block in the shell test.
    assert _covering(Block(readme.page, 0, "bash", readme.text + "oomguard show elsewhere\n",
                           None)) is None
    assert _covering(Block(readme.page, 0, "bash", "oomguard run --example > job.toml\n",
                           None)) is None


@pytest.mark.slow
@pytest.mark.parametrize("block", _SHELL, ids=lambda b: b.where)
def test_shell_examples(block, tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    for words in _commands(block.text):
        out_file = None
        if len(words) > 2 and words[-2] == ">":
            words, out_file = words[:-2], words[-1]
        done = cli_in_child(*words[1:], cwd=tmp_path, env=env)
        assert done.returncode == 0, f"{block.where}: {' '.join(words)}\n{done.stderr[-3000:]}"
        if out_file:
            (tmp_path / out_file).write_text(done.stdout)


def _check_console(block: Block, run) -> None:
    for argv, expected in _console(block):
        assert argv[0] == "oomguard", f"{block.where}: {argv} is not an oomguard command"
        printed = run(argv[1:])
        for line in expected:  # "..." stands for any text, as in doctest
            pattern = ".*".join(re.escape(part) for part in line.split("..."))
            assert re.search(pattern, printed), (
                f"{block.where}: {' '.join(argv)} did not print\n{line}\nit printed:\n{printed}")


_CONSOLE = [pytest.param(b, id=b.where, marks=() if b.mark == ("test", "fast") else pytest.mark.slow)
            for b in RUN if b.lang == "console"]


@pytest.mark.parametrize("block", _CONSOLE)
def test_console_examples(block, tmp_path, monkeypatch):
    """In-process (``main``): these are the one-line errors given before any work. A block
    that stands for a shell block's commands (:func:`_covering`: the README's bench and
    verify) runs each command as its reader does, ``python -m oomguard`` in a fresh
    interpreter, and each must exit 0: a bench forked from this worker's forkserver
    confirmed a size one item larger (19, where fresh interpreters confirmed 18 in 6 of 6)
    that verify then found over the safe line."""
    from oomguard.engine.cli.main import main

    monkeypatch.chdir(tmp_path)
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    monkeypatch.setenv("XDG_CACHE_HOME", env["XDG_CACHE_HOME"])

    def run(argv):
        if block.where in _COVERING:
            done = subprocess.run([sys.executable, "-m", "oomguard", *argv], cwd=tmp_path,
                                  env={**os.environ, **env}, capture_output=True, text=True,
                                  timeout=600)
            assert done.returncode == 0, f"{block.where}: exit {done.returncode}\n{done.stderr}"
            return done.stdout + done.stderr
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            main(argv)
        return out.getvalue() + err.getvalue()

    _check_console(block, run)
