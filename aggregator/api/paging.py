"""The admin API's listings a page at a time (``/api/jobs``, ``/api/models``, ``/api/deployments``;
``/api/devices`` pages by device id the same way, ``routes_fleet.py``).

Keyset paging, not offset+limit: ``after`` names the last row of the page before (a job id, a model
id), so a listing followed page by page holds every row exactly once even while jobs are created
(an offset shifts under an insert, newest-first at every insert) and a page costs an index seek at
any depth (``storage/pages.py``). The answer stays the bare JSON list it always was, bounded by
``limit`` (default ``PAGE``): a client that never pages gets today's answer while the listing is
smaller than a page, and a bounded one after. The headers say the rest: ``X-Total-Count`` (rows in
the listing) and, when more rows follow, ``X-Next-After`` (pass it as ``after``)."""

from __future__ import annotations

from typing import Literal

from fastapi import HTTPException, Query, Response, status

from aggregator.api.schemas import ONE

PAGE, MAX_PAGE = 1000, 5000         # rows per page: default, most (a page of jobs is bounded by MAX_PAGE rows)
Order = Literal["oldest", "newest"]
PAGED = ("; a page at a time: at most `limit` (default 1000, at most 5000); `order` oldest (default) or newest "
         "first; the header X-Total-Count counts the whole listing and, when more follow, X-Next-After names the "
         "last row: pass it as `after` for the next page")
HEADERS = {"X-Total-Count": {"description": "rows in the whole listing", "schema": {"type": "integer"}},
           "X-Next-After": {"description": "present when more rows follow: `after` for the next page",
                            "schema": {"type": "string"}}}
PAGE_READ = {**ONE, 200: {"description": "a page of the listing", "headers": HEADERS}}


def limit_query():
    return Query(default=PAGE, ge=1, le=MAX_PAGE, description="rows per page")


def order_query():
    return Query(default="oldest", description="creation order: oldest first, or newest first")


def cursor(found: dict | None, after: str) -> dict:
    """The row ``after`` names (``found``: looked up; None: no such row): a 404 naming it when it
    names none (as the row's own route answers), so a mistyped cursor is no silently empty or
    restarted listing."""
    if found is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"after={after!r}: no such row to list after")
    return found


def paged(response: Response, rows: list[dict], limit: int, total: int, key: str) -> list[dict]:
    """The page of ``rows`` (read ``limit + 1``: one more tells that more follow) with its headers."""
    page = rows[:limit]
    response.headers["X-Total-Count"] = str(total)
    if len(rows) > limit:
        response.headers["X-Next-After"] = str(page[-1][key])
    return page
