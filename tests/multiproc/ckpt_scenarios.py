"""Checkpoint code run inside each rank (see tests/_launch.py); the assertions live in test_checkpoint.py."""

import itertools
import os

import torch
from _models import tiny_gpt2, token_dataset
from scenarios import full_state, gpt2_config
from torch.utils.data import DataLoader

import torchacc

LR = 1e-3


def build(fsdp: int, dp: int | None = None):
    """Tiny GPT-2 with a persistent buffer (and tied wte/lm_head), accelerated, with its optimizer."""
    model = tiny_gpt2(seed=torchacc.dist.rank())
    model.transformer.register_buffer("marker", torch.arange(5.0) + torchacc.dist.rank())
    loader = DataLoader(token_dataset(64), batch_size=2, shuffle=True)
    config = gpt2_config(fsdp=fsdp, dp=dp)
    model, loader = torchacc.accelerate(model, loader, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    return model, loader, optimizer


def train(model, optimizer, batches) -> list[float]:
    losses = []
    for batch in batches:
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def save_shards(model, optimizer, ckpt_dir: str) -> None:
    """TorchAcc's documented save path, exactly, plus name-keyed optimizer shards."""
    rank, world = torchacc.dist.rank(), torchacc.dist.world_size()
    torchacc.dist.rendezvous("saving_model")
    torchacc.dist.mark_step()
    ckpt = {"model": model.state_dict(), "shard_metadata": model.get_shard_metadata()}
    torchacc.save(ckpt, f"{ckpt_dir}/rank-{rank}-of-{world}-model.pth", master_only=False)
    torchacc.save(optimizer.state_dict(), f"{ckpt_dir}/optimizer.pth")
    optim_shard = {"optimizer": torchacc.optim_state_dict(model, optimizer), "shard_metadata": ckpt["shard_metadata"]}
    torchacc.save(optim_shard, f"{ckpt_dir}/rank-{rank}-of-{world}-optim.pth", master_only=False)


def train_and_save(out: str) -> dict:
    """2 ranks: an uninterrupted 6-step run, then a 3-step run saved in both formats."""
    model, loader, optimizer = build(fsdp=2)
    reference_losses = train(model, optimizer, itertools.islice(loader, 6))
    reference = {"losses": reference_losses, "state": full_state(model)}

    model, loader, optimizer = build(fsdp=2)
    consumed: list[int] = []
    first_batches = [batch for batch in itertools.islice(loader, 3) if not consumed.extend(batch["index"].tolist())]
    losses = train(model, optimizer, first_batches)
    ckpt_dir = os.path.join(out, "shards")
    os.makedirs(ckpt_dir, exist_ok=True)
    save_shards(model, optimizer, ckpt_dir)
    torchacc.save_checkpoint(
        os.path.join(out, "dcp"), model=model, optimizer=optimizer, dataloader=loader, extra={"step": 3}
    )
    gathered = full_state(model)
    full_optim = torchacc.optim_state_dict(model, optimizer, full=True)
    # The TorchAcc path continues: consolidate on the master, then load the full state back.
    if torchacc.dist.is_master_ordinal(local=False):
        torchacc.dist.fsdp.consolidate_sharded_model_checkpoints(
            ckpt_prefix=ckpt_dir + "/", ckpt_suffix="rank-*-of-*-model.pth"
        )
    torchacc.dist.rendezvous("ckpt_consolidation")
    full = torch.load(ckpt_dir + "/consolidated.pth")
    model.load_state_dict(full["model"])
    reloaded = full_state(model)
    return {
        "reference": reference,
        "losses": losses,
        "gathered": gathered,
        "full_optim": full_optim,
        "consumed_indices": consumed,
        "reload_equal": all(torch.equal(reloaded[k], gathered[k]) for k in gathered),
    }


def resume(out: str) -> dict:
    """2 fresh ranks: resume from the local shards, and separately from the DCP checkpoint; 3 more steps each."""
    rank, world = torchacc.dist.rank(), torchacc.dist.world_size()
    ckpt_dir = os.path.join(out, "shards")
    model, loader, optimizer = build(fsdp=2)
    shard = torchacc.load(f"{ckpt_dir}/rank-{rank}-of-{world}-model.pth")
    model.load_state_dict(shard["model"], shard_metadata=shard["shard_metadata"])
    optim_shard = torchacc.load(f"{ckpt_dir}/rank-{rank}-of-{world}-optim.pth")
    torchacc.load_optim_state_dict(
        model, optimizer, optim_shard["optimizer"], shard_metadata=optim_shard["shard_metadata"]
    )
    from_shards = {"losses": train(model, optimizer, itertools.islice(loader, 3, 6)), "state": full_state(model)}

    model, loader, optimizer = build(fsdp=2)
    extra = torchacc.load_checkpoint(os.path.join(out, "dcp"), model=model, optimizer=optimizer, dataloader=loader)
    from_dcp = {
        "losses": train(model, optimizer, itertools.islice(loader, 3)),
        "state": full_state(model),
        "extra": extra,
    }
    return {"from_shards": from_shards, "from_dcp": from_dcp}


def load_elsewhere(out: str, layout: str) -> dict:
    """Another world size loads what 2 ranks saved: consolidated files, resharded files and DCP."""
    world = torchacc.dist.world_size()
    fsdp = world if layout == "fsdp" else 2
    model, _, optimizer = build(fsdp=fsdp, dp=None if layout == "fsdp" else world // fsdp)
    result = {}
    full = torch.load(os.path.join(out, "shards", "consolidated.pth"))
    model.load_state_dict(full["model"])
    full_optim = torch.load(os.path.join(out, "shards", "consolidated_optim.pth"))
    torchacc.load_optim_state_dict(model, optimizer, full_optim["optimizer"])
    result["consolidated"] = {
        "state": full_state(model),
        "optim": torchacc.optim_state_dict(model, optimizer, full=True),
    }

    model, loader, optimizer = build(fsdp=fsdp, dp=None if layout == "fsdp" else world // fsdp)
    torchacc.load_checkpoint(os.path.join(out, "dcp"), model=model, optimizer=optimizer, dataloader=loader)
    result["dcp"] = {"state": full_state(model), "optim": torchacc.optim_state_dict(model, optimizer, full=True)}
    # 3 steps x 2 samples x 2 ranks of the 64-sample epoch were consumed; the rest is re-split over this world.
    result["remaining_indices"] = [i for batch in loader for i in batch["index"].tolist()]

    resharded = os.path.join(out, f"resharded-{world}")
    if layout == "fsdp" and os.path.isdir(resharded):
        rank = torchacc.dist.rank()
        model, _, optimizer = build(fsdp=fsdp)
        shard = torchacc.load(f"{resharded}/rank-{rank}-of-{world}-model.pth")
        model.load_state_dict(shard["model"], shard_metadata=shard["shard_metadata"])
        optim_shard = torchacc.load(f"{resharded}/rank-{rank}-of-{world}-optim.pth")
        torchacc.load_optim_state_dict(
            model, optimizer, optim_shard["optimizer"], shard_metadata=shard["shard_metadata"]
        )
        result["resharded"] = {
            "state": full_state(model),
            "optim": torchacc.optim_state_dict(model, optimizer, full=True),
        }
    return result


def features(out: str) -> dict:
    """Frozen and optimizer-less parameters, two param groups, a bf16 buffer and a checkpoint_wrapper prefix."""
    from _models import TinyNet
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = TinyNet()
    model.register_buffer("scale", torch.linspace(0, 1, 4).bfloat16())
    model.blocks[1] = checkpoint_wrapper(model.blocks[1])
    model.blocks[0].fc1.weight.requires_grad_(False)
    config = torchacc.Config()
    config.dist.fsdp.size = 2
    config.dist.fsdp.wrap_layer_cls = {"Block"}
    model = torchacc.accelerate(model, config=config)
    named = dict(model.named_parameters())
    decay = [p for n, p in named.items() if n.endswith("weight") and p.requires_grad]
    no_decay = [p for n, p in named.items() if n.endswith("bias") and n != "head.bias"]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}])
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(torchacc.dist.rank()))
    for _ in range(2):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    rank, world = torchacc.dist.rank(), torchacc.dist.world_size()
    meta = model.get_shard_metadata()
    ckpt_dir = os.path.join(out, "features")
    os.makedirs(ckpt_dir, exist_ok=True)
    torchacc.save(
        {"model": model.state_dict(), "shard_metadata": meta},
        f"{ckpt_dir}/rank-{rank}-of-{world}-model.pth",
        master_only=False,
    )
    optim = {"optimizer": torchacc.optim_state_dict(model, optimizer), "shard_metadata": meta}
    torchacc.save(optim, f"{ckpt_dir}/rank-{rank}-of-{world}-optim.pth", master_only=False)
    return {"state": full_state(model), "optim": torchacc.optim_state_dict(model, optimizer, full=True)}
