"""Plots for reports (simulation pipelines, benches), drawn with matplotlib (fedfleet[server]).

Reports are written by ``fedfleet simulate`` and the benches, which need the server extra
anyway (torch, scikit-learn); a device never draws one, so the device extras stay free of
matplotlib and there is no second, lesser renderer to keep in step.

A panel is ``{"title", "xlabel", "ylabel", "lines": {label: (xs, ys)}}`` with optional
``"logx"``, ``"xticks"`` (tick values written plainly), ``"ylim"`` (a fixed range, so two reports compare by eye), ``"percent"`` (y ticks as
percentages), ``"styles": {label: matplotlib line kwargs}`` and ``"annotate_last"`` (labels of lines whose
last value is written next to their end). ``{"bars": {label: value}}`` instead of ``"lines"``
draws a bar panel with each value written on its bar. A line with a single point is drawn as a
marker.
"""

from __future__ import annotations

from pathlib import Path


def build_figure(panels: list[dict], title: str | None = None):
    """The matplotlib Figure of ``panels`` side by side (one row), with an optional title."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, PercentFormatter

    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 5.0), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if "bars" in panel:
            _draw_bars(ax, panel["bars"])
        else:
            _draw_lines(ax, panel)
        ax.set_title(panel["title"], fontsize=12)
        ax.set_xlabel(panel.get("xlabel", ""), fontsize=11)
        ax.set_ylabel(panel.get("ylabel", ""), fontsize=11)
        ax.tick_params(labelsize=10)
        if panel.get("logx"):
            ax.set_xscale("log")
        if panel.get("xticks"):          # these values, written plainly (not 6×10⁻¹ on a log axis)
            ax.set_xticks(panel["xticks"], [f"{x:g}" for x in panel["xticks"]])
            ax.xaxis.set_minor_formatter(NullFormatter())
        if panel.get("ylim"):
            ax.set_ylim(*panel["ylim"])
        if panel.get("percent"):
            ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0, decimals=0))
        ax.grid(alpha=0.35, which="major")
        ax.minorticks_on()
        ax.grid(alpha=0.12, which="minor")
    if title:
        fig.suptitle(title, fontsize=13, fontweight="bold")
    fig.tight_layout()
    return fig


def _draw_lines(ax, panel: dict) -> None:
    styles = panel.get("styles", {})
    for label, (xs, ys) in panel["lines"].items():
        if not len(xs):
            continue
        style = {"marker": "o", "markersize": 4} if len(xs) == 1 else {"linewidth": 2}
        (line,) = ax.plot(xs, ys, label=label, **{**style, **styles.get(label, {})})
        if label in panel.get("annotate_last", ()):
            ax.annotate(f"{ys[-1]:.1%}" if panel.get("percent") else f"{ys[-1]:.3g}", (xs[-1], ys[-1]),
                        xytext=(4, 4), textcoords="offset points", fontsize=9, color=line.get_color())
    ax.margins(x=0.08)               # room for the end labels
    # below the curves: accuracy curves climb, so the lower right is where they are not
    ax.legend(fontsize=9, loc="lower right", framealpha=0.9)


def _draw_bars(ax, bars: dict) -> None:
    labels, values = list(bars), [bars[k] for k in bars]
    colors = [f"C{i}" for i in range(len(labels))]
    rects = ax.bar(labels, values, color=colors, width=0.6)
    for rect, v in zip(rects, values):
        ax.annotate(f"{v:.1%}", (rect.get_x() + rect.get_width() / 2, v), xytext=(0, 3),
                    textcoords="offset points", ha="center", fontsize=10)


def plot_lines(path: Path, panels: list[dict], title: str | None = None) -> str:
    """Write ``panels`` as one PNG; returns the renderer's name for the caller's log line."""
    import matplotlib.pyplot as plt

    fig = build_figure(panels, title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "matplotlib"

