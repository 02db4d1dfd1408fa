"""Model-check `logplayer.pml` with spin: safety (assertions, deadlocks) and liveness (LTL).

    python models/check.py [--size small|large] [--only NAME]

prints one JSON line per check (name, defines, errors, states, seconds) and exits 1 if a check
did not end as expected (the correct model must pass, the broken variants must fail).
`tests/logplayer/test_models.py` runs the small set; the large set takes tens of minutes.

Each check runs `spin -a` in a fresh directory, compiles spin's verifier with gcc and runs it:
safety with `-DSAFETY -DNOCLAIM` (assertions and invalid end states), liveness with the LTL
claim `delivered` under weak fairness (`pan -a -f`). `-DCOLLAPSE` compresses stored states.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = Path(__file__).with_name("logplayer.pml")


@dataclasses.dataclass(frozen=True)
class Check:
    """One verification run: the model's parameters, and whether a violation is expected."""

    name: str
    defines: dict[str, int | bool]
    liveness: bool = False
    violation: bool = False
    pan_flags: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Result:
    check: Check
    errors: int
    states: int
    seconds: float
    output: str

    @property
    def as_expected(self) -> bool:
        return (self.errors > 0) == self.check.violation

    def line(self) -> str:
        c = self.check
        return json.dumps(
            {
                "check": c.name,
                "defines": c.defines,
                "property": "liveness" if c.liveness else "safety",
                "expect": "violation" if c.violation else "pass",
                "errors": self.errors,
                "states": self.states,
                "seconds": round(self.seconds, 1),
                "as_expected": self.as_expected,
            }
        )


# The paper's granularity (one step per PlusCal label, locks between) with one target, as the
# paper checked; tidings' granularity (one step per operation, as on one asyncio loop) with two
# targets; and the paper's first draft without terms, which must fail both properties.
SMALL = (
    Check("paper-safety", {"T": 1, "N": 4, "F": 2}),
    Check("paper-liveness", {"T": 1, "N": 3, "F": 2}, liveness=True),
    Check("paper-two-targets-safety", {"T": 2, "N": 2, "F": 1, "FT": 1}),
    Check("asyncio-safety", {"COARSE": True, "T": 2, "N": 3, "F": 2, "FT": 1}),
    Check("asyncio-liveness", {"COARSE": True, "T": 2, "N": 3, "F": 1, "FT": 1}, liveness=True),
    # -E: past the stuck entry spin would report first, to the duplicate delivery.
    Check("no-terms-safety", {"NO_TERMS": True, "T": 1, "N": 3, "F": 2}, violation=True, pan_flags=("-E",)),
    Check("no-terms-liveness", {"NO_TERMS": True, "T": 1, "N": 3, "F": 2}, liveness=True, violation=True),
)
LARGE = (
    *SMALL,
    Check("paper-safety-large", {"T": 1, "N": 5, "F": 3}),
    Check("paper-liveness-large", {"T": 1, "N": 4, "F": 2}, liveness=True),
    Check("paper-two-targets-liveness", {"T": 2, "N": 2, "F": 1, "FT": 1}, liveness=True),
    Check("asyncio-two-failing-safety", {"COARSE": True, "T": 2, "N": 3, "F": 1}),
)
SIZES = {"small": SMALL, "large": LARGE}


# What pan prints when it stopped before exploring every state: its "errors: 0" then proves nothing.
# "Search not completed" is printed on every early stop (memory, SIGINT, a -Q time limit); a
# depth cut-off prints only its own message (review 32).
INCOMPLETE = ("Search not completed", "reached -DMEMLIM bound", "out of memory", "max search depth too small")


class IncompleteError(RuntimeError):
    """spin's verifier stopped early (memory or depth bound): the check neither passed nor failed."""


def tools_missing() -> list[str]:
    """The programs a check needs that are not installed (`make install` installs them)."""
    return [tool for tool in ("spin", "gcc") if shutil.which(tool) is None]


def run(check: Check, memory_mb: int = 8192) -> Result:
    """Generate, compile and run spin's verifier for one check; return what it reported."""
    flags = [f"-D{k}" if v is True else f"-D{k}={int(v)}" for k, v in check.defines.items()]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tidings-spin-") as tmp:
        work = Path(tmp)
        shutil.copy(MODEL, work / MODEL.name)
        _run(["spin", *flags, "-a", MODEL.name], work)
        cflags = ["-O2", "-w", "-DCOLLAPSE", f"-DMEMLIM={memory_mb}"]
        cflags += ["-DNFAIR=3"] if check.liveness else ["-DSAFETY", "-DNOCLAIM"]
        _run(["gcc", *cflags, "-o", "pan", "pan.c"], work)
        pan = ["./pan", "-m200000", *check.pan_flags] + (["-a", "-f"] if check.liveness else [])
        output = _run(pan, work, check=False)
    return result_of(check, output, time.monotonic() - started)


def result_of(check: Check, output: str, seconds: float) -> Result:
    """What pan's `output` says of `check`; IncompleteError when it stopped before the end."""
    errors = _number(r"errors: (\d+)", output)
    stopped = [reason for reason in INCOMPLETE if reason in output]
    if stopped and errors == 0:
        raise IncompleteError(f"{check.name}: pan stopped early ({stopped[0]}); raise its bounds:\n{output}")
    return Result(check, errors, _number(r"(\d+) states, stored", output), seconds, output)


def _run(argv: list[str], cwd: Path, check: bool = True) -> str:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr or done.stdout}")
    return done.stdout + done.stderr


def _number(pattern: str, text: str) -> int:
    found = re.search(pattern, text)
    if found is None:
        raise RuntimeError(f"spin's verifier printed no {pattern!r}:\n{text}")
    return int(found.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--only", help="run only the check of this name")
    args = parser.parse_args()
    if missing := tools_missing():
        print(f"error: {', '.join(missing)} not installed; run `make install`", file=sys.stderr)
        return 2
    ok = True
    for check in SIZES[args.size]:
        if args.only and check.name != args.only:
            continue
        try:
            result = run(check)
        except IncompleteError as e:
            print(json.dumps({"check": check.name, "incomplete": str(e).splitlines()[0]}), flush=True)
            ok = False
            continue
        print(result.line(), flush=True)
        ok &= result.as_expected
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
