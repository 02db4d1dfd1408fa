"""Persister: every submitted fragment is persisted exactly once, whatever the store does first."""

from __future__ import annotations

import hashlib
import logging
import os
from collections import Counter
from pathlib import Path

import pytest

from tests.support.waiting import wait_until
from tidings.fragment import Fragment, Persister, PersisterStatistics, store_for
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import UsageError

J = "examples/persist"


def _local(tmp_path: Path, begin: int, size: int, codec: int = pb.NONE) -> tuple[Fragment, str]:
    payload = os.urandom(size)
    path = tmp_path / f"spool-{begin}"
    path.write_bytes(payload)
    return Fragment(J, begin, begin + size, hashlib.sha1(payload).digest(), codec), str(path)


async def test_failing_store_is_retried_until_each_fragment_persists_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The store's root is a plain file, so no folder can be made under it (root ignores chmod).
    root = tmp_path / "store"
    root.write_bytes(b"in the way")
    url = f"file://{root}/"
    calls: Counter[str] = Counter()
    got: list[tuple[Fragment, str]] = []

    def on_persisted(frag: Fragment, path: str) -> None:
        calls[frag.content_name()] += 1
        got.append((frag, path))

    persister = Persister(on_persisted, concurrency=2, initial_backoff=0.01, max_backoff=0.05)
    frags = [_local(tmp_path, i * 1000, 1000, codec) for i, codec in enumerate([pb.NONE, pb.GZIP, pb.ZSTANDARD])]
    with caplog.at_level(logging.WARNING, logger="tidings.fragment.persister"):
        await persister.start()
        for f, p in frags:
            persister.submit(f, p, url)
        await wait_until(lambda: persister.statistics().failures >= 2 * len(frags))
        assert got == [] and persister.statistics().queued == len(frags)
        assert not await persister.drain(timeout=0.05), "nothing can persist while the store is broken"

        root.unlink()  # the store becomes usable
        assert await persister.drain(timeout=10)

    assert calls == Counter({f.content_name(): 1 for f, _ in frags})
    assert sorted(got, key=lambda e: e[0].begin) == [(f.with_store(url), p) for f, p in frags]
    assert sorted(f.content_name() for f in store_for(url).list(J)) == sorted(f.content_name() for f, _ in frags)
    stats = persister.statistics()
    assert stats == PersisterStatistics(queued=0, persisted=len(frags), failures=stats.failures, uploaded=len(frags))
    assert frags[0][0].content_path() in caplog.text, "the warning names the fragment"
    await persister.aclose()


async def test_on_persisted_error_does_not_stop_the_loop(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}/"
    seen: list[int] = []

    def on_persisted(frag: Fragment, path: str) -> None:
        seen.append(frag.begin)
        if frag.begin == 0:
            raise RuntimeError("callback bug")

    persister = Persister(on_persisted, concurrency=1)
    await persister.start()
    for begin in (0, 10):
        persister.submit(*_local(tmp_path, begin, 10), url)
    assert await persister.drain(timeout=10)
    assert seen == [0, 10]
    assert persister.statistics() == PersisterStatistics(queued=0, persisted=2, failures=0, uploaded=2)
    await persister.aclose()


async def test_drain_before_start_times_out_and_closed_persister_refuses(tmp_path: Path) -> None:
    persister = Persister(lambda f, p: None)
    assert await persister.drain(timeout=0), "an empty persister is drained"
    persister.submit(*_local(tmp_path, 0, 10), f"file://{tmp_path / 'store'}/")
    assert not await persister.drain(timeout=0.01)
    await persister.aclose()
    with pytest.raises(UsageError, match="closed"):
        persister.submit(*_local(tmp_path, 10, 10), f"file://{tmp_path / 'store'}/")
    with pytest.raises(UsageError):
        await persister.start()


async def test_a_replicas_delayed_fragment_is_not_uploaded_again(tmp_path: Path) -> None:
    """Only the primary uploads at once; a replica waits, then finds it in the store and skips it."""
    url = f"file://{tmp_path / 'store'}/"
    done: list[Fragment] = []
    primary = Persister(lambda f, p: done.append(f))
    replica = Persister(lambda f, p: done.append(f))
    await primary.start()
    await replica.start()
    frag, path = _local(tmp_path, 0, 100)
    replica.submit(frag, path, url, delay=3600)  # an hour: released only by drain()
    primary.submit(frag, path, url)
    assert await primary.drain(timeout=10)
    assert replica.statistics().queued == 1, "the replica still waits"
    assert await replica.drain(timeout=10), "drain releases delayed fragments at once"
    assert primary.statistics().uploaded == 1
    assert replica.statistics() == PersisterStatistics(queued=0, persisted=1, failures=0, uploaded=0)
    assert len(done) == 2
    assert [f.content_name() for f in store_for(url).list(J)] == [frag.content_name()]
    # A replica's fragment the store does not hold is uploaded after its delay.
    other, other_path = _local(tmp_path, 100, 50)
    replica.submit(other, other_path, url, delay=0.01)
    await wait_until(lambda: replica.statistics().uploaded == 1)
    await primary.aclose()
    await replica.aclose()
