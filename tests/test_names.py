"""Names renamed once, consistently (issue 36): every new spelling works, every old one still
works for one release with exactly one deprecation line and is not offered by ``--help``;
``--seq-len`` and ``--start`` have one default in every command; no command offers an option
it refuses; ``oomguard --version``; ``release_memory`` takes accelerate's call and
``free_memory`` is the device call it was."""

from __future__ import annotations

import argparse
import gc
import warnings
import weakref
from importlib.metadata import version

import pytest

from oomguard.engine.cli.main import COMMANDS, build_parser, main
from oomguard.engine.cli.options import DEFAULT_SEQ_LEN, DEFAULT_START

# the smallest argv each command parses with (its required options and positionals)
MINIMAL = {"search": ["--metric", "loss"], "estimate": ["--sizes", "1"], "verify": ["rep"],
           "cache": ["show"], "show": ["out"]}

# (command, new argv, old argv, old option, new option, dest, value)
RENAMED = [
    ("bench", ["--size-step", "16"], ["--step", "16"], "--step", "--size-step", "size_step", 16),
    ("search", ["--size-step", "4"], ["--step", "4"], "--step", "--size-step", "size_step", 4),
    ("reference", ["--size-step", "4"], ["--step", "4"], "--step", "--size-step", "size_step", 4),
    ("reference", ["--metric", "loss,cka"], ["--metrics", "loss,cka"], "--metrics", "--metric",
     "metric", ["loss,cka"]),
    ("estimate", ["--metric", "loss"], ["--workload", "loss"], "--workload", "--metric",
     "metric", "loss"),
    ("run", ["--sizes-file", "s.toml"], ["--sizes", "s.toml"], "--sizes", "--sizes-file",
     "sizes_file", "s.toml"),
    ("bench", ["--strategy", "expand-bisect"], ["--strategy", "e10"], "--strategy e10",
     "--strategy expand-bisect", "strategy", "expand-bisect"),
]


def _parse(command: str, *argv: str) -> argparse.Namespace:
    full = [command, *MINIMAL.get(command, []), *argv]
    return build_parser(full).parse_args(full)


def _command_parser(command: str) -> argparse.ArgumentParser:
    parser = build_parser([command])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


@pytest.mark.parametrize("command, new, old, old_name, new_name, dest, value", RENAMED,
                         ids=[f"{c} {o[0]} {o[-1]}" for c, _, o, *_ in RENAMED])
def test_the_new_name_works_and_the_old_one_with_one_deprecation_line(
        command: str, new: list[str], old: list[str], old_name: str, new_name: str, dest: str,
        value: object, capsys: pytest.CaptureFixture[str]) -> None:
    assert getattr(_parse(command, *new), dest) == value
    assert capsys.readouterr().err == ""
    assert getattr(_parse(command, *old), dest) == value
    assert capsys.readouterr().err == (
        f"oomguard: warning: {old_name} is deprecated, use {new_name}\n")


@pytest.mark.parametrize("command, old", [("bench", "--step"), ("search", "--step"),
                                          ("reference", "--step"), ("reference", "--metrics"),
                                          ("estimate", "--workload"), ("run", "--sizes"),
                                          ("bench", "e10")])
def test_help_does_not_offer_the_old_names(command: str, old: str) -> None:
    text = _command_parser(command).format_help()
    assert not any(word.strip("[],{}") == old for word in text.split()), text


def test_an_old_name_given_twice_says_so_once(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse("reference", "--metrics", "loss", "--metrics", "cka", "--metric", "fisher")
    assert args.metric == ["loss", "cka", "fisher"]
    assert capsys.readouterr().err.count("deprecated") == 1


def test_reference_metric_is_repeatable_or_a_comma_list() -> None:
    from oomguard.engine.cli.reference import _metric_names

    assert _metric_names(_parse("reference", "--metric", "loss", "--metric", "cka").metric) \
        == _metric_names(_parse("reference", "--metric", "loss,cka").metric) == ["loss", "cka"]


def test_the_old_step_still_sizes_expand_bisect(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from oomguard.engine.cli.options import search_config
    from oomguard.engine.core.search.strategies import ExpandBisect

    for argv in (["--size-step", "16"], ["--step", "16"], ["--strategy", "e10", "--size-step",
                                                            "16"]):
        inner = search_config(_parse("bench", *argv), torch.device("cpu")).strategy
        assert isinstance(inner, ExpandBisect) and (inner.start, inner.step) == (32, 16)
    capsys.readouterr()


@pytest.mark.parametrize("option, default", [("--seq-len", DEFAULT_SEQ_LEN),
                                             ("--start", None)])  # None: SearchConfig's 32
def test_one_default_in_every_command(option: str, default: int) -> None:
    defaults = {}
    for command in COMMANDS:
        parser = _command_parser(command)
        action = parser._option_string_actions.get(option)
        if action is not None:
            defaults[command] = action.default
    # `metrics --check` runs the knob check on 3 rows of 16 tokens (its own data, not a size
    # search: 128 tokens made the check of every metric more than 3x longer); outside
    # --check, --seq-len is refused
    defaults.pop("metrics", None)
    assert defaults and set(defaults.values()) == {default}, defaults
    from oomguard.engine.core.search.strategies import Guided
    from oomguard.engine.jobs.records import DataSpec

    # --seq-len: a job file's [data] default; --start: what --help says, SearchConfig's own
    assert (DEFAULT_SEQ_LEN, DEFAULT_START) == (DataSpec.seq_len, Guided.start) == (32, 32)


def test_reference_does_not_offer_verify_steps() -> None:
    parser = _command_parser("reference")
    assert "--verify-steps" not in parser._option_string_actions
    assert "--verify-steps" not in parser.format_help()
    for command in ("bench", "search"):
        assert "--verify-steps" in _command_parser(command)._option_string_actions


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"oomguard {version('oomguard')}\n"


def test_release_memory_takes_accelerates_call() -> None:
    import torch

    import oomguard

    a, b = torch.ones(1000), [torch.ones(10)]
    ref = weakref.ref(a)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation for the new call
        released = oomguard.release_memory(a, b)
        assert released == [None, None]
        a, b = released
        gc.collect()
        assert ref() is None
        assert oomguard.release_memory() == []


@pytest.mark.parametrize("device", ["cpu", "torch.device"])
def test_release_memory_of_a_device_is_free_memory_with_a_warning(device: str) -> None:
    import torch

    import oomguard

    dev = torch.device("cpu") if device == "torch.device" else device
    with pytest.warns(FutureWarning, match="use free_memory") as caught:
        assert oomguard.release_memory(dev) is None
    assert len(caught) == 1 and caught[0].filename == __file__  # points at the caller
    with pytest.warns(FutureWarning, match="use free_memory"):
        assert oomguard.release_memory(device="cpu") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert oomguard.free_memory(dev) is None
        assert oomguard.free_memory() is None
