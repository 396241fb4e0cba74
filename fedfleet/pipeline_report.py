"""The fed3r-ft-oll (fed3r-pp-oll, fed3r-ft-pp-oll) pipeline's report: ``report.png``, ``report.html`` and the console summary.

What it shows, for a plain and a secure run alike so the two compare by eye: test accuracy of
the shared model against cumulative rounds and bytes (y fixed to 0-100 %), the personalised
WMA (global head, OLL, OLL+FP(ψ)) in a panel of its own, one sentence per phase saying what it
changed, and for a secure run the plain-vs-secure comparison (``compare_with``: the plain run's
report, kept inside the secure run's ``report.json``).
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

import numpy as np

from .plots import plot_lines

METHOD_NAMES = {"global": "global head", "personal": "own bias (PP)", "oll": "OLL", "oll_fp": "OLL+FP(ψ)"}
TRAINING_PHASES = ("fed3r", "fedavg-ft", "pp", "ditto")      # the phases that move the shared model, in pipeline order
FT_MODES = {"psi": ("FT(ψ)", None), "phi": ("FT(φ)", "tail"), "M": ("FT(M)", "tail+head")}   # label, train
FP_LABELS = {"psi": "ψ", "phi": "φ", "M": "M"}       # what FP after OLL fine-tunes (config fp_part)
ACCURACY_RANGE = (0.0, 1.0)      # every report's accuracy axes: plain and secure runs compare by eye
PHASE_HEADER = ("phase", "rounds", "tasks done", "test acc.", "MB up/device", "MB down/device",
                "device compute s", "ms/task", "job s")
COMPARE_HEADER = ("phase", "job s plain", "job s secure", "ratio", "MB up plain", "MB up secure", "ratio",
                  "acc. plain", "acc. secure")


def method_name(report: dict, method: str) -> str:
    """The OLL report's name for a method; the personal part is a head after Ditto, a bias after pp;
    FP is of the part the run fine-tuned."""
    if method == "personal" and "ditto" in report["phases"]:
        return "own head (Ditto)"
    if method == "oll_fp":
        return f"OLL+{fp_label(report)}"
    return METHOD_NAMES[method]


def fp_label(report: dict) -> str:
    return f"FP({FP_LABELS[report['config'].get('fp_part', 'psi')]})"


def ft_label(cfg_or_report) -> str:
    get = cfg_or_report.get if isinstance(cfg_or_report, dict) else lambda k, d=None: getattr(cfg_or_report, k, d)
    algorithm = {"fedgloss": " FedGloSS", "scaffold": " Scaffold"}.get(get("ft_algorithm", "fedavg"), "")
    return "Fed3R+" + FT_MODES[get("ft_mode")][0] + algorithm


def is_secure(report: dict) -> bool:
    return bool(report["config"].get("secure"))


def training_phases(report: dict) -> list[str]:
    return [name for name in TRAINING_PHASES if name in report["phases"]]


def phase_label(report: dict, name: str) -> str:
    if name == "pp":
        return f"{report['config'].get('pp_algorithm', 'fedalt')} (shared weight)"
    if name == "ditto":
        return f"Ditto λ={report['config'].get('ditto_lambda', 0.1):g} (global head)"
    return "Fed3R" if name == "fed3r" else ft_label(report["config"])


def accuracy_curves(report: dict) -> dict:
    """Test accuracy of the shared model against cumulative rounds and cumulative bytes (up + down)."""
    curves, rounds0, bytes0 = {}, 0, 0
    names = training_phases(report)
    for i, name in enumerate(names):
        hist = [h for h in report["phases"][name]["history"] if h.get("accuracy") is not None]
        if i:
            # FedAvg-family jobs evaluate after each round; their starting point is where the last phase ended
            start = report["phases"][names[i - 1]]
            hist = [{"round": 0, "accuracy": start["accuracy"], "bytes_in": 0, "bytes_out": 0}] + hist
        rounds = [rounds0 + h["round"] for h in hist]
        moved = [bytes0 + (h.get("bytes_in") or 0) + (h.get("bytes_out") or 0) for h in hist]
        accuracy = [h["accuracy"] for h in hist]
        last_of_round = {r: a for r, a in zip(rounds, accuracy)}     # per-contribution evaluations: the round's last
        curves[name] = {"rounds": rounds, "bytes": moved, "accuracy": accuracy,
                        "by_round": (list(last_of_round), list(last_of_round.values()))}
        rounds0 = rounds[-1] if rounds else rounds0
        phase = report["phases"][name]
        bytes0 += phase["bytes_up"] + phase["bytes_down"]
    curves["end"] = {"rounds": rounds0, "bytes": bytes0}
    return curves


def _points(a: float, b: float) -> str:
    return f"{100 * (b - a):+.2f} points"


def phase_sentences(report: dict) -> dict[str, str]:
    """One sentence per phase saying what it changed, in percentage points of accuracy."""
    phases, out = report["phases"], {}
    fed3r = phases["fed3r"]
    how = "summed under secure aggregation" if is_secure(report) else "sent in the clear"
    text = (f"Fed3R: one closed-form solve over {fed3r['contributions']} devices' statistics, {how}, "
            f"reached {fed3r['accuracy']:.2%} test accuracy")
    if fed3r.get("central_accuracy") is not None:
        text += (f"; the centralized ridge on the same data reaches {fed3r['central_accuracy']:.2%} "
                 f"({_points(fed3r['central_accuracy'], fed3r['accuracy'])}, relative weight error "
                 f"{fed3r.get('rel_weight_error') or float('nan'):.1e})")
    out["fed3r"] = text + "."
    ft = phases.get("fedavg-ft")
    if ft and ft.get("accuracy") is not None and ft.get("initial_accuracy") is not None:
        verb = "added" if ft["accuracy"] >= ft["initial_accuracy"] else "changed test accuracy by"
        out["fedavg-ft"] = (f"Fine-tuning ({ft_label(report['config'])}, {ft['rounds']} rounds) {verb} "
                            f"{_points(ft['initial_accuracy'], ft['accuracy'])}"
                            f"{' of test accuracy' if verb == 'added' else ''} "
                            f"({ft['initial_accuracy']:.2%} → {ft['accuracy']:.2%}).")
    pp = phases.get("pp")
    if pp and pp.get("personal_wma") is not None:
        out["pp"] = (f"Partial personalization ({report['config'].get('pp_algorithm', 'fedalt')}, {pp['rounds']} rounds): "
                     f"each device's own bias gives {pp['personal_wma']:.2%} held-out WMA against "
                     f"{pp['global_wma']:.2%} with the shared head ({_points(pp['global_wma'], pp['personal_wma'])}).")
    ditto = phases.get("ditto")
    if ditto and ditto.get("personal_wma") is not None:
        out["ditto"] = (f"Ditto ({ditto['rounds']} rounds): each device's own head gives {ditto['personal_wma']:.2%} "
                        f"held-out WMA against {ditto['global_wma']:.2%} with the global head "
                        f"({_points(ditto['global_wma'], ditto['personal_wma'])}).")
    wma = (phases.get("oll") or {}).get("wma") or {}
    if "global" in wma and "oll" in wma:
        text = (f"Personalisation: pruning the head to each device's labels (OLL) moved the held-out WMA from "
                f"{wma['global']:.2%} (global head) to {wma['oll']:.2%} ({_points(wma['global'], wma['oll'])})")
        if "oll_fp" in wma:
            text += f"; local fine-tuning {fp_label(report)} added {_points(wma['oll'], wma['oll_fp'])} more ({wma['oll_fp']:.2%})"
        if "personal" in wma:
            own = "head from Ditto" if "ditto" in phases else "bias from partial personalization"
            text += (f"; each device's own {own} alone gives {wma['personal']:.2%} "
                     f"({_points(wma['global'], wma['personal'])} over the global head)")
        out["oll"] = text + "."
    return out


def comparison_rows(plain: dict, secure: dict) -> list[tuple]:
    """Per phase, job time, bytes up and accuracy of a plain run next to a secure one."""
    rows = []
    for name in (n for n in training_phases(plain) if n in secure["phases"]):
        p, s = plain["phases"][name], secure["phases"][name]
        rows.append((name, f"{p['job_s']:.1f}", f"{s['job_s']:.1f}", f"{s['job_s'] / p['job_s']:.2f}",
                     f"{p['bytes_up'] / 1e6:.1f}", f"{s['bytes_up'] / 1e6:.1f}", f"{s['bytes_up'] / p['bytes_up']:.2f}",
                     f"{p['accuracy']:.4f}", f"{s['accuracy']:.4f}"))
    return rows


def compare_reports(plain: dict, secure: dict) -> str:
    """The comparison as console text."""
    widths = (11, 13, 14, 8, 13, 14, 8, 12, 13)
    lines = ["", "=== plain vs secure aggregation (same fleet) ===",
             "".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(COMPARE_HEADER, widths)))]
    rows = comparison_rows(plain, secure)
    lines += ["".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths))) for row in rows]
    note = averaging_difference(rows)
    return "\n".join(lines + ([note] if note else []))


AVERAGING_PHASES = ("fedavg-ft", "pp", "ditto")     # phases whose rounds average device updates


def averaging_difference(rows: list[tuple]) -> str:
    """When ``rows`` (``comparison_rows``) hold an averaging phase: why its secure accuracy need not
    follow the plain one's, from the two jobs' defaults (so the sentence stays true if they change):
    the plaintext layers need each update, a secure round has only the sum. Else ""."""
    if not any(row[0] in AVERAGING_PHASES for row in rows):
        return ""
    from aggregator.jobs.fedavg import FedAvgConfig
    from aggregator.jobs.secure_fedavg import SecureFedAvgConfig

    plain, secure = FedAvgConfig(), SecureFedAvgConfig()
    return (f"note: a plain round bounds each update by {plain.norm_bound_multiplier:g}x the round's median norm "
            f"and steps along a round history (beta {plain.history_momentum:g}); a secure round sees only the sum "
            f"and takes its weighted mean (beta {secure.history_momentum:g}), so the two runs' training curves "
            "need not agree (docs/secure-aggregation.md, \"Bounded influence: checking a group's sum\").")


def write_plots_and_html(report: dict, out: Path) -> str:
    """``report.png`` (accuracy vs rounds, vs bytes, personalised WMA) and ``report.html``."""
    engine = plot_lines(out / "report.png", report_panels(report), title=report_title(report))
    (out / "report.html").write_text(render_html(report, (out / "report.png").read_bytes()))
    return engine


def report_panels(report: dict) -> list[dict]:
    """The plot's panels (fedfleet.plots): accuracy vs rounds, vs bytes, personalised WMA bars."""
    curves = accuracy_curves(report)
    labels = {name: phase_label(report, name) for name in training_phases(report)}
    by_rounds = {label: curves[name]["by_round"] for name, label in labels.items()}
    by_bytes = {label: (np.array(curves[name]["bytes"]) / 1e6, curves[name]["accuracy"]) for name, label in labels.items()}
    styles = {}
    plain = report.get("compared_with")
    if plain:        # the plain run's curves, dashed, under the secure run's
        plain_curves = accuracy_curves(plain)
        for key, label in labels.items():
            name = f"{label} (plain run)"
            by_rounds[name] = plain_curves[key]["by_round"]
            by_bytes[name] = (np.array(plain_curves[key]["bytes"]) / 1e6, plain_curves[key]["accuracy"])
            styles[name] = {"linestyle": "--", "color": "0.55", "linewidth": 1.2}
    accuracy_axis = {"ylabel": "test accuracy (shared model)", "ylim": ACCURACY_RANGE, "percent": True,
                     "styles": styles}
    panels = [{"title": "accuracy vs rounds", "xlabel": "rounds (cumulative over phases)", "lines": by_rounds,
               "annotate_last": list(labels.values()), **accuracy_axis},
              {"title": "accuracy vs bytes", "xlabel": "MB moved, up + down (cumulative)", "lines": by_bytes,
               **accuracy_axis}]
    wma = (report["phases"].get("oll") or {}).get("wma") or {}
    if wma:
        panels.append({"title": "personalised accuracy (WMA, local held-out data)", "ylabel": "WMA",
                       "bars": {method_name(report, m): v for m, v in wma.items()}, "ylim": ACCURACY_RANGE, "percent": True})
    return panels


def report_title(report: dict) -> str:
    phases = " → ".join(report["phases"])
    mode = ("SECURE aggregation (Fed3R-Sync, then each training phase's updates summed under SecAgg)"
            if is_secure(report) else "plain aggregation")
    ft = f", {ft_label(report['config'])}" if "fedavg-ft" in report["phases"] else ""
    return f"fedfleet simulate: {phases}{ft}, {mode}"


def _phase_rows(report: dict) -> list[tuple]:
    rows = []
    for name, p in report["phases"].items():
        dev = p["device"]
        rows.append((name, p["rounds"], p["contributions"], f"{p['accuracy']:.4f}" if p.get("accuracy") is not None else "–",
                     f"{p['bytes_up_per_device'] / 1e6:.3f}", f"{p['bytes_down_per_device'] / 1e6:.3f}",
                     f"{dev['compute_s']:.1f}", f"{dev['compute_s_per_task'] * 1e3:.0f}" if dev["compute_s_per_task"] else "–",
                     f"{p['job_s']:.1f}" if p.get("job_s") else "–"))
    return rows


def _table(table_id: str, header: tuple, rows: list[tuple]) -> str:
    cell = lambda v: f"<td>{html.escape(str(v))}</td>"  # noqa: E731
    body = "".join(f"<tr>{''.join(cell(v) for v in row)}</tr>" for row in rows)
    return f"<table id=\"{table_id}\"><tr>{''.join(f'<th>{html.escape(h)}</th>' for h in header)}</tr>{body}</table>"


def render_html(report: dict, png: bytes) -> str:
    cfg = report["config"]
    oll = report["phases"].get("oll")
    fed3r = report["phases"]["fed3r"]
    if oll is None:
        personalised = "<p>This run had no personalization phase.</p>"
    else:
        wma = [(method_name(report, m), f"{v:.4f}") for m, v in (oll.get("wma") or {}).items()]
        personalised = f"""<h2>Personalised accuracy (WMA over {oll.get('test_samples')} local held-out samples)</h2>
{_table("wma", ("method", "WMA"), wma)}
<p>{fp_label(report)} learning rates chosen by the devices' cross-validation: {html.escape(json.dumps(oll.get('fp_lr_chosen')))};
held-out samples with a label outside the local training labels (scored by the global head):
{oll.get('fallback_samples')}.</p>"""
    sentences = "".join(f'<li data-phase="{html.escape(k)}">{html.escape(v)}</li>'
                        for k, v in phase_sentences(report).items())
    if is_secure(report):
        banner = ('<p class="mode secure" id="mode">SECURE AGGREGATION: Fed3R statistics (Fed3R-Sync) and FedAvg '
                  'updates were summed under SecAgg; the aggregator saw only group sums.</p>')
    else:
        banner = '<p class="mode" id="mode">Plain aggregation: the aggregator saw each device\'s contribution.</p>'
    deployed = ""
    if report.get("deployments"):
        from .deploy_phase import DEPLOY_HEADER, deployment_rows

        outcomes = "".join(f"<li>{html.escape(n)}: {html.escape(r['state'])} {html.escape(r['reason'])}</li>"
                           for n, r in report["deployments"].items())
        deployed = ("<h2>Rollout to the fleet (canary, widening stages, guard on the devices' held-out counts)</h2>"
                    + _table("deployments", DEPLOY_HEADER, deployment_rows(report["deployments"]))
                    + f"<ul id=\"deploy-outcomes\">{outcomes}</ul>")
    compared = ""
    if report.get("compared_with"):
        rows = comparison_rows(report["compared_with"], report)
        note = averaging_difference(rows)
        compared = ("<h2>Plain vs secure aggregation (same fleet and config)</h2>"
                    + _table("compare", COMPARE_HEADER, rows)
                    + "<p>Dashed grey curves in the plot: the plain run.</p>"
                    + (f'<p id="averaging-note">{html.escape(note)}</p>' if note else ""))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(report_title(report))}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:1300px}}
table{{border-collapse:collapse;margin:1em 0}}td,th{{border:1px solid #ccc;padding:4px 10px;text-align:right}}
th{{background:#f3f3f3}}td:first-child{{text-align:left}}.mode{{padding:.5em 1em;background:#eef3f8}}
.mode.secure{{background:#e8f5e9;border-left:4px solid #2e7d32;font-weight:600}}img{{max-width:100%}}</style></head><body>
<h1>{html.escape(report_title(report))}</h1>
{banner}
<p>{cfg['devices']} devices, {html.escape(cfg['split'])}{f" α={cfg['alpha']}" if cfg['split'] == 'dirichlet' else ''},
{html.escape(cfg['backbone'])}@{cfg['image_size']}px ({html.escape(cfg['runtime'])}), κ={cfg['clients_per_round']},
{cfg['holdout_fraction']:.0%} of each device held out for personalised evaluation; wall time {report.get('wall_s', 0):.0f} s.</p>
{f'<p id="timings">{html.escape(timings_line(report))}</p>' if report.get("timings_s") else ""}
<h2>What each phase changed</h2>
<ul id="effects">{sentences}</ul>
<h2>Phases</h2>
{_table("phases", PHASE_HEADER, _phase_rows(report))}
<p>Fed3R {fed3r['accuracy']:.4f} vs centralized ridge {fed3r.get('central_accuracy') or float('nan'):.4f}
(‖W_fed − W_central‖/‖W_central‖ = {fed3r.get('rel_weight_error') or float('nan'):.1e}).</p>
{compared}
{personalised}
{deployed}
<h2>Accuracy vs rounds, vs bytes, and personalised</h2>
<img alt="accuracy vs rounds and bytes, personalised WMA" src="data:image/png;base64,{base64.b64encode(png).decode()}">
</body></html>
"""


def format_pipeline_report(report: dict) -> str:
    widths = [11, 7, 11, 10, 13, 15, 17, 8, 8]
    lines = ["", f"=== {report_title(report)} ===",
             "".join(h.ljust(w) for h, w in zip(PHASE_HEADER, widths))]
    lines += ["".join(str(v).ljust(w) for v, w in zip(row, widths)) for row in _phase_rows(report)]
    lines += list(phase_sentences(report).values())
    oll = report["phases"].get("oll")
    if oll and oll.get("fp_lr_chosen"):
        lines.append(f"{fp_label(report)} learning rates chosen by local cross-validation: {oll['fp_lr_chosen']}")
    if report.get("timings_s"):
        lines.append(timings_line(report))
    if report.get("compared_with"):
        lines.append(compare_reports(report["compared_with"], report))
    return "\n".join(lines)


def timings_line(report: dict) -> str:
    """Where the run's wall time went, step by step (setup, fleet start, each phase, reference)."""
    return "time per step: " + ", ".join(f"{k} {v:.0f} s" for k, v in report["timings_s"].items()) + \
        f"; total {report.get('wall_s', sum(report['timings_s'].values())):.0f} s"
