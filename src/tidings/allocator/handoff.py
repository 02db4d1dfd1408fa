"""Hand-off: a member that is stopping (marked exiting) waits for the allocator to move its items
to other members: journals off a broker, shards off a consumer process (`allocator.kind`)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from tidings.allocator.announce import Announcement
from tidings.allocator.state import State
from tidings.keyspace import KeySpace
from tidings.keyspace.etcd import Etcd
from tidings.protocol.status import TidingsError

__all__ = ["ETCD_STOP_TIMEOUT", "item_list", "wait_handed_off"]

log = logging.getLogger(__name__)

ETCD_STOP_TIMEOUT = 2.0  # seconds for each etcd call while stopping: a gone etcd must not hold a stop up


def item_list(names: list[str], item: str = "journal", most: int = 5) -> str:
    """'journals a, b and 3 more' for log lines."""
    shown = ", ".join(names[:most])
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return f"{item}{'s' if len(names) > 1 else ''} {shown}{more}"


async def wait_handed_off(
    keyspace: KeySpace,
    etcd: Etcd,
    announcement: Announcement,
    state_of: Callable[[], State],
    who: str,
    timeout: float,
) -> None:
    """Wait until the items assigned to `announcement`'s member have moved away, at most `timeout` seconds.

    Stops waiting early when no other member could take them (the whole cluster is stopping), when
    the lease is lost, or when etcd stops answering (nothing can move then). Logs what it waits for
    and how long, and says so when no other live member is free to take an item (it then waits in
    case one joins).
    """
    spec = announcement.spec
    me = (spec.id.zone, spec.id.suffix)
    started = time.monotonic()
    deadline = started + timeout
    said: tuple[list[str], list[str]] | None = None
    first_look = True
    while True:
        state = state_of()
        kind, noun = state.kind, state.kind.item
        mine = sorted({a.journal for a in state.assignments_of(*me)})
        if not mine:
            log.info("%s: no %ss left to hand off", who, noun)
            return
        others = [
            m for mid, m in state.members.items() if mid != me and not kind.exiting(m.spec) and kind.item_limit(m.spec)
        ]
        if not others:
            log.info(
                "%s: no other %s is serving; keeping its %s for its next start", who, kind.member, item_list(mine, noun)
            )
            return
        now = time.monotonic()
        if now >= deadline:
            log.warning(
                "%s: %s still assigned after %.0fs; stopping anyway (their other replicas keep serving, and "
                "the allocator reassigns them once the lease is revoked)",
                who,
                item_list(mine, noun),
                now - started,
            )
            return
        load = {m.id: 0 for m in others}
        for assignments in state.assignments.values():
            for a in assignments:
                if a.member in load:
                    load[a.member] += 1
        free = [m.id for m in others if load[m.id] < kind.item_limit(m.spec)]
        stuck = [j for j in mine if not {*free} - {a.member for a in state.assignments.get(j, [])}]
        if stuck:
            message = (
                f"no other live {kind.member} is free to take {item_list(stuck, noun)} ({len(others)} others, all "
                f"already replicas or full); waiting up to {timeout:g}s for one to join, "
                "then stopping without handing them off"
            )
        else:
            message = f"waiting up to {timeout:g}s for {item_list(mine, noun)} to move to other {kind.member}s"
        if first_look:  # members stopping together mark themselves exiting at about the same time
            first_look = False
            with contextlib.suppress(TimeoutError):
                await keyspace.wait_for_update(keyspace.revision, timeout=min(0.5, deadline - now))
            continue
        if said != (mine, stuck):  # say it again only when the situation changes
            log.info("%s: %s", who, message)
            said = (mine, stuck)
        if announcement.lost.is_set():
            return
        try:
            await keyspace.wait_for_update(keyspace.revision, timeout=min(1.0, deadline - now))
        except TimeoutError:
            try:  # a quiet second: is etcd still there?
                await etcd.get(announcement.key, timeout=ETCD_STOP_TIMEOUT)
            except TidingsError as err:
                log.warning(
                    "%s: etcd does not answer (%s); stopping without handing off %s", who, err, item_list(mine, noun)
                )
                return
