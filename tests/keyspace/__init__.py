"""The etcd client and the KeySpace mirror."""
