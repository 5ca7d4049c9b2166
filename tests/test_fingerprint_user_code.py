"""A job's results are rerun when the user's code they ran changes, not only the plugin
file: a helper module beside the plugin (imported at the top), and a package of the user's
imported inside the metric's function, are hashed into each result's fingerprint; installed
packages, the standard library and oomguard are not."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from oomguard.engine.cli.main import main
from oomguard.engine.jobs.plugins import user_code

TINY = ("gpt2:n_layer=1,n_embd=32,n_head=2,vocab_size=64,n_positions=32,bos_token_id=0,"
        "eos_token_id=0")

# An analysis plugin as researchers write one: its maths in a module of their own next to
# it, a package of theirs imported lazily, numpy and oomguard from the installed packages.
PLUGIN = '''
import numpy as np
import torch

from oomguard.metrics.base import Knob, Metric, register
import {helper} as helper


@register
class MeanLogit(Metric):
    name = "{metric}"
    description = "mean logit per sample, in chunks"
    knobs = (Knob("chunk", "memory", 2, scales_with="samples"),)

    def compute(self, model, data, *, chunk):
        from {package}.maths import mean_of  # lazily, as analysis code often does

        ids = data["input_ids"]
        with torch.no_grad():
            parts = [model(input_ids=ids[i:i + chunk]).logits.float()
                     for i in range(0, ids.shape[0], chunk)]
        values = helper.scaled(mean_of(torch.cat(parts)))
        return {{"mean": float(np.asarray(values).mean())}}
'''


def _code(folder: Path) -> dict[str, Path]:
    """The plugin, its helper module and its package, named uniquely (they stay imported
    in this process): their paths by role."""
    tag = uuid.uuid4().hex[:8]
    names = {"helper": f"fp_helper_{tag}", "package": f"fp_lab_{tag}",
             "metric": f"fp_mean_logit_{tag}"}
    files = {"plugin": folder / f"fp_plugin_{tag}.py",
             "helper": folder / f"{names['helper']}.py",
             "package": folder / names["package"] / "__init__.py",
             "maths": folder / names["package"] / "maths.py"}
    files["package"].parent.mkdir()
    files["plugin"].write_text(PLUGIN.format(**names), encoding="utf-8")
    files["helper"].write_text("def scaled(x):\n    return x * 1.0\n", encoding="utf-8")
    files["package"].write_text("", encoding="utf-8")
    files["maths"].write_text("def mean_of(t):\n    return t.mean(dim=(1, 2))\n",
                              encoding="utf-8")
    return files | {"metric": Path(names["metric"])}


def _job(folder: Path, code: dict[str, Path]) -> Path:
    job = folder / "job.toml"
    job.write_text(f'output = "{folder / "out"}"\nplugins = ["{code["plugin"].name}"]\n'
                   f'models = ["{TINY}"]\n[data]\nseq_len = 8\nn_samples = 2\n'
                   f'[search]\nenabled = false\n[[metrics]]\nname = "{code["metric"]}"\n',
                   encoding="utf-8")
    return job


def test_user_code_is_the_users_modules_a_plugin_imports(tmp_path: Path) -> None:
    from oomguard.engine.jobs.plugins import load_plugin

    code = _code(tmp_path)
    plugin = load_plugin(code["plugin"].name, tmp_path)
    found = user_code([plugin])
    # the helper (top), the package and its module (imported inside compute); not the
    # plugin itself (hashed as the plugin), numpy, torch or oomguard
    assert found == sorted(str(code[k].resolve()) for k in ("helper", "package", "maths"))


@pytest.mark.slow
def test_editing_a_module_the_plugin_imports_reruns_its_result(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = _code(tmp_path)
    job = _job(tmp_path, code)
    key = str(code["metric"])
    assert main(["run", str(job)]) == 0
    assert main(["run", str(job)]) == 0  # nothing changed: kept
    assert "already done, kept" in capsys.readouterr().err

    for role, line in (("helper", "def scaled(x):\n    return x * 2.0\n"),
                       ("maths", "def mean_of(t):\n    return t.mean(dim=(1, 2)) + 0\n")):
        code[role].write_text(line, encoding="utf-8")
        assert main(["run", str(job)]) == 0
        err = capsys.readouterr().err
        why = f"a plugin or a module it imports changed ({code[role].name})"
        assert f"{key}: rerunning, because {why}" in err
        result = json.loads((tmp_path / "out" / "results" / f"{key}.json").read_text())
        assert result["rerun_because"] == [why]
