"""Throughput: the fastest size that ran is not always the largest. The rates each trial
measured (:attr:`Trial.items_per_second`), the fastest size at or below the
recommendation, and the report's throughput and verification sections
(``throughput.png`` is drawn by :mod:`oomguard.reports.plot`)."""

from __future__ import annotations

from oomguard.engine.core.search.search import SearchResult


def rates(result: SearchResult) -> dict[int, float]:
    """Measured items per second of every size that fitted (sizes without a rate left out)."""
    return {t.size: t.items_per_second for t in result.trials if t.ok and t.items_per_second}


def fastest_safe_size(result: SearchResult) -> int | None:
    """The size with the highest measured items per second among those that ran at or
    below the recommended size (at or below the maximum when none did); None without
    rates or a recommendation."""
    measured, rec = rates(result), result.recommendation
    if rec is None or not measured:
        return None
    safe = {s: r for s, r in measured.items() if s <= rec.safe} or measured
    return max(safe, key=safe.__getitem__)


def rate_basis(result: SearchResult) -> str:
    """What the rates measure, in words (the first step is left out when there are more)."""
    steps = max((t.steps for t in result.trials), default=1)
    return ("items per second over the steps after the first" if steps > 1
            else "items per second of the trial's one step (first-step costs included)")


def speed_and_verification(result: SearchResult, fastest: int | None) -> list[str]:
    """Throughput per size (the largest is not always the fastest; ``fastest`` is
    :func:`fastest_safe_size`) and the verification."""
    measured, out = rates(result), []
    if fastest is not None:
        out += ["", "### Throughput",
                f"- **Fastest size that ran at or below the recommended size**: {fastest} "
                f"({measured[fastest]:,.1f} items/s; {rate_basis(result)}); plotted in "
                "`throughput.png`",
                "- **Measured**: " + ", ".join(f"{s}: {r:,.1f}/s" for s, r in sorted(measured.items()))]
    check = result.verification
    if check:
        verdict = ("ran without running out of memory" if check["ok"]
                   else f"RAN OUT OF MEMORY: {check['error']}")
        out += ["", "### Verification",
                f"- {check['steps']} further steps at {check['size']}: {verdict}"]
    return out
