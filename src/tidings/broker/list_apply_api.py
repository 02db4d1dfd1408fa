"""List, Apply and ListMembers RPCs: the journals' specs and routes, changes to them, and the live
brokers, all answered from this broker's KeySpace (etcd is the only truth; Apply writes to it).

List filters by a label selector (a journal's labels plus its `name`) and, with `watch`, answers
again at every KeySpace revision. Apply validates every change (specs, store URLs) before one etcd
transaction guarded by each change's `expect_mod_revision`, keeps a suspended journal's resume
offset when an upsert omits it, and warns about a created journal whose store already holds
fragments (an earlier journal of the name: its first append is refused until reset-head, as in
Gazette).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import TYPE_CHECKING

import grpc

from tidings.allocator import keys
from tidings.broker import _metrics as metrics
from tidings.broker.replica import stores_of
from tidings.fragment.store import check_store_url, store_for
from tidings.keyspace.etcd import mod_revision_is, put_op
from tidings.member import counted
from tidings.protocol import labels, validate
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.status import TransportError, ValidationError

if TYPE_CHECKING:
    from tidings.broker.host import Host

log = logging.getLogger(__name__)

STALE_CHECK_TIMEOUT = 5.0  # seconds Apply spends listing created journals' stores


async def serve_list(broker: Host, req: pb.ListRequest, context: grpc.aio.ServicerContext) -> None:
    """Serve one List RPC: a response now, and with `watch` another after every KeySpace update."""
    with counted(metrics.RPC_STATUS, "list", context) as outcome:
        try:
            validate.selector(req.selector)
        except ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        while True:
            revision = broker.keyspace.revision
            await context.write(list_response(broker, req.selector))
            if not req.watch:
                outcome.append(pb.OK)
                return
            await broker.keyspace.wait_for_update(revision)


async def serve_apply(broker: Host, req: pb.ApplyRequest, context: grpc.aio.ServicerContext) -> pb.ApplyResponse:
    """Serve one Apply RPC: INVALID_ARGUMENT naming a bad change, UNAVAILABLE while etcd is unreachable."""
    with counted(metrics.RPC_STATUS, "apply", context) as outcome:
        try:
            resp = await apply(broker, req)
        except ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except TransportError as exc:  # etcd is unreachable: the client may retry
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"apply: {exc}")
        outcome.append(resp.status)
        return resp


async def serve_list_members(
    broker: Host, req: pb.MembersRequest, context: grpc.aio.ServicerContext
) -> pb.MembersResponse:
    with counted(metrics.RPC_STATUS, "list_members", context) as outcome:
        outcome.append(pb.OK)
        return members_response(broker)


def list_response(broker: Host, selector: pb.LabelSelector) -> pb.ListResponse:
    """The journals matching `selector`, by name, each with its spec, revisions, route and consistency."""
    state = broker.resolver.state
    resp = pb.ListResponse(status=pb.OK, header=broker.resolver.header(pb.Route(primary=-1)))
    for name in sorted(state.items):
        item = state.items[name]
        spec_labels = labels.union(item.spec.labels, labels.label_set({"name": name}))
        if not labels.matches(selector, spec_labels):
            continue
        resp.journals.append(
            pb.ListResponse.Journal(
                spec=item.spec,
                mod_revision=item.mod_revision,
                create_revision=item.create_revision,
                route=state.route(name),
                consistent=state.is_consistent(name),
            )
        )
    return resp


async def apply(broker: Host, req: pb.ApplyRequest) -> pb.ApplyResponse:
    """Apply `req`'s changes in one etcd transaction, once the KeySpace has reached it."""
    root = broker.config.root
    state = broker.resolver.state
    compares, ops, created = [], [], []
    for i, change in enumerate(req.changes):
        if change.HasField("upsert"):
            validate.journal_spec(change.upsert, f"changes[{i}].upsert")
            for j, url in enumerate(change.upsert.fragment.stores):  # a first import of a backend may be slow
                await asyncio.to_thread(check_store_url, url, f"changes[{i}].upsert.fragment.stores[{j}]")
            key = keys.item_key(root, change.upsert.name)
            spec = change.upsert
            current = state.items.get(spec.name)
            if current is None:
                created.append(spec)
            if not spec.HasField("suspend") and current is not None and current.spec.HasField("suspend"):
                spec = pb.JournalSpec()  # the brokers' resume offset survives a spec that omits it
                spec.CopyFrom(change.upsert)
                spec.suspend.CopyFrom(current.spec.suspend)
            ops.append(put_op(key, spec.SerializeToString()))
        elif change.delete:
            validate.journal_name(change.delete, f"changes[{i}].delete")
            key = keys.item_key(root, change.delete)
            ops.extend(state.delete_ops(root, change.delete))
        else:
            raise ValidationError(f"changes[{i}]", "expected an upsert or a delete")
        compares.append(mod_revision_is(key, change.expect_mod_revision))
    warnings = await stale_fragments(broker, created)  # (before the journal exists: none of its own yet)
    ok, revision = await broker.etcd.txn(compares, ops)
    await broker.keyspace.wait_for_revision(revision, timeout=10)
    status = pb.OK if ok else pb.ETCD_TRANSACTION_FAILED
    warnings = warnings if ok else []
    return pb.ApplyResponse(status=status, header=broker.resolver.header(pb.Route(primary=-1)), warnings=warnings)


async def stale_fragments(broker: Host, created: list[pb.JournalSpec]) -> list[str]:
    """A warning per created journal whose store already holds fragments: an earlier journal of the
    name left them, and its first append is refused (INDEX_HAS_GREATER_OFFSET) until reset-head, as
    in Gazette. Found at apply, not at the first append; a store that cannot be listed in time is
    left to the journal's replicas (they report it)."""
    default_store = broker.config.default_store

    def listed(spec: pb.JournalSpec) -> str | None:
        for url in stores_of(spec, default_store):
            frags = store_for(url).list(spec.name)
            if frags:
                end = max(f.end for f in frags)
                return (
                    f"journal {spec.name}: its store {url} already holds {len(frags)} fragments to offset {end} "
                    f"(an earlier journal of this name): appends are refused until `tidings journals reset-head "
                    f"{spec.name}` (reads then include them), or delete them from the store first"
                )
        return None

    checks = [asyncio.ensure_future(asyncio.to_thread(listed, spec)) for spec in created]
    if checks:
        await asyncio.wait(checks, timeout=STALE_CHECK_TIMEOUT)
    warnings: list[str] = []
    for spec, check in zip(created, checks, strict=True):
        if not check.done():  # (a store down or slow: the replicas report it)
            check.cancel()
        elif check.exception() is not None:
            log.info("apply: listing the store of created journal %s failed: %s", spec.name, check.exception())
        elif warning := check.result():
            warnings.append(warning)
    return warnings


def members_response(broker: Host) -> pb.MembersResponse:
    """Every live member (its spec from etcd), with the journals assigned to it and those it leads."""
    state = broker.resolver.state
    journals: Counter[tuple[str, str]] = Counter()
    primaries: Counter[tuple[str, str]] = Counter()
    for name in state.items:
        for a in state.assignments.get(name, []):
            journals[a.member] += 1
        route = state.route(name)
        if route.primary >= 0:
            lead = route.members[route.primary]
            primaries[(lead.zone, lead.suffix)] += 1
    resp = pb.MembersResponse(status=pb.OK, header=broker.resolver.header(pb.Route(primary=-1)))
    for mid in sorted(state.members):
        resp.members.append(
            pb.MembersResponse.Member(spec=state.members[mid].spec, journals=journals[mid], primaries=primaries[mid])
        )
    return resp
