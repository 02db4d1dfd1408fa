"""List, Apply and ListMembers RPCs: the journals' specs and routes, changes to them, and the live
brokers, all answered from this broker's KeySpace (etcd is the only truth; Apply writes to it).

List filters by a label selector (a journal's labels plus its `name`), and by the caller's token's,
and, with `watch`, answers again whenever what it lists changed. Apply validates every change
(specs, store URLs) before one etcd transaction guarded by each change's `expect_mod_revision`,
keeps a suspended journal's resume offset when an upsert omits it, and warns about a created
journal whose store already holds fragments (an earlier journal of the name: its first append is
refused until reset-head, as in Gazette).

Auth (DESIGN.md invariant 11): a List never shows a journal outside the token's selector, and a watch
answers again only when what it shows changes (so nothing hidden shows through a change of revision).
An Apply's upsert must be covered by the selector twice, with the new spec's labels and with the
existing spec's (else PERMISSION_DENIED: relabelling a journal out of someone's reach, or into one's
own, is refused); a delete of a journal outside the selector answers exactly as a delete of a missing
journal does. (One bit leaks, as in Gazette: an upsert naming a journal that exists outside the
selector is refused where a create would pass; the name is the caller's own.)
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import TYPE_CHECKING

import grpc

from tidings.allocator import keys
from tidings.auth import AuthError, seconds_left
from tidings.broker import _metrics as metrics
from tidings.broker.replica import stores_of
from tidings.fragment.store import check_store_url, store_for
from tidings.keyspace.etcd import mod_revision_is, put_op
from tidings.member import counted
from tidings.protocol import labels, validate
from tidings.protocol import protocol_pb2 as pb
from tidings.protocol.claims import Claims, covers
from tidings.protocol.status import TransportError, ValidationError

if TYPE_CHECKING:
    from tidings.broker.host import Host

log = logging.getLogger(__name__)

STALE_CHECK_TIMEOUT = 5.0  # seconds Apply spends listing created journals' stores


async def serve_list(broker: Host, req: pb.ListRequest, context: grpc.aio.ServicerContext, claims: Claims) -> None:
    """Serve one List RPC for the holder of `claims`: a response now, and with `watch` another whenever
    the journals it lists change, until the token expires (the stream then ends: the client opens it
    again with its current token)."""
    with counted(metrics.RPC_STATUS, "list", context) as outcome:
        try:
            validate.selector(req.selector)
        except ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        sent: list[pb.ListResponse.Journal] | None = None
        while True:
            revision = broker.keyspace.revision
            resp = list_response(broker, req.selector, claims)
            if list(resp.journals) != sent:  # (a watch answers changes of what it shows, not of revisions)
                await context.write(resp)
                sent = list(resp.journals)
            if not req.watch:
                outcome.append(pb.OK)
                return
            try:
                async with asyncio.timeout(seconds_left(claims)):
                    await broker.keyspace.wait_for_update(revision)
            except TimeoutError:
                outcome.append(pb.OK)
                return


async def serve_apply(
    broker: Host, req: pb.ApplyRequest, context: grpc.aio.ServicerContext, claims: Claims
) -> pb.ApplyResponse:
    """Serve one Apply RPC for the holder of `claims`: INVALID_ARGUMENT naming a bad change,
    PERMISSION_DENIED for a change outside the token's selector, UNAVAILABLE while etcd is unreachable."""
    with counted(metrics.RPC_STATUS, "apply", context) as outcome:
        try:
            resp = await apply(broker, req, claims)
        except ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except AuthError as exc:
            await broker.verifier.refuse(context, exc)
        except TransportError as exc:  # etcd is unreachable: the client may retry
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"apply: {exc}")
        outcome.append(resp.status)
        return resp


async def serve_list_members(
    broker: Host, req: pb.MembersRequest, context: grpc.aio.ServicerContext, claims: Claims
) -> pb.MembersResponse:
    with counted(metrics.RPC_STATUS, "list_members", context) as outcome:
        outcome.append(pb.OK)
        return members_response(broker, claims)


def list_response(broker: Host, selector: pb.LabelSelector, claims: Claims | None = None) -> pb.ListResponse:
    """The journals matching `selector` and the token's (`claims`), by name, each with its spec,
    revisions, route and consistency."""
    state = broker.resolver.state
    resp = pb.ListResponse(status=pb.OK, header=broker.resolver.header(pb.Route(primary=-1)))
    for name in sorted(state.items):
        item = state.items[name]
        spec_labels = labels.journal_labels(name, item.spec.labels)
        if not labels.matches(selector, spec_labels) or (claims is not None and not covers(claims, spec_labels)):
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


def _outside(claims: Claims | None, name: str, spec: pb.JournalSpec) -> bool:
    """Whether the journal `name` with `spec` lies outside the token's selector."""
    return claims is not None and not covers(claims, labels.journal_labels(name, spec.labels))


def _check_upsert(claims: Claims | None, spec: pb.JournalSpec, existing: pb.JournalSpec | None) -> None:
    """Refuse an upsert whose new spec, or the journal's spec now, lies outside the token's selector."""
    if _outside(claims, spec.name, spec) or (existing is not None and _outside(claims, spec.name, existing)):
        reason = f"not allowed to apply journal {spec.name} (outside your token's selector)"
        raise AuthError("PERMISSION_DENIED", reason)


async def apply(broker: Host, req: pb.ApplyRequest, claims: Claims | None = None) -> pb.ApplyResponse:
    """Apply `req`'s changes in one etcd transaction, once the KeySpace has reached it; every change
    within the token's selector (`claims`; None: the broker's own), checked before anything is written."""
    root = broker.config.root
    state = broker.resolver.state
    compares, ops, created = [], [], []
    doomed = False  # a hidden journal's delete expected a revision: as for a missing one, the transaction fails
    for i, change in enumerate(req.changes):
        if change.HasField("upsert"):
            validate.journal_spec(change.upsert, f"changes[{i}].upsert")
            existing = state.items.get(change.upsert.name)
            _check_upsert(claims, change.upsert, existing.spec if existing is not None else None)
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
            if claims is not None and claims.sel.ByteSize():  # (checked against this view: etcd must agree)
                compares.append(mod_revision_is(key, existing.mod_revision if existing is not None else 0))
        elif change.delete:
            validate.journal_name(change.delete, f"changes[{i}].delete")
            existing = state.items.get(change.delete)
            if existing is not None and _outside(claims, change.delete, existing.spec):
                broker.verifier.hid(f"journal {change.delete}", "JOURNAL_NOT_FOUND")
                doomed = doomed or change.expect_mod_revision != 0  # (a missing journal's key has revision 0)
                continue
            key = keys.item_key(root, change.delete)
            ops.extend(state.delete_ops(root, change.delete))
        else:
            raise ValidationError(f"changes[{i}]", "expected an upsert or a delete")
        compares.append(mod_revision_is(key, change.expect_mod_revision))
    if doomed:
        return pb.ApplyResponse(status=pb.ETCD_TRANSACTION_FAILED, header=broker.resolver.header(pb.Route(primary=-1)))
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


def members_response(broker: Host, claims: Claims | None = None) -> pb.MembersResponse:
    """Every live member (its spec from etcd), with the journals assigned to it and those it leads, of
    those the token's selector (`claims`) covers: not even a count of the others shows."""
    state = broker.resolver.state
    journals: Counter[tuple[str, str]] = Counter()
    primaries: Counter[tuple[str, str]] = Counter()
    for name, item in state.items.items():
        if claims is not None and not broker.resolver.covers(claims, name, item.spec):
            continue
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
