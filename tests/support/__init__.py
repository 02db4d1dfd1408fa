"""Shared test support: a real etcd per session, unique prefixes, wait_until."""
