"""Prometheus text exposition (format 0.0.4) of the aggregator's state, without a client library."""

from __future__ import annotations


def _label(value) -> str:
    return str(value).replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")


class _Exposition:
    def __init__(self):
        self.lines: list[str] = []

    def metric(self, name: str, kind: str, help_: str, samples: list[tuple[dict, float]]) -> None:
        self.lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        for labels, value in samples:
            lab = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
            self.lines.append(f"{name}{{{lab}}} {float(value)!r}" if lab else f"{name} {float(value)!r}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def render_metrics(store, service=None) -> str:
    out = _Exposition()
    counts = store.device_counts()
    live = service.live if service is not None else {}
    out.metric("fedfleet_devices", "gauge", "Devices known to the aggregator, by enrolment status.",
               [({"status": s}, counts.get(s, 0)) for s in ("enrolled", "revoked")])
    out.metric("fedfleet_devices_online", "gauge", "Devices whose last presence message said online.",
               [({}, len(live.get("devices_online", ())) if live else store.online_count())])
    # counted in SQLite: every job was read and parsed on each scrape, a cost growing with the jobs kept
    out.metric("fedfleet_jobs", "gauge", "Jobs by state.",
               [({"state": s}, n) for s, n in sorted(store.job_state_counts().items())])
    job = live.get("job") if live else None
    if job:
        labels = {"job": job["job_id"]}
        out.metric("fedfleet_job_round", "gauge", "Last round opened by the active job.", [(labels, job["round"])])
        out.metric("fedfleet_job_contributions", "gauge", "Contributions applied to the active job.",
                   [(labels, job["contributions"])])
        if job.get("accuracy") is not None:
            out.metric("fedfleet_job_accuracy", "gauge", "Accuracy of the active job's provisional model.",
                       [(labels, job["accuracy"])])
        if (job.get("privacy") or {}).get("not_private"):     # seeded noise (tests only): no ε to claim
            out.metric("fedfleet_job_privacy_seeded_noise", "gauge", "1: the active job's DP noise is seeded "
                       "(FEDFLEET_TEST_DP_NOISE_SEED, tests only); it claims no ε.", [(labels, 1)])
        elif job.get("privacy"):
            out.metric("fedfleet_job_privacy_epsilon", "gauge", "ε spent by the active DP job at its δ (dp-accounting).",
                       [(labels, job["privacy"]["epsilon"])])
        stats = job["stats"]
        out.metric("fedfleet_job_bytes_in_total", "counter", "Bytes received for the active job.",
                   [(labels, stats["bytes_in"])])
        out.metric("fedfleet_job_duplicates_total", "counter", "Redelivered results acknowledged as duplicate.",
                   [(labels, stats["duplicates"])])
        out.metric("fedfleet_job_late_total", "counter", "Results that arrived after their round closed.",
                   [(labels, stats["late"])])
        out.metric("fedfleet_job_devices_clock_ahead", "gauge", "Devices the active job no longer asks: their "
                   "decline said their clock runs ahead of the aggregator's.", [(labels, job.get("clock_ahead", 0))])
        rejections = {**(live.get("stats") or {}).get("rejections", {})}
        for reason, n in stats["rejections"].items():
            rejections[reason] = rejections.get(reason, 0) + n
        out.metric("fedfleet_rejections_total", "counter", "Inbound messages rejected, by reason.",
                   [({"reason": r}, n) for r, n in sorted(rejections.items())])
        current = job.get("current_round")
        if current:
            out.metric("fedfleet_round_participants", "gauge", "Devices of the open round, by answer.",
                       [({**labels, "answer": k}, len(current[k]))
                        for k in ("accepted", "declined", "rejected", "lost", "pending")])
    if service is not None:
        out.metric("fedfleet_store_commits_total", "counter", "SQLite write transactions.",
                   [({}, service.store.commits if service.store else 0)])
        out.metric("fedfleet_store_commit_seconds_total", "counter",
                   "Time spent in store write transactions, contribution payload files included.",
                   [({}, service.store.commit_seconds if service.store else 0.0)])
        out.metric("fedfleet_mqtt_bytes_out_total", "counter", "Bytes published by the aggregator.",
                   [({}, service.link.bytes_sent)])
    return out.text()

