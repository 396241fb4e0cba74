"""What ``fedfleet simulate`` reports about one job, and the text it prints.

The centralized reference is computed here, independently of the aggregator: the same features
(the devices' feature cache makes re-reading them cheap), scikit-learn's Ridge on the
bias-augmented features with the same λ, then the same column normalisation (FedNCM: numpy's
class means). Under DP (``dp_epsilon``) the reference is the model without DP the private one is
read against (``fedfleet/dp_fleet.py``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import reported_config


def job_report(cfg, results: dict, workers: list[dict], prep, job_dir: Path | None = None) -> dict:
    """What a one-phase run (or a pipeline's Fed3R phase) reports: the aggregator's figures, the
    devices' costs and the independent centralized reference on the contributing devices' data
    (``cfg`` a ``SimConfig``, ``prep`` the run's ``Prepared`` data, both ``fedfleet/simulate.py``'s)."""
    from sklearn.linear_model import Ridge

    shards, Xtr, ytr, Zte, yte, extractor = prep.shards, prep.Xtr, prep.ytr, prep.Zte, prep.yte, prep.extractor
    contributed = sorted(results["contributed"])
    # The devices cached their features per shard, so the reference reads them shard by shard
    # (stacking the whole set first would be a different cache key and a full re-extraction).
    Z = (np.concatenate([extractor.extract(Xtr[shards[d]]) for d in contributed]) if contributed
         else np.zeros((0, Zte.shape[1])))
    y = np.concatenate([ytr[shards[d]] for d in contributed]) if contributed else np.array([], dtype=int)
    fed = np.load((job_dir or prep.out) / "model.npz")
    report = {"config": reported_config(cfg), "devices": cfg.devices, "contributed": len(contributed),
              "rounds": len(results["rounds"]) + results["rounds_earlier"],
              "bytes_up": results["bytes_in"], "bytes_down": results["bytes_out"],
              "rejections": results["rejections"], "late": results["late"], "duplicates": results["duplicates"],
              "fed3r_accuracy": results["final"].get("accuracy"), "history": results["history"],
              "dropouts": sum(w["dropouts"] for w in workers), "device_compute_s": sum(w["compute_s"] for w in workers),
              "tasks_stopped": sum(w.get("tasks_stopped", 0) for w in workers),
              "job_s": results.get("wall_s"),
              **fleet_figures(cfg, results, workers), **upload_forms(workers, prep.fed3r_job.get("feature_dim"))}
    if cfg.rf_dim:
        from protocols.random_features import RandomFourierFeatures

        rf = RandomFourierFeatures(cfg.rf_dim, cfg.rf_sigma, cfg.seed + 1).fit(n_features=Z.shape[1])
        Z, Zte = rf.transform(Z), rf.transform(Zte)
    if len(y) and cfg.classifier == "fedncm":
        report.update(central_ncm(Z, y, Zte, yte, fed["raw_weights"]))
    elif len(y):
        Za = np.hstack([Z.astype(np.float64), np.ones((len(Z), 1))])
        W = Ridge(alpha=cfg.lam, fit_intercept=False, solver="cholesky").fit(Za, np.eye(10)[y]).coef_.T
        norms = np.linalg.norm(W[:-1], axis=0)
        norms[norms == 0] = 1e-6
        scores = Zte.astype(np.float64) @ (W[:-1] / norms) + W[-1] / norms
        report["central_accuracy"] = float((scores.argmax(1) == yte).mean())
        report["rel_weight_error"] = float(np.linalg.norm(fed["raw_weights"] - W) / np.linalg.norm(W))
        report["central_samples"] = int(len(y))
    if cfg.dp_epsilon:
        report["privacy"] = results["final"].get("privacy")
    return report


def central_ncm(Z, y, Zte, yte, fed_raw: np.ndarray, num_classes: int = 10) -> dict:
    """The centralized FedNCM reference, in numpy: class means of the same features, normalised;
    its test accuracy and the relative error of the federated means (FedNCM's raw_weights: the
    means (d, C), then the class counts)."""
    Z = Z.astype(np.float64)
    counts = np.bincount(y, minlength=num_classes)
    means = np.stack([Z[y == c].mean(axis=0) if counts[c] else np.zeros(Z.shape[1]) for c in range(num_classes)], 1)
    norms = np.linalg.norm(means, axis=0)
    norms[norms == 0] = 1.0
    scores = Zte.astype(np.float64) @ (means / norms)
    return {"central_accuracy": float((scores.argmax(1) == yte).mean()), "central_samples": int(len(y)),
            "rel_weight_error": float(np.linalg.norm(fed_raw[:-1] - means) / np.linalg.norm(means))}


def fleet_figures(cfg, results: dict, workers: list[dict]) -> dict:
    """Per-device costs of the run: upload bytes per contributing device (as the aggregator
    counted them, and as the devices sent them: retries included) and device-host memory."""
    contributed = max(1, len(results["contributed"]))
    rss = sum(w.get("rss_mb", 0.0) for w in workers)
    connect_s = [w.get("connect_s") for w in workers]     # workers start their devices side by side
    return {"devices_started_per_s": (cfg.devices / max(connect_s) if connect_s and None not in connect_s
                                      and max(connect_s) > 0 else None),
            "contributions_per_s": len(results["contributed"]) / results["wall_s"] if results.get("wall_s") else None,
            "bytes_up_per_device": results["bytes_in"] / contributed,
            "device_bytes_up_per_device": sum(w["bytes_up"] for w in workers) / contributed,
            "host_rss_mb": rss, "host_rss_mb_per_device": rss / max(1, cfg.devices),
            "not_connected": sum(len(w.get("not_connected", {})) for w in workers),
            "connections_lost": sum(w.get("connections_lost", 0) for w in workers),
            "host_loop_lag_max_s": max((w.get("loop_lag_max_s", 0.0) for w in workers), default=0.0)}


def upload_forms(workers: list[dict], feature_dim: int | None) -> dict:
    """How many devices sent the Fed3R factor form and how many the dense one, told apart by
    size: a device's upload below half the dense upper triangle of A_k (8·p(p+1)/2 bytes, p the
    bias-augmented dimension) is a factor (8·n·(p + C) bytes for n < p samples)."""
    if not feature_dim:
        return {}
    p = feature_dim + 1
    sent = [d["bytes_up"] for w in workers for d in w.get("per_device", {}).values() if d.get("tasks_done")]
    factor = sum(b < 8 * p * (p + 1) / 4 for b in sent)
    return {"factor_uploads": factor, "dense_uploads": len(sent) - factor}


def format_report(r: dict) -> str:
    from .dp_fleet import one_round

    name = {"fedncm": "FedNCM"}.get(r["config"].get("classifier"), "Fed3R")
    title = f"{name}-Sync (secure aggregation)" if r["config"].get("secure") else name
    lines = ["", f"=== fedfleet simulate: {title} ===",
             f"devices contributed     {r['contributed']}/{r['devices']} in {r['rounds']} rounds "
             f"({r['dropouts']} drop-outs {'lost' if one_round(r['config'].get('dp_epsilon'), r['config'].get('secure'), r['config'].get('dp_release', 'round')) else 'retried'}, "
             f"{r['late']} late results discarded"
             + (f", {r['tasks_stopped']} tasks stopped at their round's end" if r.get("tasks_stopped") else "") + ")",
             f"{name + ' accuracy':23s} {r['fed3r_accuracy']:.4f}"]
    if "central_accuracy" in r:
        reference = "centralized NCM acc.    " if name == "FedNCM" else "centralized ridge acc.  "
        lines += [f"{reference}{r['central_accuracy']:.4f}   ({'numpy' if name == 'FedNCM' else 'sklearn'}, same features, "
                  f"{r['central_samples']} samples)"]
        if r["config"].get("dp_epsilon"):
            from .dp_fleet import dp_report_lines

            lines += dp_report_lines(r)
        else:
            lines.append(f"‖W_fed − W_central‖/‖W_central‖ = {r['rel_weight_error']:.2e}")
    per_dev = r["bytes_up"] / max(1, r["contributed"])
    lines += [f"bytes up (all devices)  {r['bytes_up'] / 1e6:.1f} MB  ({per_dev / 1e6:.2f} MB per contributing device; "
              f"{r.get('factor_uploads', '?')} factor-form / {r.get('dense_uploads', '?')} dense uploads)",
              f"bytes down              {r['bytes_down'] / 1e6:.3f} MB",
              f"device hosts            {r.get('host_rss_mb', 0):.0f} MB RSS "
              f"({r.get('host_rss_mb_per_device', 0):.3f} MB per device, data and backbone included)",
              f"brokers                 {r.get('broker_rss_mb') or 0:.0f} MB RSS (mosquitto, at the end)",
              f"connections             {r.get('connections_lost', 0)} lost and re-opened; host MQTT loops at most "
              f"{r.get('host_loop_lag_max_s', 0):.1f} s late",
              f"devices started         {r.get('devices_started_per_s') or 0:.0f} per s (until all connected); "
              f"{r.get('contributions_per_s') or 0:.1f} contributions per s (job time)",
              f"device compute          {r['device_compute_s']:.1f} s total (a host's queue for its compute slot left out)",
              f"job time (aggregator)   {r.get('job_s') or 0:.1f} s   (first task to final model)",
              f"wall time               {r.get('wall_s', 0):.1f} s"]
    return "\n".join(lines)
