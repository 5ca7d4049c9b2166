"""An OOM that the workload's own code catches is still an OOM (engine/core/memory/swallowed.py).

Analysis code often wraps its work in ``except Exception`` and returns ``{"computed": False,
"error": ...}``. Such a call must not count as a success: in a search the size counts as out
of memory (the same maximum as a metric that lets the error out), in a job the executor
retries at a smaller size and records the OOM with a message that says the metric's own code
caught it. Real OOMs come from real CPU budgets in fresh processes; the CUDA branch (the
allocator's ``num_ooms``) runs on the fake device. An exception the code catches that is not
an OOM does not count, nor does an OOM that an inner oomguard call already handled.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import in_fresh_process, in_fresh_processes
from fakes.fake_cuda import FakeCuda

from oomguard.engine.cli.main import main
from oomguard.engine.core.execute.executor import Executor
from oomguard.engine.core.memory.oom import OOM, call_catching_oom
from oomguard.engine.errors import UsageError

MiB = 2**20
GiB = 2**30
CAUGHT = "out of memory caught by its own code"


class AttentionEntropy:
    """Mean entropy of the attention distributions of a tiny GPT-2 over ``n`` samples, in
    chunks of ``chunk_size`` samples (exact: a sum and a count), as an analysis suite computes
    it. With ``catch``, its forward is wrapped in ``except Exception`` and a failure returns
    ``{"computed": False, "error": ...}``, as such code often does."""

    def __init__(self, catch: bool, n: int, seq_len: int) -> None:
        self.catch, self.n, self.seq_len = catch, n, seq_len
        self.name = "entropy_catches" if catch else "entropy"
        self.state: dict[str, Any] = {}

    def warmup(self) -> None:
        from oomguard.metrics.models import build_model, make_batch

        model = build_model("tiny-gpt2")
        ids = make_batch(self.n, self.seq_len, model.config.vocab_size, pad=False)["input_ids"]
        self.state.update(model=model, ids=ids)
        self.compute(1, ids[:1])

    def compute(self, chunk_size: int, ids: torch.Tensor) -> dict[str, Any]:
        total, count = 0.0, 0
        for start in range(0, ids.shape[0], chunk_size):
            with torch.no_grad():
                out = self.state["model"](input_ids=ids[start:start + chunk_size],
                                          output_attentions=True)
            for att in out.attentions:
                ent = -(att * torch.log(att.clamp_min(1e-12))).sum(-1)
                total += float(ent.sum())
                count += ent.numel()
        return {"computed": True, "entropy": total / count}

    def __call__(self, chunk_size: int) -> dict[str, Any]:
        if not self.catch:
            return self.compute(chunk_size, self.state["ids"])
        try:
            return self.compute(chunk_size, self.state["ids"])
        except Exception as e:  # noqa: BLE001 - the shape of the code under test
            return {"computed": False, "error": str(e)}


def _search_entropy(catch: bool) -> dict[str, Any]:
    from oomguard import search
    from oomguard.engine.core.search.strategies import Guided

    # Peaks measured here: about 32 MiB at sizes 4 and 6, over the 35 MiB the budget leaves at 7.
    result = search(AttentionEntropy(catch, n=8, seq_len=256), strategy=Guided(start=2),
                    budget=38 * MiB, max_size=8)
    return {"max_ok": result.max_ok, "first_oom": result.first_oom,
            "errors": [t.error for t in result.trials if not t.ok],
            "values": [t.value for t in result.trials if t.ok]}


@pytest.mark.slow
def test_search_counts_an_oom_the_workload_caught_as_out_of_memory() -> None:
    plain, catching = in_fresh_processes(_search_entropy, [(False,), (True,)])
    assert plain["first_oom"] is not None and plain["max_ok"] >= 1  # the budget binds
    # The same answer as the workload that lets the error out, and no placeholder among the fits.
    assert (catching["max_ok"], catching["first_oom"]) == (plain["max_ok"], plain["first_oom"])
    assert all(v["computed"] for v in catching["values"])
    assert catching["errors"] and all(
        e.startswith(f"entropy_catches: {CAUGHT}, which then returned normally (RuntimeError: ")
        and "DefaultCPUAllocator: can't allocate memory" in e for e in catching["errors"])


# ------------------------------------------------------------------ a job
PLUGIN = '''
import torch
from oomguard.metrics.base import Knob, Metric, register


def entropy_sum(model, ids, chunk_size):
    """Sum and count of the attention entropies over the samples, in chunks."""
    total, count = 0.0, 0
    for start in range(0, ids.shape[0], chunk_size):
        with torch.no_grad():
            out = model(input_ids=ids[start:start + chunk_size], output_attentions=True)
        for att in out.attentions:
            ent = -(att * torch.log(att.clamp_min(1e-12))).sum(-1)
            total += float(ent.sum())
            count += ent.numel()
    return total, count


@register
class Entropy(Metric):
    name = "test_entropy"
    knobs = (Knob("chunk_size", "memory", 16, 1),)

    def compute(self, model, data, chunk_size=16):
        total, count = entropy_sum(model, data["input_ids"], chunk_size)
        return {"computed": True, "entropy": total / count}


@register
class EntropyCatches(Metric):
    """The same, written as analysis code often is: any failure becomes a placeholder."""
    name = "test_entropy_catches"
    knobs = (Knob("chunk_size", "memory", 16, 1),)

    def compute(self, model, data, chunk_size=16):
        try:
            total, count = entropy_sum(model, data["input_ids"], chunk_size)
            return {"computed": True, "entropy": total / count}
        except Exception as e:
            return {"computed": False, "error": str(e)}
'''


def _run(job: str, cache: str) -> int:
    return main(["run", job, "--cache", cache])


@pytest.mark.slow
def test_job_retries_a_metric_that_caught_its_own_oom_and_says_so(tmp_path: Path) -> None:
    plugin = tmp_path / "entropy_metrics.py"
    plugin.write_text(PLUGIN, encoding="utf-8")
    job = tmp_path / "job.toml"
    job.write_text(f'output = "{tmp_path / "out"}"\nplugins = ["{plugin}"]\n'
                   'models = ["tiny-gpt2"]\nbudget = "64MiB"\n'
                   "[data]\nseq_len = 256\nn_samples = 16\n[search]\nenabled = false\n"
                   '[[metrics]]\nname = "test_entropy"\n'
                   '[[metrics]]\nname = "test_entropy_catches"\n', encoding="utf-8")
    # In a fresh process: both metrics must meet the same boundary, which a worker's
    # earlier tests would move (free heap chunks under the budget)
    assert in_fresh_process(_run, str(job), str(tmp_path / "cache.json")) == 0
    out = tmp_path / "out"
    tasks = json.loads((out / "results.json").read_text())["tasks"]
    plain, caught = tasks["test_entropy"], tasks["test_entropy_catches"]
    # Not a success at the default size: retried as the metric that lets the error out was.
    assert caught["status"] == "ok" and caught["summary"]["computed"] is True
    assert caught["sizes"]["attempts"][0] == {"chunk_size": 16}
    assert caught["sizes"]["attempts"] == plain["sizes"]["attempts"]
    assert len(caught["sizes"]["attempts"]) > 1
    assert math.isclose(caught["summary"]["entropy"], plain["summary"]["entropy"], rel_tol=1e-9)
    errors = caught["sizes"]["errors"]
    assert errors and all(e.startswith(f"test_entropy_catches: {CAUGHT}") for e in errors)
    assert [e["error"] for e in caught["oom_events"]] == errors  # measured at the OOM
    assert not any(CAUGHT in e for e in plain["sizes"]["errors"])
    report = (out / "report.md").read_text()
    assert f"- OOMs: test_entropy_catches: {CAUGHT}, which then returned normally" in report


# ------------------------------------------------------------------ what counts
def _caught_outcomes() -> dict[str, Any]:
    from oomguard import budget

    def shape_error(n: int) -> str:
        try:
            torch.ones(2, 3) @ torch.ones(2, 3)  # an aten error that is not an OOM
        except RuntimeError:
            pass
        try:
            raise ValueError("not memory")
        except ValueError:
            return "ok"

    def swallows(n: int) -> dict[str, Any]:
        try:
            return {"computed": True, "sum": float(torch.ones(n * MiB // 4).sum())}
        except Exception as e:  # noqa: BLE001 - the shape of the code under test
            return {"computed": False, "error": str(e)}

    def wraps_error(n: int) -> None:
        try:
            torch.ones(n * MiB // 4).sum()
        except RuntimeError as e:
            raise ValueError("the metric failed") from e

    def handled_inside(n: int) -> int:
        # An inner oomguard executor handles its own OOM (retries at half): not the outer call's.
        return Executor().run(lambda b: float(torch.ones(b * MiB // 4).sum()) and b,
                              batch_size=n, name="inner")

    # 64 MiB of embeddings made before the budget: the forward of one token fits, the
    # backward's dense gradient (64 MiB, in a C++ autograd node) does not.
    table = torch.randn(64 * MiB // 4 // 16, 16, requires_grad=True)

    def backward_caught(n: int) -> str:
        loss = torch.nn.functional.embedding(torch.tensor([n]), table).sum()
        try:
            loss.backward()
            return "ok"
        except RuntimeError:
            return "skipped"

    torch.ones(64, 64).sum()
    out: dict[str, Any] = {}
    with budget(48 * MiB, "cpu"):
        for name, fn, size in (("non_oom", shape_error, 1), ("fits", swallows, 8),
                               ("swallowed", swallows, 128), ("wrapped", wraps_error, 128),
                               ("inner", handled_inside, 128), ("backward", backward_caught, 3)):
            got = call_catching_oom(fn, size, workload=name)
            out[name] = ({"oom": got.message, "caught": got.caught_by_workload}
                         if isinstance(got, OOM) else got)
    return out


@pytest.mark.slow
def test_what_a_workload_catches_counts_only_when_it_is_an_oom() -> None:
    out = in_fresh_process(_caught_outcomes)
    assert out["non_oom"] == "ok"  # a caught shape error and ValueError are not OOMs
    assert out["fits"]["computed"] is True
    assert out["swallowed"]["caught"] is True
    assert out["swallowed"]["oom"].startswith(f"swallowed: {CAUGHT}, which then returned normally "
                                              "(RuntimeError: ")
    assert out["wrapped"]["caught"] is True
    assert out["wrapped"]["oom"].startswith(
        f"wrapped: {CAUGHT}, which then raised ValueError: the metric failed (RuntimeError: ")
    assert out["inner"] in (16, 32)  # the inner executor's retry worked; the outer call did too
    assert out["backward"]["caught"] is True and "DefaultCPUAllocator" in out["backward"]["oom"]


def test_swallowed_cuda_oom_counts_through_num_ooms_fake_cuda(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeCuda(total=16 * GiB).install(monkeypatch)

    def step(batch_size: int) -> dict[str, Any]:
        try:
            gpu.free(gpu.alloc(batch_size * 512 * MiB))
            return {"computed": True, "batch_size": batch_size}
        except torch.OutOfMemoryError as e:
            return {"computed": False, "error": str(e)}

    got = call_catching_oom(step, 64, device="cuda:0", workload="step")
    assert isinstance(got, OOM) and got.caught_by_workload
    assert got.message == (f"step: {CAUGHT}, which then returned normally (OutOfMemoryError: "
                           "the CUDA caching allocator reported 1 OOM(s) on cuda:0 "
                           "(memory_stats num_ooms))")
    executor = Executor(device="cuda:0")
    # 32 GiB and 16 GiB do not fit beside the 512 MiB context; 8 GiB does.
    assert executor.run(step, batch_size=64, name="step") == {"computed": True, "batch_size": 16}
    record = executor.history[-1]
    assert [a["batch_size"] for a in record.attempts] == [64, 32, 16]
    assert all(e.startswith(f"step: {CAUGHT}") for e in record.errors)
    assert gpu.num_ooms == 3


def test_the_spotter_mode_is_checked_in_one_line() -> None:
    from oomguard.engine.core.memory.swallowed import set_spotter_mode, spotter_mode

    assert spotter_mode() == "auto"
    with pytest.raises(UsageError) as err:
        set_spotter_mode("sometimes")
    assert str(err.value) == ("OOMGUARD_SWALLOWED_OOMS must be one of auto, on, off, "
                              "got 'sometimes'; set it to one of those, or unset it")
    assert spotter_mode() == "auto"


@pytest.mark.slow
def test_a_bad_spotter_mode_in_the_environment_stops_a_job_in_one_line_before_any_work(
        tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    job = tmp_path / "job.toml"
    job.write_text(f'output = "{tmp_path / "out"}"\nmodels = ["tiny-gpt2"]\n[data]\nseq_len = 8\n'
                   'n_samples = 2\n[[metrics]]\nname = "loss"\n', encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "oomguard", "run", str(job)], cwd=tmp_path,
                          env={**os.environ, "OOMGUARD_SWALLOWED_OOMS": "sometimes"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "oomguard: error: OOMGUARD_SWALLOWED_OOMS must be one of auto, on, off, got "
        "'sometimes'; set it to one of those, or unset it"]
    assert not (tmp_path / "out").exists()  # no metric ran, nothing was written
