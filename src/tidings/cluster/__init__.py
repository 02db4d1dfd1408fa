"""Local launcher: a private etcd child process and broker processes, each ready on return.

``start()`` returns only once the child answers (trio's readiness handshake); every child is
stopped by PID in a ``finally`` so nothing is left running.
"""

from tidings.cluster.etcd import EtcdProcess, find_etcd, free_port
from tidings.cluster.launcher import BrokerProcess, LocalCluster, broker_endpoints

__all__ = ["BrokerProcess", "EtcdProcess", "LocalCluster", "broker_endpoints", "find_etcd", "free_port"]
