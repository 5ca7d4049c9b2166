"""Recomputation (activation checkpointing per block) for analysis metrics: the same results
both ways, and a job that measures both configurations and keeps the faster.

Models are tiny transformers built from configs; results are compared in float64.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import in_fresh_process, tiny_data, tiny_model

from oomguard.engine.core.memory.heap import return_freed_memory_to_os
from oomguard.engine.core.recompute import checkpointed
from oomguard.engine.errors import UsageError
from oomguard.engine.jobs.cache import SizeCache
from oomguard.engine.jobs.data import load_data
from oomguard.engine.jobs.runner import run_job
from oomguard.engine.jobs.sizing import (
    PLAIN,
    RECOMPUTE,
    Recompute,
    Request,
    SearchRecord,
    Slot,
    choose_sizes,
)
from oomguard.engine.jobs.spec import load_job
from oomguard.metrics.base import get_metric
from oomguard.metrics.common import mean_loss_hvp, trainable
from oomguard.metrics.models import build_model, make_batch, model_config
from oomguard.metrics.workload import MetricTrial
from oomguard.probes.peak import PeakMeter

MiB = 2**20
# Four blocks whose attention probabilities (8 heads x 128 x 128) are most of the activations.
DEEP = ("gpt2:n_embd=16,n_head=8,n_layer=4,vocab_size=64,n_positions=256,eos_token_id=0,"
        "bos_token_id=0")


def test_a_transformers_model_checkpointed_gives_the_same_gradients_and_keeps_its_cache() -> None:
    # Its blocks fill the key/value cache: recomputed with the cache on, they appended to it
    # twice and attention failed on twice the keys.
    for arch in ("tiny-gpt2", "tiny-llama"):
        model, data = tiny_model(arch), tiny_data(n=2, seq_len=8)
        ids = data["input_ids"]
        model(input_ids=ids, labels=ids).loss.backward()
        plain = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        with checkpointed(model) as blocks:
            assert not model.config.use_cache
            model(input_ids=ids, labels=ids).loss.backward()
        assert len(blocks) == model.config.num_hidden_layers and model.config.use_cache
        for a, p in zip(plain, model.parameters(), strict=True):
            torch.testing.assert_close(p.grad, a, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- the choice

DEVICE = {"device": "cpu", "name": "test-cpu", "total_bytes": 1 << 30, "budget_bytes": None}
WORKLOAD = {"model_config": "abc", "dtype": "float32", "seq_len": 16, "params": {},
            "metric": "integrated_gradients"}


class Fits:
    """A knob search's answer: each knob fits up to its limit (None: up to its cap, no OOM),
    as a bracketed search answers; every call recorded."""

    def __init__(self, **limits: int | None) -> None:
        self.limits, self.calls = limits, []

    def __call__(self, knob: str, sizes: dict[str, int], unit: int, cap: int) -> SearchRecord:
        self.calls.append(knob)
        limit = self.limits.get(knob)
        top = (cap if limit is None else min(limit, cap)) // unit * unit
        return SearchRecord(metric="integrated_gradients", knob=knob, max_ok=top, safe=top,
                            trials=2, unit=unit, peak_at_safe_bytes=top << 20,
                            first_oom=None if limit is None or limit >= cap else top + unit)


def _choose(slot: Slot | None, plain: Fits, recomputed: Fits | None,
            seconds: dict[str, float | None], n: int = 16) -> Any:
    timed: list[tuple[str, dict[str, int]]] = []

    def time_it(configuration: str, sizes: dict[str, int]) -> float | None:
        timed.append((configuration, sizes))
        return seconds[configuration]

    req = Request(get_metric("integrated_gradients"), {}, n, model_config("tiny-gpt2"))
    got = choose_sizes(req, evaluate=plain, slot=slot,
                       recompute=None if recomputed is None else Recompute(recomputed, time_it))
    return got, timed


def test_the_faster_configuration_is_kept_recorded_and_cached(tmp_path: Path) -> None:
    slot = Slot(SizeCache(tmp_path / "sizes.json"), "k", DEVICE, WORKLOAD)
    plain, recomputed = Fits(chunk_size=2, internal_batch_size=4), Fits(chunk_size=8)
    got, timed = _choose(slot, plain, recomputed, {PLAIN: 2.0, RECOMPUTE: 0.5})
    assert plain.calls == recomputed.calls == ["chunk_size", "internal_batch_size"]
    assert got.configuration == RECOMPUTE and got.sizes == {"chunk_size": 8,
                                                            "internal_batch_size": 128}
    assert timed == [(PLAIN, {"chunk_size": 2, "internal_batch_size": 4}), (RECOMPUTE, got.sizes)]
    rows = {r["configuration"]: r for r in got.configurations}
    assert (rows[PLAIN]["samples_per_second"], rows[RECOMPUTE]["samples_per_second"]) == (8, 32)
    assert (rows[PLAIN]["chosen"], rows[RECOMPUTE]["chosen"]) == (False, True)
    assert rows[RECOMPUTE]["peak_bytes"] == 128 << 20  # its last knob's search's
    assert [r.extra["configuration"] for r in got.records] == [PLAIN] * 2 + [RECOMPUTE] * 2
    entry = slot.cache.get("k")
    assert entry["configuration"] == RECOMPUTE and entry["configurations"] == got.configurations
    assert entry["sizes"] == got.sizes and entry["max_ok"] == 8 and len(entry["search"]) == 4
    # read back: the sizes, the configuration and only its own records
    again, timed = _choose(slot, Fits(), Fits(), {})
    assert (again.source, again.configuration, again.sizes, timed) == (
        "cache", RECOMPUTE, got.sizes, [])
    assert [(r.knob, r.extra["configuration"]) for r in again.records] == [
        ("chunk_size", RECOMPUTE), ("internal_batch_size", RECOMPUTE)]
    # a caller that cannot run recomputed searches again, and its plain entry says so
    reference = Fits(chunk_size=3)
    got, _ = _choose(slot, reference, None, {})
    assert (got.source, got.configuration, got.sizes["chunk_size"]) == ("search", PLAIN, 3)
    assert slot.cache.get("k")["configuration"] == PLAIN
    # ... and a caller that would measure both does not take a plain-only answer
    both = Fits(chunk_size=3)
    got, timed = _choose(slot, both, Fits(chunk_size=4), {PLAIN: 1.0, RECOMPUTE: 1.0})
    assert both.calls and got.source == "search" and len(timed) == 2
    assert got.configuration == PLAIN  # a tie keeps plain


def test_plain_is_kept_when_faster_when_recomputed_runs_out_or_when_nothing_met_memory() -> None:
    got, _ = _choose(None, Fits(chunk_size=4), Fits(chunk_size=16), {PLAIN: 1.0, RECOMPUTE: 1.5})
    assert got.configuration == PLAIN and got.sizes["chunk_size"] == 4
    got, _ = _choose(None, Fits(chunk_size=4), Fits(chunk_size=16), {PLAIN: 1.0, RECOMPUTE: None})
    assert got.configuration == PLAIN
    assert [r.get("note") for r in got.configurations] == [
        None, "ran out of memory in its timed run"]
    # a plain answer that reached every knob's cap: recomputation can only add work
    recomputed = Fits()
    got, timed = _choose(None, Fits(), recomputed, {})
    assert got.configuration == PLAIN and recomputed.calls == [] and timed == []
    assert got.configurations[1]["note"].startswith("not measured: no plain size met")


# ----------------------------------------------------------------------------- why these metrics


def _peaks_both_ways() -> dict[str, Any]:
    """In a fresh process: the measured peak (MiB) and the value of a Hessian-vector product
    and of integrated gradients, each plain and with the blocks checkpointed."""
    torch.set_num_threads(1)
    return_freed_memory_to_os()
    model = build_model(DEEP, dtype="float32", seed=0)
    data = make_batch(2, 128, 64, seed=0, pad=False)
    params = trainable(model)
    gen = torch.Generator().manual_seed(0)
    vec = [torch.randn(p.shape, generator=gen) for p in params]
    ig = get_metric("integrated_gradients")
    work = {"hvp": lambda again: torch.cat([t.reshape(-1) for t in mean_loss_hvp(
                model, data, 2, vec, params)]) if not again else _checkpointed_hvp(
                model, data, vec, params),
            "ig": lambda again: ig.run(model, data, recompute=again, n_steps=4, chunk_size=2,
                                       internal_batch_size=8)["attributions"]}
    out: dict[str, Any] = {}
    for name, run in work.items():
        for again in (False, True):
            run(again)  # warm: one-time setup is not a peak
            meter = PeakMeter("cpu")
            meter.reset()
            value = run(again)
            # as a list: a tensor would travel back through shared memory the child frees
            out[f"{name} {'recompute' if again else 'plain'}"] = (meter.read() / MiB,
                                                                  value.tolist())
    return out


def _checkpointed_hvp(model: torch.nn.Module, data: dict, vec: list, params: list
                      ) -> torch.Tensor:
    with checkpointed(model):
        return torch.cat([t.reshape(-1) for t in mean_loss_hvp(model, data, 2, vec, params)])


@pytest.mark.slow
def test_checkpointing_lowers_the_peak_of_integrated_gradients_not_of_a_hessian_product() -> None:
    # A double backward keeps every recomputed activation until its second backward: the
    # Lanczos metrics do not declare recomputation (measured: 19.9 and 19.8 MiB here), the
    # captum ones do (28.6 and 11.7 MiB).
    got = in_fresh_process(_peaks_both_ways)
    (hvp, hvp_value), (hvp_r, hvp_r_value) = got["hvp plain"], got["hvp recompute"]
    (ig, ig_value), (ig_r, ig_r_value) = got["ig plain"], got["ig recompute"]
    for a, b in ((hvp_r_value, hvp_value), (ig_r_value, ig_value)):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-7)
    assert hvp_r > 0.9 * hvp, got
    assert ig_r < 0.6 * ig, got
    assert get_metric("integrated_gradients").recomputes and get_metric("layer_attribution").recomputes
    assert not get_metric("hessian_eigenvalues").recomputes
    assert not get_metric("ggn_eigenvalues").recomputes


def test_recomputing_a_metric_that_does_not_gain_from_it_is_one_line() -> None:
    model, data = tiny_model("tiny-gpt2"), tiny_data(n=2, seq_len=8)
    with pytest.raises(UsageError, match="does not gain from recomputation"):
        get_metric("hessian_eigenvalues").run(model, data, recompute=True)
    with pytest.raises(UsageError, match="does not gain from recomputation"):
        MetricTrial("ggn_eigenvalues", recompute=True)
    one_block = build_model("gpt2:n_embd=8,n_layer=1,n_head=2,vocab_size=16", seed=0)
    assert not get_metric("integrated_gradients").can_recompute(one_block)
    assert get_metric("integrated_gradients").can_recompute(model)


# ----------------------------------------------------------------------------- a job

# Sixteen heads over 96 tokens: under a 24 MiB budget plain integrated gradients fits one sample
# per captum call, recomputed both (measured peaks 22 and 14 MiB at 2).
WIDE = DEEP.replace("n_head=8", "n_head=16")


@pytest.mark.slow
def test_a_job_measures_both_configurations_keeps_the_faster_and_the_result_is_plain(
        tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text(f'output = "{tmp_path / "out"}"\nmodels = ["{WIDE}"]\nbudget = "24MiB"\n'
                    '[data]\nseq_len = 96\nn_samples = 2\n[search]\nstart = 1\nmax_trials = 3\n'
                    '[[metrics]]\nname = "integrated_gradients"\nparams = {n_steps = 4}\n',
                    encoding="utf-8")
    job = load_job(path)
    outcome = run_job(job, cache_path=tmp_path / "cache.json", progress=False, threads=1)
    out = Path(outcome.out)
    task = json.loads((out / "results.json").read_text())["tasks"]["integrated_gradients"]
    assert task["status"] == "ok", task.get("reason")
    sizes = task["sizes"]
    rows = {c["configuration"]: c for c in sizes["configurations"]}
    faster = max(rows.values(), key=lambda c: c["samples_per_second"])  # both were timed
    assert [c for c in rows.values() if c["chosen"]] == [faster]
    assert sizes["configuration"] == faster["configuration"] and sizes["start"] == faster["sizes"]
    # plain met the budget; recomputed, a larger chunk ran within it
    searches = {(s["configuration"], s["knob"]): s for s in task["searches"]}
    assert len(searches) == 4 and searches[(PLAIN, "chunk_size")]["first_oom"] is not None
    assert rows[RECOMPUTE]["sizes"]["chunk_size"] > rows[PLAIN]["sizes"]["chunk_size"]
    # whichever ran, the result is the plain metric's
    model = build_model(WIDE, job.dtype, seed=job.seed)
    data = load_data(job.data, model.config.vocab_size, seed=job.seed)
    plain = get_metric("integrated_gradients").run(model, data, n_steps=4, chunk_size=1,
                                                   internal_batch_size=1)["attributions"]
    got = torch.load(out / task["tensors"], weights_only=True)["attributions"]
    assert float((got - plain).abs().max() / plain.abs().max()) <= 1e-5
    # recorded: the size cache, the journal and the report
    entry = SizeCache(tmp_path / "cache.json").get(sizes["cache_key"])
    assert entry["configuration"] == sizes["configuration"]
    assert entry["configurations"] == sizes["configurations"]
    events = [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]
    (chosen,) = [e for e in events if e["event"] == "configuration"]
    assert chosen["chosen"] == sizes["configuration"]
    report = (out / "report.md").read_text()
    assert "## Recomputation" in report
    assert f"- configuration: {sizes['configuration']} (see Recomputation)" in report
