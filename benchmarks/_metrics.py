"""The cost of watching a run (``throughput.py --metrics``): the step time with ``metrics.every = 10`` against
metrics off, measured two ways.

* Paired blocks: each pair times one block of (a) (metrics off) and one of (a*) (``metrics.every = 10``, the
  JSONL sink) in alternating order; a block holds a multiple of 10 steps. The ratios of (a*) over (a) by wall
  time and by CPU time (the busiest rank's ``time.process_time()``) are reported as median, mean and range.
* CPU time in the hooks: ``instrument()`` wraps every function through which metrics run in the training
  step (the two process-wide optimizer hooks, with the gradient norm, the all-gather and the sinks of logged
  steps; the loss hook; the loader observer's two calls) and adds up the CPU time spent inside them, which
  is then divided by (a*)'s CPU time per step. On a shared machine the paired ratios move by several percent
  from pair to pair; this share does not depend on what other processes do. It leaves out what the wrappers
  cannot see: the loader generator's own two clock reads per batch and the forward pre-hook (a no-op call).
"""

import argparse
import functools
import statistics
import time
from typing import Any

from _common import markdown_table, median

__all__ = ["METRICS_EVERY", "metrics_table", "instrument"]

METRICS_EVERY = 10
_TOTALS: dict[str, float] = {}


def instrument() -> dict[str, float]:
    """Count the CPU seconds spent in the metrics hooks from now on (benchmark only: patches torchacc.metrics
    before any model is watched). Returns the live totals: ``{"cpu_s": ..., "calls": ...}``."""
    from torchacc.metrics import install
    from torchacc.metrics.record import Recorder

    if _TOTALS:  # instrumented already (an earlier model size)
        return _TOTALS
    totals = _TOTALS
    totals.update(cpu_s=0.0, calls=0)

    def timed(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                totals["cpu_s"] += time.process_time() - start
                totals["calls"] += 1

        return wrapper

    install._before_step = timed(install._before_step)
    install._after_step = timed(install._after_step)
    make_loss_hook = install._loss_hook
    install._loss_hook = lambda recorder: timed(make_loss_hook(recorder))
    Recorder.read = timed(Recorder.read)
    Recorder.delivered = timed(Recorder.delivered)
    return totals


def _cell(ratios: list[float]) -> str:
    return (
        f"**{median(ratios):.4f}** ({statistics.fmean(ratios):.4f}; {min(ratios):.3f}-{max(ratios):.3f})"
        if ratios
        else "-"
    )


def metrics_table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """One row per model size: step time, the (a*)/(a) ratios by wall and CPU time, the CPU time in the hooks,
    records written, load."""
    rows = []
    for r in (r for r in results if "metrics_wall" in r):
        hooks = r["hook_cpu_s"] / r["metrics_steps"]  # the busiest rank's, per step of (a*)
        rows.append(
            [
                r["size"],
                f"{median(r['off_step_s']) * 1e3:.0f}",
                f"{len(r['metrics_wall'])} x {r['block']}",
                _cell(r["metrics_wall"]),
                _cell(r["metrics_cpu"]),
                f"{hooks * 1e3:.2f} ms = **{hooks / r['metrics_cpu_step_s']:.2%}**",
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
        "CPU in the metrics hooks per step (share of (a*)'s CPU per step)",
        "records written",
        "load avg",
    ]
    return markdown_table(headers, rows) + f"\n\ngoal: (a*)/(a) <= 1.01 (metrics.every = {METRICS_EVERY})"
