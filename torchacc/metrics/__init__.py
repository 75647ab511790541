"""Watching a run: loss, tokens/s, MFU, memory and gradient norm every few optimizer steps (docs/watching.md).

By concept:

* what is counted (tokens, FLOPs, the device's peak, memory): ``counting.py``;
* the record and its computation from every rank's tallies: ``record.py``;
* the sinks (console, JSONL, TensorBoard, W&B): ``sinks.py``;
* the hooks that feed a model's recorder, and ``log_metrics``/``last_metrics``: ``install.py``;
* the plot of a run's JSONL (``torchacc plot``): ``plot.py``.

``accelerate()`` and ``FSDP2Strategy`` install it from ``config.metrics``; nothing is installed with
``metrics.every = 0`` (the default).
"""

from .install import close_metrics, install_metrics, last_metrics, log_metrics, note_grad_norm, watch_loader
from .plot import plot_metrics
from .record import KEYS, Recorder

__all__ = [
    "install_metrics",
    "watch_loader",
    "note_grad_norm",
    "log_metrics",
    "last_metrics",
    "close_metrics",
    "plot_metrics",
    "Recorder",
    "KEYS",
]
