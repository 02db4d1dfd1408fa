"""`--ab REF [--ab-rounds N]`: a benchmark's measurements on this tree and on commit REF, interleaved in
one run, so a change to the data path shows its before and after side by side.

Each round runs the script once per side as a child process with the same arguments: this tree's
script over this tree's package, and REF's own script over REF's package (a `git worktree` of REF made
for the run and removed after; its `src` first on PYTHONPATH, which the brokers, consumers and clients
the script starts inherit). The order alternates from round to round: on this VM the second slot of a
round runs slower, and whole runs minutes apart drift by more than most changes buy. Every JSON line
is printed again tagged `ab` (`head` or REF) and `round`; then, per measurement and figure, one line
`{"test": "ab", ...}` with both sides' values and the change of their medians (`change_pct`, head
against REF: positive is more of the figure on head, which is worse for a latency or CPU figure).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIGURE_KEYS = ("median_us", "p99_us", "msgs_per_s", "mb_per_s")  # compared first, in this order


def requested(argv: list[str]) -> tuple[str, int, list[str]] | None:
    """(REF, rounds, the script's own arguments) if `argv` asks for an A/B run, else None."""
    if "--ab" not in argv:
        return None
    args, ref, rounds = list(argv), "", 2
    at = args.index("--ab")
    if at + 1 >= len(args) or args[at + 1].startswith("-"):
        raise SystemExit("--ab needs a commit to compare with: --ab REF (a branch, tag or hash)")
    ref = args[at + 1]
    del args[at : at + 2]
    if "--ab-rounds" in args:
        at = args.index("--ab-rounds")
        try:
            rounds = int(args[at + 1])
        except (IndexError, ValueError):
            raise SystemExit("--ab-rounds needs a whole number of rounds, e.g. --ab-rounds 3") from None
        del args[at : at + 2]
    if rounds < 1:
        raise SystemExit("--ab-rounds must be at least 1")
    return ref, rounds, args


@contextlib.contextmanager
def worktree(ref: str) -> Iterator[Path]:
    """A checkout of `ref` in a temporary folder (removed after, whatever happens)."""
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
                         capture_output=True, text=True)  # fmt: skip
    if rev.returncode != 0:
        raise SystemExit(f"--ab {ref}: not a commit of {REPO} (see `git log --oneline`)")
    with tempfile.TemporaryDirectory(prefix="tidings-ab-") as tmp:
        tree = Path(tmp) / "tree"
        add = ["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(tree), rev.stdout.strip()]
        subprocess.run(add, check=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)


def _side(tree: Path, script: str, args: list[str]) -> list[dict]:
    """One run of `script` (a path under bench/) from `tree`, over `tree`'s package: its JSON lines."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "src"), str(tree / "bench")])}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    proc = subprocess.run([sys.executable, str(tree / "bench" / script), *args], env=env, capture_output=True,
                          text=True, cwd=tree)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"{script} at {tree} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    recs = []
    for line in proc.stdout.splitlines():
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if isinstance(rec, dict):
                recs.append(rec)
    return recs


def _identity(rec: dict) -> tuple:
    """What names a measurement (a client transport of "tidings" too: older commits measured over their
    default without naming it)."""
    return tuple(
        sorted(
            (k, v)
            for k, v in rec.items()
            if not _is_figure(k, v) and k not in ("ab", "round") and (k, v) != ("transport", "tidings")
        )
    )


SETTINGS = ("replicas", "payload_bytes", "count", "window", "slices", "round")  # numbers that name a measurement


def _is_figure(key: str, value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and key not in SETTINGS


def run(script: str, ref: str, rounds: int, args: list[str]) -> None:
    """The A/B run of bench/`script` with `args`: tagged lines, then the comparison lines."""
    sides: dict[str, list[dict]] = {"head": [], ref: []}
    with worktree(ref) as old:
        trees = {"head": REPO, ref: old}
        for i in range(rounds):
            for side in ("head", ref) if i % 2 == 0 else (ref, "head"):
                for rec in _side(trees[side], script, args):
                    rec.update(ab=side, round=i)
                    print(json.dumps(rec), flush=True)
                    sides[side].append(rec)
    values: dict[tuple, dict[str, dict[str, list[float]]]] = {}
    for side, recs in sides.items():
        for rec in recs:
            per = values.setdefault(_identity(rec), {})
            for key, value in rec.items():
                if _is_figure(key, value):
                    per.setdefault(key, {"head": [], ref: []})[side].append(value)
    for ident, figures in values.items():
        ordered = sorted(figures, key=lambda k: (FIGURE_KEYS.index(k) if k in FIGURE_KEYS else len(FIGURE_KEYS), k))
        for key in ordered:
            head, base = figures[key]["head"], figures[key][ref]
            if not head or not base:
                continue
            mh, mb = statistics.median(head), statistics.median(base)
            change = round((mh / mb - 1) * 100, 1) if mb else None
            rec = {**dict(ident), "test": "ab", "measure": dict(ident).get("test"), "figure": key}
            print(json.dumps({**rec, "head": head, ref: base, "change_pct": change}), flush=True)


def main_if_requested(script: str) -> None:
    """At the top of a benchmark's main(): run the A/B instead and exit, if `--ab` was given."""
    asked = requested(sys.argv[1:])
    if asked is not None:
        ref, rounds, args = asked
        run(script, ref, rounds, args)
        raise SystemExit(0)
