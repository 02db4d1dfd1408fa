"""logplayer: in-order, exactly-once delivery of a WAL journal's entries to storage shards
(targets), after the LogPlayer paper (seed: logplayer-paper.txt). Being built in steps (issue 11):

- `target_queue`: `TargetQueue`, a target's normal and catch-up queues, states N / RF / FC / S,
  terms and batches (Algorithms 1-2).

`models/` holds the Promela model of these algorithms that spin checks (models/README.md maps
its processes to these modules).
"""

from tidings.logplayer.target_queue import Entry, QueueState, TargetQueue, TransitionError

__all__ = ["Entry", "QueueState", "TargetQueue", "TransitionError"]
