"""Recovery logs (gazette-exactly-once.txt, "Recovery Logs and Register Fencing"; Gazette's
consumer/recoverylog): a shard's store directory recorded, operation by operation, to the shard's
recovery-log journal, so that any process can play it back byte for byte, a hot standby can tail it,
and a zombie recorder is fenced by the log's `author` register.

Modules: `ops` (operations on the wire, the author fence), `segment` (runs of the log by one author,
merged and checked), `fsm` (applies operations in order; builds and follows hints), `recorder`
(records a directory's operations, fenced by the log's author register), `player` (plays a log into a
directory, tails it as a hot standby, hands it off to a new author), `hints` (hints in etcd: the
primary's, and rotated backups). The recorded stores are in `tidings.consumer.store_recorded`.
"""
