"""Checkpoints and initialization under tensor parallelism: DCP across layouts, meta init, init_from, and the
seed's optimizer lines. Each suite returns plain data; the assertions live in test_tp_checkpoint.py."""

import os
import shutil
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from _models import tiny_llama, token_dataset
from scenarios import full_state
from torch.distributed.tensor import DTensor

import torchacc
from torchacc.parallel import init_from

BATCH = torch.stack([s["input_ids"] for s in token_dataset(4)])


def llama_config(*, fsdp: int = 1, tp: int = 1, init_from: str | None = None) -> torchacc.Config:
    config = torchacc.Config()
    config.dist.fsdp.size = fsdp
    config.dist.tp.size = tp
    config.dist.fsdp.wrap_layer_cls = {"LlamaDecoderLayer"}
    config.dist.fsdp.init_from = init_from
    config.dist.timeout = 120.0
    return config


def optim_full(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every optimizer state tensor, gathered to its full value, by ``<param name>/<key>``."""
    state = torchacc.optim_state_dict(model, optimizer)["state"]
    out = {}
    for name, values in state.items():
        for key, value in values.items():
            value = value.full_tensor() if isinstance(value, DTensor) else value
            out[f"{name}/{key}"] = value.detach().cpu().clone()
    return out


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    return {"model": full_state(model), "optim": optim_full(model, optimizer)}


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    loss = model(input_ids=BATCH, labels=BATCH).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def fresh(config: torchacc.Config, seed: int = 99) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torchacc.accelerate(tiny_llama(seed=seed), config=config)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def meta_init(config: torchacc.Config) -> dict[str, torch.Tensor]:
    """tiny_llama(seed=7) built on the meta device and accelerated with ``config`` (own init or init_from)."""
    with torchacc.init_empty_weights():
        model = tiny_llama(seed=7)
    return full_state(torchacc.accelerate(model, config=config))


def write_init_files(out: Path) -> dict[str, str]:
    """A consolidated .pth and an HF safetensors directory of tiny_llama(seed=11), written by rank 0."""
    paths = {"pth": str(out / "init.pth"), "hf": str(out / "init-hf")}
    if torchacc.dist.rank() == 0:
        model = tiny_llama(seed=11)
        torch.save({"model": model.state_dict()}, paths["pth"])
        model.save_pretrained(paths["hf"])
    torchacc.dist.barrier()
    return paths


def counting_reads(counts: dict[str, int]) -> Any:
    """``init_from._open_source`` that adds the number of elements each read returns to ``counts["read"]``."""
    original = init_from._open_source

    def open_source(path: str) -> Any:
        keys, read = original(path)

        def counted(key: str) -> torch.Tensor:
            value = read(key)
            counts["read"] += value.numel()
            return value

        return keys, counted

    return open_source


def init_suite(out: Path, *, fsdp: int, tp: int) -> dict[str, Any]:
    paths = write_init_files(out)
    result: dict[str, Any] = {"meta": meta_init(llama_config(fsdp=fsdp, tp=tp))}
    for kind, path in paths.items():
        counts = {"read": 0}
        with mock.patch.object(init_from, "_open_source", counting_reads(counts)):
            result[f"init_from_{kind}"] = meta_init(llama_config(fsdp=fsdp, tp=tp, init_from=path))
        result[f"read_{kind}"] = counts["read"]
    return result


def placements(model: torch.nn.Module) -> set[str]:
    return {str(getattr(p, "placements", "plain")) for p in model.parameters()}


def seed_optimizer_lines(out: Path, config: torchacc.Config) -> dict[str, Any]:
    """Train 2 steps; ``torchacc.save(optimizer.state_dict())``; a restarted job loads it with torch.load and
    takes the next step like the uninterrupted run."""
    model, optimizer = fresh(config)
    step(model, optimizer)
    step(model, optimizer)
    path = out / "optimizer.pth"
    torchacc.save(optimizer.state_dict(), path)
    weights = full_state(model)
    step(model, optimizer)
    straight = snapshot(model, optimizer)
    model, optimizer = fresh(config, seed=5)
    model.load_state_dict(weights)
    optimizer.load_state_dict(torch.load(path, weights_only=True))
    step(model, optimizer)
    return {"straight": straight, "resumed": snapshot(model, optimizer)}


def four_rank_suite(out: str) -> dict[str, Any]:
    """TP2 x FSDP2: init, train and save; then FSDP4 loads that checkpoint and saves its own."""
    out_dir = Path(out)
    result = init_suite(out_dir, fsdp=2, tp=2)
    model, optimizer = fresh(llama_config(fsdp=2, tp=2))
    step(model, optimizer)
    step(model, optimizer)
    torchacc.save_checkpoint(out_dir / "ckpt-tp2-fsdp2", model=model, optimizer=optimizer)
    result["saved"] = snapshot(model, optimizer)
    result["placements"] = placements(model)
    model, optimizer = fresh(llama_config(fsdp=4), seed=3)
    torchacc.load_checkpoint(out_dir / "ckpt-tp2-fsdp2", model=model, optimizer=optimizer)
    result["fsdp4"] = snapshot(model, optimizer)
    torchacc.save_checkpoint(out_dir / "ckpt-fsdp4", model=model, optimizer=optimizer)
    result["seed_lines"] = seed_optimizer_lines(out_dir, llama_config(fsdp=2, tp=2))
    return result


def init_from_rank0_only(out: Path) -> dict[str, torch.Tensor]:
    """init_from a relative path that only rank 0 has (each rank in its own directory): rank 0 sends."""
    rank = torchacc.dist.rank()
    node_dir = out / f"node{rank}"
    node_dir.mkdir(exist_ok=True)
    if rank == 0:
        shutil.copy(out / "init.pth", node_dir / "init.pth")
    torchacc.dist.barrier()
    cwd = os.getcwd()
    os.chdir(node_dir)
    try:
        return meta_init(llama_config(tp=2, init_from="init.pth"))
    finally:
        os.chdir(cwd)


def two_rank_suite(out: str) -> dict[str, Any]:
    """TP2 alone: init; resume the one-process checkpoint; the seed's optimizer lines."""
    out_dir = Path(out)
    result = init_suite(out_dir, fsdp=1, tp=2)
    result["init_from_rank0"] = init_from_rank0_only(out_dir)
    model, optimizer = fresh(llama_config(tp=2), seed=4)
    torchacc.resume_latest(out_dir / "ckpt-one", model, optimizer)
    result["tp2"] = snapshot(model, optimizer)
    result["placements"] = placements(model)
    torchacc.export_hf(model, out_dir / "tp2-export")  # the live model, every rank (issue 24 item 4)
    with torch.no_grad():
        result["logits"] = model(input_ids=BATCH).logits
    result["seed_lines"] = seed_optimizer_lines(out_dir, llama_config(tp=2))
    return result
