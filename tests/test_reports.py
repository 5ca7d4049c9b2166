"""Reports: Markdown, JSON and PNG rendered from a real search under a CPU memory budget
(in a fresh process), from hand-built results, and a job's report.md with its plots."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import matplotlib
import pytest
import torch
from conftest import in_fresh_process

from oomguard.engine.core.search.fit import fit_line, recommend
from oomguard.engine.core.search.search import SearchResult, search
from oomguard.engine.core.search.strategies import ExpandBisect
from oomguard.engine.core.search.trial import Trial
from oomguard.engine.util.units import MiB, fmt_bytes
from oomguard.reports import plot_memory, render_json, render_markdown, style, write_report
from oomguard.reports.job_report import write_job_report
from oomguard.reports.json_report import summarise
from oomguard.reports.plot import memory_figure, throughput_figure

BASE = 4 * MiB
PER_ITEM = 2 * MiB
BUDGET = 96 * MiB

SECTIONS = [
    "## Recommendation", "## Configuration", "## Data Configuration", "## Search Strategy",
    "## Results", "### Maximum Batch Size: **", "### Performance Metrics", "### Search Details",
    "## Memory Scaling Analysis", "## Key Observations", "## Conclusion",
]


class LinearAlloc:
    """Allocates (and touches) BASE + PER_ITEM * size bytes; returns a loss-like float."""

    name = "linear-alloc"

    def warmup(self) -> None:
        # Big enough to run in parallel, so the OpenMP pool (~8 MiB of thread
        # stacks) exists before the budget; a 1 KiB warm-up would charge it to the budget.
        torch.ones(8 * MiB, dtype=torch.uint8).sum()

    def __call__(self, size: int) -> float:
        x = torch.ones(BASE + PER_ITEM * size, dtype=torch.uint8)
        return float(x[:1024].sum().item()) / 1024 + 1.0 / size


CONTEXT = {
    "model": "linear allocator (test)",
    "parameters": 1_234_567,
    "architecture": {"base_bytes": BASE, "per_item_bytes": PER_ITEM},
    "dtype": "uint8",
    "data": {"source": "synthetic", "sequence_length": 1},
}


def _search() -> SearchResult:
    # In-process trials (fork=False): the report's caveat for history-dependent answers.
    return search(LinearAlloc(), start=8, size_step=8, budget=BUDGET, device="cpu", max_trials=30,
                  fork=False)


@pytest.fixture(scope="module")
def result() -> SearchResult:
    # A fresh process: in a long test process free heap chunks left by earlier
    # tests are reused without counting against the budget.
    return in_fresh_process(_search)


def _table_rows(md: str) -> list[tuple[int, str]]:
    block = md.split("### Search Details", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| (\d+) \| (✓ SUCCESS|✗ OOM) \|", block, flags=re.M)
    return [(int(s), status) for s, status in rows]


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.mark.slow
def test_search_is_real(result: SearchResult) -> None:
    assert result.mode == "in-process"
    assert result.first_oom == result.max_ok + 1
    # 4 + 2 * 45 = 94 MiB fits in 96 MiB; 46 needs all 96 MiB (fits only if nothing else grew).
    assert 42 <= result.max_ok <= 46
    assert any(not t.ok for t in result.trials)
    assert result.fit is not None and result.fit.r2 > 0.95


@pytest.mark.slow
def test_markdown_sections_and_table(result: SearchResult) -> None:
    md = render_markdown(result, CONTEXT)
    assert md.startswith("# linear-alloc Maximum Batch Size Report")
    positions = [md.index(s) for s in SECTIONS]
    assert positions == sorted(positions), "sections out of order"
    assert f"### Maximum Batch Size: **{result.max_ok}**" in md
    assert _table_rows(md) == [(t.size, "✓ SUCCESS" if t.ok else "✗ OOM")
                               for t in result.trials]
    assert "1. Started with batch_size=8" in md
    # each trial narrated with the reason its strategy gave for it
    assert "Tried batch_size=16, +8 from 8, which fitted (✓ SUCCESS)" in md
    first_oom_seen = next(t.size for t in result.trials if not t.ok)
    assert f"Tried batch_size={first_oom_seen}, +8 from {first_oom_seen - 8}, which fitted (✗ OOM)" in md
    assert f"found maximum at batch_size={result.max_ok}" in md
    assert "in-process" in md and "history-dependent" in md
    assert "least-squares" in md and "VmHWM" in md and "R²" in md
    assert f"**Use batch size {result.recommendation.safe}.**" in md
    assert "1,234,567" in md and "synthetic" in md


@pytest.mark.slow
def test_json_round_trips(result: SearchResult) -> None:
    doc = json.loads(json.dumps(render_json(result, CONTEXT)))
    assert [t["size"] for t in doc["result"]["trials"]] == [t.size for t in result.trials]
    assert [t["ok"] for t in doc["result"]["trials"]] == [t.ok for t in result.trials]
    assert doc["result"]["max_ok"] == result.max_ok
    assert doc["result"]["fit"]["per_item_bytes"] == pytest.approx(result.fit.per_item_bytes)
    assert doc["result"]["recommendation"]["safe"] == result.recommendation.safe
    assert doc["context"]["parameters"] == 1_234_567
    assert doc["oomguard_version"]
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00$", doc["generated_at"])
    assert doc["summary"]["utilisation"] == pytest.approx(
        doc["summary"]["peak_at_max_bytes"] / BUDGET)


@pytest.mark.slow
def test_write_report_files(result: SearchResult, tmp_path) -> None:
    paths = write_report(result, tmp_path / "out" / "nested", CONTEXT)
    assert {p.name for p in paths.values()} == {"report.md", "report.json", "memory.png",
                                                "throughput.png"}
    assert _png_size(paths["throughput_png"].read_bytes()) == (8 * style.DPI, 5 * style.DPI)
    data = paths["png"].read_bytes()
    assert _png_size(data) == (9 * style.DPI, round(6.4 * style.DPI))  # the search's size
    assert len(data) > 20_000
    assert json.loads(paths["json"].read_text())["result"]["max_ok"] == result.max_ok
    assert "## Key Observations" in paths["markdown"].read_text()
    leftovers = [p.name for p in paths["png"].parent.iterdir() if p.name.startswith(".")]
    assert leftovers == []


def _hand_built(trials: list[Trial], capacity: int | None, fit=None, first_oom=None,
                stopped: str = "max_size (64) reached") -> SearchResult:
    max_ok = max(t.size for t in trials if t.ok)
    return SearchResult(
        workload="hand", device="cpu", mode="isolated", strategy="expand-bisect",
        strategy_description=ExpandBisect().describe(), max_ok=max_ok, first_oom=first_oom,
        trials=trials, fit=fit,
        recommendation=recommend(trials, max_ok, capacity, fit, margin=0.15, first_oom=first_oom),
        capacity_bytes=capacity, budget_bytes=None, stopped_because=stopped, seconds=0.5,
        config={"start": 64, "step": 8, "max_size": 64, "max_trials": 64, "margin": 0.15})


@pytest.mark.parametrize("capacity", [None, 512 * MiB])
def test_degenerate_results_render(capacity: int | None, tmp_path) -> None:
    # One trial: no fit, no OOM, maybe no capacity.
    res = _hand_built([Trial(size=64, ok=True, peak_bytes=300 * MiB, seconds=0.1,
                             value={"loss": 1.5})], capacity)
    md = render_markdown(res)
    assert "### Maximum Batch Size: **64** (no OOM seen" in md
    assert "No fit" in md and "No OOM seen" in md
    if capacity is None:
        assert "unknown" in md
    doc = json.loads(json.dumps(render_json(res)))
    assert doc["summary"]["max_is_lower_bound"] is True
    out = plot_memory(res, tmp_path / "one.png")
    assert out == tmp_path / "one.png"
    assert _png_size(out.read_bytes()) == (9 * style.DPI, round(6.4 * style.DPI))


def test_start_oom_then_halving_and_nan_value(tmp_path) -> None:
    trials = [Trial(size=32, ok=False, peak_bytes=None, seconds=0.1, error="oom"),
              Trial(size=16, ok=True, peak_bytes=100 * MiB, seconds=0.1, value=float("nan")),
              Trial(size=24, ok=False, peak_bytes=None, seconds=0.1, error="oom"),
              Trial(size=20, ok=True, peak_bytes=None, seconds=0.1)]
    res = _hand_built(trials, None, first_oom=21, stopped="max_trials (4) reached")
    md = render_markdown(res, {"device_name": "test box"})
    assert "Started with batch_size=32 (✗ OOM)" in md and "Tried batch_size=16 (✓ SUCCESS)" in md
    assert "Final refinement found maximum at batch_size=20 (batch_size=21 ran out of memory)" in md
    doc = json.loads(json.dumps(render_json(res, {"odd": object(), "dtype": torch.float16}),
                                allow_nan=False))  # strict JSON: nan is a string
    assert doc["context"]["dtype"] == "torch.float16"
    assert doc["context"]["odd"].startswith("<object object at ")
    assert [t["value"] for t in doc["result"]["trials"]] == [None, "nan", None, None]
    assert doc["summary"]["peak_at_max_bytes"] is None  # size 20 ran, its peak is unknown
    png = plot_memory(res, tmp_path / "x.png").read_bytes()
    assert _png_size(png) == (9 * style.DPI, round(6.4 * style.DPI))


# ------------------------------------------------------------------- wording: knob, cap, slope
class KnobAlloc:
    """Allocates and touches ``per_item`` bytes per unit of its size (nothing when 0), like a
    metric whose memory knob is ``knob``; no knob means the batch of a training step."""

    def __init__(self, per_item: int, knob: str | None = None) -> None:
        self.per_item = per_item
        self.name = f"alloc-{knob or 'batch'}"
        if knob is not None:
            self.knob = knob

    def warmup(self) -> None:
        # The first allocations of a process cost extra pages (~4 MiB); keep them out of trial 1.
        self(4)

    def __call__(self, size: int) -> float:
        if not self.per_item:
            return float(size)
        x = torch.ones(self.per_item * size, dtype=torch.uint8)
        return float(x[::4096].sum().item())


def _prose(res: SearchResult, md: str) -> str:
    # The strategy's own description (engine/core/search/strategies.py) is quoted as is.
    return md.replace(res.strategy_description, "")


def _knob_search() -> SearchResult:
    return search(KnobAlloc(MiB, "chunk_size"), start=4, size_step=4, max_size=16)


@pytest.mark.slow
def test_report_names_the_knob_searched(tmp_path: Path) -> None:
    # A real search, no budget: memory grows 1 MiB per unit of chunk_size. In a fresh
    # process: resident free heap left by earlier tests would serve the allocations
    # unseen by the peak meter, and the scaling line would read flat.
    res = in_fresh_process(_knob_search)
    assert res.size_name == "chunk_size" and res.fit is not None and res.fit.per_item_bytes > 0
    md = render_markdown(res)
    assert "batch" not in _prose(res, md).lower()
    assert md.startswith("# alloc-chunk_size Maximum chunk_size Report\n")
    assert f"### Maximum chunk_size: **{res.max_ok}**" in md
    assert "| chunk_size | Status | Peak Memory |" in md
    assert "each +4 chunk_size increment adds" in md
    assert f"**Use chunk_size {res.recommendation.safe}.**" in md
    assert render_json(res)["summary"]["size_label"] == "chunk_size"
    ax = memory_figure(res).axes[0]
    assert ax.get_xlabel() == "chunk_size (items)"
    assert "peak memory vs chunk_size" in ax.get_title()
    assert write_report(res, tmp_path)["png"].stat().st_size > 20_000


def test_zero_slope_is_not_linear_scaling() -> None:
    # Memory does not depend on the knob: every measured peak is the same.
    res = search(KnobAlloc(0, "chunk_size"), start=8, size_step=8, max_size=32)
    assert res.fit is not None and res.fit.points == 4
    md = render_markdown(res)
    assert "Linear scaling" not in md and "Linear memory scaling" not in md
    assert "peak memory did not grow with chunk_size over the sizes tried (8 to 32" in md
    assert "the limit is elsewhere and every size tried fits" in md
    assert render_json(res)["summary"]["memory_scaling"] == "flat"


def test_falling_peaks_with_an_oom_say_the_limit_is_elsewhere() -> None:
    # Built as search() builds it: trials, then fit_line, bracket and recommend.
    trials = [Trial(size=s, ok=True, peak_bytes=p * MiB, seconds=0.1)
              for s, p in ((8, 40), (16, 30), (24, 20))]
    trials.append(Trial(size=32, ok=False, peak_bytes=None, seconds=0.1, error="oom"))
    fit = fit_line(trials)
    assert fit is not None and fit.per_item_bytes < 0 and fit.r2 == pytest.approx(1.0)
    res = _hand_built(trials, 512 * MiB, fit=fit, first_oom=32, stopped="bracket closed")
    res.size_name = "chunk_size"
    md = render_markdown(res)
    assert "Linear scaling" not in md and "Linear memory scaling" not in md
    assert "did not grow with chunk_size over the sizes tried (8 to 24" in md
    assert "yet chunk_size 32 ran out of memory, so the limit is elsewhere" in md


@pytest.mark.parametrize("samples_key", ["samples", "n_samples"])
def test_cap_from_samples_does_not_advise_max_size(samples_key: str) -> None:
    # As `oomguard search` runs a knob that slices the samples: max_size = the number of samples.
    res = search(KnobAlloc(0, "chunk_size"), start=8, size_step=8, max_size=16)
    context = {"knob": "chunk_size", samples_key: 16}
    md = render_markdown(res, context)
    assert "max_size (16) reached" in res.stopped_because
    assert "raise max_size" not in md.replace("raising max_size changes nothing", "")
    assert "--max-size" not in md
    assert "the number of samples (--samples 16)" in md
    assert "**Every useful chunk_size fits**" in md
    assert render_json(res, context)["summary"]["capped_by"] == "samples"


def test_cap_from_user_max_size_advises_raising_it() -> None:
    # --max-size 16 below --samples 64: the user's cap, not the data's.
    res = search(KnobAlloc(0, "chunk_size"), start=8, size_step=8, max_size=16)
    context = {"knob": "chunk_size", "samples": 64}
    md = render_markdown(res, context)
    assert "stopped at max_size (16)" in md and "raise max_size (--max-size)" in md
    assert "--samples" not in md
    assert render_json(res, context)["summary"]["capped_by"] == "max_size"


@pytest.mark.parametrize(("limit", "option"), [({"max_trials": 2}, "raise max_trials (--max-trials)"),
                                               ({"max_seconds": 0.1, "max_trials": 10**6},
                                                "raise max_seconds")])
def test_cap_from_trials_or_time_names_that_option(limit: dict, option: str) -> None:
    res = search(KnobAlloc(0), start=8, size_step=8, **limit)  # the batch of a training step
    name = next(iter(limit))
    assert res.stopped_because.startswith(name) and res.first_oom is None
    md = render_markdown(res)
    assert "raise max_size" not in md
    assert option in md and "max_size (65536) was not reached" in md
    assert render_json(res)["summary"]["capped_by"] == name
    assert memory_figure(res).axes[0].get_xlabel() == "batch size (items)"


def test_markdown_json_and_plots_state_the_one_record() -> None:
    # The figures are computed once (summarise); every output renders what it is given.
    trials = [Trial(size=s, ok=True, peak_bytes=(4 + 2 * s) * MiB, seconds=0.1,
                    items_per_second=100.0 * s) for s in (8, 16, 24)]
    trials.append(Trial(size=32, ok=False, peak_bytes=None, seconds=0.1, error="oom"))
    res = _hand_built(trials, 128 * MiB, fit=fit_line(trials), first_oom=32,
                      stopped="max_trials (4) reached")
    record = summarise(res, CONTEXT)
    assert render_json(res, CONTEXT)["summary"] == json.loads(json.dumps(record))
    record |= {"search_steps": ["From the record"], "utilisation": 0.125, "trials_ok": 99,
               "size_label": "widgets", "capacity_kind": "budget", "fastest_safe_size": 16,
               "rate_spread": 0.01, "safe_line_bytes": 100 * MiB,
               "recommended_limit_bytes": 100 * MiB}
    md = render_markdown(res, CONTEXT, record)
    assert "1. From the record\n" in md and "| Memory Utilization | 12.5% (of" in md
    assert "(99 fitted," in md and "**Use widgets " in md and "stays under 100.00 MiB" in md
    assert "12.5% of the budget), without the" in md
    assert "**Fastest at or below the recommended size**: 16" in md
    assert render_json(res, CONTEXT, record)["summary"]["trials_ok"] == 99
    ax = memory_figure(res, record).axes[0]
    assert ax.get_xlabel() == "widgets (items)"
    texts = [t.get_text() for t in ax.get_legend().get_texts()]
    assert texts[0].startswith("capacity (budget): ") and "= 100.00 MiB" in texts[1]
    assert any(t.startswith("fastest: 16 is faster") for t in [
        t.get_text() for t in throughput_figure(res, record).axes[0].get_legend().get_texts()])


@pytest.mark.slow
def test_write_report_of_a_plain_search_does_not_load_the_metrics(tmp_path: Path) -> None:
    # Reports sit above the metrics in the layers; a search of a plain function needs none.
    code = ("import sys\nimport oomguard\nfrom oomguard.engine.core.search.search import search\n"
            "result = search(lambda n: n, start=2, size_step=2, max_size=8)\n"
            f"oomguard.write_report(result, {str(tmp_path)!r})\n"
            "print(sorted(m for m in sys.modules if m.startswith('oomguard.metrics')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout == "[]\n", done.stderr
    assert {p.name for p in tmp_path.iterdir()} >= {"report.md", "report.json", "memory.png"}


# ------------------------------------------------------------------- a job's report
def _task(status: str, **fields) -> dict:
    base = {"task": "t", "metric": "loss", "model": "tiny-gpt2", "status": status, "params": {},
            "seconds": None, "sizes": None, "search": None, "peak_bytes": None,
            "peak_source": None, "summary": None, "tensors": None, "reason": None,
            "traceback": None}
    return {**base, **fields}


def _summary(tmp_path: Path) -> dict:
    (tmp_path / "results").mkdir()
    torch.save({"entropy_per_head": torch.rand(2, 4, dtype=torch.float64)},
               tmp_path / "results" / "attn.pt")
    sizes = {"start": {"micro_batch_size": 8}, "final": {"micro_batch_size": 4},
             "attempts": [{"micro_batch_size": 8}, {"micro_batch_size": 4}],
             "errors": ["out of memory at 8"], "retries": 1, "source": "search"}
    grid = [[abs(i - 2) + abs(j - 2) + 0.5 for j in range(5)] for i in range(5)]
    return {
        "job": {"name": "night", "path": "/jobs/night.toml", "dtype": "float32",
                "models": ["tiny-gpt2"], "budget_bytes": 64 * MiB,
                "device": {"device": "cpu", "name": "test-cpu", "total_bytes": 2**30},
                "data": {"source": "generated", "path": None, "seq_len": 8, "n_samples": 2}},
        "run": "r1", "status": "failed", "exit_code": 1, "failed": ["boom"],
        "finished": "2030-01-01T00:00:00Z",
        "tasks": {
            "landscape": _task("ok", metric="loss_landscape", seconds=1.5, sizes=sizes,
                               peak_bytes=40 * MiB, peak_source="measured: test",
                               summary={"loss_grid": grid, "alpha": [0.0, 1.0]}),
            "attn": _task("ok", metric="attention_stats", seconds=0.25, peak_bytes=12 * MiB,
                          sizes={**sizes, "final": {"micro_batch_size": 8}, "retries": 0,
                                 "errors": [], "source": "cache"},
                          summary={"n_samples": 2}, tensors="results/attn.pt"),
            "boom": _task("failed", seconds=0.1, reason="ValueError: boom",
                          traceback="tracebacks/boom.txt"),
            "later": _task("pending"),
        },
    }


def test_job_report_markdown_and_plots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_global_backend(*args, **kwargs):
        raise AssertionError("library code must not call matplotlib.use()")

    monkeypatch.setattr(matplotlib, "use", no_global_backend)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)  # importing pyplot fails
    report = write_job_report(_summary(tmp_path), tmp_path)
    md = report.read_text()
    assert md.startswith("# oomguard job report: night\n")
    assert "- **Status**: failed (exit code 1); 1 failed, 2 ok, 1 pending" in md
    assert "- **Budget**: 64.00 MiB" in md
    assert "| landscape | ok | micro_batch_size=4 | search | 1 | 1.50 | 40.00 MiB |" in md
    assert "| attn | ok | micro_batch_size=8 | cache | 0 | 0.25 | 12.00 MiB |" in md
    assert "| later | pending | - | - | - | - | - |" in md
    assert "- **boom**: ValueError: boom (traceback: `tracebacks/boom.txt`)" in md
    assert "- OOMs: out of memory at 8" in md
    plots = {"plots/memory.png", "plots/landscape-landscape.png", "plots/attn-entropy.png"}
    assert set(re.findall(r"!\[[^]]*\]\(([^)]+)\)", md)) == plots
    for rel in plots:  # every plot in the one style and size, written whole
        assert _png_size((tmp_path / rel).read_bytes()) == (
            round(style.SIZE[0] * style.DPI), round(style.SIZE[1] * style.DPI))
    assert sorted(p.name for p in tmp_path.rglob(".*")) == []  # no temporary files left


def test_a_job_on_two_gpu_kinds_reports_each_tasks_device_beside_its_sizes(
        tmp_path: Path) -> None:
    # Two GPU kinds are a Ray cluster's case: here the devices are written into the
    # summary, as the workers that measured them would have.
    h100 = {"device": "cuda", "name": "NVIDIA H100 80GB HBM3", "total_bytes": 81559 * MiB,
            "host": "node-1"}
    a100 = {"device": "cuda", "name": "NVIDIA A100-SXM4-40GB", "total_bytes": 40960 * MiB,
            "mig_profile": "3g.20gb", "host": "node-2"}
    summary = _summary(tmp_path)
    summary["job"]["device"] = {"device": "cuda", "name": "Ray cluster: 16 CPU(s), 2 GPU(s)",
                                "total_bytes": None, "ray": {"address": "local", "nodes": 2}}
    summary["tasks"]["landscape"]["device"] = h100
    summary["tasks"]["attn"]["device"] = a100
    md = write_job_report(summary, tmp_path).read_text()
    assert "- **Device**: cuda (Ray cluster: 16 CPU(s), 2 GPU(s))\n" in md
    assert ("- **Tasks ran on**: NVIDIA H100 80GB HBM3 (79.65 GiB) (1 task), "
            "NVIDIA A100-SXM4-40GB MIG 3g.20gb (40.00 GiB) (1 task)") in md
    assert ("| landscape | ok | NVIDIA H100 80GB HBM3 (79.65 GiB) | micro_batch_size=4 | search "
            "| 1 | 1.50 | 40.00 MiB |") in md
    assert "| attn | ok | NVIDIA A100-SXM4-40GB MIG 3g.20gb (40.00 GiB) | micro_batch_size=8 |" in md
    assert "| later | pending | - | - | - | - | - | - |" in md
    assert "- ran on NVIDIA H100 80GB HBM3 (79.65 GiB) on host `node-1`" in md


# ------------------------------------------------------------------- one recommendation (issue 36)
def _first_statement(md: str) -> str:
    """The report's first paragraph after its title."""
    return md.split("\n\n", 2)[1]


@pytest.mark.slow
def test_the_reports_first_statement_is_the_one_size_to_use_and_why(result: SearchResult) -> None:
    md = render_markdown(result, CONTEXT)
    rec, s = result.recommendation, summarise(result, CONTEXT)
    first = _first_statement(md)
    # Which size, then why: its peak against a line that keeps the margin, with the figures.
    assert first.startswith(f"## Recommendation\n**Use batch size {rec.safe}.** Its peak (")
    assert f"keeps a {fmt_bytes(rec.margin_bytes)} margin below" in first
    assert s["recommended_limit_bytes"] <= s["safe_line_bytes"] == BUDGET - rec.margin_bytes
    # One size is recommended: no range, no second "conservative" choice; the maximum is a
    # measured fact after it, and the conclusion repeats the recommendation, not the maximum.
    assert "Recommended range" not in md and "Conservative" not in md
    assert md.index(f"- **Measured maximum**: batch size {result.max_ok} ran") > md.index(first)
    assert md.split("## Conclusion\n", 1)[1].startswith(f"**Use batch size {rec.safe} for ")


def test_a_recommendation_held_below_the_safe_line_says_against_what() -> None:
    # The fitted peak at the first OOM (32) is below the capacity: the limit counted bytes the
    # peak does not, so the margin is taken off that peak, and the report says so first. The
    # margin is 15% of what grows: 4 + 2 x 32 MiB less the fixed 4 MiB.
    trials = [Trial(size=s, ok=True, peak_bytes=(4 + 2 * s) * MiB, seconds=0.1) for s in (8, 16, 24)]
    trials.append(Trial(size=32, ok=False, peak_bytes=None, seconds=0.1, error="oom"))
    res = _hand_built(trials, 128 * MiB, fit=fit_line(trials), first_oom=32, stopped="bracket closed")
    s = summarise(res)
    assert res.recommendation.fixed_bytes == 4 * MiB == s["fixed_bytes"]
    assert res.recommendation.margin_bytes == int(0.15 * 64 * MiB) == s["margin_bytes"]
    assert s["safe_line_bytes"] == 128 * MiB - int(0.15 * 64 * MiB)
    assert s["recommended_limit_bytes"] == 68 * MiB - int(0.15 * 64 * MiB)
    assert s["margin_source"] == ("15% of the 64.00 MiB that grows above the fixed 4.00 MiB "
                                  "(as configured)")
    md = render_markdown(res)
    assert _first_statement(md) == (
        "## Recommendation\n**Use batch size 24.** Its peak (measured 52.00 MiB, 40.6% "
        "utilization) stays under 58.40 MiB, which keeps a 9.60 MiB margin below "
        "68.00 MiB, the fitted peak at the first OOM (32).")
    assert ("- **Margin**: 15% of the 64.00 MiB that grows above the fixed 4.00 MiB (as "
            "configured); kept free") in md
    assert "- **Why under 58.40 MiB, not the safe line**: memory ran out where" in md
    texts = [t.get_text() for t in memory_figure(res, s).axes[0].get_legend().get_texts()]
    assert "safe line: capacity less the 9.60 MiB margin = 118.40 MiB" in texts
    assert ("recommended size held under: the fitted peak at the first OOM (32) less the "
            "9.60 MiB margin = 58.40 MiB") in texts


def test_every_search_setting_the_report_shows_is_explained() -> None:
    res = _hand_built([Trial(size=8, ok=True, peak_bytes=MiB, seconds=0.1, steps=2)], 64 * MiB)
    res.config = {"strategy": "guided", "start": 8, "misses": 2, "max_size": 64,
                  "max_trials": 64, "max_seconds": None, "margin": 0.15,
                  "steps_per_trial": None, "verify_steps": 0, "knob_of_a_plugin": 3}
    md = render_markdown(res)
    assert "misses=2" not in md  # a bare name=value, as the report listed it before
    block = md.split("- **Search settings**:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [line.split(" = ", 1)[0].strip(" -") for line in block] == list(res.config)
    assert all(re.match(r"  - \w+ = [^:]+: \S", line) for line in block), block
    assert ("  - misses = 2: after this many wrong predictions the strategy stops predicting "
            "and only doubles and bisects") in block
    assert "  - steps_per_trial = none: workload calls per trial (none: the workload's own " \
           "count) (here 2)" in block
    assert "  - knob_of_a_plugin = 3: a parameter of the strategy" in block
    # The tables' columns and the figures under them are said in words.
    assert "Seconds are the wall-clock seconds of the whole trial" in md
    assert "The value is what the workload returned at the trial's last step" in md
    assert "Each trial ran 2 steps" in md


def _timed(size: int, step_rates: list[float]) -> Trial:
    """A fitted trial whose steps after the first ran at ``step_rates`` items per second."""
    seconds = [2.0, *(size / r for r in step_rates)]
    t = Trial(size=size, ok=True, peak_bytes=(4 + size) * MiB, seconds=sum(seconds),
              steps=len(seconds), items_per_second=size * len(step_rates) / sum(seconds[1:]))
    t.step_seconds = seconds  # Trial.step_seconds: the seconds of each step, as run_trial times them
    return t


@pytest.mark.parametrize(("rates_16", "rates_24", "fastest"), [
    # The case: 48.7 against 47.8 items/s, while one size's rate varies by 4.8% from
    # one step to the next: noise, no size is named fastest.
    ([47.5, 49.9], [47.0, 48.6], None),
    # 24 is faster by far more than any step-to-step spread: named, and starred.
    ([30.0, 30.5], [47.5, 48.0], 24),
])
def test_a_fastest_size_is_named_only_when_faster_beyond_the_step_spread(
        rates_16: list[float], rates_24: list[float], fastest: int | None) -> None:
    trials = [_timed(16, rates_16), _timed(24, rates_24)]
    res = _hand_built(trials, 512 * MiB, fit=fit_line(trials))
    assert res.recommendation.safe == 24  # both sizes are candidates
    s = summarise(res)
    assert s["fastest_safe_size"] == fastest
    assert s["rate_spread"] == pytest.approx(max((max(r) - min(r)) / max(r)
                                                 for r in (rates_16, rates_24)))
    md = render_markdown(res, summary=s)
    ax = throughput_figure(res, s).axes[0]
    stars = [line for line in ax.get_lines() if line.get_marker() == "*"]
    texts = [t.get_text() for t in ax.get_legend().get_texts()]
    if fastest is None:
        assert "- **No size is named fastest**: the rates at or below the recommendation " \
               "differ by no more than the step-to-step spread (4.8%): noise" in md
        assert stars == [] and not any(t.startswith("fastest") for t in texts)
        assert any(t.startswith("no size named fastest: the rates") for t in texts)
    else:
        assert "- **Fastest at or below the recommended size**: 24 (" in md
        assert [line.get_xdata()[0] for line in stars] == [24]
    # Each size's step-to-step range is drawn: the spread the verdict is judged against.
    assert "step-to-step range of a size's rate (measured)" in texts


def test_no_fastest_size_without_a_measured_spread() -> None:
    # Rates without per-step timings (one timed step each): their noise is unknown.
    trials = [Trial(size=s, ok=True, peak_bytes=(4 + s) * MiB, seconds=1.0, steps=2,
                    items_per_second=r) for s, r in ((16, 20.0), (24, 48.7))]
    res = _hand_built(trials, 512 * MiB, fit=fit_line(trials))
    s = summarise(res)
    assert s["fastest_safe_size"] is None and s["rate_spread"] is None
    assert "the rates' step-to-step spread is unknown" in render_markdown(res, summary=s)


@pytest.mark.parametrize(("peaks", "said"), [
    # 15% of what grows (128 MiB less the fixed 4 MiB) kept free: under 109.40 MiB.
    ([40 * MiB, 41 * MiB], "41.00 MiB, 68.40 MiB under the line the recommendation keeps (109.40 MiB)"),
    ([40 * MiB, 110 * MiB], "110.00 MiB, 614.40 KiB ABOVE the line the recommendation keeps "
                            "(109.40 MiB): the margin was not kept"),
])
def test_the_searchs_own_verification_is_judged_against_the_line(peaks: list[int], said: str) -> None:
    trials = [Trial(size=s, ok=True, peak_bytes=(4 + 2 * s) * MiB, seconds=0.1) for s in (8, 16)]
    res = _hand_built(trials, 128 * MiB, fit=fit_line(trials))
    res.verification = {"size": 16, "steps": 2, "ok": True, "step_peaks": peaks,
                        "peak_bytes": max(peaks), "seconds": 0.2, "error": None}
    md = render_markdown(res)
    assert ("## Verification\n- 2 further steps at 16: ran without running out of memory; "
            f"highest step peak {said}") in md
