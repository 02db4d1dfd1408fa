"""Local launcher: a private etcd child process and broker processes, each ready on return.

``start()`` returns only once the child answers (trio's readiness handshake); every child is
stopped by PID in a ``finally`` so nothing is left running.
"""

from tidings.cluster.etcd import EtcdProcess, find_etcd, free_port

__all__ = ["EtcdProcess", "find_etcd", "free_port"]
