"""TargetQueue (Algorithms 1-2) and Dispatcher (Algorithm 3, dummy entries), case by case, and a
simulation that drives both as LogPlayer's streams, fetchers and health checker do, with target
failures, returns and LogPlayer restarts at random points (hypothesis): every target applies
each of its entries once, in order (DESIGN.md invariant 9)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidings.logplayer.dispatcher import NOTHING, Dispatcher
from tidings.logplayer.target_queue import Entry, QueueState, TargetQueue, TransitionError

N, RF, FC, S = QueueState.NORMAL, QueueState.RECOVERY_FETCHING, QueueState.FETCHING_COMPLETED, QueueState.SUSPENDED


def e(i: int) -> Entry:
    return Entry(i, (f"m{i}",))


def test_normal_queue_in_order() -> None:
    q = TargetQueue("t")
    assert q.front() is None
    for i in (1, 2, 3):
        assert q.push(e(i), normal=True)
    assert [x.index for x in q.next_batch(2)] == [1, 2]
    assert [x.index for x in q.next_batch(10)] == [3]
    assert q.next_batch(10) == []


def test_suspended_drops_pushes_and_clears_everything() -> None:
    q = TargetQueue("t")
    q.push(e(1), normal=True)
    q.next_batch(1)
    q.pop_batch()
    q.push(e(2), normal=True)
    q.suspend()
    assert (q.state, list(q.normal), list(q.catchup), q.popped, q.current_batch) == (S, [], [], {}, [])
    assert not q.push(e(3), normal=True)
    assert not q.push(e(3), normal=False, term=q.term)
    assert q.front() is None


def test_recovery_sends_catchup_first_then_normal() -> None:
    q = TargetQueue("t")
    q.suspend()
    term = q.begin_recovery()
    assert (q.state, term) == (RF, 2)
    q.push(e(5), normal=True)  # the main stream goes on meanwhile
    assert q.front() is None  # nothing caught up yet: the main stream's entry waits
    q.push(e(3), normal=False, term=term)
    assert [x.index for x in q.next_batch(10)] == [3]
    q.push(e(4), normal=False, term=term)
    assert not q.fetching_completed(term)  # 4 still to send
    assert q.state is FC
    assert [x.index for x in q.next_batch(10)] == [4, 5]  # catch-up drained, then the main stream
    assert q.state is N


def test_fetching_completed_with_empty_catchup_goes_normal() -> None:
    q = TargetQueue("t")
    q.suspend()
    term = q.begin_recovery()
    q.push(e(3), normal=False, term=term)
    q.next_batch(10)
    assert q.fetching_completed(term)
    assert q.state is N


def test_stale_term_is_dropped() -> None:
    q = TargetQueue("t")
    q.suspend()
    old = q.begin_recovery()
    q.suspend()
    new = q.begin_recovery()
    assert not q.push(e(3), normal=False, term=old)
    assert not q.fetching_completed(old)
    assert q.state is RF
    assert q.push(e(3), normal=False, term=new)


def test_transitions_outside_the_diagram_raise() -> None:
    q = TargetQueue("t")
    with pytest.raises(TransitionError):
        q.begin_recovery()  # N -> RF: the target never left
    q.suspend()
    with pytest.raises(TransitionError):
        q.nothing_missed()  # S -> N: a return always starts a term


def test_erase_trusts_only_what_was_sent() -> None:
    q = TargetQueue("t")
    for i in (1, 2, 3, 4):
        q.push(e(i), normal=True)
    q.next_batch(2)
    q.pop_batch()
    q.next_batch(2)
    q.pop_batch()
    assert list(q.popped) == [2, 4]
    assert not q.erase(3)  # no batch ends at 3
    assert q.erase(4)  # acknowledges both batches
    assert q.popped == {}
    assert not q.erase(4)  # twice


def test_dispatcher_skips_acknowledged_entries_and_wakes() -> None:
    woken: list[str] = []
    d = Dispatcher(["a", "b"], woken.append, last_acks={"a": 20})
    assert d.start_index() == NOTHING
    d.dispatch(10, {"a": ("x",), "b": ("y",)})
    d.dispatch(30, {"a": ("z",)})
    assert woken == ["b", "a"]
    assert [x.index for x in d.queues["a"].normal] == [30]
    assert d.current_index == 30


def test_dummy_entries_for_idle_targets() -> None:
    d = Dispatcher(["busy", "idle"], lambda t: None, dummy_every=2)
    for index in (0, 10, 20, 30):
        d.dispatch(index, {"busy": ("m",)})
    assert [x.index for x in d.queues["busy"].normal] == [0, 10, 20, 30]
    assert [(x.index, x.dummy) for x in d.queues["idle"].normal] == [(10, True), (30, True)]


# ---- simulation ----


@dataclasses.dataclass
class Target:
    applied: list[int] = dataclasses.field(default_factory=list)  # real entries, in apply order
    last: int = NOTHING  # last applied index, dummies included (stored with the apply)
    net: list[list[Entry]] = dataclasses.field(default_factory=list)  # batches written, not applied
    acks: list[int] = dataclasses.field(default_factory=list)  # acknowledgements not yet read

    def deliver(self) -> None:
        batch = self.net.pop(0)
        for entry in batch:
            assert entry.index > self.last, f"entry {entry.index} after {self.last}: out of order or twice"
            self.last = entry.index
            if not entry.dummy:
                self.applied.append(entry.index)
        self.acks.append(batch[-1].index)


class Player:
    """The LogPlayer's glue, synchronous: streams (one write in flight), fetchers, health."""

    def __init__(self, wal: list[tuple[int, dict[str, tuple]]], targets: dict[str, Target], max_batch: int) -> None:
        self.wal, self.targets, self.max_batch = wal, targets, max_batch
        self.d = Dispatcher(targets, lambda t: None, dummy_every=3, last_acks={t: x.last for t, x in targets.items()})
        start = self.d.start_index()
        self.next_main = next((i for i, (index, _) in enumerate(wal) if index >= start), len(wal))
        self.writing = {t: False for t in targets}
        # Recovery fetchers: target -> [next wal position, end index, term]. A failure does not
        # stop one at once (a real one may be reading the WAL); its stale pushes are dropped.
        self.recovery: dict[str, list[list[int]]] = {t: [] for t in targets}

    def fetch(self) -> bool:
        if self.next_main >= len(self.wal):
            return False
        index, parts = self.wal[self.next_main]
        self.d.dispatch(index, parts)
        self.next_main += 1
        return True

    def recover_step(self, t: str) -> bool:
        if not self.recovery[t]:
            return False
        fetcher = self.recovery[t][0]
        pos, end, term = fetcher
        if pos < len(self.wal) and self.wal[pos][0] <= end:
            index, parts = self.wal[pos]
            if t in parts:
                self.d.dispatch_recovery(t, index, parts[t], term)
            fetcher[0] += 1
        else:
            self.recovery[t].pop(0)
            self.d.queues[t].fetching_completed(term)
        return True

    def write(self, t: str) -> bool:
        q = self.d.queues[t]
        if self.writing[t] or q.state is S:
            return False
        batch = q.next_batch(self.max_batch)
        if not batch:
            return False
        q.pop_batch()
        self.targets[t].net.append(batch)
        self.writing[t] = True
        return True

    def write_done(self, t: str) -> bool:
        if not self.writing[t]:
            return False
        self.writing[t] = False
        return True

    def ack(self, t: str) -> bool:
        x = self.targets[t]
        if not x.acks:
            return False
        index = x.acks.pop(0)
        assert self.d.queues[t].erase(index), f"acknowledgement {index} of {t} matches no batch"
        self.d.acknowledged(t, index)
        return True

    def fail(self, t: str) -> bool:
        q = self.d.queues[t]
        if q.state is S:
            return False
        q.suspend()
        x = self.targets[t]
        x.net.clear()  # unsent writes are lost; what the target applied stays applied
        x.acks.clear()
        self.writing[t] = False
        return True

    def come_back(self, t: str) -> bool:
        q = self.d.queues[t]
        if q.state is not S:
            return False
        term = q.begin_recovery()
        last = self.targets[t].last  # what the new stream's opening reports
        self.d.acknowledged(t, last)
        if last < self.d.current_index:
            pos = next(i for i, (index, _) in enumerate(self.wal) if index > last)
            self.recovery[t].append([pos, self.d.current_index, term])
        else:
            q.nothing_missed()
        return True


# Progress is likelier than faults, so that runs get far between them.
OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["fetch", "send", "deliver", "ack"] * 2 + ["recover"] * 3 + ["fail", "back", "back", "restart"]
        ),
        st.integers(0, 2),
    ),
    max_size=200,
)


@settings(max_examples=1000, deadline=None)
@given(
    parts=st.lists(st.sets(st.integers(0, 2), min_size=1), min_size=1, max_size=25),
    ops=OPS,
    max_batch=st.integers(1, 4),
)
def test_simulated_failures_and_restarts_deliver_each_entry_once_in_order(parts, ops, max_batch) -> None:
    names = ["t0", "t1", "t2"]
    wal = [(10 * i, {names[t]: (f"m{i}",) for t in sorted(p)}) for i, p in enumerate(parts)]
    targets = {t: Target() for t in names}
    player = Player(wal, targets, max_batch)
    for op, k in ops:
        t = names[k]
        if op == "fetch":
            player.fetch()
        elif op == "recover":
            player.recover_step(t)
        elif op == "send":  # a write, and its completion
            player.write(t)
            player.write_done(t)
        elif op == "deliver" and targets[t].net:
            targets[t].deliver()
        elif op == "ack":
            player.ack(t)
        elif op == "fail":
            player.fail(t)
        elif op == "back":
            player.come_back(t)
        elif op == "restart":  # LogPlayer crashes: streams gone, targets keep what they applied
            for x in targets.values():
                x.net.clear()
                x.acks.clear()
            player = Player(wal, targets, max_batch)
    settle(player, targets)
    for t in names:
        expected = [index for index, p in wal if t in p]
        assert targets[t].applied == expected, t


def settle(player: Player, targets: dict[str, Target]) -> None:
    """No more faults: every target comes back and everything is delivered."""
    for t in targets:
        player.come_back(t)
    progress = True
    while progress:
        progress = player.fetch()
        for t, x in targets.items():
            progress |= player.recover_step(t) | player.write(t) | player.write_done(t) | player.ack(t)
            if x.net:
                x.deliver()
                progress = True


def test_a_stale_recovery_fetcher_delivers_nothing_twice() -> None:
    """The target fails again while its recovery stream is half way: that stream goes on
    pushing in the old term (dropped), the new one catches the target up once."""
    wal = [(10 * i, {"t": (f"m{i}",)}) for i in range(5)]
    targets = {"t": Target()}
    player = Player(wal, targets, max_batch=2)
    player.fail("t")
    for _ in wal:
        player.fetch()
    player.come_back("t")
    player.recover_step("t")  # pushes entry 0 in term 2
    player.fail("t")
    player.come_back("t")  # term 3: a second recovery fetcher from the start
    assert [f[2] for f in player.recovery["t"]] == [2, 3]
    while player.recover_step("t"):  # the stale one first: all of its pushes are dropped
        pass
    settle(player, targets)
    assert targets["t"].applied == [0, 10, 20, 30, 40]


def test_an_entry_naming_an_unknown_target_queues_nothing() -> None:
    d = Dispatcher(["a"], lambda t: None)
    with pytest.raises(KeyError, match="unknown target"):
        d.dispatch(10, {"a": ("x",), "zz": ("y",)})
    assert (list(d.queues["a"].normal), d.current_index) == ([], NOTHING)


def test_a_bad_part_queues_nothing_and_a_retry_queues_once() -> None:
    """Any part that cannot be built refuses the whole entry before a push."""
    d = Dispatcher(["a", "b"], lambda t: None)
    with pytest.raises(TypeError):
        d.dispatch(10, {"a": ("x",), "b": None})  # type: ignore[dict-item]
    assert list(d.queues["a"].normal) == []
    d.dispatch(10, {"a": ("x",), "b": ("y",)})
    assert [x.index for x in d.queues["a"].normal] == [10]


def test_a_batch_is_bounded_by_bytes_but_takes_one_entry_whatever_its_size() -> None:
    q = TargetQueue("t")
    for i, size in enumerate([3, 3, 3, 50, 1], 1):
        q.push(Entry(i, (f"m{i}",), size=size), normal=True)
    assert [x.index for x in q.next_batch(10, 7)] == [1, 2]
    q.pop_batch()
    assert [x.index for x in q.next_batch(10, 7)] == [3]
    q.pop_batch()
    assert [x.index for x in q.next_batch(10, 7)] == [4]  # (larger than the bound alone: sent alone)
    q.pop_batch()
    assert [x.index for x in q.next_batch(10, 7)] == [5]
