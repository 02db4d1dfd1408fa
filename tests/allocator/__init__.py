"""The allocator: the assignment solver, and the leader converging assignments in etcd."""
