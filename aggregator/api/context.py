"""What every admin-API route needs: the store to read, the live snapshot, and the one way to
change anything — a function run on the service thread (the only writer), with its errors turned
into HTTP statuses."""

from __future__ import annotations

from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable

from fastapi import HTTPException, status

from aggregator.storage.store import Store, StoreError


@dataclass
class ApiContext:
    store: Store
    service: Any = None              # the running AggregatorService (None: read-only API on a store)
    deployments: Any = None          # the DeploymentController beside it (None: deployments are read-only)

    def live(self) -> dict:
        return self.service.live if self.service is not None else {}

    def mutate(self, fn: Callable[[], Any]) -> Any:
        if self.service is None:
            raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "no aggregator service in this process")
        return self.run_on(self.service, fn)

    def deploy_action(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the deployment controller's thread (its only writer)."""
        if self.deployments is None:
            raise HTTPException(status.HTTP_409_CONFLICT, "no deployment controller in this process "
                                                          "(the aggregator runs one with --state)")
        return self.run_on(self.deployments, fn)

    @staticmethod
    def run_on(owner: Any, fn: Callable[[], Any]) -> Any:
        """``owner.call(fn)`` with its errors turned into HTTP statuses."""
        try:
            return owner.call(fn, timeout=10.0)
        except FutureTimeout:
            # withdrawn unrun (MessageLoop.call): the answer can promise that nothing changed
            raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE,
                                "the aggregator is not answering (busy for 10 s): nothing was changed, try again") from None
        except KeyError as exc:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"not found: {exc}") from None
        except StoreError as exc:
            raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from None
        except (ValueError, TypeError) as exc:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_ENTITY, str(exc)) from None

    def job(self, job_id: str) -> dict:
        row = self.store.job(job_id)
        if row is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id!r}")
        return row

    def job_out(self, row: dict) -> dict:
        # counted, not read: /api/jobs (every job, each second from the dashboard) parsed every round
        # of every job to count them
        return {**row, "rounds": self.store.round_count(row["job_id"]),
                "contributions": self.store.contribution_count(row["job_id"])}
