"""A listing a page at a time (keyset paging): the rows after a cursor row's key, in key order or
its reverse, so a listing followed page by page holds every row once even while rows are added,
and a page costs an index seek, not the rows before it (OFFSET reads and drops them)."""

from __future__ import annotations

import sqlite3
from typing import Any


def key_page(db: sqlite3.Connection, select: str, keys: tuple[str, ...], after: tuple | None = None,
             limit: int | None = None, newest: bool = False, where: str = "", args: tuple = ()) -> list[sqlite3.Row]:
    """The rows of ``select`` (``SELECT ... FROM table``) matching ``where`` (with ``args``), in
    ``keys`` order (``newest``: reversed): every one, or the first ``limit`` whose key is past
    ``after`` (the key of the last row of the page before)."""
    op, way = ("<", "DESC") if newest else (">", "ASC")
    conditions, values = ([where] if where else []), list(args)
    if after is not None:
        conditions.append(f"({', '.join(keys)}) {op} ({', '.join('?' * len(keys))})")
        values += after
    sql = select + (" WHERE " + " AND ".join(conditions) if conditions else "")
    sql += " ORDER BY " + ", ".join(f"{k} {way}" for k in keys)
    if limit is not None:
        sql, values = sql + " LIMIT ?", values + [limit]
    return db.execute(sql, values).fetchall()


def row_count(db: sqlite3.Connection, table: str, where: str = "", args: tuple = ()) -> int:
    """How many rows of ``table`` match ``where``: a listing's total beside its page."""
    value: Any = db.execute(f"SELECT COUNT(*) FROM {table}" + (f" WHERE {where}" if where else ""), args).fetchone()[0]
    return int(value)
