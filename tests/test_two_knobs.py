"""A job sizes every memory knob of a metric, not only the first (issue 27, defect 5: captum's
``internal_batch_size`` stayed at its default): a two-knob plugin metric, shaped like captum's
``chunk_size`` x ``internal_batch_size``, in a job under a real 64 MiB CPU budget.

``micro_batch_size`` slices the samples, so its search stops at the sample count (4, capped,
no OOM); ``width`` is then searched with ``micro_batch_size`` at 4 and meets the budget: each
step holds a ``[micro_batch_size, width, 1 MiB]`` float64 scratch, as a chunk of integration
steps holds its activations. The result (a float64 sum of the token ids, integers: exact) does
not depend on either knob, so the knob check before the search lets both through. Memory
boundaries are asserted only inside the job's own child process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oomguard.engine.jobs.journal import replay
from oomguard.engine.jobs.runner import run_job
from oomguard.engine.jobs.spec import load_job

PLUGIN = '''
import torch
from oomguard.metrics import metric

MiB = 2**20


@metric(memory={"micro_batch_size": 1, "width": 2})
def token_sum(model, batch, *, micro_batch_size, width):
    """The sum of the token ids, by micro-batches of rows and blocks of `width` columns; each
    step holds a [micro_batch_size, width, 1 MiB] float64 scratch (its activations)."""
    ids = batch["input_ids"]
    total = 0.0
    for r in range(0, ids.shape[0], micro_batch_size):
        for c in range(0, ids.shape[1], width):
            block = ids[r:r + micro_batch_size, c:c + width].to(torch.float64)
            scratch = block[..., None].expand(*block.shape, MiB // 8).clone()
            total += float(scratch[..., 0].sum())
            del scratch
    return {"token_sum": total, "rows": ids.shape[0]}
'''


def _job(tmp_path: Path) -> Path:
    plugin = tmp_path / "two_knob_plugin.py"
    plugin.write_text(PLUGIN, encoding="utf-8")
    path = tmp_path / "job.toml"
    path.write_text(f'output = "{tmp_path / "out"}"\nplugins = ["{plugin}"]\n'
                    'models = ["tiny-gpt2"]\nbudget = "64MiB"\n'
                    '[data]\nseq_len = 64\nn_samples = 4\n'
                    '[search]\nstart = 2\nmax_trials = 8\nmax_size = 64\n'
                    '[[metrics]]\nname = "token_sum"\n', encoding="utf-8")
    return path


@pytest.mark.slow
def test_a_job_sizes_both_knobs_of_a_two_knob_plugin_under_a_budget(tmp_path: Path) -> None:
    outcome = run_job(load_job(_job(tmp_path)), cache_path=tmp_path / "cache.json",
                      progress=False)
    out = Path(outcome.out)
    task = json.loads((out / "results.json").read_text())["tasks"]["token_sum"]
    assert task["status"] == "ok", task.get("reason")
    searches = {s["knob"]: s for s in task["searches"]}
    assert list(searches) == ["micro_batch_size", "width"]  # in declared order, both
    rows, width = searches["micro_batch_size"], searches["width"]
    # the first knob stops at the samples, not at memory
    assert (rows["max_ok"], rows["first_oom"], rows["capped_by"]) == (4, None, "samples")
    # the second knob is searched with the first at its size, and meets the budget
    assert width["others"] == {"micro_batch_size": 4}
    assert width["first_oom"] is not None and width["max_ok"] > 2  # above its default
    assert width["max_ok"] < width["first_oom"] < 64
    start = task["sizes"]["start"]
    assert start == {"micro_batch_size": 4, "width": width["safe"]} and start["width"] > 2
    assert task["sizes"]["source"] == "search"
    # the result does not depend on the sizes (an exact integer sum)
    assert task["summary"]["rows"] == 4 and task["summary"]["token_sum"] > 0
    # the journal and the report carry each knob's search
    events = [e for e in replay(out / "journal.jsonl") if e["event"] == "search"]
    assert [e["knob"] for e in events] == ["micro_batch_size", "width"]
    report = (out / "report.md").read_text()
    assert "- search of `micro_batch_size`: " in report
    assert f"- search of `width`: {width['trials']} trials" in report
    assert f"max ok {width['max_ok']}" in report
