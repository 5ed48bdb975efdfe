"""``--plot FILE.png`` of every ``kvstore bench`` suite: each row of the table as a bar of
its value against the limit measured in the same run.

Rows mix units (GB/s, ms, bytes), so each bar is the row's ratio value/limit on one axis,
with the limit at 1 (the dashed line) and the target, when the row has one, as a tick; the
value and the limit are written beside each bar in their own units.  Green: meets its
target; red: misses it; grey: no target.  matplotlib is imported only here (the ``test``
extra installs it; ``pip install matplotlib`` otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from kvstore.errors import ConfigError

COLORS = {True: "#2e7d32", False: "#c62828", None: "#78909c"}


def plot_rows(path: str | Path, title: str, rows: Sequence) -> Path:
    """Draw ``rows`` (``kvstore.bench.common.Row``s) into the PNG ``path`` (see the module
    docstring); returns the path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ConfigError("--plot needs matplotlib (pip install matplotlib)") from err
    rows = list(rows)
    fig, ax = plt.subplots(figsize=(11, 0.55 * len(rows) + 1.6))
    try:
        ys = range(len(rows))[::-1]
        ratios = [r.ratio if math.isfinite(r.ratio) else 0.0 for r in rows]  # no limit: no bar
        ax.barh(list(ys), ratios, color=[COLORS[r.meets_target] for r in rows], height=0.6)
        ax.axvline(1.0, color="black", linestyle="--", linewidth=1)
        for y, r, ratio in zip(ys, rows, ratios):
            if r.target is not None:
                ax.plot([r.target, r.target], [y - 0.35, y + 0.35], color="black", linewidth=2)
            ax.text(
                ratio + 0.02 * max(ratios + [1.0]),
                y,
                f"{r.value:.3g} {r.unit} vs {r.limit_name} {r.limit_value:.3g}  ({r.ratio:.2f}x)",
                va="center",
                fontsize=8,
            )
        ax.set_yticks(list(ys), [r.name for r in rows], fontsize=8)
        ax.set_xlim(0, max(ratios + [1.0]) * 1.9)
        ax.set_xlabel("value / limit measured in the same run (dashed: the limit; tick: the target)")
        ax.set_title(title, fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return Path(path)


__all__ = ["plot_rows"]
