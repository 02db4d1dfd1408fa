"""An application's hooks are called as docs/shards.md says, and a use that would lose messages is
refused with a clear error instead (DESIGN.md invariant 8):

- a `consume_message` that returns an awaitable without being a coroutine function (an `async def`
  under a plain decorator) is awaited, not dropped while the checkpoint moves past its message;
- an `on_garbage` that is a coroutine function is refused (it cannot be awaited mid-decode: raising
  there, to fail the shard, would be lost);
- publishing committed to a journal holding the transaction's uncommitted messages, or anything to
  a journal whose ACK is built but not yet written (from `finished_txn`), is refused: read-committed
  readers would lose those messages (the ACK, or the committed message, rolls them back).

Real etcd and brokers; shards in this process (serve_primary)."""

from __future__ import annotations

import asyncio
import functools

import msgspec
import pytest

from tests.consumer.test_commit_barrier import outputs, publish_ids, relay_spec
from tests.support.apps import Relay, seen
from tests.support.waiting import wait_until
from tidings.consumer import Shard, serve_primary
from tidings.consumer.shard import _message_type
from tidings.protocol.specs import shard_from_dict
from tidings.protocol.status import UsageError


def traced(fn):
    """A plain (non-async) decorator, as tracing and metrics libraries write them."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


class TracedRelay(Relay):
    @traced
    async def consume_message(self, shard, store, envelope, publisher) -> None:
        await super().consume_message(shard, store, envelope, publisher)


async def serve(c, spec, app, tmp_path, until) -> None:
    """Serve the shard until `until(shard)` holds; raises what stopped it early."""
    stop = asyncio.Event()
    shard = Shard(spec, c, data_dir=tmp_path)
    task = asyncio.ensure_future(serve_primary(c, spec, app, stop, shard))
    try:
        await wait_until(lambda: task.done() or until(shard), 30)
    finally:
        stop.set()
        await asyncio.wait([task])
    task.result()


async def test_a_decorated_async_consume_message_is_awaited(cluster, tmp_path) -> None:
    await cluster.create_journal("relay/in", 1)
    await cluster.create_journal("relay/out", 1)
    await publish_ids(cluster, ["m0", "m1"])
    async with cluster.client() as c:
        head = await c.write_head("relay/in")
        spec = relay_spec("uncommitted", 0)
        await serve(c, spec, TracedRelay(), tmp_path, lambda s: s.read_through.get("relay/in", 0) >= head)
    assert seen(tmp_path / "relay%2F0.db") == {"m0": 1, "m1": 1}
    assert await outputs(cluster) == {"m0": 1, "m1": 1}


class AsyncGarbage(Relay):
    async def on_garbage(self, shard, journal, garbage) -> None:
        raise RuntimeError("stop here")


class DecoratedAsyncGarbage(Relay):
    @traced
    async def on_garbage(self, shard, journal, garbage) -> None:
        raise RuntimeError("stop here")


@pytest.mark.parametrize("app", [AsyncGarbage, DecoratedAsyncGarbage])
async def test_an_async_on_garbage_is_refused_not_skipped(cluster, tmp_path, app) -> None:
    await cluster.create_journal("relay/in", 1)
    async with cluster.client() as c:
        await c.append("relay/in", b"not json\n")
        await publish_ids(cluster, ["after"])
        spec = shard_from_dict({"id": "relay/0", "sources": ["relay/in"], "max_txn_duration": "1s"})
        with pytest.raises(UsageError, match="on_garbage must be a plain function"):
            await serve(c, spec, app(), tmp_path, lambda s: False)
    assert seen(tmp_path / "relay%2F0.db") == {}  # nothing was committed past the garbage


class Mixes(Relay):
    """Publishes each message uncommitted, then a committed audit line to the same journal."""

    async def consume_message(self, shard, store, envelope, publisher) -> None:
        await super().consume_message(shard, store, envelope, publisher)
        await publisher.publish_committed("relay/out", {"id": "audit:" + envelope.message["id"], "pad": ""})


class PublishesWhenFinished(Relay):
    async def finished_txn(self, shard, store, commit) -> None:
        await shard.publisher.publish_uncommitted("relay/out", {"id": "summary", "pad": ""})


@pytest.mark.parametrize(
    ("app", "says"),
    [(Mixes, "a committed message would roll back"), (PublishesWhenFinished, "built but not written")],
)
async def test_publishing_that_would_lose_messages_is_refused(cluster, tmp_path, app, says) -> None:
    await cluster.create_journal("relay/in", 1)
    await cluster.create_journal("relay/out", 1)
    await publish_ids(cluster, ["m0"])
    async with cluster.client() as c:
        with pytest.raises(UsageError, match=says):
            await serve(c, relay_spec("uncommitted", 0), app(), tmp_path, lambda s: False)
    assert seen(tmp_path / "relay%2F0.db") in ({}, {"m0": 1})  # (refused before or after its commit)
    assert set(await outputs(cluster)) <= {"m0"}  # nothing read committed is lost or half there


class ReturnsCursor(Relay):
    """A plain-function consume_message returning what its last call gave (an apsw Cursor)."""

    def consume_message(self, shard, store, envelope, publisher):
        msg_id = envelope.message["id"]
        return store.transaction().execute(
            "INSERT INTO seen VALUES (?, 1) ON CONFLICT (id) DO UPDATE SET n = n + 1", (msg_id,)
        )


async def test_a_plain_consume_message_may_return_anything(cluster, tmp_path) -> None:
    await cluster.create_journal("relay/in", 1)
    await publish_ids(cluster, ["m0", "m1"])
    async with cluster.client() as c:
        head = await c.write_head("relay/in")
        spec = shard_from_dict({"id": "relay/0", "sources": ["relay/in"], "max_txn_duration": "1s"})
        await serve(c, spec, ReturnsCursor(), tmp_path, lambda s: s.read_through.get("relay/in", 0) >= head)
    assert seen(tmp_path / "relay%2F0.db") == {"m0": 1, "m1": 1}


class DuckTyped:
    """An application that does not subclass Application: its missing hooks would fail mid-transaction."""

    def new_store(self, shard):
        raise AssertionError("never called")

    async def consume_message(self, shard, store, envelope, publisher) -> None:
        raise AssertionError("never called")


async def test_an_application_that_is_no_application_is_refused_before_it_runs(cluster) -> None:
    """Every hook but new_store and consume_message is optional because Application gives it a no-op:
    an object that is no Application is refused at once, by `tidings consumer --app` and by
    serve_primary, instead of failing a transaction later."""
    import sys
    import types

    from tidings.consumer.service import load_app

    module = types.ModuleType("duck_app")
    module.DuckTyped = DuckTyped  # type: ignore[attr-defined]
    sys.modules["duck_app"] = module
    try:
        with pytest.raises(UsageError, match=r"gives DuckTyped, which is no tidings\.consumer\.Application"):
            load_app("duck_app:DuckTyped")
    finally:
        del sys.modules["duck_app"]
    spec = shard_from_dict({"id": "hooks/duck", "sources": ["hooks/none"]})
    async with cluster.client() as c:
        with pytest.raises(UsageError, match=r"DuckTyped is no tidings\.consumer\.Application"):
            await serve_primary(c, spec, DuckTyped(), asyncio.Event())  # type: ignore[arg-type]


class Typed(msgspec.Struct):
    id: str


async def test_a_new_message_set_on_the_application_object_chooses_the_type(cluster) -> None:
    """`new_message` is a hook like the others: one given to the object (not its class) is used too,
    not silently passed over for the framing's default."""
    await cluster.create_journal("hooks/typed", 1)
    app = Relay()
    app.new_message = lambda spec: Typed  # type: ignore[method-assign]
    async with cluster.client() as c:
        assert await _message_type(c, app, ["hooks/typed"]) is Typed
        assert await _message_type(c, Relay(), ["hooks/typed"]) is None
