"""The report's throughput and verification sections: the fastest size that ran is not
always the largest, and a size verified over further steps is one the run can trust."""

from __future__ import annotations

from oomguard.engine.core.search import SearchResult


def speed_and_verification(result: SearchResult) -> list[str]:
    """Throughput per size (the largest is not always the fastest) and the verification."""
    rec, out = result.recommendation, []
    rates = {t.size: t.items_per_second for t in result.trials if t.ok and t.items_per_second}
    if rec is not None and rates:
        safe_rates = {s: r for s, r in rates.items() if s <= rec.safe}
        fastest = max(safe_rates or rates, key=(safe_rates or rates).__getitem__)
        steps = max(t.steps for t in result.trials)
        how = ("items per second over the steps after the first" if steps > 1
               else "items per second of the trial's one step (first-step costs included)")
        out += ["", "### Throughput",
                f"- **Fastest size that ran at or below the recommended size**: {fastest} "
                f"({rates[fastest]:,.1f} items/s; {how})",
                "- **Measured**: " + ", ".join(f"{s}: {r:,.1f}/s" for s, r in sorted(rates.items()))]
    check = result.verification
    if check:
        verdict = ("ran without running out of memory" if check["ok"]
                   else f"RAN OUT OF MEMORY: {check['error']}")
        out += ["", "### Verification",
                f"- {check['steps']} further steps at {check['size']}: {verdict}"]
    return out
