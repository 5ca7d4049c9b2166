"""Every command loads plugins: ``--plugin FILE_OR_MODULE`` on ``search``, ``metrics``,
``estimate``, ``verify`` and ``reference``, resolved as a job resolves its plugins (a
``.py`` path against the current folder, else a module name); one that cannot be imported
is one line and exit code 2.

The plugin is written here as analysis code is: a metric over the samples in chunks of a
memory knob, whose working memory (a real allocation of ``chunk`` x 2 MiB) meets a real
CPU budget."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from oomguard.engine.cli.main import main
from tests.conftest import cli_in_child

TINY = ("gpt2:n_layer=1,n_embd=32,n_head=2,vocab_size=64,n_positions=32,bos_token_id=0,"
        "eos_token_id=0")
WORKLOAD = ["--model", TINY, "--seq-len", "8", "--samples", "4"]

PLUGIN = '''
import torch

from oomguard.metrics.base import Knob, Metric, register

MiB = 2**20


@register
class ChunkedLogitNorm(Metric):
    """The logits' norm per sample, computed ``chunk`` samples at a time, each chunk with a
    scratch buffer of chunk x 2 MiB (what a chunked analysis holds per chunk)."""
    name = "{name}"
    description = "logit norm per sample, in chunks"
    knobs = (Knob("chunk", "memory", 2, scales_with="samples"),)

    def compute(self, model, data, *, chunk):
        ids, norms = data["input_ids"], []
        with torch.no_grad():
            for i in range(0, ids.shape[0], chunk):
                scratch = torch.ones(chunk * MiB // 2)  # chunk x 2 MiB of float32
                logits = model(input_ids=ids[i:i + chunk]).logits
                norms.append(logits.norm(dim=(1, 2)) * scratch[0])
        return {{"norm": torch.cat(norms)}}
'''


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The plugin file in the current folder (the test's own); its metric's name (unique:
    a metric stays registered in this process)."""
    name = f"chunked_norm_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(PLUGIN.format(name=name), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    return name


@pytest.mark.slow
def test_search_with_a_plugin_finds_a_size_and_every_command_uses_it(
        plugin: str, capsys: pytest.CaptureFixture[str]) -> None:
    file = f"{plugin}.py"  # relative: against the current folder
    # the searches assert a memory boundary: each in a fresh process (tests/conftest.py)
    ran = cli_in_child("search", "--plugin", file, "--metric", plugin, *WORKLOAD, "--budget",
                       "32MiB", "--max-size", "64", "--out", "rep", "--json", cwd=Path.cwd())
    assert ran.returncode == 0, ran.stderr
    found = json.loads(ran.stdout)
    # chunk x 2 MiB meets the 32 MiB budget (at 16 or below): a size found, the next one out of memory
    assert 1 <= found["max_ok"] <= 16 and found["first_oom"] == found["max_ok"] + 1

    assert main(["metrics", "--plugin", file, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)[plugin]
    assert listed["description"] == "logit norm per sample, in chunks"

    assert main(["estimate", "--plugin", file, "--metric", plugin, *WORKLOAD,
                 "--sizes", "1,2", "--no-workspace", "--json"]) == 0
    estimates = json.loads(capsys.readouterr().out)["estimates"]
    # the scratch buffer alone is 2 MiB a chunk: seen by the estimate
    assert estimates[1]["peak_bytes"] - estimates[0]["peak_bytes"] >= 2 * 2**20

    assert json.loads(Path("rep/report.json").read_text())["context"]["plugins"] == [
        str(Path(file).resolve())]
    assert main(["verify", "rep", "--plugin", file, "--steps", "2", "--json"]) == 0
    check = json.loads(capsys.readouterr().out)
    assert check["ok"] and check["size"] == found["recommendation"]["safe"]

    ran = cli_in_child("reference", "--plugin", file, "--metric", plugin, *WORKLOAD,
                       "--budget", "32MiB", "--max-size", "64", "--out", "ref", "--json",
                       cwd=Path.cwd())
    assert ran.returncode == 0, ran.stderr
    rows = json.loads(ran.stdout)["rows"]
    assert [(r["metric"], r["knob"]) for r in rows] == [(plugin, "chunk")]
    assert 1 <= rows[0]["max_ok"] <= 16 and rows[0]["first_oom"] == rows[0]["max_ok"] + 1


@pytest.mark.slow
def test_an_isolated_search_imports_the_plugin_in_its_children(plugin: str) -> None:
    """``--isolate``: each trial in a forkserver's child, which imports the plugin too (a
    fresh command, as users run it: this test process's forkserver may be running already)."""
    exe = Path(sys.executable).with_name("oomguard")
    done = subprocess.run([str(exe), "search", "--plugin", f"{plugin}.py", "--metric", plugin,
                           *WORKLOAD, "--budget", "32MiB", "--max-size", "64", "--isolate",
                           "--out", "rep", "--json"], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout)
    assert found["mode"] == "isolated"
    assert 1 <= found["max_ok"] <= 16 and found["first_oom"] == found["max_ok"] + 1


@pytest.mark.parametrize("command", [
    ["search", "--metric", "loss"], ["metrics"], ["estimate", "--sizes", "1"],
    ["verify", "rep"], ["reference"]])
def test_a_plugin_that_cannot_be_imported_is_one_line(
        command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.py").write_text("import torch\ndef f(:\n", encoding="utf-8")
    for spec, says in (("missing.py", f"no such file {tmp_path / 'missing.py'}"),
                       ("broken.py", "cannot import 'broken.py': invalid syntax"),
                       ("no_such_module_q", "No module named 'no_such_module_q'")):
        assert main([*command, "--plugin", spec]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("oomguard: error: --plugin cannot import")
        assert says in err[0]


def test_verify_names_the_plugin_a_report_was_searched_with(tmp_path: Path) -> None:
    """A search with --plugin records it in its report; a verify that does not know the
    metric (a fresh process without --plugin) says which --plugin to give."""
    from oomguard.engine.cli.verify import _rebuild
    from oomguard.engine.errors import UsageError

    spec = {"kind": "MetricTrial", "fields": {"metric": "not_loaded_here", "model": TINY}}
    with pytest.raises(UsageError, match=r"its metric comes from a plugin: give "
                                         r"--plugin /lab/p\.py$"):
        _rebuild(spec, tmp_path / "report.json", ["/lab/p.py"])
