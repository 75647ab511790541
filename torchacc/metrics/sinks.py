"""Where records go: the console, a JSONL file, TensorBoard and Weights & Biases. Rank 0 alone opens them.

A sink that fails while training (a full disk, a lost connection) is dropped with one warning: metrics never
stop a run. tensorboard and wandb are imported only when their sink is opened (optional extras:
``pip install 'torchacc[tensorboard]'``, ``'torchacc[wandb]'``; ``Config.validate`` checks they are present).
"""

import json
import os
from typing import Any

from tqdm import tqdm

from .._utils.logging import warn_once

__all__ = ["Sinks", "format_line", "JSONL_NAME"]

JSONL_NAME = "metrics.jsonl"


def format_line(record: dict[str, Any]) -> str:
    """One console line: ``step 10 | loss 2.3456 | 12,345 tok/s (6,172/device) | ...``."""
    parts = [f"step {record['step']}"]
    shown = {"step"}

    def show(key: str, text: str) -> None:
        if key in record:
            parts.append(text.format(record[key]))
            shown.add(key)

    show("loss", "loss {:.4f}")
    if "tokens_per_second" in record:
        per_device = record["tokens_per_second_per_device"]
        parts.append(f"{record['tokens_per_second']:,.0f} tok/s ({per_device:,.0f}/device)")
        shown.update(("tokens_per_second", "tokens_per_second_per_device"))
    show("step_seconds", "{:.3f} s/step")
    show("data_wait_seconds", "data {:.3f} s")
    show("mfu", "mfu {:.1%}")
    if "memory_peak_bytes" in record:
        fraction = record.get("memory_peak_fraction")
        parts.append(f"mem {record['memory_peak_bytes'] / 2**30:.2f} GiB" + (f" ({fraction:.0%})" if fraction else ""))
        shown.update(("memory_peak_bytes", "memory_peak_fraction"))
    show("grad_norm", "grad_norm {:.4g}")
    show("lr", "lr {:.3g}")
    parts += [f"{key} {value:.6g}" for key, value in record.items() if key not in shown]
    return " | ".join(parts)


class Sinks:
    """The sinks named in ``names``, opened now (call on rank 0 only).

    Args:
        names: any of "console", "jsonl", "tensorboard", "wandb".
        dir: the directory of the file sinks (created when one of them is asked for).
        run_name: the run's name in every sink.

    Raises:
        OSError: the directory or a file cannot be created.
    """

    def __init__(self, names: set[str], *, dir: str, run_name: str) -> None:
        self.run_name = run_name
        self.paths: dict[str, str] = {}
        self._open: dict[str, Any] = {}
        try:
            if names - {"console"}:
                os.makedirs(dir, exist_ok=True)
            if "console" in names:
                self._open["console"] = None
            if "jsonl" in names:
                self.paths["jsonl"] = os.path.join(dir, JSONL_NAME)
                self._open["jsonl"] = open(self.paths["jsonl"], "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
            if "tensorboard" in names:
                from torch.utils.tensorboard import SummaryWriter

                self.paths["tensorboard"] = os.path.join(dir, "tensorboard", run_name)
                self._open["tensorboard"] = SummaryWriter(log_dir=self.paths["tensorboard"])
            if "wandb" in names:
                import wandb

                run = wandb.init(dir=dir, name=run_name, reinit="create_new")
                self.paths["wandb"] = run.dir
                self._open["wandb"] = run
        except BaseException:
            self.close()
            raise

    def write(self, record: dict[str, Any]) -> None:
        """Write one record (it holds ``step``) to every sink still open."""
        for name, handle in list(self._open.items()):
            try:
                _WRITERS[name](handle, record, self.run_name)
            except Exception as exc:  # any failure of a sink drops it, and training goes on
                warn_once(f"torchacc metrics: the {name} sink failed ({exc!r}) and is dropped; training goes on")
                self._close_one(name)

    def close(self) -> None:
        """Flush and close every sink (safe to call twice)."""
        for name in list(self._open):
            self._close_one(name)

    def _close_one(self, name: str) -> None:
        handle = self._open.pop(name)
        try:
            if name == "wandb":
                handle.finish()
            elif handle is not None:
                handle.close()
        except Exception:  # closing a broken sink must not fail the run, nor the exit
            pass


def _console(_: Any, record: dict[str, Any], run_name: str) -> None:
    tqdm.write(format_line(record))  # clears and redraws any progress bar around the line


def _jsonl(file: Any, record: dict[str, Any], run_name: str) -> None:
    file.write(json.dumps({"run_name": run_name, **record}) + "\n")
    file.flush()


def _tensorboard(writer: Any, record: dict[str, Any], run_name: str) -> None:
    step = record["step"]
    for key, value in record.items():
        if key != "step":
            writer.add_scalar(key, value, step)
    writer.flush()


def _wandb(run: Any, record: dict[str, Any], run_name: str) -> None:
    run.log({key: value for key, value in record.items() if key != "step"}, step=record["step"])


_WRITERS = {"console": _console, "jsonl": _jsonl, "tensorboard": _tensorboard, "wandb": _wandb}
