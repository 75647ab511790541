"""Regression scenarios of the trust review, run on 2 ranks emulating 2 nodes (LOCAL_RANK 0 on both).

Each function returns plain data; the assertions live in test_trust.py.
"""

import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from _models import TinyNet, tiny_gpt2
from scenarios import full_state, gpt2_config, meta_init_state

import torchacc
import torchacc._utils.fs


def _attempt(fn: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        value = fn()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    return {"error": None, "value": value, "seconds": time.monotonic() - start}


def concurrent_saves(out: Path) -> dict[str, Any]:
    """Both 'nodes' save one path with the default arguments (the first rank of every node writes), 5 times."""
    rank = torchacc.dist.rank()
    torchacc._utils.fs._HOST = f"node{rank}"  # the emulated nodes have different host names
    target = out / "shared.pth"
    if rank == 0:
        (out / f"shared.pth.tmp-{2**22 + 7}@node0-0badc0de").write_text("left by a dead process of node0")
        (out / "shared.pth.tmp-1@node9-0badc0de").write_text("in flight on another node")
    torchacc.dist.barrier()
    errors = []
    for i in range(5):
        big = {"step": i, "weights": torch.full((2**21,), float(i))}  # 8 MB: the writes overlap
        errors.append(_attempt(lambda: torchacc.save(big, target))["error"])  # noqa: B023
    torchacc.dist.barrier()
    return {
        "errors": errors,
        "final_step": torchacc.load(target)["step"],
        "leftovers": sorted(n for n in os.listdir(out) if n.startswith("shared.pth.tmp-")),
    }


def same_path(out: Path) -> dict[str, Any]:
    """Every rank writes 'its own' file with master_only=False, but all were given the same path."""
    target = out / "mine.pth"
    result = _attempt(lambda: torchacc.save({"rank": torch.tensor(torchacc.dist.rank())}, target, master_only=False))
    torchacc.dist.barrier()
    result["written"] = target.exists()
    return result


def save_defaultdicts(out: Path) -> dict[str, Any]:
    """A defaultdict, and a sharded optimizer's state_dict holding one, saved with the default arguments."""
    model = torchacc.accelerate(TinyNet(), config=_tinynet_config())
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    optimizer.step()
    nested = defaultdict(list, {"a": [torch.ones(2)], "b": defaultdict(dict, {"c": {"d": torch.zeros(1)}})})
    saved = _attempt(lambda: torchacc.save({"nested": nested, "optim_state": optimizer.state}, out / "dd.pth"))
    loaded = torchacc.load(out / "dd.pth") if saved["error"] is None else None
    return {
        "saved": saved,
        "nested": loaded and loaded["nested"],
        "num_optim_states": loaded and len(loaded["optim_state"]),
    }


def _tinynet_config() -> torchacc.Config:
    config = torchacc.Config()
    config.dist.fsdp.size = torchacc.dist.world_size()
    config.dist.fsdp.wrap_layer_cls = {"Block"}
    return config


def init_from_rank0_only(out: Path) -> dict[str, Any]:
    """init_from on rank 0's disk only (a relative path, each rank in its own working directory)."""
    rank = torchacc.dist.rank()
    node_dir = out / f"node{rank}"
    node_dir.mkdir(exist_ok=True)
    if rank == 0:
        torch.save({"model": tiny_gpt2(seed=11).state_dict()}, node_dir / "init.pth")
    torchacc.dist.barrier()
    cwd = os.getcwd()
    os.chdir(node_dir)
    try:
        with torchacc.init_empty_weights():
            meta_model = tiny_gpt2(seed=123)
        meta = _attempt(
            lambda: full_state(
                torchacc.accelerate(meta_model, config=gpt2_config(fsdp=2, dist__fsdp__init_from="init.pth"))
            )
        )
        # A model built on the CPU (not meta) with init_from: the file is loaded, not ignored.
        real = tiny_gpt2(seed=100 + rank)
        config = gpt2_config(fsdp=2, dist__fsdp__init_from="init.pth")
        loaded = _attempt(lambda: full_state(torchacc.accelerate(real, config=config)))
    finally:
        os.chdir(cwd)
    return {"meta": meta, "real": loaded}


def per_rank_extra(out: Path) -> dict[str, Any]:
    """save_checkpoint's extra differs per rank (an RNG state); each rank must get its own back."""
    rank = torchacc.dist.rank()
    model = torchacc.accelerate(TinyNet(), config=_tinynet_config())
    torch.manual_seed(1000 + rank)
    extra = {"rank": rank, "rng": torch.get_rng_state(), "note": f"from rank {rank}"}
    torchacc.save_checkpoint(out / "ckpt", model=model, extra=extra)
    loaded = torchacc.load_checkpoint(out / "ckpt", model=model)
    return {"saved": extra, "loaded": loaded}


def two_node_suite(out: str) -> dict[str, Any]:
    out_dir = Path(out)
    results = {"meta_init": meta_init_state()}
    for name in ("concurrent_saves", "same_path", "save_defaultdicts", "init_from_rank0_only", "per_rank_extra"):
        directory = out_dir / name
        directory.mkdir(exist_ok=True)
        torchacc.dist.barrier()
        results[name] = globals()[name](directory)
    return results
