"""oomguard's search strategies against other libraries' batch-size finders, in one table.

For each workload (bench/peer_workloads.py) and its CPU budget, every algorithm runs
its own search in a fresh process (forkserver), with real OOMs: the workload is warmed
up, the budget entered, and each step run through oomguard's trial runner. Rows:
oomguard's E10 routine (``E10(32, 8)``), ``Doubling(32)``, ``Guided()`` when
``oomguard.engine.core.strategies`` has it, and the peers of bench/peer_algorithms.py.

Columns: trials (sizes tried; Lightning runs 3 steps per trial: ``calls``), seconds
(the search after the warm-up, measured), the size found, whether that size ran again
in a fresh process under the same budget, and its distance from the brute-force
maximum m (m - found: positive is below the maximum, negative above it). The maximum is
found in fresh processes only: galloping from the largest found size that ran fresh,
then bisection, until m runs and m + 1 runs out of memory; both are run once more to
confirm (a table's "unconfirmed" lists what the second runs gave). Warm-up seconds are
measured and shown apart. A summary line per algorithm counts the workloads it found
exactly (distance 0) and totals its trials and seconds, also as fractions of E10's.

    .venv/bin/python bench/peers.py [--quick] [--only WORKLOAD] [--out peers.json]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from peer_algorithms import DERIVED, PEERS, run_peer
from peer_workloads import PRELOAD, Workload, workloads

from oomguard.engine.core import strategies
from oomguard.engine.core.atomic import atomic_write_json
from oomguard.engine.core.budget import return_freed_memory_to_os
from oomguard.engine.core.isolate import IsolatedRunner, forkserver_context
from oomguard.engine.core.search import SearchConfig, search
from oomguard.engine.errors import SearchFailed


def _oomguard_strategies() -> dict[str, Callable[[], Any]]:
    found = {"oomguard e10": lambda: strategies.E10(start=32, step=8),
             "oomguard doubling": lambda: strategies.Doubling(start=32)}
    if hasattr(strategies, "Guided"):
        found["oomguard guided"] = lambda: strategies.Guided()  # type: ignore[attr-defined]
    return found


def algorithms() -> list[str]:
    """Row names in table order (derived rows come after the row whose run they share)."""
    names = list(_oomguard_strategies())
    for peer in PEERS:
        names += [peer, *(d for d, (source, _) in DERIVED.items() if source == peer)]
    return names


def _search(key: str, algorithm: str, quick: bool) -> dict[str, Any]:
    """Runs in a fresh child: warm up, then one search under the budget -> a row."""
    w = workloads(quick)[key]
    fn = w.make()
    return_freed_memory_to_os()  # as search() does before a warm-up
    t0 = time.perf_counter()
    if hasattr(fn, "warmup"):
        fn.warmup()
    t1 = time.perf_counter()
    row: dict[str, Any] = {"algorithm": algorithm, "warmup_seconds": t1 - t0, "note": "",
                           "extra": {}}
    try:
        if algorithm in PEERS:
            outcome, runner = run_peer(algorithm, fn, w)
            trials, calls = runner.trials, runner.calls
            row.update(size=outcome.size, note=outcome.note, extra=outcome.extra)
        else:
            config = SearchConfig(strategy=_oomguard_strategies()[algorithm](),
                                  budget=w.budget_bytes, max_size=w.max_size)
            try:
                result = search(fn, config)
            except SearchFailed as exc:
                result = exc.result
            trials, calls = result.trials, len(result.trials)
            row.update(size=result.max_ok, note=result.stopped_because)
    except Exception as exc:  # a row that fails says why; the bench goes on
        traceback.print_exc()
        trials, calls = [], 0
        row.update(size=None, note=f"error: {type(exc).__name__}: {exc}"[:200])
    row.update(seconds=time.perf_counter() - t1, trials=len(trials), calls=calls,
               tried=[[t.size, t.ok, round(t.seconds, 4)] for t in trials])
    return row


def _boundary(check: Callable[[int], bool], seen: dict[int, list[bool]], hint: int,
              max_size: int, step_downs: int = 4) -> dict[str, Any]:
    """The largest size m that runs in a fresh process while m + 1 does not.

    ``check(size)`` runs one fresh-process trial; ``seen`` holds the outcomes of every
    fresh run so far, by size (reused, then extended). Gallops from ``hint`` to a
    bracket and bisects it on each size's first outcome; then runs m and m + 1 once
    more each. If m fails its second run, m steps down (at most ``step_downs`` times)
    to the largest size that ran twice. ``confirmed``: m ran on both runs and m + 1
    ran out of memory on both.
    """
    def ok(size: int) -> bool:
        if size not in seen:
            seen[size] = [check(size)]
        return seen[size][0]

    def twice(size: int) -> list[bool]:
        ok(size)
        while len(seen[size]) < 2:
            seen[size].append(check(size))
        return seen[size]

    before = sum(map(len, seen.values()))
    lo: int | None = None
    hi: int | None = None
    step, size = 1, max(1, min(hint, max_size))
    if ok(size):
        lo = size
        while lo < max_size:
            size = min(lo + step, max_size)
            if not ok(size):
                hi = size
                break
            lo, step = size, step * 2
    else:
        hi = size
        while lo is None and hi > 1:
            size = max(1, hi - step)
            if ok(size):
                lo = size
            else:
                hi, step = size, step * 2
    while lo is not None and hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    for _ in range(step_downs):
        if lo is None or all(twice(lo)):
            break
        lo, hi = (lo - 1 if lo > 1 else None), lo
    confirmed = (lo is not None and all(twice(lo))
                 and (hi is None or not any(twice(hi))))
    runs = {str(n): seen[n] for n in (lo, hi) if n is not None and n in seen}
    return {"max": lo or 0, "first_oom": hi, "confirmed": confirmed, "runs": runs,
            "fresh_runs": sum(map(len, seen.values())) - before}


def _fresh_checker(w: Workload) -> Callable[[int], bool]:
    runner = IsolatedRunner(w.make(), device="cpu", budget=w.budget_bytes)

    def check(size: int) -> bool:
        return bool(runner(size).ok)

    return check


def run_workload(w: Workload, quick: bool, ctx: Any) -> dict[str, Any]:
    """Every algorithm's row on ``w``, the fresh-process checks, the brute-force maximum."""
    rows: list[dict[str, Any]] = []
    for algorithm in algorithms():
        if algorithm in DERIVED:
            source, field = DERIVED[algorithm]
            base = next(r for r in rows if r["algorithm"] == source)
            rows.append({**base, "algorithm": algorithm, "size": base["extra"].get(field),
                         "note": f"same run as {source}, before the margin"})
            continue
        with ctx.Pool(1, maxtasksperchild=1) as pool:  # a fresh process per search
            rows.append(pool.apply(_search, (w.key, algorithm, quick)))
        r = rows[-1]
        print(f"  {algorithm}: {r['size']} in {r['trials']} trials, {r['seconds']:.1f} s",
              file=sys.stderr, flush=True)
    check = _fresh_checker(w)
    t0 = time.perf_counter()
    fresh: dict[int, bool] = {}
    for size in sorted({r["size"] for r in rows if r["size"] is not None}):
        fresh[size] = check(size)
    for r in rows:
        r["fresh_ok"] = fresh.get(r["size"]) if r["size"] is not None else None
    ran = [s for s, ok in fresh.items() if ok]
    hint = max(ran) if ran else min(fresh, default=32)
    brute = _boundary(check, {s: [ok] for s, ok in fresh.items()}, hint, w.max_size)
    brute["seconds"] = time.perf_counter() - t0
    for r in rows:
        r["distance"] = brute["max"] - r["size"] if r["size"] is not None else None
    print(f"  brute force: max {brute['max']} (confirmed {brute['confirmed']}, "
          f"{brute['fresh_runs']} more fresh runs, {brute['seconds']:.1f} s with the checks)",
          file=sys.stderr, flush=True)
    return {"label": w.label, "budget_bytes": w.budget_bytes, "max_size": w.max_size,
            "peer_start": w.peer_start, "brute_force": brute, "rows": rows}


def _yes_no(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "no")


def table(results: dict[str, dict[str, Any]]) -> str:
    """The markdown table: one row per workload and algorithm."""
    head = ("workload", "max (fresh)", "algorithm", "trials", "calls", "seconds", "warm-up s",
            "size found", "runs fresh", "distance", "note")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for res in results.values():
        brute = res["brute_force"]
        mark = "" if brute["confirmed"] else " (unconfirmed: " + ", ".join(
            f"{n} ran {sum(v)}/{len(v)}" for n, v in brute["runs"].items()) + ")"
        for r in res["rows"]:
            cells = [res["label"], f"{brute['max']}{mark}", r["algorithm"], str(r["trials"]),
                     str(r["calls"]), f"{r['seconds']:.2f}", f"{r['warmup_seconds']:.2f}",
                     "-" if r["size"] is None else str(r["size"]), _yes_no(r["fresh_ok"]),
                     "-" if r["distance"] is None else str(r["distance"]),
                     r["note"].replace("|", "/")]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per algorithm: workloads found exactly (distance 0), total trials and seconds, and
    both totals as fractions of the E10 routine's."""
    out = []
    for algorithm in algorithms():
        rows = [r for res in results.values() for r in res["rows"] if r["algorithm"] == algorithm]
        out.append({"algorithm": algorithm, "exact": sum(r["distance"] == 0 for r in rows),
                    "workloads": len(rows), "trials": sum(r["trials"] for r in rows),
                    "seconds": sum(r["seconds"] for r in rows),
                    "ran_fresh": sum(bool(r["fresh_ok"]) for r in rows)})
    e10 = next(s for s in out if s["algorithm"] == "oomguard e10")
    for s in out:
        s["trials_vs_e10"] = s["trials"] / e10["trials"] if e10["trials"] else None
        s["seconds_vs_e10"] = s["seconds"] / e10["seconds"] if e10["seconds"] else None
    return out


def _summary_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for s in rows:
        ratio = (f" ({s['trials_vs_e10']:.2f}x e10 trials, {s['seconds_vs_e10']:.2f}x e10 "
                 "seconds)" if s["trials_vs_e10"] is not None else "")
        lines.append(f"- {s['algorithm']}: distance 0 on {s['exact']}/{s['workloads']} "
                     f"workloads, ran fresh on {s['ran_fresh']}/{s['workloads']}, "
                     f"{s['trials']} trials, {s['seconds']:.1f} s{ratio}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smaller workloads and budgets (about 5 minutes on 2 cores)")
    parser.add_argument("--only", choices=sorted(workloads(False)), action="append",
                        help="run only this workload (repeatable)")
    parser.add_argument("--out", help="write the table's data to this JSON file")
    args = parser.parse_args()
    t0 = time.perf_counter()
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    forkserver_context(PRELOAD)
    ctx = mp.get_context("forkserver")
    if "oomguard guided" not in algorithms():
        print("note: oomguard.engine.core.strategies has no Guided yet: its row is left out")
    chosen = {k: w for k, w in workloads(args.quick).items() if not args.only or k in args.only}
    results = {}
    for key, w in chosen.items():
        print(f"{w.label} (budget {w.budget_bytes / 2**20:.1f} MiB):", file=sys.stderr,
              flush=True)
        results[key] = run_workload(w, args.quick, ctx)
    wall = time.perf_counter() - t0
    rows = summary(results)
    print(table(results))
    print()
    print("\n".join(_summary_lines(rows)))
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"\nwall time {wall:.0f} s ({'quick' if args.quick else 'full'}, {os.cpu_count()} "
          f"CPUs" + (f", load average {load_start:.1f} at start, {load[0]:.1f} at the end)"
                     if load else ")"))
    if args.out:
        atomic_write_json(args.out, {"quick": args.quick, "wall_seconds": wall, "load": load,
                                     "workloads": results, "summary": rows})


if __name__ == "__main__":
    main()
