"""Start-up cost of the command line, measured side by side in one run.

Each command runs ``--repeat`` times in a fresh interpreter (interleaved, so
load on the machine hits every row alike); the table shows the median wall
seconds and the ratio to ``import torch``, the cost the light commands avoid.
Goal: ``oomguard --help`` under 0.5 s.

    python bench/bench_startup.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent
ROWS = {
    "python -c pass (interpreter)": [sys.executable, "-c", "pass"],
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    "python -c 'import oomguard'": [sys.executable, "-c", "import oomguard"],
    "oomguard --help": [str(BIN / "oomguard"), "--help"],
    "oomguard probe": [str(BIN / "oomguard"), "probe"],
    "oomguard metrics": [str(BIN / "oomguard"), "metrics"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per command (5)")
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in ROWS}
    for _ in range(args.repeat):
        for name, cmd in ROWS.items():
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, capture_output=True)
            times[name].append(time.perf_counter() - t0)
    ref = statistics.median(times["python -c 'import torch'"])
    print(f"| command | median s ({args.repeat} runs) | x import torch |")
    print("|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.3f} | {med / ref:.2f} |")


if __name__ == "__main__":
    main()
