"""The LogPlayer model (`models/logplayer.pml`) checked by spin, as `models/check.py` runs it.

The correct model must pass safety (every target receives its entries in order, no duplicate,
none skipped; no deadlock) and liveness (once the bounded faults stop, every target acknowledges
every entry); the paper's first draft without terms must fail both, which shows the checks can
fail. `python models/check.py --size large` runs larger bounds.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

_PATH = Path(__file__).parents[2] / "models" / "check.py"
_spec = importlib.util.spec_from_file_location("models_check", _PATH)
assert _spec is not None and _spec.loader is not None
check = importlib.util.module_from_spec(_spec)
sys.modules["models_check"] = check
_spec.loader.exec_module(check)


def test_spin_and_gcc_are_installed() -> None:
    assert check.tools_missing() == [], "run `make install` (it installs Debian's spin)"


@pytest.fixture(scope="module")
def verified() -> Iterator[dict[str, Future]]:
    """Every check's verifier, started at once on a core each (they are independent CPU-bound processes:
    one at a time left a core idle for a minute and a half)."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = {case.name: pool.submit(check.run, case) for case in check.SMALL}
        yield futures
        for f in futures.values():
            f.cancel()  # (a test failed before its own: the rest need not run)


@pytest.mark.parametrize("case", check.SMALL, ids=lambda c: c.name)
def test_model(case, verified: dict[str, Future]) -> None:
    result = verified[case.name].result()
    assert "max search depth too small" not in result.output
    assert result.states > 0
    if not case.violation:
        assert result.errors == 0, result.output
        return
    assert result.errors > 0, f"spin found no violation in {case.name}:\n{result.output}"
    expected = "acceptance cycle" if case.liveness else "assertion violated"
    assert expected in result.output, result.output


def test_a_verifier_stopped_by_its_bounds_is_no_pass() -> None:
    """pan prints "errors: 0" also when it ran out of memory: that must not read as verified."""
    with pytest.raises(check.IncompleteError, match="stopped early"):
        check.run(check.SMALL[0], memory_mb=64)


def test_an_interrupted_verifier_is_no_pass() -> None:
    """pan stopped by SIGINT or a time limit prints "errors: 0" and exits 0: that is no pass."""
    output = (
        "Interrupted\nWarning: Search not completed\n"
        "State-vector 96 byte, depth reached 9, errors: 0\n  3600000 states, stored\n"
    )
    with pytest.raises(check.IncompleteError, match="Search not completed"):
        check.result_of(check.SMALL[0], output, 3.0)
