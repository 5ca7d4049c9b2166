"""Guided against the brute-force maximum on the peer bench's workloads (bench/peers.py).

Small variants of the five workloads (``workloads(small=True)``: the E10 line, the
GPT-2 step, the loss metric, attention over the sequence length, an LSTM step), each
under a real CPU budget, real OOMs. The brute-force maximum m is the largest size that
runs in a fresh process (warm-up, budget, one trial) while m + 1 does not; the bench's
``Fresh.brute_force`` finds it with fresh processes only, galloping from a hint and
bisecting (monotone workloads), so the hint moves where it looks, never what it finds.

Guided runs isolated (each trial a fresh process), the mode that gives the faithful
maximum: in-process answers drift by a few sizes either way (measured on the small GPT-2
step: 79 in-process where 77 is the fresh maximum; bench/peers.py reports both modes).
On the two linear workloads it needs at most 5 trials.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from peer_algorithms import PEERS  # noqa: E402
from peer_workloads import PRELOAD, Workload, workloads  # noqa: E402
from peers import ISOLATED, Fresh, run_algorithm  # noqa: E402

from oomguard.engine.core.child import forkserver_context  # noqa: E402
from oomguard.engine.core.search.trial import Trial  # noqa: E402

# Before any test starts the forkserver: a child then imports none of these itself
# (measured: a GPT-2 child that imported transformers took ~13 s here, not ~2 s).
forkserver_context(PRELOAD)
SMALL = workloads(small=True)


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(SMALL))
def test_guided_isolated_finds_the_fresh_maximum(key: str) -> None:
    w = SMALL[key]
    row = run_algorithm(w, ISOLATED)
    assert row["note"] == "bracket closed", row
    if w.key in ("e10", "gpt2"):  # the two linear workloads: at most 5 trials
        assert row["trials"] <= 5, row["tried"]
    brute = Fresh(w).brute_force(row["size"], confirm=False)
    assert brute["first_oom"] == brute["max"] + 1, brute
    assert row["size"] == brute["max"], (row["tried"], brute)


def _proposals(peer: str, fits_up_to: int, max_size: int = 65536) -> tuple[list[int], object]:
    """The sizes a peer proposes when every size up to ``fits_up_to`` fits, and its answer.
    No memory is used: this checks the rewrites' documented sequences only."""
    w = Workload(key="x", label="x", make=int, budget_bytes=1 << 30, max_size=max_size)
    strategy, trials = PEERS[peer].strategy(w), []
    while (size := strategy.next(trials, 65536)) is not None and len(trials) < 64:
        trials.append(Trial(size, size <= fits_up_to, 1, 0.0, limit_peak_bytes=size << 20))
    return [t.size for t in trials], strategy.outcome


def test_the_peers_propose_their_documented_sequences() -> None:
    sizes, out = _proposals("accelerate x0.9 (>=1.9)", 100)
    assert sizes == [128, 115, 103, 92] and out.size == 92
    sizes, out = _proposals("accelerate /2 (<1.9)", 100)
    assert sizes == [128, 64] and out.size == 64
    sizes, out = _proposals("toma", 100)
    assert sizes == [128, 64] and out.size == 64
    sizes, out = _proposals("lightning power", 100)
    assert sizes == [2, 4, 8, 16, 32, 64, 128] and out.size == 64
    sizes, out = _proposals("lightning binsearch", 100)
    assert sizes[:7] == [2, 4, 8, 16, 32, 64, 128] and sizes[7:] == [96, 112, 104, 100, 102, 101]
    assert out.size == 95 and out.extra == {"no_margin": 100}  # 2.6's 5% margin
    sizes, out = _proposals("ultralytics autobatch", 100)  # 1 MiB per item, 60% of 1 GiB
    assert sizes == [1, 2, 4, 8, 16] and out.size == 614
