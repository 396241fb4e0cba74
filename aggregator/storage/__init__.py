"""Durable state: the SQLite store, its schema, contribution payload files, the round log."""
