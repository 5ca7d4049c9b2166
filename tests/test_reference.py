"""``oomguard reference``: every metric's memory knobs measured on this device, cached (a
second run runs no trial), written as reference.md, reference.json and sizes.toml, and
taken by jobs: automatically from the size cache, or pinned with ``--sizes-file``.

The end-to-end test runs the command line in fresh processes (forked from the test's
forkserver, which imported torch once), as a user does, under a real CPU budget; the job that pins the reference's sizes runs every metric in a fresh
child under the same budget, so each safe size is checked where it will be used.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import cli_in_child

from oomguard.engine.errors import JobError
from oomguard.engine.jobs.cache import SizeCache, entry_key
from oomguard.engine.jobs.plan import device_identity, plan
from oomguard.engine.jobs.reference import apply_sizes, load_sizes
from oomguard.engine.jobs.spec import load_job
from oomguard.metrics.base import load_all

BUDGET = "384MiB"
# A GPT-2 of one narrow layer: the curvature metrics and the landscape take a fraction of
# what the built-in tiny-gpt2 takes, and every metric and knob is still there.
MODEL = "gpt2:n_layer=1,n_embd=32,n_head=2,vocab_size=64,n_positions=32"
SETTINGS = ["--model", MODEL, "--samples", "2", "--seq-len", "16", "--budget", BUDGET]


def _built_in() -> dict:
    """The catalogue a fresh ``oomguard`` process has: other tests register metrics of their
    own in this process."""
    return {n: m for n, m in load_all().items()
            if type(m).__module__.startswith("oomguard.metrics.")}


def _oomguard(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return cli_in_child(*args, cwd=cwd)


def _job_file(tmp_path: Path, metrics: list[str]) -> Path:
    blocks = "".join(f'\n[[metrics]]\nname = "{m}"\n' for m in metrics)
    path = tmp_path / "job.toml"
    path.write_text(f'output = "job"\nmodels = ["{MODEL}"]\nbudget = "{BUDGET}"\n'
                    f'[data]\nseq_len = 16\nn_samples = 2\n{blocks}', encoding="utf-8")
    return path


@pytest.mark.slow
def test_reference_covers_every_knob_is_cached_and_its_sizes_run_in_a_job(tmp_path: Path) -> None:
    cache = tmp_path / "sizes.json"
    first = _oomguard("reference", *SETTINGS, "--cache", str(cache), "--out", "ref",
                      cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    doc = json.loads((tmp_path / "ref" / "reference.json").read_text())
    expected = {(name, k.name) for name, m in _built_in().items() for k in m.memory_knobs()}
    assert {(r["metric"], r["knob"]) for r in doc["rows"]} == expected
    assert all(r["source"] == "measured" and r["max_ok"] for r in doc["rows"]), doc["rows"]
    assert all(r["safe"] <= r["max_ok"] for r in doc["rows"])
    text = (tmp_path / "ref" / "reference.md").read_text()
    assert all(f"| {m} | {k} |" in text for m, k in expected)

    again = _oomguard("reference", *SETTINGS, "--cache", str(cache), "--out", "ref2",
                      cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    doc2 = json.loads((tmp_path / "ref2" / "reference.json").read_text())
    assert doc2["trials"] == 0 and {r["source"] for r in doc2["rows"]} == {"cache"}
    assert [(r["max_ok"], r["safe"]) for r in doc2["rows"]] == [
        (r["max_ok"], r["safe"]) for r in doc["rows"]]

    # Every metric at the reference's sizes, each in a fresh child under the same budget.
    job = _job_file(tmp_path, sorted(_built_in()))
    run = _oomguard("run", str(job), "--sizes-file", "ref/sizes.toml", "--cache",
                    str(tmp_path / "other.json"), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads((tmp_path / "job" / "results.json").read_text())
    tasks = {t["metric"]: t for t in results["tasks"].values()} if isinstance(
        results.get("tasks"), dict) else {t["metric"]: t for t in results["tasks"]}
    for metric, sizes in doc["job_sizes"].items():
        t = tasks[metric]
        assert t["status"] == "ok", t
        assert t["sizes"]["source"] == "sizes file ref/sizes.toml", t["sizes"]
        assert t["sizes"]["final"] == sizes, t["sizes"]
        assert t["sizes"]["retries"] == 0, t["sizes"]


def test_a_job_on_the_same_device_and_workload_finds_the_references_sizes(
        tmp_path: Path) -> None:
    # The key a job's metric looks up (engine/jobs/task_child.py) is the one the reference
    # stored its job sizes under: same device identity, same workload fingerprint.
    from oomguard.engine.core.search.record import SearchRecord
    from oomguard.engine.jobs.sizing import Request, Slot, choose_sizes
    from oomguard.metrics.base import get_metric
    from oomguard.metrics.models import model_config

    job = load_job(_job_file(tmp_path, ["loss"]))
    dev = device_identity(job)
    (task,) = plan(job)
    cache = SizeCache(tmp_path / "sizes.json")
    slot = Slot(cache, entry_key(dev, task.workload), dev, task.workload, source="reference")
    request = Request(get_metric("loss"), {}, 2, model_config(MODEL))

    def measured(knob: str, sizes: dict, unit: int, cap: int) -> SearchRecord:
        return SearchRecord(metric="loss", knob=knob, max_ok=2, first_oom=None, safe=2,
                            trials=1, seconds=0.1)

    choose_sizes(request, evaluate=measured, slot=slot)
    assert cache.get(entry_key(device_identity(load_job(job.path)), task.workload))[
        "sizes"] == {"micro_batch_size": 2}
    # A job's own entry (lowered after an OOM in a real run) is never overwritten.
    cache.lower(entry_key(dev, task.workload), {"micro_batch_size": 1}, reason="test")
    choose_sizes(request, evaluate=measured, slot=slot)
    assert cache.get(entry_key(dev, task.workload))["sizes"] == {"micro_batch_size": 1}


def test_a_sizes_file_for_another_setting_or_corrupt_is_a_one_line_error(tmp_path: Path) -> None:
    job = load_job(_job_file(tmp_path, ["loss"]))
    dev = device_identity(job)
    good = (f'[reference]\nmodel = "{MODEL}"\ndtype = "float32"\nseq_len = 16\n'
            f'device = "cpu"\ndevice_name = "{dev["name"]}"\ntotal_bytes = {dev["total_bytes"]}\n'
            f'budget_bytes = {dev["budget_bytes"]}\n\n[[metrics]]\nname = "loss"\n'
            'sizes = { micro_batch_size = 3 }\n')
    path = tmp_path / "sizes.toml"
    path.write_text(good)
    pinned = apply_sizes(job, load_sizes(path), dev)
    assert pinned.metrics[0].sizes == {"micro_batch_size": 3}
    path.write_text(good.replace("seq_len = 16", "seq_len = 64"))
    with pytest.raises(JobError, match="seq_len 64 .*the job: 16") as err:
        apply_sizes(job, load_sizes(path), dev)
    assert "\n" not in str(err.value)
    path.write_text("[reference\nnot toml")
    with pytest.raises(JobError, match="not a valid TOML sizes file"):
        load_sizes(path)
    path.write_text(good.replace("micro_batch_size = 3", "micro_batch_size = 0"))
    with pytest.raises(JobError, match="positive whole numbers"):
        load_sizes(path)
    path.write_text(good + "capped = { vjp_block = 8 }\n")
    with pytest.raises(JobError, match="capped names knobs of its sizes"):
        load_sizes(path)


# ------------------------------------------------- sizes.toml on any sample count and budget
def _sizes_file(tmp_path: Path, dev: dict, budget: int | None, capped: bool) -> Path:
    """A sizes file as `oomguard reference` writes it (through sizes_toml) for MODEL on 8
    samples: loss.micro_batch_size 8, capped by those 8 samples where ``capped``."""
    from oomguard.engine.jobs.reference import Reference, sizes_toml

    ref = Reference(model=MODEL, dtype="float32", seq_len=16, n_samples=8,
                    device={**dev, "budget_bytes": budget},
                    job_sizes={"loss": {"micro_batch_size": 8}},
                    job_capped={"loss": {"micro_batch_size": 8}} if capped else {})
    path = tmp_path / "sizes.toml"
    path.write_text(sizes_toml(ref), encoding="utf-8")
    return path


def _job_on(tmp_path: Path, n_samples: int, budget: str | None, search: bool = True):
    text = _job_file(tmp_path, ["loss"]).read_text().replace(
        "n_samples = 2", f"n_samples = {n_samples}").replace(
        f'budget = "{BUDGET}"\n', f'budget = "{budget}"\n' if budget else "")
    path = tmp_path / "job.toml"
    path.write_text(text + ("" if search else "[search]\nenabled = false\n"))
    job = load_job(path)
    return job, device_identity(job)


def test_a_size_capped_by_the_references_samples_is_searched_by_a_job_on_more(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    job, dev = _job_on(tmp_path, 16, BUDGET)
    pins = load_sizes(_sizes_file(tmp_path, dev, dev["budget_bytes"], capped=True))
    assert pins.capped == {"loss": {"micro_batch_size": 8}}
    # 8 fitted on 8 samples without an OOM: on 16 the job searches instead of pinning 8.
    with caplog.at_level("INFO", logger="oomguard.job"):
        assert apply_sizes(job, pins, dev).metrics[0].sizes == {}
    assert ("loss.micro_batch_size = 8 reached the reference's cap (8), not memory; this job "
            "allows up to 16: it searches micro_batch_size instead of pinning it") in caplog.text
    # Where the job cannot search, or allows no more, the size that fitted stays pinned.
    assert apply_sizes(job, pins, dev, search=False).metrics[0].sizes == {"micro_batch_size": 8}
    job, dev = _job_on(tmp_path, 16, BUDGET, search=False)
    assert apply_sizes(job, pins, dev).metrics[0].sizes == {"micro_batch_size": 8}
    for n in (8, 4):
        job, dev = _job_on(tmp_path, n, BUDGET)
        assert apply_sizes(job, pins, dev).metrics[0].sizes == {"micro_batch_size": 8}
    # A size memory bounded holds on any sample count: per batch, more batches on more samples.
    job, dev = _job_on(tmp_path, 64, BUDGET)
    plain = load_sizes(_sizes_file(tmp_path, dev, dev["budget_bytes"], capped=False))
    assert apply_sizes(job, plain, dev).metrics[0].sizes == {"micro_batch_size": 8}


def test_sizes_found_under_a_budget_hold_under_a_larger_one_or_none_and_say_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    two = 2 * 1024**3
    job, dev = _job_on(tmp_path, 2, None)
    path = _sizes_file(tmp_path, dev, two, capped=False)
    with caplog.at_level("INFO", logger="oomguard.job"):
        assert apply_sizes(job, load_sizes(path), dev).metrics[0].sizes == {
            "micro_batch_size": 8}
    (said,) = [r.getMessage() for r in caplog.records if "found under" in r.getMessage()]
    assert said.startswith(f"{path}: sizes found under a 2.00 GiB budget")
    assert "this job has none" in said or "retried at half" in said  # as free memory says
    job, dev = _job_on(tmp_path, 2, "4GiB")
    assert apply_sizes(job, load_sizes(path), dev).metrics[0].sizes == {"micro_batch_size": 8}
    # A smaller budget than the sizes were found under, or sizes found with none: refused.
    job, dev = _job_on(tmp_path, 2, BUDGET)
    with pytest.raises(JobError, match=r"budget 2.00 GiB \(the job: 384.00 MiB; its sizes hold "
                       "under the same budget, a larger one or none\\); run `oomguard "
                       "reference` with"):
        apply_sizes(job, load_sizes(path), dev)
    with pytest.raises(JobError, match=r"budget none \(the job: 384.00 MiB"):
        apply_sizes(job, load_sizes(_sizes_file(tmp_path, dev, None, capped=False)), dev)


@pytest.mark.slow
def test_the_documented_flow_reference_then_run_sizes_file_works_with_the_defaults(
        tmp_path: Path) -> None:
    # docs/guides/quick-reference.md: `oomguard reference`, then `oomguard run JOB.toml
    # --sizes-file sizes.toml`, each with its defaults: the reference under its default
    # budget, the job under none; the job on more samples than the reference's 8.
    ref = _oomguard("reference", "--model", MODEL, "--metric", "loss", "--seq-len", "16",
                    "--cache", str(tmp_path / "sizes.json"), "--out", "ref", cwd=tmp_path)
    assert ref.returncode == 0, ref.stderr[-2000:]
    sizes = (tmp_path / "ref" / "sizes.toml").read_text()
    assert "capped = { micro_batch_size = 8 }" in sizes
    job, _ = _job_on(tmp_path, 16, None)
    run = _oomguard("run", job.path, "--sizes-file", "ref/sizes.toml", "--cache",
                    str(tmp_path / "other.json"), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    if "budget_bytes" in sizes:  # a default budget (none where the OS cannot cap memory)
        assert "ref/sizes.toml: sizes found under a " in run.stderr
    assert "it searches micro_batch_size instead of pinning it" in run.stderr
    task = json.loads((tmp_path / "job" / "results.json").read_text())["tasks"]["loss"]
    assert task["status"] == "ok" and task["sizes"]["source"] == "search", task["sizes"]
    assert task["sizes"]["final"] == {"micro_batch_size": 16}  # all 16 samples in one batch
