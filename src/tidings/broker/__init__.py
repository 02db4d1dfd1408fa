"""The journal broker (gazette-transactional-appends.txt).

A broker serves the Journal gRPC service for the journals assigned to it in etcd. Each assigned
journal has a `Replica` (its Spool, fragment index and daemons); the journal's primary runs a
`Pipeline` of Replicate streams to its peers, and every append traverses the `AppendFSM`
(`append_fsm.py`, one method per seed state). Guarantees: an append acknowledged OK is held by
every replica of its Route; offsets are never assigned twice; readers see only committed bytes;
every replica validates every proposal (DESIGN.md invariants 1-4, 6).

Modules: transport (replication streams), pipeline (barrier), replica (ownership tokens), resolver
(journal -> Route, replicas), host (`BrokerConfig`, and `Host`: what the broker lends the modules
above), append_fsm, append_api (response mapping, proxy), replicate_api (peer side), read_api,
list_apply_api, fragments_api, pulse, recovery, service (the Broker: wiring), _metrics.
"""
