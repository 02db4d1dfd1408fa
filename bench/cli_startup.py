"""CLI start-up: medians of 9 runs of `tidings --version`, `--help`, `journals list` (against a
private 1-broker cluster) and `import tidings.client`, beside a bare interpreter. Prints JSON lines.

Run as an installed CLI runs: bytecode written and read (PYTHONDONTWRITEBYTECODE unset; one run
first to write it), else every run compiles the project's modules again."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tidings.cluster import LocalCluster

RUNS = 9
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def median_seconds(argv: list[str]) -> float:
    subprocess.run(argv, capture_output=True, check=True, env=ENV)  # (writes the bytecode)
    took = []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        subprocess.run(argv, capture_output=True, check=True, env=ENV)
        took.append(time.perf_counter() - t0)
    return statistics.median(took)


def main() -> None:
    tidings = str(Path(sys.executable).with_name("tidings"))
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(brokers=1, zones=1, data_dir=Path(tmp)) as lc:
        cases = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "import tidings.client": [sys.executable, "-c", "import tidings.client"],
            "tidings --version": [tidings, "--version"],
            "tidings --help": [tidings, "--help"],
            "tidings journals list": [tidings, "journals", "list", "--broker", lc.endpoints[0]],
        }
        for name, argv in cases.items():
            print(json.dumps({"bench": "cli_startup", "case": name, "median_s": round(median_seconds(argv), 3)}))


if __name__ == "__main__":
    main()
