"""The out-of-memory remedy ladder (``on_oom``) on real CPU OOMs under real budgets.

A job whose metrics fit only in bfloat16, fit nowhere, or keep the failed attempt's
tensors on purpose (restarted in a fresh process, not looped); a retry policy that makes
no progress (stopped); the API's ladder with a lower precision and a move to the CPU; an
unknown remedy name (one line). Memory boundaries are asserted only in job children or
fresh processes."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from conftest import budget_after_warmup, in_fresh_process

from oomguard.engine.core.execute.executor import Executor
from oomguard.engine.core.execute.remedies import (
    ALLOC_CONF,
    REMEDIES,
    Ladder,
    NoProgress,
    RestartNeeded,
    parse_on_oom,
)
from oomguard.engine.errors import NoExecutableBatchSize, UsageError
from oomguard.engine.jobs.journal import replay
from oomguard.engine.jobs.runner import run_job
from oomguard.engine.jobs.spec import JobError, load_job

MiB = 1024**2

# Test metrics, loaded by the job through `plugins` (each metric's process imports it).
PLUGIN = '''
import torch
from oomguard.metrics.base import Knob, Metric, register

MiB = 2**20
HELD = []  # the leaky metric's blocks, kept on purpose


def dtype_of(model):
    return next(model.parameters()).dtype


@register
class FitsInBf16(Metric):
    """(18 + chunk) Mi elements of the model's dtype after a forward: at chunk 1, 76 MiB in
    float32 (over a 64 MiB budget) and 38 MiB in bfloat16."""
    name = "test_fits_in_bf16"
    knobs = (Knob("chunk", "memory", 2, 1),)
    tolerates_lower_precision = True

    def compute(self, model, data, chunk=2):
        with torch.no_grad():
            logits = model(input_ids=data["input_ids"][:1]).logits
        block = torch.ones((18 + chunk) * MiB, dtype=dtype_of(model))
        return {"sum": float(block.sum()), "dtype": str(logits.dtype)}


@register
class FitsNowhere(Metric):
    """256 MiB in float32 and 128 MiB in bfloat16 at every size."""
    name = "test_fits_nowhere"
    knobs = (Knob("chunk", "memory", 2, 1),)
    tolerates_lower_precision = True

    def compute(self, model, data, chunk=2):
        return {"sum": float(torch.ones(64 * MiB + chunk, dtype=dtype_of(model)).sum())}


@register
class Exact(FitsNowhere):
    """The same memory, and a result that must not be computed at a lower precision."""
    name = "test_exact"
    tolerates_lower_precision = False


@register
class Leaky(Metric):
    """Keeps its first block (chunk x 5 MiB) on purpose; the second one is as large. Chunk 8
    (80 MiB) runs out under 64 MiB and leaves 40 MiB in use; chunk 4 (40 MiB) fits."""
    name = "test_leaky"
    knobs = (Knob("chunk", "memory", 8, 1),)

    def compute(self, model, data, chunk=8):
        first = torch.ones(chunk * 5 * MiB // 4)
        HELD.append(first)
        second = torch.ones(chunk * 5 * MiB // 4)
        return {"sum": float(first.sum() + second.sum()), "held": len(HELD)}
'''


def _job(tmp_path: Path, metrics: str, top: str = "") -> Path:
    plugin = tmp_path / "remedy_metrics.py"
    plugin.write_text(PLUGIN, encoding="utf-8")
    path = tmp_path / "job.toml"
    path.write_text(f'output = "{tmp_path / "out"}"\nplugins = ["{plugin}"]\n'
                    f'models = ["tiny-gpt2"]\nbudget = "64MiB"\n{top}'
                    '[data]\nseq_len = 8\nn_samples = 2\n[search]\nenabled = false\n'
                    + metrics, encoding="utf-8")
    return path


# ------------------------------------------------------------------ names and order
def test_unknown_remedy_is_a_one_line_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as info:
        parse_on_oom(["halve", "bf16"])
    assert str(info.value) == ("on_oom: unknown remedy 'bf16': use one of halve, "
                               "bfloat16, float16, expandable_segments, cpu")
    path = _job(tmp_path, '[[metrics]]\nname = "loss"\n', top='on_oom = ["halve", "bf16"]\n')
    with pytest.raises(JobError) as job_info:
        load_job(path)
    message = str(job_info.value)
    assert "\n" not in message and "line 5: on_oom: unknown remedy 'bf16'" in message
    assert "use one of " + ", ".join(REMEDIES) in message
    per_metric = _job(tmp_path, '[[metrics]]\nname = "loss"\non_oom = ["halve", "gpu"]\n')
    with pytest.raises(JobError, match=r"line 12: metrics\[0\]\.on_oom: unknown remedy 'gpu'"):
        load_job(per_metric)
    for bad, words in ((["bfloat16"], "first remedy must be \"halve\""),
                       (["halve", "cpu", "bfloat16"], "\"cpu\" must come last"),
                       (["halve", "halve"], "'halve' is given twice"),
                       (["halve", "bfloat16", "float16"], "bfloat16 or float16, not both"),
                       ("halve", "expected a list of remedy names")):
        with pytest.raises(UsageError, match=words):
            parse_on_oom(bad)
    assert parse_on_oom(("halve", "float16", "cpu")) == ("halve", "float16", "cpu")


# ------------------------------------------------------------------ a job, end to end
@pytest.mark.slow
def test_job_ladder_lower_precision_fits_nowhere_and_restart(tmp_path: Path) -> None:
    metrics = ('[[metrics]]\nname = "test_fits_in_bf16"\n'
               '[[metrics]]\nname = "test_fits_nowhere"\n'
               '[[metrics]]\nname = "test_exact"\n'
               '[[metrics]]\nname = "test_leaky"\non_oom = ["halve"]\n')
    job = load_job(_job(tmp_path, metrics,
                        top='on_oom = ["halve", "bfloat16", "expandable_segments", "cpu"]\n'))
    outcome = run_job(job, cache_path=tmp_path / "cache.json", progress=False)
    out = Path(outcome.out)
    tasks = json.loads((out / "results.json").read_text())["tasks"]
    report = (out / "report.md").read_text()

    # Only bfloat16 fits: the result says so, in results.json and in the report's table.
    bf16 = tasks["test_fits_in_bf16"]
    assert bf16["status"] == "ok" and bf16["summary"]["dtype"] == "torch.bfloat16"
    assert (bf16["remedy"], bf16["precision"], bf16["lowered_precision"]) == (
        "bfloat16", "bfloat16", True)
    assert [a["chunk"] for a in bf16["sizes"]["attempts"]] == [2, 1, 2]
    assert [(r["remedy"], r["outcome"]) for r in bf16["remedies"]] == [
        ("halve", "failed"), ("bfloat16", "ok")]
    assert "| test_fits_in_bf16 | ok **(lowered precision: bfloat16)** | chunk=2 |" in report
    remedies = report.split("## Remedies\n", 1)[1].split("\n## ", 1)[0]
    assert ("- **test_fits_in_bf16**: result from **bfloat16**, at **bfloat16** instead of "
            "float32.") in remedies

    # Nowhere: one line naming every remedy and why it failed or was skipped.
    for key, precision in (("test_fits_nowhere", "bfloat16 failed (no executable chunk: "
                            "every size down to 1 ran out of memory)"),
                           ("test_exact", "bfloat16 skipped (the workload does not declare "
                            "tolerates_lower_precision = True)")):
        t = tasks[key]
        assert t["status"] == "failed" and "\n" not in t["reason"]
        assert t["reason"].startswith(
            f"{key}: fits nowhere: halve failed (no executable chunk: every size down to 1 "
            f"ran out of memory); {precision}; expandable_segments skipped (CUDA only); cpu "
            "skipped (already on cpu) (tried "), t["reason"]
        assert f"- **{key}**: **failed**. Tried: halve failed" in remedies
    assert tasks["test_exact"]["sizes"]["attempts"] == [{"chunk": 2}, {"chunk": 1}]
    assert tasks["test_fits_nowhere"]["lowered_precision"] is None

    # Memory kept after the OOM at 8: chunk 4 ran in a fresh process, once, not looped here.
    leaky = tasks["test_leaky"]
    # a new process's list: the block of its warm-up (chunk 1, before the budget) and the run's
    assert leaky["status"] == "ok" and leaky["summary"]["held"] == 2
    assert [a["chunk"] for a in leaky["sizes"]["attempts"]] == [8, 4]
    assert leaky["remedy"] == "halve" and leaky["lowered_precision"] is False
    [why] = leaky["restarts"]
    assert why.startswith("memory did not come back after the OOM at 8: ") and "MiB more" in why
    journal = [e for e in replay(out / "journal.jsonl") if e.get("task") == "test_leaky"]
    restarts = [e for e in journal if e["event"] == "restart"]
    assert len(restarts) == 1 and restarts[0]["resume"] == {"chunk": 4}
    [done] = [e for e in journal if e["event"] == "success"]
    assert done["pid"] != restarts[0]["pid"] and done["sizes"] == {"chunk": 4}
    [event] = leaky["oom_events"]
    assert event["action"].startswith("gave up: restart in a fresh process: memory did not")
    assert [(r["remedy"], r["outcome"]) for r in leaky["remedies"]] == [
        ("halve", "restarted"), ("halve", "ok")]
    assert outcome.failed() == ["test_fits_nowhere", "test_exact"]


# ------------------------------------------------------------------ the API
class SameSizes:
    """A retry policy that proposes the sizes that just ran out of memory again."""

    def shrink(self, sizes, minimum):
        return dict(sizes)


class Block:
    """``batch_size`` x 12 MiB + 40 MiB of float32 (half of it in bfloat16), on a device
    that only says where it runs: ``on_device`` moves it. ``extra / 4`` MiB more while on
    ``mps`` stand for a GPU's smaller memory (this machine has none: a fake device)."""

    tolerates_lower_precision = True

    def __init__(self, extra: int = 0) -> None:
        self.dtype, self.precision, self.device, self.extra = torch.float32, "float32", "mps", extra
        self.moves: list[str] = []

    def __call__(self, batch_size: int) -> float:
        mib = 48 * batch_size + 160 + (self.extra if self.device == "mps" else 0)
        return float(torch.ones(mib * MiB // 16, dtype=self.dtype).sum())

    def at_precision(self, dtype: torch.dtype) -> Block:
        self.dtype, self.precision = dtype, str(dtype).removeprefix("torch.")
        return self

    def on_device(self, device: str) -> Block:
        self.device = device
        self.moves.append(device)
        return self


def _api_ladders() -> dict:
    out: dict = {}
    stuck = Executor(policy=SameSizes(), on_oom=["halve"])
    with budget_after_warmup(48 * MiB):
        try:
            stuck.run(lambda batch_size: float(torch.ones(batch_size * 4 * MiB).sum()),
                      batch_size=4, name="stuck")
        except NoProgress as exc:
            out["stuck"] = str(exc)
    rec = stuck.history[-1]
    out["stuck_attempts"] = rec.attempts
    out["stuck_actions"] = [e.action for e in rec.events]
    lower = Executor(device="cpu", on_oom=["halve", "bfloat16", "expandable_segments", "cpu"])
    with budget_after_warmup(48 * MiB):
        value = lower.run(Block(), batch_size=2)
    out["lower"] = (value, lower.ladder.produced, lower.ladder.precision,
                    [r.line() for r in lower.ladder.rungs], lower.history[-1].attempts)
    moved, block = Executor(device="mps", on_oom=["halve", "cpu"]), Block(extra=128)
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("oomguard.executor").addHandler(handler)
    with budget_after_warmup(72 * MiB):
        value = moved.run(block, batch_size=2)
    out["moved"] = (value, moved.ladder.produced, block.moves, moved.ladder.rungs[-1].estimate_s,
                    [m for m in records if "moving to the CPU" in m])
    return out


@pytest.mark.slow
def test_api_no_progress_stops_and_fake_gpu_moves_to_cpu_after_an_estimate() -> None:
    got = in_fresh_process(_api_ladders)
    # Two attempts at the same sizes, same remedy, same OOM: stopped, in one line.
    assert got["stuck"].startswith("stuck: no progress: two attempts in a row ran out of "
                                   "memory with the same remedy (halve), the same sizes (4) "
                                   "and the same error (tried 4, 4); last error: ")
    assert "\n" not in got["stuck"] and got["stuck_attempts"] == [{"batch_size": 4}] * 2
    assert got["stuck_actions"][0] == "retried at batch_size=4"
    assert got["stuck_actions"][1].startswith("gave up: no progress: ")
    # float32 needs 52 MiB at size 1 (of 48); bfloat16 32 MiB at 2: flagged in the ladder.
    value, produced, precision, rungs, attempts = got["lower"]
    assert (value, produced, precision) == (16 * MiB, "bfloat16", "bfloat16")
    assert rungs == ["halve failed (no executable batch size: every size down to 1 ran out "
                     "of memory)", "bfloat16 ok"]
    assert [a["batch_size"] for a in attempts] == [2, 1, 2]
    # 32 MiB more on the fake GPU: 84 MiB at size 1, of 72; on the CPU size 2 (64 MiB)
    # fits, after the estimate was logged.
    value, produced, moves, estimate, lines = got["moved"]
    assert (value, produced, moves) == (16 * MiB, "cpu", ["cpu"]) and estimate >= 0
    assert len(lines) == 1 and "a stated CPU/GPU time ratio, not measured here" in lines[0]


def _fake_cuda_expandable_segments() -> dict:
    import os

    from oomguard.engine.core.execute import remedies

    # This machine has no GPU: its answers are faked (the workload runs on the CPU).
    remedies.device_kind = lambda device: "cuda"  # type: ignore[assignment]
    remedies.cuda_async_backend = lambda: False  # type: ignore[assignment]
    os.environ.pop(ALLOC_CONF, None)
    out: dict = {}
    with budget_after_warmup(48 * MiB):
        try:  # 84 MiB at size 1: halving fails, then the rung asks for a fresh process
            Executor(device="mps", on_oom=["halve", "expandable_segments"],
                     fresh_process=True).run(Block(extra=128), batch_size=2)
        except RestartNeeded as exc:
            out["why"], handoff = exc.why, exc.ladder.to_dict()
        ladder = Ladder.from_dict(handoff)  # what the next process gets
        remedies.apply_env(ladder.env)
        out["env"] = os.environ.get(ALLOC_CONF)
        again = Executor(device="mps", on_oom=["halve", "expandable_segments"],
                         fresh_process=True)
        try:
            again.run(Block(extra=128), batch_size=2, ladder=ladder)
        except NoExecutableBatchSize as exc:
            out["end"] = (type(exc).__name__, exc.message, again.history[-1].attempts)
    return out


@pytest.mark.slow
def test_fake_cuda_expandable_segments_runs_once_in_a_fresh_process_with_the_variable() -> None:
    got = in_fresh_process(_fake_cuda_expandable_segments)
    assert got["why"] == f"expandable_segments: a fresh process with {ALLOC_CONF}=" \
                         "expandable_segments:True"
    assert got["env"] == "expandable_segments:True"
    kind, message, attempts = got["end"]  # ran there (not "already in force"), and ended
    assert kind == "NoExecutableBatchSize" and attempts == [{"batch_size": 2},
                                                            {"batch_size": 1}]
    assert message == ("fits nowhere: halve failed (no executable batch size: every size down "
                       "to 1 ran out of memory); expandable_segments failed (no executable "
                       "batch size: every size down to 1 ran out of memory)")


class CastsLarge:
    """A 64 MiB float32 model (casting it to bfloat16 allocates a 32 MiB copy of its weight
    before the float32 one is freed) whose call needs 64 MiB per size on ``mps``, which
    stands for a GPU (a fake device: this machine has none), and 1 MiB on the CPU."""

    tolerates_lower_precision = True

    def __init__(self) -> None:
        self.model = torch.nn.Linear(4096, 4096, bias=False)
        self.device, self.precision = "mps", "float32"

    def __call__(self, batch_size: int) -> float:
        mib = 64 if self.device == "mps" else 1
        return float(torch.ones(batch_size * mib * MiB // 4).sum())

    def at_precision(self, dtype: torch.dtype) -> CastsLarge:
        self.model.to(dtype)
        self.precision = str(dtype).removeprefix("torch.")
        return self

    def on_device(self, device: str) -> CastsLarge:
        self.device = device
        return self


def _cast_runs_out() -> tuple:
    work = CastsLarge()  # built before the budget, as a job builds its model
    ex = Executor(device="mps", on_oom=["halve", "bfloat16", "cpu"])
    with budget_after_warmup(24 * MiB):
        value = ex.run(work, batch_size=2)
    return value, ex.ladder.produced, [r.line() for r in ex.ladder.rungs], work.device


@pytest.mark.slow
def test_fake_gpu_cast_to_bfloat16_that_runs_out_is_a_failed_rung_and_the_next_one_runs() -> None:
    value, produced, rungs, device = in_fresh_process(_cast_runs_out)
    assert rungs[0].startswith("halve failed (no executable batch size")
    assert rungs[1].startswith("bfloat16 failed (casting the model to bfloat16 ran out of "
                               "memory (")
    assert rungs[2:] == ["cpu ok"]
    assert (value, produced, device) == (2 * MiB // 4, "cpu", "cpu")
