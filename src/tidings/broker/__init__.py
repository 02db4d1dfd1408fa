"""The journal broker (gazette-transactional-appends.txt).

A broker serves the Journal gRPC service for the journals assigned to it in etcd. Each assigned
journal has a `Replica` (its Spool, fragment index and daemons); the journal's primary runs a
`Pipeline` of Replicate streams to its peers, and every append traverses the `AppendFSM`
(`append_fsm.py`, one method per seed state). Guarantees: an append acknowledged OK is held by
every replica of its Route; offsets are never assigned twice; readers see only committed bytes;
every replica validates every proposal (DESIGN.md invariants 1-4, 6).

Modules: resolver (journal -> Route, replicas), replica (ownership tokens), pipeline (barrier),
append_fsm, append_api (response mapping, proxy), replicate_api (peer side), read_api, service
(the Broker: wiring, pulse, List/Apply/ListFragments), _metrics.
"""
