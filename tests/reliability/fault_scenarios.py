"""Code run inside each rank of a 2-rank launch (see tests/_launch.py); the assertions live in the test modules."""

import errno
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_fs
from _faults import disk_full, inject, raising, stamped_kill
from _models import TinyNet, tiny_gpt2
from torch.distributed.tensor import DTensor

import torchacc
import torchacc.checkpoint.directory

_REAL_SAVE = torch.save


def build(timeout: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    config = torchacc.Config()
    config.dist.fsdp.size = 2
    config.dist.fsdp.wrap_layer_cls = {"Block"}
    config.dist.timeout = timeout
    torch.manual_seed(0)
    model = torchacc.accelerate(TinyNet(), config=config)
    return model, torch.optim.AdamW(model.parameters())


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(torchacc.dist.rank()))
    model(x).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()
    }


def _is_staging(src: Any, dst: Any, *args: Any, **kwargs: Any) -> bool:
    return str(src).endswith(".incomplete")


def killed_save(out: str, point: str) -> None:
    """Save checkpoint-1, then die at ``point`` (``rank<r>-...``) inside the save of checkpoint-2."""
    out_dir, rank = Path(out), torchacc.dist.rank()
    directory = out_dir / "ckpt"
    model, optimizer = build(timeout=60.0)
    train_step(model, optimizer)
    torchacc.save_checkpoint(directory, model=model, optimizer=optimizer, extra={"step": 1})
    expected = full_state(model)
    if rank == 0:
        torch.save(expected, out_dir / "expected.pt")
    train_step(model, optimizer)
    kill = stamped_kill(out_dir / "killed-at")
    if point == f"rank{rank}-mid-write":
        inject(dcp_fs, "_write_item", kill, nth=2)
    elif point == f"rank{rank}-before-rename":
        inject(os, "replace", kill, when=_is_staging)
    elif point == f"rank{rank}-before-latest":
        inject(torchacc.checkpoint.directory, "atomic_write_text", kill)
    try:
        torchacc.save_checkpoint(directory, model=model, optimizer=optimizer, extra={"step": 2})
    except Exception as exc:
        (out_dir / f"survivor-rank{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
        raise
    raise AssertionError(f"rank {rank} finished a save that another rank died in")


def _attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn``; return what it raised (type, message) and how long it took."""
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}
    return {"type": None, "message": None, "seconds": time.monotonic() - start}


def _only_on(rank: int, patch: Callable[[], None]) -> None:
    if torchacc.dist.rank() == rank:
        patch()


def _partial_then_disk_full(obj: Any, target: Any, *args: Any, **kwargs: Any) -> None:
    """A ``torch.save`` that writes part of the file, then finds the disk full."""
    _REAL_SAVE(obj, target, *args, **kwargs)
    Path(target).write_bytes(Path(target).read_bytes()[:500])
    raise disk_full()


def _damaged_copy(source: Path, target: Path, damage: Callable[[Path], None]) -> Path:
    """Rank 0 copies a checkpoint and damages its rank-1 data file; every rank gets the path."""
    if torchacc.dist.rank() == 0:
        shutil.copytree(source, target)
        damage(target / "__1_0.distcp")
    torchacc.dist.barrier()
    return target


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100])


class _FailingIO:
    """A checkpoint_io whose save fails (on rank 0, the only rank that calls it for a full state dict)."""

    def save_checkpoint(self, checkpoint: Any, path: Any) -> None:
        raise OSError(errno.EIO, "input/output error", str(path))


def _denied(*args: Any, **kwargs: Any) -> None:
    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(args[0]) if args else None)


def rank_errors(out: str) -> dict[str, Any]:
    """One launch, many failures: a config error, and errors raised on one rank only, inside save and load."""
    out_dir, rank = Path(out), torchacc.dist.rank()
    results: dict[str, Any] = {}

    bad = torchacc.Config()
    bad.dist.fsdp.size = 3
    results["config"] = _attempt(lambda: torchacc.accelerate(TinyNet(), config=bad))

    # Ranks that disagree: a wrap class set on rank 0 only (a gloo abort before), and a config that only
    # rank 1 finds invalid (rank 0 waited out the timeout before).
    differs = torchacc.Config()
    differs.dist.fsdp.size = 2
    differs.dist.fsdp.wrap_layer_cls = {"Block"} if rank == 0 else set()
    results["config_differs"] = _attempt(lambda: torchacc.accelerate(TinyNet(), config=differs))
    one_bad = torchacc.Config()
    one_bad.dist.fsdp.size = 2 if rank == 0 else 3
    results["config_bad_on_rank1"] = _attempt(lambda: torchacc.accelerate(TinyNet(), config=one_bad))

    model, optimizer = build(timeout=20.0)
    train_step(model, optimizer)
    blocker = out_dir / "blocker"
    if rank == 1:
        blocker.write_text("a file where rank 1 expects a directory")
    own = out_dir / (f"rank{rank}.pth" if rank == 0 else "blocker/rank1.pth")
    results["save_unwritable_on_rank1"] = _attempt(lambda: torchacc.save(model.state_dict(), own, master_only=False))
    results["rank0_file_complete"] = rank != 0 or torchacc.load(own, verify=True).keys() == model.state_dict().keys()

    full = out_dir / "full.pth"
    torchacc.save(full_state(model), full)
    _only_on(0, lambda: setattr(torch, "save", _partial_then_disk_full))
    results["save_disk_full_on_rank0"] = _attempt(lambda: torchacc.save({"w": torch.ones(2)}, full))
    torch.save = _REAL_SAVE
    results["full_file_intact"] = torchacc.load(full, verify=True).keys() == model.state_dict().keys()
    results["full_file_leftovers"] = sorted(n for n in os.listdir(out_dir) if n.startswith("full.pth.tmp-"))

    directory = out_dir / "ckpt"
    torchacc.save_checkpoint(directory, model=model, optimizer=optimizer, extra={"step": 1})
    saved = full_state(model)
    train_step(model, optimizer)
    real_write_item = dcp_fs._write_item
    _only_on(1, lambda: inject(dcp_fs, "_write_item", raising(disk_full), nth=2))
    results["checkpoint_disk_full_on_rank1"] = _attempt(
        lambda: torchacc.save_checkpoint(directory, model=model, optimizer=optimizer, extra={"step": 2})
    )
    dcp_fs._write_item = real_write_item

    real_prepare = dcp_fs.FileSystemWriter.prepare_local_plan

    def unwritable(self: Any, plan: Any) -> Any:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self.path))

    _only_on(1, lambda: setattr(dcp_fs.FileSystemWriter, "prepare_local_plan", unwritable))
    results["checkpoint_unwritable_on_rank1"] = _attempt(
        lambda: torchacc.save_checkpoint(directory, model=model, optimizer=optimizer, extra={"step": 2})
    )
    dcp_fs.FileSystemWriter.prepare_local_plan = real_prepare
    results["checkpoint_below_a_file"] = _attempt(lambda: torchacc.save_checkpoint(blocker / "ckpt", model=model))
    torchacc.dist.barrier()
    leftovers = (".incomplete", ".replaced")  # staging directories; the writer's claim (a dot file) stays
    results["checkpoint_leftovers"] = sorted(n for n in os.listdir(directory) if n.endswith(leftovers))
    results["latest"] = torchacc.latest_checkpoint(directory)

    first = directory / "checkpoint-1"
    flipped = _damaged_copy(first, out_dir / "flipped", _flip)
    results["load_bit_flip"] = _attempt(lambda: torchacc.load_checkpoint(flipped, model=model))
    truncated = _damaged_copy(first, out_dir / "truncated", _truncate)
    results["load_truncated"] = _attempt(lambda: torchacc.load_checkpoint(truncated, model=model, verify=False))

    # Work only rank 0 does in the strategy, failing there: the other rank must hear of it at once.
    strategy = torchacc.FSDP2Strategy(sharding_strategy="FULL_SHARD", seed=0)
    strategy.config.dist.fsdp.wrap_layer_cls = {"GPT2Block"}
    strategy.setup_environment()
    gpt2 = strategy.parallelize(tiny_gpt2(seed=0))
    below_a_file = out_dir / "blocker0"
    if rank == 0:
        below_a_file.write_text("a file where a directory is expected")
    torchacc.dist.barrier()
    results["save_model_fails_on_rank0"] = _attempt(lambda: strategy.save_model(gpt2, None, below_a_file / "hf"))
    doomed = out_dir / "doomed-ckpt"
    doomed.mkdir(exist_ok=True)
    real_rmtree = shutil.rmtree
    _only_on(0, lambda: setattr(shutil, "rmtree", _denied))
    results["remove_fails_on_rank0"] = _attempt(lambda: strategy.remove_checkpoint(doomed))
    shutil.rmtree = real_rmtree
    strategy.checkpoint_io = _FailingIO()
    results["checkpoint_io_fails_on_rank0"] = _attempt(lambda: strategy.save_checkpoint({"a": 1}, out_dir / "io.pt"))

    # After all that, the process group still works and the good checkpoint still resumes.
    results["all_reduce"] = torchacc.dist.all_reduce(torch.ones(1)).item()
    results["resumed_extra"] = torchacc.resume_latest(directory, model, optimizer)
    results["resumed_equal"] = all(torch.equal(v, saved[k]) for k, v in full_state(model).items())
    return results
