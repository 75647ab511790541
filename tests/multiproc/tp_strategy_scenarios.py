"""FSDP2Strategy with tensor parallelism, run inside each rank (see tests/_launch.py); assertions live in
test_strategy_tp.py. The same suite runs on 2 ranks (TP2) and on 4 ranks (FSDP2 x TP2)."""

import itertools
import os

import strategy_scenarios
import torch
from _models import tiny_llama, token_dataset
from scenarios import full_state
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import torchacc

MICRO = 2


def make_strategy(**kwargs) -> torchacc.FSDP2Strategy:
    config = torchacc.Config()
    config.dist.fsdp.wrap_layer_cls = {"LlamaDecoderLayer"}
    config.dist.timeout = 120.0
    data_ranks = torchacc.dist.world_size() // 2
    strategy = torchacc.FSDP2Strategy(
        config,
        tensor_parallel_size=2,
        sharding_strategy="FULL_SHARD",
        micro_train_batch_size=MICRO,
        train_batch_size=2 * MICRO * data_ranks,  # two micro-steps per optimizer step
        seed=0,
        **kwargs,
    )
    strategy.setup_environment()
    return strategy


def fresh(seed: int = 0, **kwargs):
    strategy = make_strategy(**kwargs)
    model = strategy.parallelize(tiny_llama(seed=seed))
    loader = strategy.process_dataloader(DataLoader(token_dataset(64), batch_size=MICRO))
    return strategy, model, iter(loader), torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(strategy, model, optimizer, batches, num_steps: int) -> dict:
    """``num_steps`` optimizer steps of strategy_scenarios.train (each of accumulation_steps micro-batches)."""
    return strategy_scenarios.train(
        strategy, model, optimizer, itertools.islice(batches, num_steps * strategy.accumulation_steps)
    )


def tp_suite(out: str) -> dict:
    """Everything on 2 ranks (TP2); on 4 (FSDP2 x TP2) all but the resume, to keep the launch short."""
    results = {"layout": layout(), "parity": parity(), "fp16": fp16_overflow_on_one_rank(), "size_error": size_error()}
    if torchacc.dist.world_size() == 2:
        results["resume"] = resume(out)
    return results


def layout() -> dict:
    """The mesh, the data-parallel view, and the mesh a parallelize_fn gets."""
    seen = {}

    def parallelize_fn(model, mesh, mp_policy):
        seen["names"] = mesh.mesh_dim_names
        return model

    strategy = make_strategy(parallelize_fn=parallelize_fn)
    strategy.parallelize(tiny_llama(seed=0))
    return {
        "mesh_names": strategy.device_mesh.mesh_dim_names,
        "fn_mesh_names": seen["names"],
        "data_parallel_size": strategy.data_parallel_size,
        "tensor_parallel_size": strategy.tensor_parallel_size,
        "sampler": strategy.distributed_sampler_kwargs,
        "accumulation_steps": strategy.accumulation_steps,
    }


def parity() -> dict:
    strategy, model, batches, optimizer = fresh(max_norm=0.05)
    result = train(strategy, model, optimizer, batches, 3)
    up = model.model.layers[0].mlp.up_proj.weight
    result.update(
        state=full_state(model),
        up_proj_placements=[str(p) for p in up.placements] if isinstance(up, DTensor) else None,
        data_parallel_rank=strategy.data_parallel_rank,
    )
    return result


def resume(out: str) -> dict:
    """4 steps straight vs 2 steps, save_ckpt, a fresh strategy and model that load_ckpt, 2 more: bitwise alike."""
    strategy, model, batches, optimizer = fresh()
    straight = train(strategy, model, optimizer, batches, 4)
    straight_state = full_state(model)

    strategy, model, batches, optimizer = fresh()
    first = train(strategy, model, optimizer, batches, 2)
    save_dir = os.path.join(out, "ckpt")
    strategy.save_ckpt(model, save_dir, client_state={"note": 1}, optimizer=optimizer)

    strategy, model, _, optimizer = fresh(seed=1)
    _, client_state = strategy.load_ckpt(model, save_dir, optimizer=optimizer)
    second = train(strategy, model, optimizer, iter(strategy.dataloader), 2)
    return {
        "losses_equal": straight["losses"] == first["losses"] + second["losses"],
        "indices_equal": straight["indices"] == first["indices"] + second["indices"],
        "state_equal": all(torch.equal(v, straight_state[k]) for k, v in full_state(model).items()),
        "client_state": client_state,
        "global_step": strategy.global_step,
    }


def fp16_overflow_on_one_rank() -> dict:
    """An inf in rank 1's local shard of a TP-split gradient only: every rank must skip the step and back off."""
    strategy, model, batches, _ = fresh(mp_policy="fp16", max_norm=1e6)
    # the final norm's gradient first: not TP-split, so on FSDP x TP it lives on the "fsdp" mesh alone, and
    # DTensor's own overflow check (which reduces over the first gradient's mesh) would miss rank 1's inf on rank 0
    params = sorted(model.parameters(), key=lambda p: p.dim())  # the norm weights (1-D) first
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    steps = []
    for step in range(3):
        for i in range(strategy.accumulation_steps):
            batch = next(batches)
            loss = strategy.training_step({"input_ids": batch["input_ids"], "labels": batch["labels"]}, i)
            strategy.backward(loss, model, optimizer)
        grad = model.model.layers[1].mlp.down_proj.weight.grad  # rowwise: split over tp (and fsdp)
        if step == 1 and torchacc.dist.rank() == 1:
            grad.to_local().view(-1)[0] = float("inf")
        before, scale = full_state(model), strategy.scaler.get_scale()
        strategy.optimizer_step(optimizer, model)
        steps.append(
            {
                "scale": scale,
                "scale_after": strategy.scaler.get_scale(),
                "changed": any(not torch.equal(v, before[k]) for k, v in full_state(model).items()),
            }
        )
    return {"steps": steps, "grad_is_dtensor": isinstance(grad, DTensor)}


def size_error() -> str:
    """A TP size that does not divide the world: the same ValueError on every rank, from setup_environment."""
    strategy = torchacc.FSDP2Strategy(tensor_parallel_size=3)
    try:
        strategy.setup_environment()
    except ValueError as exc:
        return str(exc)
    return "no error"
