"""Tensor-parallel runs inside each rank (see tests/_launch.py); test_tp.py compares them with one process."""

import itertools

import torch
from _models import TinyNet, tiny_llama, token_dataset
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import torchacc

NUM_STEPS = 5
LR = 1e-3
MAX_NORM = 1.0


def llama_config(*, fsdp: int = 1, tp: int = 2, kind: str = "llama", **tp_extra) -> torchacc.Config:
    config = torchacc.Config()
    config.dist.fsdp.size = fsdp
    config.dist.tp.size = tp
    config.dist.fsdp.wrap_layer_cls = {"LlamaDecoderLayer" if kind == "llama" else "Qwen2DecoderLayer"}
    config.dist.timeout = 120.0
    for key, value in tp_extra.items():
        setattr(config.dist.tp, key, value)
    return config


def train(config: torchacc.Config, kind: str = "llama", *, optimizer_first: bool = False) -> dict:
    """5 AdamW steps with clipping; each rank starts from different weights (rank 0's win: sync_module_states)."""
    model = tiny_llama(seed=torchacc.dist.rank(), kind=kind)
    loader = DataLoader(token_dataset(32), batch_size=2)
    if optimizer_first:  # built on the unsplit parameters: accelerate() must move it onto the DTensors
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        model, loader, optimizer = torchacc.accelerate(model, loader, config, optimizer=optimizer)
    else:
        model, loader = torchacc.accelerate(model, loader, config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms, indices = [], [], []
    for batch in itertools.islice(loader, NUM_STEPS):
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        norms.append(torchacc.clip_grad_norm_(model.parameters(), MAX_NORM))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        indices.append(batch["index"].tolist())
    return {
        "losses": losses,
        "norms": norms,
        "indices": indices,
        "state": {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()
        },
        "placements": {
            name: ([repr(p) for p in param.placements], list(param.device_mesh.mesh_dim_names or ()))
            for name, param in model.named_parameters()
            if isinstance(param, DTensor)
        },
        "mesh": torchacc.accelerated_state(model).mesh.mesh.tolist(),
    }


def train_dict_plan() -> dict:
    """A plain nn.Module (no Hugging Face plan) split by a dict plan: fc1 by columns, fc2 by rows."""
    torch.manual_seed(0)
    model = TinyNet()
    config = torchacc.Config()
    config.dist.tp.size = 2
    config.dist.tp.plan = {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}
    model = torchacc.accelerate(model, config=config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {
        "state": {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()
        },
        "local": tuple(model.blocks[0].fc1.weight.to_local().shape),
    }


def two_rank_suite() -> dict:
    return {
        "tp2": train(llama_config()),
        "tp2_optimizer_first": train(llama_config(), optimizer_first=True),
        "tp2_sp_qwen2": train(llama_config(kind="qwen2", sequence_parallel=True), kind="qwen2"),
        "dict_plan": train_dict_plan(),
    }


def four_rank_suite() -> dict:
    return {
        "fsdp2_tp2": train(llama_config(fsdp=2)),
        "fsdp2_tp2_sp": train(llama_config(fsdp=2, sequence_parallel=True)),
        "dp2_tp2": train(llama_config(fsdp=1)),
    }
