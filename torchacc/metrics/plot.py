"""``torchacc plot <dir>``: draw a run's ``metrics.jsonl`` as ``metrics.png`` (loss, tokens/s, MFU, memory).

matplotlib is an optional extra (``pip install 'torchacc[plot]'``), imported only here. Each ``run_name`` in
the file is drawn as its own line, so runs appended to one directory can be compared.
"""

import json
import os
from typing import Any

from .sinks import JSONL_NAME

__all__ = ["plot_metrics", "read_records"]

PANELS = (
    ("loss", "loss", 1.0),
    ("tokens_per_second", "tokens/s (all devices)", 1.0),
    ("mfu", "MFU (%)", 100.0),
    ("memory_peak_bytes", "peak memory per device (GiB)", 1 / 2**30),
)


def read_records(path: str) -> dict[str, list[dict[str, Any]]]:
    """The records of a ``metrics.jsonl``, by ``run_name`` in order of appearance.

    Raises:
        ValueError: a line that is not a JSON object with a ``step``, naming the file and the line.
    """
    runs: dict[str, list[dict[str, Any]]] = {}
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number} is not JSON ({exc.msg}); was the file cut short?") from None
            if not isinstance(record, dict) or "step" not in record:
                raise ValueError(f"{path}:{number} is not a metrics record (a JSON object with a 'step')")
            runs.setdefault(str(record.get("run_name", "")), []).append(record)
    return runs


def plot_metrics(dir: str, *, out: str | None = None) -> str:
    """Draw ``<dir>/metrics.jsonl``: loss, tokens/s, MFU and peak memory against the step, one line per run.

    Args:
        dir: a ``metrics.dir`` of a run with the "jsonl" sink.
        out: the PNG to write; default ``<dir>/metrics.png``.

    Returns:
        The path of the PNG.

    Raises:
        ValueError: no ``metrics.jsonl`` in ``dir``, or a damaged line in it.
        ImportError: matplotlib is not installed (``pip install 'torchacc[plot]'``).

    Example:
        >>> torchacc.metrics.plot_metrics("runs")  # "runs/metrics.png"
    """
    path = os.path.join(dir, JSONL_NAME)
    if not os.path.isfile(path):
        raise ValueError(
            f"{path} does not exist: plot reads the JSONL sink; train with metrics.every > 0 and 'jsonl' in "
            f"metrics.sinks, with metrics.dir={dir!r}"
        )
    runs = read_records(path)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("torchacc plot needs matplotlib: pip install 'torchacc[plot]'") from None
    figure = Figure(figsize=(11, 7), layout="constrained")
    FigureCanvasAgg(figure)
    for axes, (key, label, scale) in zip(figure.subplots(2, 2).flat, PANELS, strict=True):
        drawn = False
        for run_name, records in runs.items():
            points = [(r["step"], r[key] * scale) for r in records if isinstance(r.get(key), (int, float))]
            if points:
                axes.plot(*zip(*points, strict=True), marker=".", label=run_name or "run")
                drawn = True
        axes.set_title(label)
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
        axes.ticklabel_format(axis="y", useOffset=False)
        if drawn and len(runs) > 1:
            axes.legend(fontsize="small")
        elif not drawn:
            hint = " (set metrics.peak_flops)" if key == "mfu" else ""
            axes.text(0.5, 0.5, f"no {key} recorded{hint}", ha="center", va="center", transform=axes.transAxes)
    out = out or os.path.join(dir, "metrics.png")
    figure.savefig(out, dpi=100)
    return out
