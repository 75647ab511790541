"""TorchAcc's own checkpoint section (taken from docs/migration.md, unchanged) and other first-week habits,
run on 2 ranks; the assertions live in test_seed_checkpoint.py."""

import itertools
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _models import tiny_gpt2, token_dataset
from scenarios import full_state, gpt2_config
from torch.utils.data import DataLoader

import torchacc
import torchacc.distributed.collectives

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "docs"))
from _markdown import parse  # noqa: E402

STEPS = 3


def seed_blocks() -> dict[str, str]:
    """The definitions, save and load blocks of docs/migration.md, by their first line."""
    found = {}
    for block in parse(ROOT / "docs" / "migration.md"):
        for name, first in (
            ("define", 'CKPT_DIR = "./"'),
            ("save", "# 1) Save model shards"),
            ("load", "# 1) Reorganize"),
        ):
            if block.code.startswith(first):
                found[name] = block.code
    return found


def _build(bf16: bool) -> dict[str, Any]:
    config = gpt2_config(fsdp=2, compute__bf16=bf16)
    model, loader = torchacc.accelerate(tiny_gpt2(seed=0), DataLoader(token_dataset(32), batch_size=2), config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return {"model": model, "loader": loader, "optimizer": optimizer, "lr_scheduler": lr_scheduler}


def _train(run: dict[str, Any], batches: list) -> list[float]:
    losses = []
    for batch in batches:
        loss = run["model"](input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        run["optimizer"].step()
        run["lr_scheduler"].step()
        run["optimizer"].zero_grad()
        losses.append(loss.item())
    return losses


def seed_replay(out: Path, bf16: bool) -> dict[str, Any]:
    """2*STEPS steps straight, against STEPS steps, the seed's save block, a new set-up, its load block, STEPS more."""
    straight = _build(bf16)
    batches = list(itertools.islice(straight["loader"], 2 * STEPS))
    reference = _train(straight, batches)
    blocks = seed_blocks()
    cwd = os.getcwd()
    os.chdir(out)
    try:
        first = _build(bf16)
        losses = _train(first, batches[:STEPS])
        namespace = {"torch": torch, "torchacc": torchacc, **first}
        exec(blocks["define"], namespace)
        exec(blocks["save"], namespace)
        resumed = _build(bf16)  # a restarted job: new model, optimizer and scheduler
        namespace = {"torch": torch, "torchacc": torchacc, **resumed, **{k: namespace[k] for k in ("CKPT_DIR",)}}
        exec(blocks["define"], namespace)
        exec(blocks["load"], namespace)
        losses += _train(resumed, batches[STEPS:])
        files = sorted(os.listdir("."))
    finally:
        os.chdir(cwd)
    return {
        "reference": reference,
        "losses": losses,
        "state_equal": all(
            torch.equal(v, full_state(straight["model"])[k]) for k, v in full_state(resumed["model"]).items()
        ),
        "files": files,
    }


def foreign_optimizer_state(out: Path) -> dict[str, Any]:
    """A plain optimizer state dict that belongs to other parameters fails at load time, naming the parameter."""
    run = _build(bf16=False)
    other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3, 3)) for _ in run["model"].parameters()])
    for p in other.param_groups[0]["params"]:
        p.grad = torch.ones(3, 3)
    other.step()
    try:
        run["optimizer"].step()  # the first step attaches the load hook (an optimizer built after accelerate())
        run["optimizer"].load_state_dict(other.state_dict())
        return {"error": None}
    except ValueError as exc:
        return {"error": str(exc)}


def forward_called_directly() -> dict[str, Any]:
    """model.forward(...) instead of model(...) on an accelerated model: it runs, and matches model(...)."""
    model = torchacc.accelerate(tiny_gpt2(seed=0), config=gpt2_config(fsdp=2))
    ids = token_dataset(2)[0]["input_ids"].unsqueeze(0)
    with torch.no_grad():
        via_call = model(input_ids=ids).logits
        via_forward = model.forward(input_ids=ids).logits
    loss = model.forward(input_ids=ids, labels=ids).loss
    loss.backward()
    return {"equal": torch.equal(via_call, via_forward), "grads": all(p.grad is not None for p in model.parameters())}


def save_on_rank0_only(out: Path) -> dict[str, Any]:
    """torchacc.save(model.state_dict(), ...) under `if rank == 0:` raises there quickly instead of hanging."""
    model = torchacc.accelerate(tiny_gpt2(seed=0), config=gpt2_config(fsdp=2))
    torchacc.dist.collectives.MEET_TIMEOUT = 3.0
    result: dict[str, Any] = {"error": None}
    start = time.monotonic()
    if torchacc.dist.rank() == 0:
        try:
            torchacc.save(model.state_dict(), out / "rank0-only.pth")
        except RuntimeError as exc:
            result["error"] = str(exc)
    result["seconds"] = time.monotonic() - start
    torchacc.dist.barrier()
    torchacc.dist.collectives.MEET_TIMEOUT = 300.0
    return result


class BatchNormNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU())
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def batchnorm_buffers(broadcast: bool) -> dict[str, Any]:
    """Running statistics after 3 steps on each rank's own data, with and without broadcast_buffers."""
    config = torchacc.Config()
    config.dist.fsdp.size = 2
    config.dist.fsdp.wrap_layer_cls = {"Sequential"}
    config.dist.fsdp.broadcast_buffers = broadcast
    torch.manual_seed(0)
    model = torchacc.accelerate(BatchNormNet(), config=config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(torchacc.dist.rank())
    for _ in range(3):
        model(torch.randn(8, 8, generator=gen) * (1 + torchacc.dist.rank())).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():  # an evaluation after training starts from rank 0's statistics
        model(torch.randn(8, 8, generator=gen))
    bn = model.block[1]
    return {"mean": bn.running_mean.clone(), "var": bn.running_var.clone(), "count": int(bn.num_batches_tracked)}


def seed_suite(out: str) -> dict[str, Any]:
    out_dir = Path(out)
    results = {}
    for name, bf16 in (("replay_fp32", False), ("replay_bf16", True)):
        directory = out_dir / name
        directory.mkdir(exist_ok=True)
        torchacc.dist.barrier()
        results[name] = seed_replay(directory, bf16)
    results["foreign_optimizer_state"] = foreign_optimizer_state(out_dir)
    results["forward"] = forward_called_directly()
    results["save_on_rank0_only"] = save_on_rank0_only(out_dir)
    results["bn_broadcast"] = batchnorm_buffers(True)
    results["bn_local"] = batchnorm_buffers(False)
    return results
