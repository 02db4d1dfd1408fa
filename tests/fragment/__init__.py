"""Fragments: naming, the index, stores and the persister."""
