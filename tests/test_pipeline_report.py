"""The fed3r-ft-oll report (fedfleet/pipeline_report.py): what the PNG's axes hold, the phase
sentences, the secure report's banner and plain-vs-secure table, each checked against the
report's own numbers recomputed here."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from fedfleet.pipeline_report import (ACCURACY_RANGE, METHOD_NAMES, compare_reports, comparison_rows,  # noqa: E402
                                      format_pipeline_report, phase_sentences, render_html, report_panels, report_title,
                                      write_plots_and_html)
from fedfleet.plots import build_figure  # noqa: E402
from fedfleet.sim_config import PRESETS  # noqa: E402


def fake_run(seed: int, secure: bool) -> dict:
    """A report shaped as pipeline_report() writes it, with random figures."""
    rng = np.random.default_rng(seed)
    cfg = dataclasses.asdict(dataclasses.replace(PRESETS["smoke"], secure=secure))
    device = {"tasks": 20, "compute_s": 3.0, "compute_s_per_task": 0.15, "bytes_up_devices": 1000}
    fed3r_acc = float(rng.uniform(0.6, 0.8))
    ft_hist = np.clip(fed3r_acc + np.cumsum(rng.uniform(0, 0.01, 5)), 0, 1)
    phases = {
        "fed3r": {"rounds": 2, "contributions": 20, "accuracy": fed3r_acc,
                  "central_accuracy": fed3r_acc + float(rng.uniform(-1e-3, 1e-3)), "rel_weight_error": 1e-9,
                  "history": [{"round": 1, "accuracy": fed3r_acc - 0.1, "bytes_in": 5e5, "bytes_out": 1e4},
                              {"round": 1, "accuracy": fed3r_acc - 0.05, "bytes_in": 1e6, "bytes_out": 1e4},
                              {"round": 2, "accuracy": fed3r_acc, "bytes_in": 2e6, "bytes_out": 2e4}]},
        "fedavg-ft": {"rounds": 5, "contributions": 25, "accuracy": float(ft_hist[-1]), "initial_accuracy": fed3r_acc,
                      "history": [{"round": r + 1, "accuracy": float(a), "bytes_in": 1e5 * (r + 1),
                                   "bytes_out": 1e5 * (r + 1)} for r, a in enumerate(ft_hist)]},
        "oll": {"rounds": 2, "contributions": 20, "accuracy": float(ft_hist[-1]), "history": [],
                "wma": {"global": 0.7, "oll": float(rng.uniform(0.8, 0.9)), "oll_fp": float(rng.uniform(0.85, 0.95))},
                "test_samples": 600, "fp_lr_chosen": {"0.001": 20}, "fallback_samples": 3},
    }
    for p in phases.values():
        p.update(bytes_up=float(rng.uniform(1e6, 5e6)) * (3 if secure else 1), bytes_down=2e5,
                 bytes_up_per_device=1e5, bytes_down_per_device=1e4, job_s=float(rng.uniform(5, 50)), device=device)
    timings = {"setup (data, bundles, evaluation features)": 7.0, "fed3r": float(rng.uniform(10, 40)), "oll": 12.5}
    return {"config": cfg, "devices": 20, "phases": phases, "wall_s": 100.0, "timings_s": timings}


def test_plain_and_secure_reports_share_fixed_accuracy_axes_and_put_personalised_scores_in_their_own_panel():
    plain, secure = fake_run(1, False), fake_run(2, True)
    secure["compared_with"] = plain
    axes = {name: build_figure(report_panels(r), report_title(r)).axes for name, r in (("plain", plain), ("secure", secure))}
    for name, report in (("plain", plain), ("secure", secure)):
        by_rounds, by_bytes, personalised = axes[name]
        for ax in (by_rounds, by_bytes, personalised):
            assert ax.get_ylim() == pytest.approx(ACCURACY_RANGE)
        # the accuracy panels hold the shared model's curves only; the WMA values are bars elsewhere
        wma = report["phases"]["oll"]["wma"]
        for ax in (by_rounds, by_bytes):
            plotted = np.concatenate([line.get_ydata() for line in ax.get_lines()])
            assert not any(np.isclose(plotted, v).any() for v in wma.values())
            assert ax.get_legend() is not None
        fed3r_line = by_rounds.get_lines()[0]
        # per-contribution evaluations: the rounds panel shows each round's last one
        fed3r_hist = report["phases"]["fed3r"]["history"]
        assert list(fed3r_line.get_ydata()) == [fed3r_hist[1]["accuracy"], fed3r_hist[2]["accuracy"]]
        assert list(by_bytes.get_lines()[0].get_ydata()) == [h["accuracy"] for h in fed3r_hist]
        heights = [bar.get_height() for bar in personalised.patches]
        assert heights == pytest.approx([wma[m] for m in METHOD_NAMES if m in wma])
        assert [t.get_text() for t in personalised.get_xticklabels()] == [METHOD_NAMES[m] for m in wma]
    # the secure plot also carries the plain run's curves (dashed)
    assert len(axes["plain"][0].get_lines()) == 2
    labels = [line.get_label() for line in axes["secure"][0].get_lines()]
    assert "Fed3R (plain run)" in labels and len(labels) == 4
    assert "SECURE" in report_title(secure) and "SECURE" not in report_title(plain)


def test_phase_sentences_say_what_each_phase_changed_in_points():
    report = fake_run(3, False)
    ph = report["phases"]
    sentences = phase_sentences(report)
    gain = 100 * (ph["fedavg-ft"]["accuracy"] - ph["fed3r"]["accuracy"])
    assert f"added {gain:+.2f} points" in sentences["fedavg-ft"]
    wma = ph["oll"]["wma"]
    assert f"({100 * (wma['oll'] - wma['global']):+.2f} points)" in sentences["oll"]
    assert f"added {100 * (wma['oll_fp'] - wma['oll']):+.2f} points more" in sentences["oll"]
    central_gap = 100 * (ph["fed3r"]["accuracy"] - ph["fed3r"]["central_accuracy"])
    assert f"({central_gap:+.2f} points, relative weight error" in sentences["fed3r"]
    # a fine-tuning that lost accuracy is not said to have added it
    worse = fake_run(3, False)
    worse["phases"]["fedavg-ft"]["accuracy"] = worse["phases"]["fed3r"]["accuracy"] - 0.015
    assert "changed test accuracy by -1.50 points" in phase_sentences(worse)["fedavg-ft"]
    assert all(s in format_pipeline_report(report) for s in sentences.values())
    assert (f"time per step: setup (data, bundles, evaluation features) 7 s, fed3r {report['timings_s']['fed3r']:.0f} s, "
            "oll 12 s; total 100 s") in format_pipeline_report(report)


def test_secure_report_says_it_is_secure_and_carries_the_comparison_table(tmp_path):
    plain, secure = fake_run(4, False), fake_run(5, True)
    secure["compared_with"] = plain
    write_plots_and_html(secure, tmp_path)
    page = (tmp_path / "report.html").read_text()
    assert 'class="mode secure"' in page and "SECURE AGGREGATION" in page
    table = page[page.index('<table id="compare">'):]
    table = table[:table.index("</table>")]
    rows = re.findall(r"<tr>(.*?)</tr>", table)[1:]
    cells = [re.findall(r"<td>(.*?)</td>", r) for r in rows]
    assert [c[0] for c in cells] == ["fed3r", "fedavg-ft"]
    for c, name in zip(cells, ("fed3r", "fedavg-ft")):
        p, s = plain["phases"][name], secure["phases"][name]
        assert float(c[1]) == pytest.approx(p["job_s"], abs=0.05) and float(c[2]) == pytest.approx(s["job_s"], abs=0.05)
        assert float(c[6]) == pytest.approx(s["bytes_up"] / p["bytes_up"], abs=0.005)
        assert float(c[7]) == pytest.approx(p["accuracy"], abs=5e-5) and float(c[8]) == pytest.approx(s["accuracy"], abs=5e-5)
    assert cells == [list(r) for r in comparison_rows(plain, secure)]
    for sentence in phase_sentences(secure).values():
        assert sentence in page.replace("&#x27;", "'")
    # the plain report says it is plain and has no comparison
    write_plots_and_html(plain, tmp_path)
    page = (tmp_path / "report.html").read_text()
    assert "SECURE" not in page and 'id="compare"' not in page and "Plain aggregation" in page
    from PIL import Image

    with Image.open(tmp_path / "report.png") as img:
        assert img.size[0] > 3 * img.size[1] * 0.9         # three panels side by side


def test_the_comparison_says_why_a_secure_averaging_phase_need_not_follow_the_plain_one(tmp_path):
    """The secure FedAvg family averages without the plaintext layers that need each update (its
    rounds equal plain FedAvg's plain weighted mean: tests/test_fedavg_secure_over_mqtt.py), so the
    comparison names the two jobs' actual defaults; a Fed3R-only comparison (exact either way) has no note."""
    from aggregator.jobs.fedavg import FedAvgConfig
    from aggregator.jobs.secure_fedavg import SecureFedAvgConfig

    plain, secure = fake_run(6, False), fake_run(7, True)
    secure["compared_with"] = plain
    text = compare_reports(plain, secure)
    note = text.splitlines()[-1]
    assert note.startswith("note: ")
    assert f"{FedAvgConfig().norm_bound_multiplier:g}x the round's median norm" in note
    assert f"(beta {FedAvgConfig().history_momentum:g})" in note
    assert f"(beta {SecureFedAvgConfig().history_momentum:g})" in note
    assert FedAvgConfig().history_momentum != SecureFedAvgConfig().history_momentum
    write_plots_and_html(secure, tmp_path)
    page = (tmp_path / "report.html").read_text().replace("&quot;", '"').replace("&#x27;", "'")
    assert f'<p id="averaging-note">{note}</p>' in page
    for report in (plain, secure):
        del report["phases"]["fedavg-ft"]
    assert "note:" not in compare_reports(plain, secure)
    write_plots_and_html(secure, tmp_path)
    assert "averaging-note" not in (tmp_path / "report.html").read_text()


def test_a_pp_pipeline_report_plots_the_pp_rounds_after_fed3r_and_says_what_the_own_bias_gave():
    """fed3r-pp-oll: no fine-tuning phase; the pp phase's curve continues from Fed3R's end, its
    sentence states the personal and shared WMA it reports, OLL's bars include 'own bias (PP)'."""
    report = fake_run(3, False)
    pp = report["phases"].pop("fedavg-ft")
    pp.update(personal_wma=0.81, global_wma=0.64)
    report["phases"] = {"fed3r": report["phases"]["fed3r"], "pp": pp, "oll": report["phases"]["oll"]}
    report["phases"]["oll"]["wma"] = {"global": 0.64, "personal": 0.81, "oll": 0.85}
    rounds_ax, _, bars = build_figure(report_panels(report), report_title(report)).axes
    fed3r_rounds = report["phases"]["fed3r"]["history"][-1]["round"]
    pp_line = [line for line in rounds_ax.get_lines() if "fedalt" in line.get_label()][0]
    assert pp_line.get_xdata()[0] == fed3r_rounds
    assert pp_line.get_ydata()[0] == pytest.approx(report["phases"]["fed3r"]["accuracy"])
    assert [t.get_text() for t in bars.get_xticklabels()] == [METHOD_NAMES[m] for m in ("global", "personal", "oll")]
    sentence = phase_sentences(report)["pp"]
    assert "81.00%" in sentence and "64.00%" in sentence and "+17.00 points" in sentence
    assert "FT(" not in report_title(report)
    assert "81.00% (+17.00 points over the global head)" in phase_sentences(report)["oll"]
    assert "own bias (PP)" in render_html(report, b"png")


def test_a_ditto_pipeline_report_plots_the_ditto_rounds_and_names_the_own_head():
    """fed3r-ditto-oll: the ditto phase's curve (its global head) continues from Fed3R's end; its
    sentence and OLL's bars speak of each device's own head, not a bias; FP is named by its part."""
    report = fake_run(3, False)
    ditto = report["phases"].pop("fedavg-ft")
    ditto.update(personal_wma=0.79, global_wma=0.70)
    report["config"].update(ditto_lambda=0.5, fp_part="phi")
    report["phases"] = {"fed3r": report["phases"]["fed3r"], "ditto": ditto, "oll": report["phases"]["oll"]}
    report["phases"]["oll"]["wma"] = {"global": 0.70, "personal": 0.79, "oll": 0.85, "oll_fp": 0.88}
    rounds_ax, _, bars = build_figure(report_panels(report), report_title(report)).axes
    line = [line for line in rounds_ax.get_lines() if "Ditto λ=0.5" in line.get_label()][0]
    assert line.get_xdata()[0] == report["phases"]["fed3r"]["history"][-1]["round"]
    assert [t.get_text() for t in bars.get_xticklabels()] == ["global head", "own head (Ditto)", "OLL", "OLL+FP(φ)"]
    assert "local fine-tuning FP(φ) added +3.00 points" in phase_sentences(report)["oll"]
    assert "79.00%" in phase_sentences(report)["ditto"] and "+9.00 points" in phase_sentences(report)["ditto"]
    assert "own head from Ditto alone gives 79.00%" in phase_sentences(report)["oll"]
