"""The one rule for timing configurations side by side and keeping the faster: the remedies'
pricing (:mod:`~oomguard.engine.core.execute.priced`: accumulation, checkpointing, bf16) and
an analysis job's plain against recomputed sizes (:mod:`~oomguard.engine.jobs.sizing`) both
choose with :func:`fastest`.

The rule: the most samples per second; a configuration without a rate (it ran out of memory,
or was not timed) is never chosen; a tie, or a difference within the measured spread of the
timings, keeps the earlier configuration (callers list the plain one first: a change of
configuration must pay for itself beyond what the clock can tell apart)."""

from __future__ import annotations

from collections.abc import Sequence


def spread(seconds: Sequence[float]) -> float:
    """The relative spread of repeated timings of one configuration (seconds): ``(slowest -
    fastest) / fastest`` (0.1: the slowest took 10% longer); 0 for fewer than two timings
    or a fastest of 0 seconds."""
    if len(seconds) < 2 or min(seconds) <= 0:
        return 0.0
    return (max(seconds) - min(seconds)) / min(seconds)


def fastest(rates: Sequence[float | None], spreads: Sequence[float] | None = None
            ) -> int | None:
    """The index of the configuration to keep among ``rates`` (samples per second, in the
    callers' order of preference, the plain configuration first; None: it has no rate, as
    where its timed run ran out of memory). A later configuration replaces the one kept so
    far only where its rate is higher by more than the larger of their ``spreads``
    (relative, :func:`spread`; none given: 0, so only a strictly higher rate). None where no
    configuration has a rate."""
    if spreads is not None and len(spreads) != len(rates):
        raise ValueError(f"one spread per rate: {len(spreads)} spreads for {len(rates)} rates")
    kept: int | None = None
    for i, rate in enumerate(rates):
        if rate is None or rate <= 0:
            continue
        if kept is None:
            kept = i
            continue
        margin = max(spreads[i], spreads[kept]) if spreads is not None else 0.0
        if rate > rates[kept] * (1.0 + margin):  # type: ignore[operator]
            kept = i
    return kept
