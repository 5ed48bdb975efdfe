"""Shared benchmark plumbing: rows, repeated timing, printing and JSON output."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Row:
    """One figure beside its limit.  ``better`` says which way is good; ``ratio`` is
    value/limit_value either way (≥ target for "higher", ≤ target for "lower")."""

    name: str
    value: float
    unit: str
    limit_name: str
    limit_value: float
    better: str = "higher"
    target: float | None = None

    @property
    def ratio(self) -> float:
        return self.value / self.limit_value if self.limit_value else float("nan")

    @property
    def meets_target(self) -> bool | None:
        if self.target is None:
            return None
        return self.ratio >= self.target if self.better == "higher" else self.ratio <= self.target

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        d.update(ratio=round(self.ratio, 4), meets_target=self.meets_target)
        return d


def median_seconds(fn: Callable[[], object], repeat: int, setup: Callable[[], object] | None = None) -> float:
    """Median wall time of ``fn`` over ``repeat`` runs (``setup`` runs untimed before each)."""
    times = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def print_rows(title: str, rows: list[Row]) -> None:
    print(f"\n{title}")
    print(
        f"{'benchmark':<34} {'value':>10} {'unit':<6} {'limit (same run)':<30} {'limit':>10} {'ratio':>7} {'target':>8}"
    )
    for r in rows:
        tgt = "" if r.target is None else ("≥" if r.better == "higher" else "≤") + f"{r.target:g}"
        mark = {True: " ok", False: " MISS", None: ""}[r.meets_target]
        print(
            f"{r.name:<34} {r.value:>10.3f} {r.unit:<6} {r.limit_name:<30} {r.limit_value:>10.3f} "
            f"{r.ratio:>7.3f} {tgt:>8}{mark}"
        )


def write_json(path: str | None, rows: list[Row]) -> None:
    if path:
        Path(path).write_text(json.dumps([r.as_dict() for r in rows], indent=2))


def write_plot(path: str | None, title: str, rows: list[Row]) -> None:
    """``--plot FILE.png``: the rows beside their limits (``kvstore.bench.plot``)."""
    if path:
        from kvstore.bench.plot import plot_rows

        print(f"plot: {plot_rows(path, title, rows)}")
