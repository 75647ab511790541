"""``dist.fsdp.init_from`` inside each rank of a 2-rank launch (see tests/_launch.py): checkpoints that do not
fit the model, dtype conversion, and a read failing halfway. The assertions live in test_init_from.py.

Two modes: every rank can see the file (``shared``), or only rank 0 can (``rank0``: each rank works in its own
directory and only rank 0's holds the checkpoint, under a relative path). Either way only rank 0 reads it.
"""

import errno
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
from _faults import inject, raising
from _models import tiny_gpt2
from torch.distributed.tensor import DTensor

import torchacc
from torchacc.parallel import init_from

TIMEOUT = 20.0  # config.dist.timeout: a rank left waiting in a collective gives up only after this long
MISFITS = [f"{size}.{kind}" for size in ("bigger", "smaller") for kind in ("pth", "hf", "hf-index")]


def write_checkpoints(out: Path) -> dict[str, Any]:
    """The model is tiny GPT-2 with a vocabulary of 128: checkpoints of one with 256 (bigger) and 64 (smaller),
    each as a .pth, an HF directory with one safetensors file and one with an index; the model's own weights in
    bfloat16; and one with an integer tensor where the model has a float one."""
    out.mkdir(parents=True, exist_ok=True)
    for size, vocab in (("bigger", 256), ("smaller", 64)):
        model = tiny_gpt2(seed=3, vocab_size=vocab)
        torch.save({"model": model.state_dict()}, out / f"{size}.pth")
        model.save_pretrained(out / f"{size}.hf")
        model.save_pretrained(out / f"{size}.hf-index", max_shard_size="40KB")
    reference = tiny_gpt2(seed=11)
    bf16 = reference.to(torch.bfloat16)
    torch.save({"model": bf16.state_dict()}, out / "bf16.pth")
    bf16.save_pretrained(out / "bf16.hf")
    integer = {k: v.float() for k, v in bf16.state_dict().items()}
    integer["transformer.wpe.weight"] = torch.zeros(integer["transformer.wpe.weight"].shape, dtype=torch.int64)
    torch.save({"model": integer}, out / "int.pth")
    expected = {k: v.float() for k, v in bf16.state_dict().items()}
    index_files = {
        size: next(p.name for p in (out / f"{size}.hf-index").glob("*.safetensors") if _holds(p, "wte"))
        for size in ("bigger", "smaller")
    }
    return {"bf16": expected, "index_files": index_files}


def _holds(path: Path, fragment: str) -> bool:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return any(fragment in key for key in f.keys())  # noqa: SIM118 - safe_open is not a Mapping


def _config(source: str) -> torchacc.Config:
    config = torchacc.Config()
    config.dist.fsdp.size = 2
    config.dist.fsdp.wrap_layer_cls = {"GPT2Block"}
    config.dist.fsdp.init_from = source
    config.dist.timeout = TIMEOUT
    return config


def _build(kind: str) -> torch.nn.Module:
    if kind == "real":
        return tiny_gpt2(seed=100 + torchacc.dist.rank())
    with torchacc.init_empty_weights():
        return tiny_gpt2(seed=123)


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()
    }


def _patched_source(counts: dict[str, int], fail_at: int | None) -> Callable[[str], Any]:
    """``init_from._open_source`` whose reads are counted, the ``fail_at``-th raising an I/O error (a damaged
    disk halfway through the checkpoint)."""
    original = init_from._open_source

    def open_source(path: str) -> Any:
        keys, read = original(path)

        def counted(key: str) -> torch.Tensor:
            counts["reads"] += 1
            return read(key)

        holder = SimpleNamespace(read=counted)
        if fail_at is not None:
            error = OSError(errno.EIO, os.strerror(errno.EIO), "model-weights")
            inject(holder, "read", raising(lambda: error), nth=fail_at)
        return keys, holder.read

    return open_source


def _accelerate(source: str, kind: str, *, fail_at: int | None = None) -> dict[str, Any]:
    """accelerate() with ``init_from=source``: what it raised (type, message), how long it took, how many
    reads this rank made, and the loaded state when it succeeded."""
    counts = {"reads": 0}
    model = _build(kind)
    start = time.monotonic()
    try:
        with mock.patch.object(init_from, "_open_source", _patched_source(counts, fail_at)):
            model = torchacc.accelerate(model, config=_config(source))
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start, **counts}
    result = {"type": None, "message": None, "seconds": time.monotonic() - start, **counts}
    return {**result, "state": _full_state(model)}


def _in_mode(mode: str, ckpts: Path, out: Path, fn: Callable[[str], Any]) -> Any:
    """Run ``fn(directory)`` where ``directory`` holds the checkpoints: every rank's (shared), or, for rank0,
    a relative one that only rank 0 has."""
    if mode == "shared":
        return fn(str(ckpts))
    rank = torchacc.dist.rank()
    node = out / f"node{rank}"
    node.mkdir(parents=True, exist_ok=True)
    if rank == 0 and not (node / "ckpts").exists():
        (node / "ckpts").symlink_to(ckpts)
    torchacc.dist.barrier()
    cwd = os.getcwd()
    os.chdir(node)
    try:
        return fn("ckpts")
    finally:
        os.chdir(cwd)


def suite(out: str) -> dict[str, Any]:
    out_dir, rank = Path(out), torchacc.dist.rank()
    ckpts = out_dir / "ckpts"
    results: dict[str, Any] = {"info": write_checkpoints(ckpts) if rank == 0 else None}
    torchacc.dist.barrier()
    for mode in ("shared", "rank0"):

        def fits(directory: str, mode: str = mode) -> None:
            for name in ("bf16.pth", "bf16.hf", "int.pth"):  # first: the first call pays for warming up
                results[f"{mode}/{name}"] = _accelerate(f"{directory}/{name}", "meta")
            for name in MISFITS:
                for kind in ("meta", "real"):
                    results[f"{mode}/{name}/{kind}"] = _accelerate(f"{directory}/{name}", kind)

        _in_mode(mode, ckpts, out_dir, fits)
    for mode in ("shared", "rank0"):

        def fails(directory: str, mode: str = mode) -> None:
            # a read failing halfway on rank 0, the one that reads and sends, whether the others see the file or not
            fail_at = 5 if rank == 0 else None
            results[f"{mode}/read-fails"] = _accelerate(f"{directory}/bf16.hf", "meta", fail_at=fail_at)

        _in_mode(mode, ckpts, out_dir, fails)
    # after all that, no rank was left behind in a collective
    results["all_reduce"] = torchacc.dist.all_reduce(torch.ones(1)).item()
    return results
