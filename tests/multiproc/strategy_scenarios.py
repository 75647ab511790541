"""FSDP2Strategy code run inside each rank (see tests/_launch.py); assertions live in test_strategy.py."""

import ctypes
import itertools
import os
import resource
import threading

import torch
import torch.distributed.checkpoint as dcp
from _models import tiny_gpt2, token_dataset
from scenarios import full_state
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

import torchacc

MICRO, TRAIN = 2, 8


def make_strategy(sharding: str, **kwargs) -> torchacc.FSDP2Strategy:
    config = torchacc.Config()
    config.dist.fsdp.wrap_layer_cls = {"GPT2Block"}
    config.dist.timeout = 120.0
    strategy = torchacc.FSDP2Strategy(
        config, sharding_strategy=sharding, micro_train_batch_size=MICRO, train_batch_size=TRAIN, seed=0, **kwargs
    )
    strategy.setup_environment()
    return strategy


def train(strategy, model, optimizer, micro_batches) -> dict:
    losses, indices, norms = [], [], []
    for i, batch in enumerate(micro_batches):
        loss = strategy.training_step({"input_ids": batch["input_ids"], "labels": batch["labels"]}, i)
        strategy.backward(loss, model, optimizer)
        norm = strategy.optimizer_step(optimizer, model)
        losses.append(loss.item())
        indices.append(batch["index"].tolist())
        if norm is not None:
            norms.append(norm)
    return {"losses": losses, "indices": indices, "norms": norms}


def parity(sharding: str, **kwargs) -> dict:
    strategy = make_strategy(sharding, max_norm=0.05, **kwargs)
    model = strategy.parallelize(tiny_gpt2(seed=torchacc.dist.rank()))
    loader = strategy.process_dataloader(DataLoader(token_dataset(64), batch_size=MICRO))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = 3 * strategy.accumulation_steps
    result = train(strategy, model, optimizer, itertools.islice(loader, steps))
    result.update(
        state=full_state(model), accumulation_steps=strategy.accumulation_steps, mesh=str(strategy.device_mesh)
    )
    return result


def two_rank_suite(out: str) -> dict:
    results = {s: parity(s) for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")}
    results["NO_SHARD_fn"] = no_shard_parallelize_fn()
    results["deferred"] = deferred_restore(out)
    results["rotation"] = rotation_and_export(out)
    results["meta_memory"] = meta_memory()
    results["fp16"] = fp16_scaling()
    return results


def no_shard_parallelize_fn() -> dict:
    """NO_SHARD with a parallelize_fn: the fn is called, with a mesh whose "fsdp" axis has one rank."""
    seen = {}

    def parallelize_fn(model, mesh, mp_policy):
        seen.update(names=mesh.mesh_dim_names, shape=tuple(mesh.shape))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)

    result = parity("NO_SHARD", parallelize_fn=parallelize_fn)
    result["fn_mesh"] = seen
    return result


def hybrid_suite() -> dict:
    return {
        "HYBRID_SHARD": parity("HYBRID_SHARD"),
        "HYBRID_DEFER": parity("HYBRID_SHARD", defer_replica_all_reduce=True),
    }


def deferred_restore(out: str) -> dict:
    """4 steps straight vs 2 steps, a full checkpoint, a fresh strategy that defers the optimizer restore, 2 more."""

    def fresh():
        strategy = make_strategy("FULL_SHARD")
        model = strategy.parallelize(tiny_gpt2(seed=0))
        loader = strategy.process_dataloader(DataLoader(token_dataset(64), batch_size=MICRO))
        return strategy, model, loader, torch.optim.AdamW(model.parameters(), lr=1e-3)

    steps = 2 * (TRAIN // (MICRO * torchacc.dist.world_size()))
    strategy, model, loader, optimizer = fresh()
    straight = train(strategy, model, optimizer, itertools.islice(loader, 2 * steps))
    straight_state = full_state(model)

    strategy, model, loader, optimizer = fresh()
    first = train(strategy, model, optimizer, itertools.islice(loader, steps))
    path = os.path.join(out, "full.pth")
    strategy.save_checkpoint(
        {
            "state_dict": strategy.model_state_dict(),
            "optimizer": torchacc.optim_state_dict(model, optimizer, full=True),
        },
        path,
    )
    strategy, model, loader, optimizer = fresh()
    checkpoint = strategy.load_checkpoint(path)
    strategy.load_optimizer_state_dict(checkpoint)
    second = train(strategy, model, optimizer, itertools.islice(loader, steps, 2 * steps))
    return {
        "losses_equal": straight["losses"] == first["losses"] + second["losses"],
        "state_equal": all(torch.equal(v, straight_state[k]) for k, v in full_state(model).items()),
    }


def fp16_scaling() -> dict:
    """mp_policy="fp16": backward scales the loss, optimizer_step unscales before clipping, and an inf on one
    rank skips the step (and the scheduler) on every rank while the scale backs off."""
    strategy = make_strategy("FULL_SHARD", mp_policy="fp16", max_norm=1e6)
    model = strategy.parallelize(tiny_gpt2(seed=0))
    loader = strategy.process_dataloader(DataLoader(token_dataset(64), batch_size=MICRO))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    batches = iter(loader)
    result = {"initial_scale": strategy.scaler.get_scale() if strategy.scaler is not None else None, "steps": []}
    for step in range(3):
        for i in range(strategy.accumulation_steps):
            batch = next(batches)
            loss = strategy.training_step({"input_ids": batch["input_ids"], "labels": batch["labels"]}, i)
            strategy.backward(loss, model, optimizer)
        scaled_norm = torchacc.parallel.clip_grad.grad_norm(model.parameters())
        if step == 1 and torchacc.dist.rank() == 1:
            next(iter(model.parameters())).grad.to_local().view(-1)[0] = float("inf")
        before, scale, lr_steps = full_state(model), strategy.scaler.get_scale(), scheduler.last_epoch
        norm = strategy.optimizer_step(optimizer, model, scheduler)
        result["steps"].append(
            {
                "scaled_norm": scaled_norm,
                "norm": norm,
                "scale": scale,
                "scale_after": strategy.scaler.get_scale(),
                "changed": any(not torch.equal(v, before[k]) for k, v in full_state(model).items()),
                "scheduler_stepped": scheduler.last_epoch > lr_steps,
            }
        )
    return result


def rotation_and_export(out: str) -> dict:
    strategy = make_strategy("FULL_SHARD")
    model = strategy.parallelize(tiny_gpt2(seed=0))
    loader = strategy.process_dataloader(DataLoader(token_dataset(64), batch_size=MICRO))
    optimizer = strategy.create_optimizer(model, lr=1e-3, weight_decay=0.1)
    save_dir = os.path.join(out, "rotating")
    if torchacc.dist.rank() == 0:  # the user's own DCP export beside the rotating checkpoints: never deleted
        dcp.save({"w": torch.ones(2)}, checkpoint_id=os.path.join(save_dir, "my-export"), no_dist=True)
    torchacc.dist.barrier()
    batches = iter(loader)
    for _ in range(4):
        train(strategy, model, optimizer, itertools.islice(batches, strategy.accumulation_steps))
        strategy.save_ckpt(model, save_dir, max_num=2, client_state={"note": strategy.global_step}, optimizer=optimizer)
    kept = sorted(name for name in os.listdir(save_dir) if name != ".torchacc-writer.json")  # the writer's claim
    expected = full_state(model)
    next_batch = next(batches)["index"].tolist()

    strategy2 = make_strategy("FULL_SHARD")
    model2 = strategy2.parallelize(tiny_gpt2(seed=1))
    loader2 = strategy2.process_dataloader(DataLoader(token_dataset(64), batch_size=MICRO))
    optimizer2 = strategy2.create_optimizer(model2, lr=1e-3, weight_decay=0.1)
    path, client_state = strategy2.load_ckpt(model2, save_dir, optimizer=optimizer2)
    resumed_equal = all(torch.equal(v, expected[k]) for k, v in full_state(model2).items())
    hf_dir = os.path.join(out, "hf")
    if torchacc.dist.rank() == 0:  # the user's files in the output directory survive save_model
        os.makedirs(os.path.join(hf_dir, "run-1"), exist_ok=True)
        with open(os.path.join(hf_dir, "train.log"), "w") as f:
            f.write("step 1\n")
        with open(os.path.join(hf_dir, "model.safetensors"), "w") as f:
            f.write("an earlier export, replaced")
    torchacc.dist.barrier()
    strategy2.save_model(model2, None, hf_dir)
    return {
        "kept": kept,
        "loaded": os.path.basename(path),
        "client_state": client_state,
        "global_step": strategy2.global_step,
        "resumed_equal": resumed_equal,
        "same_next_batch": next(iter(loader2))["index"].tolist() == next_batch,
        "groups": [(len(g["params"]), g["weight_decay"]) for g in optimizer2.param_groups],
    }


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def build_meta_model() -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(16)])


def meta_memory() -> dict:
    """Peak RSS growth while building and parallelizing a 64M-parameter model on the meta device."""
    build = build_meta_model

    model_bytes = 16 * 2048 * 2048 * 4
    strategy = torchacc.FSDP2Strategy(sharding_strategy="FULL_SHARD", seed=0)
    strategy.config.dist.fsdp.wrap_layer_cls = {"Linear"}
    strategy.setup_environment()
    # RSS should follow the live tensors: glibc raises its mmap threshold after frees of large blocks and then
    # keeps freed 16 MB units in the heap (growth varied 144-191 MB on rank 1 from run to run). A fixed
    # threshold (M_MMAP_THRESHOLD, -3) of 1 MiB maps each large block on its own and unmaps it when freed.
    ctypes.CDLL(None).mallopt(-3, 1 << 20)
    torchacc.dist.barrier()
    base, peak, done = _rss_bytes(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            done.wait(0.002)

    thread = threading.Thread(target=sample)
    thread.start()
    with strategy.init_model_context():
        model = build()
    model = strategy.parallelize(model)
    done.set()
    thread.join()
    growth = max(peak[0], _rss_bytes()) - base
    local = sum(p.to_local().numel() * 4 for p in model.parameters())
    std = model[0].weight.full_tensor().std().item()
    return {
        "first_and_last": [model[0].weight.full_tensor(), model[15].weight.full_tensor()],
        "local_rows": model[0].weight.to_local()[:4].clone(),
        "growth": growth,
        "model_bytes": model_bytes,
        "local_bytes": local,
        "std": std,
        "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }
