"""oomguard's search strategies against other libraries' batch-size finders, in one table.

Every algorithm searches every workload of bench/peer_workloads.py under the same CPU
budget, with real OOMs (``RLIMIT_DATA``), through :func:`oomguard.search`: the warm-up,
then the budget, then trials. In-process searches each run in a fresh process of their
own; the "isolated" rows run each trial in a fresh child (``isolate=True``, the mode
that gives the faithful maximum); the "confirmed" row searches in-process, then re-runs
the answer and the size above it in fresh children and goes on there where they disagree
(``confirm=True``). Rows: oomguard's expand-then-bisect routine (``ExpandBisect(32, 8)``,
the E10 report's) and ``Guided()``, each in-process and isolated, ``Guided()`` confirmed,
``Doubling(32)``, and the peers of bench/peer_algorithms.py.

Columns: trials (sizes run); seconds (measured, from the first trial's start to the
search's end: the in-process warm-up, paid once by every algorithm, is left out; an
isolated search's seconds include each child's start and warm-up); the size found;
whether that size ran in a fresh process under the same budget ("1/2": one of two fresh
runs); the distance from the brute-force maximum m (m - found: positive is below the
maximum, negative above it). m is the largest size that runs in a fresh process (warm-up,
budget, one trial of the workload's steps) while m + 1 runs out of memory. It is found by
an isolated search that gallops from the largest size found that ran fresh (+1, +2, +4,
...) and bisects; bisection assumes fitting is monotone in the size (if a size fits,
every smaller one does), which every workload here is built to satisfy. m and m + 1 are
then run once more each ("unconfirmed" says when a second run disagreed). Summary rows
count, per algorithm, the workloads found exactly (distance 0) and the sizes that ran
fresh, and total its trials and seconds, also as multiples of E10's in the same mode
(in-process, or isolated for the isolated rows).

    .venv/bin/python bench/peers.py [--quick] [--only WORKLOAD] [--row ALGORITHM] [--out peers.json]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from peer_algorithms import DERIVED, PEERS, PeerStrategy
from peer_workloads import PRELOAD, Workload, workloads

from oomguard.engine.core.child import Child, forkserver_context
from oomguard.engine.core.search.isolate import IsolatedRunner
from oomguard.engine.core.search.search import SearchConfig, SearchResult, search
from oomguard.engine.core.search.strategies import Doubling, ExpandBisect, Guided, Strategy, bracket
from oomguard.engine.core.search.trial import Trial
from oomguard.engine.core.workload import steps_of
from oomguard.engine.errors import SearchFailed
from oomguard.engine.util.atomic import atomic_write_json

ISOLATED = "oomguard guided, isolated"
CONFIRMED = "oomguard guided, confirmed"
E10_ISOLATED = "oomguard e10, isolated"
OURS: dict[str, Any] = {"oomguard e10": lambda: ExpandBisect(start=32, step=8),
                        "oomguard doubling": lambda: Doubling(start=32),
                        "oomguard guided": Guided, E10_ISOLATED: lambda: ExpandBisect(start=32, step=8),
                        ISOLATED: Guided, CONFIRMED: Guided}
ROWS: set[str] | None = None  # --row: the rows to run (None: all)


def algorithms() -> list[str]:
    """Row names in table order (a derived row comes after the row whose run it shares)."""
    names = list(OURS)
    for peer in PEERS:
        names += [peer, *(d for d, (source, _) in DERIVED.items() if source == peer)]
    return [n for n in names if ROWS is None or n in ROWS]


@dataclass(frozen=True)
class Gallop:
    """The brute force's strategy: ``start``, then steps of 1, 2, 4, ... up while sizes
    fit (down while none has), then bisection of the bracket until it is closed."""

    start: int
    name: ClassVar[str] = "gallop"

    def describe(self) -> str:
        return f"gallop from {self.start} by 1, 2, 4, ... then bisect"

    def next(self, trials: Sequence[Trial], max_size: int) -> int | None:
        if not trials:
            return self.start
        lo, hi = bracket(trials)
        step = 2 ** (len(trials) - 1)
        if lo is None:  # nothing fitted yet: down from the smallest OOM
            return max(hi - step, 1) if hi is not None and hi > 1 else None
        if hi is None:
            return min(lo + step, max_size) if lo < max_size else None
        return (lo + hi) // 2 if hi - lo > 1 else None


def timed_search(fn: Any, config: SearchConfig) -> tuple[SearchResult, float, float]:
    """(result, seconds from the first trial's start to the end, warm-up seconds before
    it). A search that found nothing gives its partial result."""
    ends: list[float] = []
    t0 = time.perf_counter()
    try:
        result = search(fn, config, on_trial=lambda _: ends.append(time.perf_counter()))
    except SearchFailed as exc:
        result = exc.result
        if exc.__cause__ is not None:  # a trial's own error: say what it was
            why = str(exc.__cause__).strip().splitlines()
            result.stopped_because += f" ({why[0][:160]})" if why else ""
    end = time.perf_counter()
    if config.isolate or not result.trials:  # no warm-up here: every child pays its own
        return result, end - t0, 0.0
    first_start = ends[0] - result.trials[0].seconds
    return result, end - first_start, first_start - t0


def run_algorithm(w: Workload, algorithm: str) -> dict[str, Any]:
    """One search of ``w`` by ``algorithm`` -> a row (the caller runs an in-process search
    in a fresh process of its own)."""
    peer = PEERS.get(algorithm)
    strategy: Strategy = peer.strategy(w) if peer else OURS[algorithm]()
    config = SearchConfig(strategy=strategy, budget=w.budget_bytes,
                          isolate=algorithm.endswith(", isolated"),
                          confirm=algorithm.endswith(", confirmed"),
                          steps_per_trial=peer.steps if peer else None,
                          **({} if peer else {"max_size": w.max_size}))  # a peer has none
    row: dict[str, Any] = {"algorithm": algorithm, "extra": {}}
    try:
        result, seconds, warmup = timed_search(w.make(), config)
    except Exception as exc:  # a row that fails says why; the bench goes on
        traceback.print_exc()
        return {**row, "size": None, "note": f"error: {type(exc).__name__}: {exc}"[:200],
                "seconds": 0.0, "warmup_seconds": 0.0, "trials": 0, "tried": []}
    if isinstance(strategy, PeerStrategy):
        out = strategy.outcome
        size, note = (out.size, out.note) if out else (None, result.stopped_because)
        row["extra"] = out.extra if out else {}
    else:
        size, note = result.max_ok, result.stopped_because
    return {**row, "size": size, "note": note, "seconds": seconds, "warmup_seconds": warmup,
            "trials": len(result.trials),
            "tried": [[t.size, t.ok, t.limit_peak_bytes, t.headroom_bytes] for t in result.trials]}


class Fresh:
    """Fresh-process runs of one workload under its budget: ``runs[size]`` lists the
    outcomes (True: it ran); :meth:`check` adds runs up to ``n`` at a size."""

    def __init__(self, w: Workload) -> None:
        self.w, self.fn = w, w.make()
        self.steps = steps_of(self.fn)
        self.runner = IsolatedRunner(self.fn, device="cpu", budget=w.budget_bytes)
        self.runs: dict[int, list[bool]] = {}

    def check(self, size: int, n: int = 1) -> list[bool]:
        runs = self.runs.setdefault(size, [])
        while len(runs) < n:
            runs.append(self.runner(size, self.steps).ok)
        return runs

    def brute_force(self, hint: int, confirm: bool = True) -> dict[str, Any]:
        """The brute-force maximum m (see the module docstring), searched from ``hint``;
        ``confirm``: run m and m + 1 a second time each (``confirmed``: both agreed)."""
        config = SearchConfig(strategy=Gallop(min(hint + 1, self.w.max_size)), isolate=True,
                              budget=self.w.budget_bytes, max_size=self.w.max_size)
        result, seconds, _ = timed_search(self.fn, config)
        for t in result.trials:
            self.runs.setdefault(t.size, []).append(t.ok)
        m, first_oom = result.max_ok, result.first_oom
        runs = 2 if confirm else 1
        confirmed = m is not None and all(self.check(m, runs))
        if first_oom is not None:
            confirmed = confirmed and not any(self.check(first_oom, runs))
        return {"max": m or 0, "first_oom": first_oom, "confirmed": confirmed,
                "runs": {n: self.runs[n] for n in (m, first_oom) if n is not None},
                "search_trials": len(result.trials), "search_seconds": seconds,
                "stopped": result.stopped_because}


def _in_fresh_process(ctx: Any, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a fresh, non-daemonic process (a pool's workers cannot start the
    children a confirmed search runs its fresh trials in)."""
    with Child(ctx, fn, *args) as child:
        return child.wait().result()


def run_workload(w: Workload, ctx: Any) -> dict[str, Any]:
    """Every algorithm's row on ``w``, the fresh-process checks and the brute-force maximum."""
    rows: list[dict[str, Any]] = []
    for algorithm in algorithms():
        if algorithm in DERIVED:
            source, key = DERIVED[algorithm]
            base = next(r for r in rows if r["algorithm"] == source)
            rows.append({**base, "algorithm": algorithm, "size": base["extra"].get(key),
                         "note": f"same run as {source}, before the margin"})
            continue
        if algorithm.endswith(", isolated"):  # its trials are fresh children of this process
            rows.append(run_algorithm(w, algorithm))
        elif algorithm.endswith(", confirmed"):
            # a fresh process that may have children (the confirmed trials)
            rows.append(_in_fresh_process(ctx, run_algorithm, w, algorithm))
        else:
            with ctx.Pool(1, maxtasksperchild=1) as pool:  # a fresh process per search
                rows.append(pool.apply(run_algorithm, (w, algorithm)))
        r = rows[-1]
        print(f"  {algorithm}: {r['size']} in {r['trials']} trials, {r['seconds']:.1f} s",
              file=sys.stderr, flush=True)
    fresh = Fresh(w)
    t0 = time.perf_counter()
    found = sorted({r["size"] for r in rows if r["size"] is not None})
    for size in found:
        fresh.check(size)
    ran = [s for s in found if fresh.runs[s][0]]
    brute = fresh.brute_force(max(ran) if ran else max(1, min(found, default=2) - 1))
    brute["seconds"] = time.perf_counter() - t0
    for r in rows:
        r["fresh_runs"] = fresh.runs.get(r["size"]) if r["size"] is not None else None
        r["distance"] = brute["max"] - r["size"] if r["size"] is not None else None
    print(f"  brute force: max {brute['max']} (confirmed {brute['confirmed']}, "
          f"{brute['seconds']:.1f} s with the checks)", file=sys.stderr, flush=True)
    return {"label": w.label, "budget_bytes": w.budget_bytes, "max_size": w.max_size,
            "peer_start": w.peer_start, "brute_force": brute, "rows": rows}


def _ran_fresh(runs: list[bool] | None) -> str:
    if not runs:
        return "-"
    return "yes" if all(runs) else "no" if not any(runs) else f"{sum(runs)}/{len(runs)}"


def _times(ratio: float | None, base: str) -> str:
    return f" ({ratio:.2f}x {base.removeprefix('oomguard ')})" if ratio is not None else ""


def summary(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per algorithm: workloads found exactly (distance 0), found sizes that ran fresh,
    total trials and seconds, and both totals as multiples of the E10 routine's in the
    same mode (an isolated row against E10 isolated, every other row against E10)."""
    out = []
    for algorithm in algorithms():
        rows = [r for res in results.values() for r in res["rows"] if r["algorithm"] == algorithm]
        out.append({"algorithm": algorithm, "exact": sum(r["distance"] == 0 for r in rows),
                    "workloads": len(rows), "trials": sum(r["trials"] for r in rows),
                    "seconds": sum(r["seconds"] for r in rows),
                    "ran_fresh": sum(bool(r["fresh_runs"]) and all(r["fresh_runs"])
                                     for r in rows)})
    by_name = {s["algorithm"]: s for s in out}
    for s in out:
        s["vs"] = E10_ISOLATED if s["algorithm"].endswith(", isolated") else "oomguard e10"
        for key, base in (("e10", by_name.get(s["vs"])),):
            s[f"trials_vs_{key}"] = s["trials"] / base["trials"] if base and base["trials"] \
                else None
            s[f"seconds_vs_{key}"] = s["seconds"] / base["seconds"] if base and base["seconds"] \
                else None
    return out


def table(results: dict[str, dict[str, Any]], totals: list[dict[str, Any]]) -> str:
    """The markdown table: a row per workload and algorithm, then a summary row per
    algorithm (workload "all")."""
    head = ("workload", "max (fresh)", "algorithm", "trials", "seconds", "size found",
            "runs fresh", "distance", "note")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for res in results.values():
        brute = res["brute_force"]
        mark = "" if brute["confirmed"] else " (unconfirmed: " + ", ".join(
            f"{n} ran {sum(v)}/{len(v)}" for n, v in brute["runs"].items()) + ")"
        for r in res["rows"]:
            cells = [res["label"], f"{brute['max']}{mark}", r["algorithm"], str(r["trials"]),
                     f"{r['seconds']:.2f}", "-" if r["size"] is None else str(r["size"]),
                     _ran_fresh(r["fresh_runs"]),
                     "-" if r["distance"] is None else str(r["distance"]),
                     str(r["note"]).replace("|", "/")]
            lines.append("| " + " | ".join(cells) + " |")
    for s in totals:
        n = s["workloads"]
        cells = [f"**all {n}**", "", f"**{s['algorithm']}**",
                 f"{s['trials']}{_times(s['trials_vs_e10'], s['vs'])}",
                 f"{s['seconds']:.1f}{_times(s['seconds_vs_e10'], s['vs'])}", "",
                 f"{s['ran_fresh']}/{n}", f"0 on {s['exact']}/{n}", ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smaller workloads and budgets (about 6 minutes on 2 cores)")
    parser.add_argument("--only", choices=sorted(workloads()), action="append",
                        help="run only this workload (repeatable)")
    parser.add_argument("--row", choices=algorithms(), action="append",
                        help="run only this row (repeatable; the E10 and guided rows of the "
                             "same mode, the ratios' bases, always run)")
    parser.add_argument("--out", help="write the table's data to this JSON file")
    args = parser.parse_args()
    if args.row:
        global ROWS
        isolated = any(r.endswith(", isolated") for r in args.row)
        ROWS = {*args.row, "oomguard e10", "oomguard guided",
                *((E10_ISOLATED, ISOLATED) if isolated else ())}
    t0 = time.perf_counter()
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    forkserver_context(PRELOAD)
    ctx = mp.get_context("forkserver")
    results = {}
    for key, w in workloads(args.quick).items():
        if args.only and key not in args.only:
            continue
        print(f"{w.label} (budget {w.budget_bytes / 2**20:.1f} MiB):", file=sys.stderr,
              flush=True)
        results[key] = run_workload(w, ctx)
    wall = time.perf_counter() - t0
    totals = summary(results)
    print(table(results, totals))
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"\nwall time {wall:.0f} s ({'quick' if args.quick else 'full'}, {os.cpu_count()} "
          "CPUs" + (f", load average {load_start:.1f} at the start, {load[0]:.1f} at the end)"
                    if load and load_start is not None else ")"))
    if args.out:
        atomic_write_json(args.out, {"quick": args.quick, "wall_seconds": wall, "load": load,
                                     "workloads": results, "summary": totals})


if __name__ == "__main__":
    main()
