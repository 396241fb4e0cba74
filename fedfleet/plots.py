"""Line plots for reports (simulation pipelines, benches): matplotlib when installed, else PIL.

Pillow ships with the device extra; matplotlib is optional, so a report always gets its PNG.
Panels: ``{"title", "xlabel", "ylabel", "lines": {label: (xs, ys)}, "logx"}``; a line with a
single point is drawn as a dot.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def plot_lines(path: Path, panels: list[dict]) -> str:
    """Panels of line plots: {"title", "xlabel", "ylabel", "lines": {label: (xs, ys)}, "logx"}."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _plot_lines_pil(path, panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5))
    for ax, panel in zip(np.atleast_1d(axes), panels):
        for label, (xs, ys) in panel["lines"].items():
            ax.plot(xs, ys, label=label)
        ax.set(title=panel["title"], xlabel=panel["xlabel"], ylabel=panel["ylabel"])
        if panel.get("logx"):
            ax.set_xscale("log")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return "matplotlib"


def _plot_lines_pil(path: Path, panels: list[dict]) -> str:
    """Bare-bones fallback when matplotlib is not installed: axes, ticks, lines, legend."""
    from PIL import Image, ImageDraw

    W, H, L, R, T, B = 560, 420, 60, 15, 30, 45
    colors = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
              (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]
    def ascii_only(text: str) -> str:   # PIL's default bitmap font has no Greek letters
        for greek, latin in (("ψ", "psi"), ("φ", "phi"), ("β", "beta"), ("κ", "kappa"), ("−", "-"), ("±", "+-"),
                             ("×", "x")):
            text = text.replace(greek, latin)
        return text

    img = Image.new("RGB", (W * len(panels), H), "white")
    draw = ImageDraw.Draw(img)
    for p, panel in enumerate(panels):
        ox = p * W
        lines = {k: (np.asarray(x, float), np.asarray(y, float)) for k, (x, y) in panel["lines"].items() if len(x)}
        fx = np.log10 if panel.get("logx") else (lambda v: v)
        xs = np.concatenate([fx(x) for x, _ in lines.values()])
        ys = np.concatenate([y for _, y in lines.values()])
        x0, x1, y0, y1 = xs.min(), xs.max() + 1e-9, ys.min(), ys.max() + 1e-9

        def to_px(x, y):
            return (ox + L + (fx(x) - x0) / (x1 - x0) * (W - L - R), T + (y1 - y) / (y1 - y0) * (H - T - B))

        draw.rectangle([ox + L, T, ox + W - R, H - B], outline="black")
        for frac in np.linspace(0, 1, 5):
            yv, xv = y0 + frac * (y1 - y0), x0 + frac * (x1 - x0)
            py, px = T + (1 - frac) * (H - T - B), ox + L + frac * (W - L - R)
            draw.text((ox + 5, py - 6), f"{yv:.3g}", fill="black")
            draw.text((px - 12, H - B + 4), f"{10 ** xv:.3g}" if panel.get("logx") else f"{xv:.3g}", fill="black")
        draw.text((ox + L, 8), ascii_only(panel["title"]), fill="black")
        draw.text((ox + W // 2 - 40, H - 16), ascii_only(panel["xlabel"]), fill="black")
        draw.text((ox + 5, T - 14), ascii_only(panel["ylabel"]), fill="black")
        for i, (label, (x, y)) in enumerate(lines.items()):
            color = colors[i % len(colors)]
            pts = [to_px(a, b) for a, b in zip(x, y)]
            if len(pts) > 1:
                draw.line(pts, fill=color, width=2)
            else:
                draw.ellipse([pts[0][0] - 3, pts[0][1] - 3, pts[0][0] + 3, pts[0][1] + 3], fill=color)
            draw.text((ox + W - R - 200, H - B - 14 * (len(lines) - i) - 4), ascii_only(label)[:34], fill=color)
    img.save(path)
    return "PIL (matplotlib is not installed)"
