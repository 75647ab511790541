"""Tensor-parallel checkpoint code run inside each rank (see tests/_launch.py); the assertions live in
test_tp_checkpoint.py. One launch per layout trains, saves shards, and loads them back in fresh models."""

import os

import torch
from _models import SEQ, VOCAB, tiny_llama
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import torchacc

INPUT_IDS = torch.arange(2 * SEQ).reshape(2, SEQ) * 7 % VOCAB


def build(fsdp: int, seed: int):
    config = torchacc.Config()
    config.dist.tp.size = 2
    config.dist.tp.plan = "auto"
    config.dist.fsdp.size = fsdp
    config.dist.fsdp.wrap_layer_cls = {"LlamaDecoderLayer"}
    config.dist.timeout = 120.0
    loader = DataLoader([{"input_ids": INPUT_IDS[0]}] * 4, batch_size=2)
    model, _ = torchacc.accelerate(tiny_llama(seed=seed), loader, config)
    return model


def full_state(model) -> dict[str, torch.Tensor]:
    state = {}
    for key, value in model.state_dict().items():
        state[key] = (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu().clone()
    return state


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=INPUT_IDS).logits
    return (logits.full_tensor() if isinstance(logits, DTensor) else logits).detach().cpu()


def _bad_blocks(model, meta: dict) -> list[str]:
    """Keys whose recorded (offset, local shape) is not where this rank's local tensor lies in the full one."""
    bad = []
    for key, value in model.state_dict().items():
        entry = meta["tensors"][key]
        full = value.full_tensor() if isinstance(value, DTensor) else value
        local = value.to_local() if isinstance(value, DTensor) else value
        block = full[tuple(slice(o, o + n) for o, n in zip(entry["offset"], entry["local_shape"], strict=True))]
        if block.shape != local.shape or not torch.equal(block, local):
            bad.append(key)
    return bad


def _name(rank: int, world: int) -> str:
    return f"rank-{rank}-of-{world}-model.pth"


def save_and_reload(out: str, fsdp: str) -> dict:
    """Train 2 steps, save shards + metadata, record the full state; then load the consolidated state and the
    local shards into fresh models."""
    rank, world, fsdp = torchacc.dist.rank(), torchacc.dist.world_size(), int(fsdp)
    model = build(fsdp, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(input_ids=INPUT_IDS, labels=INPUT_IDS).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    shards = os.path.join(out, "shards")
    os.makedirs(shards, exist_ok=True)
    meta = model.get_shard_metadata()
    ckpt = {"model": model.state_dict(), "shard_metadata": meta}
    torchacc.save(ckpt, f"{shards}/{_name(rank, world)}", master_only=False)
    if rank == 0:
        model.config.save_pretrained(shards)
    result = {"meta": meta, "state": full_state(model), "logits": _logits(model)}
    result["bad_blocks"] = _bad_blocks(model, meta)

    if rank == 0:  # offline consolidation, as the training script would run it
        torchacc.dist.fsdp.consolidate_sharded_model_checkpoints(shards)
    torchacc.dist.rendezvous("consolidated")
    fresh = build(fsdp, seed=1)
    fresh.load_state_dict(torch.load(os.path.join(shards, "consolidated.pth"), weights_only=True)["model"])
    result["from_full"] = full_state(fresh)
    result["from_full_logits"] = _logits(fresh)
    fresh = build(fsdp, seed=1)
    own = torchacc.load(os.path.join(shards, _name(rank, world)))
    fresh.load_state_dict(own["model"], shard_metadata=own["shard_metadata"])
    result["from_shards"] = full_state(fresh)
    other = torchacc.load(os.path.join(shards, _name((rank + 1) % world, world)))
    try:  # another rank's shards, passed off as this rank's: the blocks differ
        fresh.load_state_dict(other["model"], shard_metadata={**other["shard_metadata"], "rank": rank})
        result["foreign_error"] = None
    except ValueError as exc:
        result["foreign_error"] = str(exc)
    return result
