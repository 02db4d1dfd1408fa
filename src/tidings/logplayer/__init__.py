"""logplayer: in-order, exactly-once delivery of a WAL journal's entries to storage shards
(targets), after the LogPlayer paper (seed: logplayer-paper.txt). One module per part:

- `wal`: the WAL's transactions (`WalEntry`), the declared `Targets` (targets.yaml, key -> target)
  and the transaction manager's `WalWriter` (retries filtered by the read-committed reader).
- `target`: a target: `TargetStore` (SQLite: apply + last index in one transaction, fence) and
  the Target gRPC service (`Deliver` stream, `GetLastAck`), `TargetServer`.
- `target_queue`: `TargetQueue`, a target's normal and catch-up queues, states N / RF / FC / S,
  terms and batches (Algorithms 1-2).
- `dispatcher`: `Dispatcher` (Algorithm 3, dummy entries of Algorithm 5).
- `fetcher`: the main stream and recovery streams over the WAL, with Sequencer checkpoints.
- `stream`: `TargetLink`, a target's health checker, writer and reader (Algorithm 4).
- `player`: `LogPlayer`, which runs them, its epoch and its state file (Algorithm 5).

`models/` holds the Promela model of these algorithms that spin checks (models/README.md maps
its processes to these modules).
"""

from tidings.logplayer.dispatcher import NOTHING, Dispatcher
from tidings.logplayer.player import LogPlayer
from tidings.logplayer.target import TargetServer, TargetStore
from tidings.logplayer.target_queue import Entry, QueueState, TargetQueue, TransitionError
from tidings.logplayer.wal import Target, Targets, WalEntry, WalMutation, WalWriter

__all__ = [
    "NOTHING",
    "Dispatcher",
    "Entry",
    "LogPlayer",
    "QueueState",
    "Target",
    "TargetQueue",
    "TargetServer",
    "TargetStore",
    "Targets",
    "TransitionError",
    "WalEntry",
    "WalMutation",
    "WalWriter",
]
