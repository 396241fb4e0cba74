"""What ``fedfleet admin`` prints for people (``--json`` prints the API's JSON instead): tables, progress
lines, a job, a round-log line. Every value the API answered is shown on one line (``one_line``), the
whole made terminal-safe: the answers quote devices' words."""

from __future__ import annotations

import time

from .terminal_text import one_line, terminal_safe


def ago(ts: float | None) -> str:
    if not ts:
        return "-"
    s = max(0.0, time.time() - ts)
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago" if s < 7200 else f"{s / 3600:.1f}h ago"


def table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """Left-aligned text table; ``columns`` = [(header, key)], each value on one line (``one_line``)."""
    cells = [[h for h, _ in columns]] + [["-" if r.get(k) is None else one_line(r.get(k)) for _, k in columns]
                                         for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return terminal_safe("\n".join(lines))


def bar(done: int, total: int, width: int = 30) -> str:
    filled = int(width * min(done, total) / max(1, total))
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}"


def device_count(value) -> int:
    """A count of devices in /api/status (an earlier aggregator listed them: the list's length)."""
    count = len(value) if isinstance(value, list) else value
    if type(count) is not int or count < 0:         # a bool is no count
        raise TypeError(f"a count of devices is {type(value).__name__} {value!r:.40}")
    return count


def progress_line(status: dict) -> str:
    job = status.get("job")
    online = device_count(status.get("devices_online", 0))
    if not job:
        return f"no active job; {online} devices online"
    cur = job.get("current_round")
    acc = f"  acc {job['accuracy']:.4f}" if job.get("accuracy") is not None else ""
    if cur:
        answered = sum(device_count(cur[k]) for k in ("accepted", "declined", "rejected"))
        rnd = f"round {cur['round']:>3} {bar(answered, device_count(cur['participants']), 20)}"
    else:
        rnd = f"round {job['round']:>3} ({one_line(job.get('waiting') or 'between rounds')})"
    return (f"{one_line(job['job_id'], 64)} [{one_line(job['state'], 64)}] {rnd}  contributions {job['contributions']}  "
            f"online {online}{acc}")


def listed(values, empty: str = "-") -> str:
    """Device ids (or other values) the API listed, on one line: each a value, never layout."""
    return one_line(", ".join(str(v) for v in values), 4000) or empty


def devices_rows(devices: list[dict]) -> list[dict]:
    return [{**d, "seen": ago(d["last_seen"]), "state": "online" if d["online"] else "offline",
             "tags_": ",".join(d.get("tags", []))[:40],
             "profile_": ",".join(f"{k}={v}" for k, v in sorted(d["profile"].items()))[:40]} for d in devices]


def round_rows(rounds: list[dict]) -> list[dict]:
    return [{**r, "n_part": len(r["participants"]), "n_acc": len(r["accepted"]), "n_drop": len(r["dropped"]),
             "n_decl": len(r["declined"]), "n_rej": len(r["rejected"]),
             "dur": f"{r['duration_s']:.1f}s" if r["duration_s"] is not None else "open",
             "kb": f"{r['bytes_in'] / 1024:.1f}"} for r in rounds]


def model_rows(models: list[dict]) -> list[dict]:
    return [{**m, "acc": (f"{m['metrics']['accuracy']:.4f}" if m["metrics"].get("accuracy") is not None else None),
             "sha": m["sha256"][:12], "final_": "yes" if m["final"] else ""} for m in models]


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(ts))} ({ago(ts)})"


def job_text(j: dict) -> str:
    """A job as an operator reads it: state, times as dates, counters and config as key: value lines."""
    lines = [f"job {one_line(j['job_id'], 64)} ({one_line(j['kind'], 64)}): {one_line(j['state'], 64)}",
             f"  rounds {j['rounds']}, contributions {j['contributions']}",
             f"  created   {_when(j.get('created_at'))}", f"  started   {_when(j.get('started_at'))}",
             f"  finished  {_when(j.get('finished_at'))}"]
    counters = j.get("counters") or {}
    rejections = counters.get("rejections") or {}
    if counters:
        lines.append(f"  bytes in {counters.get('bytes_in', 0):,}, late {counters.get('late', 0)}, "
                     f"duplicates {counters.get('duplicates', 0)}")
    if rejections:
        lines.append("  rejected  " + ", ".join(f"{one_line(k)}: {v}" for k, v in sorted(rejections.items())))
    if (j.get("summary") or {}).get("error"):
        lines.append(f"  error     {one_line(j['summary']['error'], 2000)}")
    lines.append("  config")
    lines += [f"    {k:<22}{one_line(v, 2000)}" for k, v in sorted((j.get("config") or {}).items())]
    return "\n".join(lines)


def log_line(e: dict) -> str:
    """One round-log event as a line of text: time, round, event, then its fields."""
    when = time.strftime("%H:%M:%S", time.localtime(e["t"])) if isinstance(e.get("t"), (int, float)) else "--:--:--"
    rnd = f"round {e['round']:>3}" if isinstance(e.get("round"), int) else " " * 9
    rest = []
    for k, v in e.items():
        if k in ("t", "job_id", "event", "round") or v in (None, [], ""):
            continue
        if isinstance(v, list):
            v = f"{len(v)} [{', '.join(map(str, v[:5]))}{', ...' if len(v) > 5 else ''}]"
        elif isinstance(v, float):
            v = f"{v:.4f}" if abs(v) < 1e6 else f"{v:.0f}"
        rest.append(f"{one_line(k, 64)}={one_line(v)}")
    return f"{when} {rnd} {one_line(e.get('event', '?'), 64):<13}{' '.join(rest)}"
