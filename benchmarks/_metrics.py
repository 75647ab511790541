"""The table of ``throughput.py --metrics``: the step time with ``metrics.every = 10`` against metrics off.

Each pair times one block of (a) (metrics off) and one of (a*) (``metrics.every = 10``, the JSONL sink) in
alternating order; a block holds a multiple of 10 steps, so two logged steps for the default 20. The ratios of
(a*) over (a) by wall time and by CPU time (the busiest rank's ``time.process_time()``, which leaves out the
time other processes take) are reported as median, mean and range over the pairs.
"""

import argparse
import statistics
from typing import Any

from _common import markdown_table, median

__all__ = ["METRICS_EVERY", "metrics_table"]

METRICS_EVERY = 10


def _cell(ratios: list[float]) -> str:
    return (
        f"**{median(ratios):.4f}** ({statistics.fmean(ratios):.4f}; {min(ratios):.3f}-{max(ratios):.3f})"
        if ratios
        else "-"
    )


def metrics_table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """One row per model size: step time, the (a*)/(a) ratios by wall and CPU time, records written, load."""
    rows = []
    for r in (r for r in results if "metrics_wall" in r):
        rows.append(
            [
                r["size"],
                f"{median(r['off_step_s']) * 1e3:.0f}",
                f"{len(r['metrics_wall'])} x {r['block']}",
                _cell(r["metrics_wall"]),
                _cell(r["metrics_cpu"]),
                str(r["records"]),
                f"{r['loadavg']:.1f}",
            ]
        )
    headers = [
        "model",
        "step ms, metrics off",
        "pairs x steps",
        "(a*)/(a) step time, wall: median (mean; range)",
        "by CPU time",
        "records written",
        "load avg",
    ]
    return markdown_table(headers, rows) + f"\n\ngoal: (a*)/(a) <= 1.01 (metrics.every = {METRICS_EVERY})"
