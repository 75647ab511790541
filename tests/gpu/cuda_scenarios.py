"""CUDA code run inside each rank (see tests/_launch.py, which puts rank r on cuda:LOCAL_RANK); the assertions live
in test_cuda_ranks.py.

Each scenario of a suite runs on its own: an exception is recorded with its traceback under the scenario's name
and the next scenario runs, so that a first GPU run reports every broken path, not only the first one. (A
scenario that fails on one rank only can still leave the others in a collective until ``dist.timeout``.)
"""

import gc
import itertools
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multiproc"))
import ckpt_scenarios  # noqa: E402
import strategy_scenarios  # noqa: E402
from _models import tiny_gpt2, tiny_llama, token_dataset  # noqa: E402
from scenarios import LR, full_state, gpt2_config, train_gpt2  # noqa: E402

import torchacc  # noqa: E402
from torchacc.distributed import env  # noqa: E402

NUM_STEPS = 5


def run_each(scenarios: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Each scenario's result, or ``{"error": traceback}`` for one that raised."""
    results: dict[str, Any] = {}
    for name, scenario in scenarios.items():
        try:
            results[name] = scenario()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    return results


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _devices(tensors) -> list[str]:
    return sorted({_local(t).device.type for t in tensors})


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]


# --- where things live ---------------------------------------------------------------------------------------


def devices_and_backends() -> dict:
    """This rank's device, the model's, the batches', the mesh's, and the backends of the default group and mesh."""
    loader = DataLoader(token_dataset(8), batch_size=2)
    model, loader = torchacc.accelerate(tiny_gpt2(seed=0), loader, gpt2_config(fsdp=2))
    batch = next(iter(loader))
    loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    weight = model.transformer.wte.weight
    return {
        "rank": env.rank(),
        "local_rank": env.local_rank(),
        "current_device": torch.cuda.current_device(),
        "device": str(env.device()),
        "model_device": str(model.device),
        "param_local": str(weight.to_local().device),
        "mesh_device_type": weight.device_mesh.device_type,
        "batch": str(batch["input_ids"].device),
        "loss": str(loss.device),
        "backend": dist.get_backend_config(),
        "mesh_backend": dist.get_backend_config(weight.device_mesh.get_group()),
        "reduce": torchacc.dist.reduce(float(env.rank() + 1)),
        "broadcast": torchacc.dist.broadcast({"from": env.rank()}, src=1),
    }


# --- training runs -----------------------------------------------------------------------------------------


def train(config: torchacc.Config, *, max_norm: float = 0.0) -> dict:
    """``scenarios.train_gpt2`` (each rank starts from its own weights; rank 0's win), with optional clipping, and
    where the parameter shards, gradients and optimizer state live."""
    loader = DataLoader(token_dataset(32), batch_size=2)
    model, loader = torchacc.accelerate(tiny_gpt2(seed=env.rank()), loader, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, indices, norms, grads = [], [], [], set()
    for batch in itertools.islice(loader, NUM_STEPS):
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        grads |= set(_devices(p.grad for p in model.parameters() if p.grad is not None))
        if max_norm:
            norms.append(torchacc.clip_grad_norm_(model.parameters(), max_norm))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        indices.append(batch["index"].tolist())
    return {
        "losses": losses,
        "indices": indices,
        "norms": norms,
        "state": full_state(model),
        "keys": sorted(model.state_dict()),
        "param_devices": _devices(model.parameters()),
        "grad_devices": sorted(grads),
        "optimizer_devices": _devices(_state_tensors(optimizer)),
    }


def fp16_train() -> dict:
    """FSDP with fp16 compute (the policy casts) and torchacc's GradScaler, on the batches of ``train``."""
    loader = DataLoader(token_dataset(32), batch_size=2)
    model, loader = torchacc.accelerate(tiny_gpt2(seed=env.rank()), loader, gpt2_config(fsdp=2, compute__fp16=True))
    inside: dict[str, str] = {}

    def record(module, args, output) -> None:  # a hook that returns a value would replace the output
        inside.setdefault("dtype", str(output.dtype))

    model.transformer.h[0].mlp.c_fc.register_forward_hook(record)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scaler = torchacc.GradScaler(init_scale=1024.0)
    losses, indices, scales = [], [], []
    for batch in itertools.islice(loader, NUM_STEPS):
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        losses.append(loss.item())
        indices.append(batch["index"].tolist())
        scales.append(scaler.get_scale())
    return {"losses": losses, "indices": indices, "scales": scales, "inside": inside, "state": full_state(model)}


def tp_train() -> dict:
    """Tensor parallelism over the 2 GPUs (the model's own plan), 5 AdamW steps with clipping at 1.0."""
    config = torchacc.Config()
    config.dist.tp.size = 2
    config.dist.timeout = 120.0
    loader = DataLoader(token_dataset(32), batch_size=2)
    model, loader = torchacc.accelerate(tiny_llama(seed=env.rank()), loader, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms, indices = [], [], []
    for batch in itertools.islice(loader, NUM_STEPS):
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        norms.append(torchacc.clip_grad_norm_(model.parameters(), 1.0))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        indices.append(batch["index"].tolist())
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    return {
        "losses": losses,
        "norms": norms,
        "indices": indices,
        "state": full_state(model),
        "q_proj": [str(p) for p in q_proj.placements] if isinstance(q_proj, DTensor) else None,
    }


# --- meta-device init and init_from --------------------------------------------------------------------------


def meta_init(*, fsdp: int, dp: int | None = None, offload: bool = False) -> dict:
    """Tiny GPT-2 built on the meta device and initialized on the GPUs by its own (HF) init."""
    with torchacc.init_empty_weights():
        model = tiny_gpt2(seed=7)  # seeds every device's generator: the init draws on the GPU
    config = gpt2_config(fsdp=fsdp, dp=dp, memory__offload_params=offload)
    model = torchacc.accelerate(model, config=config)
    ids = token_dataset(2)[0]["input_ids"].unsqueeze(0).to(env.device())
    with torch.no_grad():
        model(input_ids=ids)  # FSDP's lazy init: under CPU offload it moves the shards to CPU memory here
    return {"state": full_state(model), "param_devices": _devices(model.parameters())}


def init_from_offload(path: str) -> dict:
    """A meta-device model filled from ``path`` (a consolidated .pth) under CPU offload."""
    with torchacc.init_empty_weights():
        model = tiny_gpt2(seed=123)
    config = gpt2_config(fsdp=2, memory__offload_params=True, dist__fsdp__init_from=path)
    model = torchacc.accelerate(model, config=config)
    ids = torch.arange(16, device=env.device()).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float().cpu()
    return {"state": full_state(model), "logits": logits, "param_devices": _devices(model.parameters())}


# --- the strategy's optimizer offload ------------------------------------------------------------------------


def _where(optimizer: torch.optim.Optimizer) -> list[tuple[str, str | None]]:
    return sorted(
        {
            (_local(v).device.type, v.device_mesh.device_type if isinstance(v, DTensor) else None)
            for v in _state_tensors(optimizer)
        },
        key=str,
    )


def strategy_offload_round_trip() -> dict:
    """FSDP2Strategy(cpu_offload=True) on FSDP: the state lives in CPU memory with the offloaded shards, so
    maybe_offload_optimizer and maybe_load_optimizer leave it there; training goes on as without them."""
    runs = {}
    for round_trip in (False, True):
        strategy = strategy_scenarios.make_strategy("FULL_SHARD", cpu_offload=True)
        model = strategy.parallelize(tiny_gpt2(seed=0))
        loader = strategy.process_dataloader(DataLoader(token_dataset(64), batch_size=strategy_scenarios.MICRO))
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        half = 2 * strategy.accumulation_steps
        batches = list(itertools.islice(loader, 2 * half))
        run = {"first": strategy_scenarios.train(strategy, model, optimizer, batches[:half])["losses"]}
        if round_trip:
            objects = [id(v) for v in _state_tensors(optimizer)]
            run["before"] = _where(optimizer)
            strategy.maybe_offload_optimizer(optimizer)
            run["offloaded"] = _where(optimizer)
            strategy.maybe_load_optimizer(optimizer)
            run["loaded"] = _where(optimizer)
            run["same_objects"] = objects == [id(v) for v in _state_tensors(optimizer)]
        run["second"] = strategy_scenarios.train(strategy, model, optimizer, batches[half:])["losses"]
        run["state"] = full_state(model)
        runs["round_trip" if round_trip else "plain"] = run
    return runs


# --- memory ----------------------------------------------------------------------------------------------------


def peak_memory() -> dict:
    """GPU memory of a larger GPT-2 built on the meta device and sharded over the ranks: after set-up and around
    one AdamW step, against the bytes of the whole model."""
    gc.collect()  # the models of earlier scenarios (HF models hold reference cycles) go before the baseline
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torchacc.init_empty_weights():
        model = tiny_gpt2(seed=0, n_embd=256, n_head=8, n_layer=8)
    params = list(model.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in params)
    largest = max(p.numel() * p.element_size() for p in params)
    model = torchacc.accelerate(model, config=gpt2_config(fsdp=env.world_size()))
    torch.cuda.synchronize()
    after_setup = torch.cuda.memory_allocated() - base
    peak_setup = torch.cuda.max_memory_allocated() - base
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    ids = torch.stack([s["input_ids"] for s in token_dataset(2)]).to(env.device())
    torch.cuda.reset_peak_memory_stats()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    torch.cuda.synchronize()
    return {
        "world_size": env.world_size(),
        "model_bytes": model_bytes,
        "largest_param_bytes": largest,
        "after_setup": after_setup,
        "peak_setup": peak_setup,
        "after_step": torch.cuda.memory_allocated() - base,  # shards of parameters, gradients and both moments
        "peak_step": torch.cuda.max_memory_allocated() - base,
    }


# --- suites ----------------------------------------------------------------------------------------------------


def two_gpu_suite(out: str) -> dict:
    """Everything checked on 2 GPUs, in one launch; ``out`` holds ``reference.pth`` for init_from."""
    return run_each(
        {
            "devices": devices_and_backends,
            "fsdp": lambda: train(gpt2_config(fsdp=2)),
            "offload": lambda: train(gpt2_config(fsdp=2, memory__offload_params=True)),
            "clip": lambda: train(gpt2_config(fsdp=2), max_norm=0.05),
            "clip_offload": lambda: train(gpt2_config(fsdp=2, memory__offload_params=True), max_norm=0.05),
            "fp16": fp16_train,
            "tp": tp_train,
            "meta_fsdp1": lambda: meta_init(fsdp=1),
            "meta_fsdp2": lambda: meta_init(fsdp=2),
            "meta_offload": lambda: meta_init(fsdp=2, offload=True),
            "init_from_offload": lambda: init_from_offload(os.path.join(out, "reference.pth")),
            "strategy_offload": strategy_offload_round_trip,
            "memory": peak_memory,
        }
    )


def four_gpu_suite() -> dict:
    """HSDP (2 replicas x 2 shards) on 4 GPUs."""
    return run_each(
        {
            "hsdp": lambda: train(gpt2_config(fsdp=2, dp=2)),
            "meta_hsdp": lambda: meta_init(fsdp=2, dp=2),
            "meta_fsdp1": lambda: meta_init(fsdp=1),
        }
    )


def user_group(backend: str) -> dict:
    """A migrated script: it starts the process group itself (without torch.cuda.set_device), then uses torchacc."""
    dist.init_process_group(backend=backend)
    result: dict[str, Any] = {"backend": dist.get_backend_config()}
    try:
        result["train"] = train_gpt2(gpt2_config(fsdp=2))
    except ValueError as exc:
        result["error"] = str(exc)
    result["current_device"] = torch.cuda.current_device()
    return result


def save_on_gpus(out: str) -> dict:
    """``ckpt_scenarios.train_and_save`` on the GPUs: per-rank shards, a DCP checkpoint and the gathered state."""
    return ckpt_scenarios.train_and_save(out)


def load_without_gpu(out: str) -> dict:
    """On a machine without CUDA: the DCP checkpoint written by CUDA ranks, loaded into a one-process model."""
    model, loader, optimizer = ckpt_scenarios.build(fsdp=1)
    extra = torchacc.load_checkpoint(os.path.join(out, "dcp"), model=model, optimizer=optimizer, dataloader=loader)
    return {
        "cuda": torch.cuda.is_available(),
        "state": full_state(model),
        "optim": torchacc.optim_state_dict(model, optimizer, full=True),
        "extra": extra,
    }
