"""A replica's ownership tokens (its pipeline, its spool) pass in the order they were asked for, and
are never lost: a release goes to the longest waiter even when a newcomer asks in between, a waiter
cancelled after being handed the token passes it on, and a double release is refused."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.waiting import wait_until
from tidings.broker.replica import Slot, acquire


def held_token(slot: Slot[str]) -> str:
    """A token taken from a fresh slot: its holder releases it later."""
    slot.put_nowait("pipeline")
    return slot.get_nowait()


async def take_in_turn(slot: Slot[str], name: str, order: list[str]) -> None:
    """Acquire as an append does, note the turn, release."""
    ok, got = await acquire(slot, asyncio.Event())
    assert ok
    order.append(name)
    slot.put_nowait(got)


async def test_a_release_goes_to_the_longest_waiter_not_to_a_newcomer() -> None:
    slot: Slot[str] = Slot()
    token = held_token(slot)
    order: list[str] = []
    waiters = [asyncio.create_task(take_in_turn(slot, f"waiter-{i}", order)) for i in range(3)]
    await wait_until(lambda: len(slot._getters) == 3, 5)
    newcomer = asyncio.create_task(take_in_turn(slot, "newcomer", order))  # runs before the woken waiter does
    slot.put_nowait(token)  # released: the first waiter's, though it has not run yet
    assert slot.empty()
    await asyncio.wait_for(asyncio.gather(*waiters, newcomer), 5)
    assert order == ["waiter-0", "waiter-1", "waiter-2", "newcomer"]
    assert slot.full()


async def test_a_waiter_cancelled_after_the_hand_off_passes_the_token_on() -> None:
    slot: Slot[int] = Slot()
    first = asyncio.create_task(slot.get())
    second = asyncio.create_task(slot.get())
    await wait_until(lambda: len(slot._getters) == 2, 5)
    slot.put_nowait(7)  # handed to `first`...
    first.cancel()  # ...which is cancelled before it runs
    assert await asyncio.wait_for(second, 5) == 7
    assert first.cancelled()
    assert slot.empty()


async def test_acquire_gives_up_when_its_event_fires_and_leaves_the_token() -> None:
    slot: Slot[int] = Slot()
    slot.put_nowait(1)
    held = slot.get_nowait()
    moved = asyncio.Event()
    waiting = asyncio.create_task(acquire(slot, moved))
    await wait_until(lambda: len(slot._getters) == 1, 5)
    moved.set()
    assert await asyncio.wait_for(waiting, 5) == (False, None)
    slot.put_nowait(held)
    assert slot.get_nowait() == 1


async def test_a_double_release_is_refused() -> None:
    slot: Slot[None] = Slot()
    slot.put_nowait(None)
    with pytest.raises(asyncio.QueueFull):
        slot.put_nowait(None)
    assert slot.get_nowait() is None
    with pytest.raises(asyncio.QueueEmpty):
        slot.get_nowait()


async def test_one_who_asked_first_goes_first_even_if_the_release_comes_before_it_waits() -> None:
    slot: Slot[str] = Slot()
    token = held_token(slot)
    order: list[str] = []

    async def release() -> None:
        slot.put_nowait(token)

    first = asyncio.ensure_future(take_in_turn(slot, "first", order))  # asks, then...
    released = asyncio.ensure_future(release())  # ...the holder releases in the same loop iteration...
    second = asyncio.ensure_future(take_in_turn(slot, "second", order))  # ...and another asks
    await asyncio.wait_for(asyncio.gather(first, released, second), 5)
    assert order == ["first", "second"]


async def test_a_double_release_is_refused_while_someone_waits() -> None:
    slot: Slot[int] = Slot()
    waiter = asyncio.ensure_future(slot.get())
    await wait_until(lambda: len(slot._getters) == 1, 5)
    slot.put_nowait(1)  # handed to the waiter, which has not run yet
    with pytest.raises(asyncio.QueueFull):
        slot.put_nowait(1)  # (a holder releasing twice would give two owners one pipeline)
    assert await asyncio.wait_for(waiter, 5) == 1
    slot.put_nowait(1)  # (its owner's release)
    assert slot.full()
