"""What the LADD comparison reports: the text table and the PNG plots."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedfleet.ladd.config import METHODS

def format_report(r: dict) -> str:
    s = r["summary"]
    lines = ["", "=== fedfleet simulate: LADD (mIoU on the target test sets, mean of per-domain mIoU) ===",
             f"{'method':<16}{'mean':>8}{'std':>8}   per seed"]
    for m in METHODS:
        v = s["miou"][m]
        lines.append(f"{m:<16}{v['mean']:>8.4f}{v['std']:>8.4f}   " + " ".join(f"{x:.4f}" for x in v["per_seed"]))
    domains = list(s["miou"]["ladd"]["per_domain"])
    lines += ["", f"{'per domain':<16}" + "".join(f"{d:>10}" for d in domains)]
    for m in METHODS:
        lines.append(f"{m:<16}" + "".join(f"{s['miou'][m]['per_domain'][d]:>10.4f}" for d in domains))
    for seed, rep in r["seeds"].items():
        ladd = rep["methods"]["ladd"]
        majority = {str(c): max(ladd["routing"], key=lambda d: ladd["routing"][d][int(c)]) for c in ladd["per_cluster"]}
        lines.append(f"LADD seed {seed} per cluster (test images routed by style; majority domain): " +
                     ", ".join(f"c{c}[{majority[c]}] {v:.4f}" for c, v in ladd["per_cluster"].items()))
    lines += ["", f"clusters k per seed {s['k']}, silhouette {[round(x, 3) for x in s['silhouette']]}, "
              f"purity {[round(x, 3) for x in s['purity']]}, test-image routing purity "
              f"{[round(x, 3) for x in s['test_routing_purity']]}",
              f"source-only < FedAvg+ST < LADD: {s['ordering_source_lt_fedavg_lt_ladd']}",
              f"wall time {r['wall_s']:.0f}s"]
    if r["config"].get("secure"):
        failed = {seed: {n: len(v) for n, v in rep.get("secure_failed_rounds", {}).items()}
                  for seed, rep in r["seeds"].items()}
        lines.insert(-1, f"secure aggregation ({r['config']['secure_graph']}): training rounds summed under SecAgg; "
                         f"failed (nothing applied) per seed {failed}")
    return "\n".join(lines)


def plots(report: dict, out: Path) -> list[str]:
    """Bar chart of mIoU per method (mean ± std over seeds) and mIoU per round (PNG, Pillow)."""
    try:
        from PIL import Image, ImageDraw
    except ImportError:  # pragma: no cover - depends on the install
        return []
    s = report["summary"]["miou"]
    W, H, pad = 640, 360, 50
    img = Image.new("RGB", (W, H), "white")
    g = ImageDraw.Draw(img)
    vals = [s[m]["mean"] for m in METHODS]
    lo = max(0.0, min(vals) - 0.1)
    hi = min(1.0, max(vals) + 0.05)
    y = lambda v: H - pad - (v - lo) / max(hi - lo, 1e-9) * (H - 2 * pad)
    g.line([(pad, pad), (pad, H - pad), (W - pad, H - pad)], fill="black")
    for t in np.linspace(lo, hi, 5):
        g.text((5, y(t) - 6), f"{t:.2f}", fill="black")
    bw = (W - 2 * pad) / len(METHODS)
    colours = ["#999999", "#77aadd", "#ee8866", "#44bb99"]
    for i, m in enumerate(METHODS):
        x0 = pad + i * bw + bw * 0.15
        g.rectangle([x0, y(s[m]["mean"]), x0 + bw * 0.7, H - pad], fill=colours[i])
        xc = x0 + bw * 0.35
        g.line([(xc, y(s[m]["mean"] - s[m]["std"])), (xc, y(s[m]["mean"] + s[m]["std"]))], fill="black", width=2)
        g.text((x0, H - pad + 8), m, fill="black")
        g.text((x0, y(s[m]["mean"]) - 14), f"{s[m]['mean']:.3f}", fill="black")
    g.text((pad, 10), "mIoU on target test sets (mean ± std over seeds)", fill="black")
    paths = [out / "ladd_miou.png"]
    img.save(paths[0])
    curves = {}
    for m in ("fedavg_st", "ladd"):
        runs = [r["histories"][m] for r in report["seeds"].values() if r["histories"].get(m)]
        if runs:
            rounds = sorted({h["train_round"] for run in runs for h in run})
            curves[m] = (rounds, [float(np.mean([h["miou"] for run in runs for h in run if h["train_round"] == t]))
                                  for t in rounds])
    if curves:
        img = Image.new("RGB", (W, H), "white")
        g = ImageDraw.Draw(img)
        allv = [v for _, ys in curves.values() for v in ys] + [s["fda_pretrained"]["mean"], s["source_only"]["mean"]]
        lo, hi = min(allv) - 0.02, max(allv) + 0.02
        tmax = max(max(xs) for xs, _ in curves.values())
        x = lambda t: pad + t / max(tmax, 1) * (W - 2 * pad)
        y = lambda v: H - pad - (v - lo) / max(hi - lo, 1e-9) * (H - 2 * pad)
        g.line([(pad, pad), (pad, H - pad), (W - pad, H - pad)], fill="black")
        for t in np.linspace(lo, hi, 5):
            g.text((5, y(t) - 6), f"{t:.3f}", fill="black")
        for t in range(0, tmax + 1, max(1, tmax // 6)):
            g.text((x(t) - 3, H - pad + 6), str(t), fill="black")
        g.text((W // 2 - 20, H - pad + 22), "round", fill="black")
        start = s["fda_pretrained"]["mean"]
        for (m, (xs, ys)), colour in zip(curves.items(), ("#ee8866", "#44bb99")):
            g.line([(x(0), y(start))] + [(x(a), y(b)) for a, b in zip(xs, ys)], fill=colour, width=2)
            g.text((W - pad - 90, y(ys[-1]) - 12), m, fill=colour)
        g.line([(pad, y(s["source_only"]["mean"])), (W - pad, y(s["source_only"]["mean"]))], fill="#999999")
        g.text((pad + 5, y(s["source_only"]["mean"]) + 2), "source-only", fill="#999999")
        g.text((pad, 10), "mIoU per round (mean over seeds); round 0 = FDA pre-trained", fill="black")
        paths.append(out / "ladd_rounds.png")
        img.save(paths[-1])
    return [str(p) for p in paths]
