"""Context-parallel runs inside each rank (see tests/_launch.py); test_cp.py compares them with one process."""

import itertools
from pathlib import Path
from typing import Any

import torch
from _models import VOCAB, tiny_llama, token_dataset
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader
from tp_dcp_scenarios import snapshot

import torchacc

NUM_STEPS = 3
LR = 1e-3
SFT_LEN = 15  # odd: not a multiple of the CP size, so the loader pads


def sft_dataset(num_samples: int = 16, seed: int = 2) -> list[dict[str, torch.Tensor]]:
    """Prompt + answer samples, right-padded to SFT_LEN: the prompt and the padding have no targets (-100), so
    the chunks of one sequence hold different numbers of targets (the first chunk often none)."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(num_samples):
        length = int(torch.randint(9, SFT_LEN + 1, (1,), generator=gen))
        prompt = int(torch.randint(5, 8, (1,), generator=gen))
        ids = torch.randint(0, VOCAB - 1, (SFT_LEN,), generator=gen)
        mask = (torch.arange(SFT_LEN) < length).long()
        labels = torch.where((torch.arange(SFT_LEN) >= prompt) & (mask == 1), ids, torch.tensor(-100))
        samples.append({"input_ids": ids, "attention_mask": mask, "labels": labels, "index": torch.tensor(i)})
    return samples


def cp_config(
    *,
    fsdp: int = 1,
    cp: int = 2,
    tp: int = 1,
    kind: str = "llama",
    method: str = "ulysses",
    gc: bool = False,
    bf16: bool = False,
) -> torchacc.Config:
    config = torchacc.Config()
    config.memory.gc = gc
    config.compute.bf16 = bf16
    config.dist.fsdp.size = fsdp
    config.dist.cp.size = cp
    config.dist.cp.method = method
    config.dist.tp.size = tp
    config.dist.fsdp.wrap_layer_cls = {"LlamaDecoderLayer" if kind == "llama" else "Qwen2DecoderLayer"}
    config.dist.timeout = 120.0
    return config


def _full(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()


def train(config: torchacc.Config, kind: str = "llama", *, data: str = "tokens", **model_kw) -> dict:
    """3 AdamW steps; each rank starts from different weights (rank 0's win: sync_module_states)."""
    model = tiny_llama(seed=torchacc.dist.rank(), kind=kind, **model_kw)
    dataset = token_dataset(32) if data == "tokens" else sft_dataset()
    model, loader = torchacc.accelerate(model, DataLoader(dataset, batch_size=2), config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, indices, lengths = [], [], []
    for batch in itertools.islice(loader, NUM_STEPS):
        loss = model(**{k: v for k, v in batch.items() if k != "index"}).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        indices.append(batch["index"].tolist())
        lengths.append(batch["input_ids"].shape[1])
    state = torchacc.accelerated_state(model)
    return {
        "losses": losses,
        "indices": indices,
        "lengths": lengths,
        "state": {k: _full(v) for k, v in model.state_dict().items()},
        "placements": {
            name: ([repr(p) for p in param.placements], list(param.device_mesh.mesh_dim_names or ()))
            for name, param in model.named_parameters()
            if isinstance(param, DTensor)
        },
        "mesh": (list(state.mesh.mesh_dim_names), state.mesh.mesh.tolist()),
        "attn": model.config._attn_implementation,
    }


def train_strategy(config: torchacc.Config) -> dict:
    """The same run through FSDP2Strategy (its process_dataloader splits the sequences too)."""
    strategy = torchacc.FSDP2Strategy(config, micro_train_batch_size=2, seed=0)
    strategy.setup_environment()
    model = strategy.parallelize(tiny_llama(seed=torchacc.dist.rank()))
    loader = strategy.process_dataloader(DataLoader(token_dataset(32), batch_size=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, indices = [], []
    for i, batch in enumerate(itertools.islice(loader, NUM_STEPS)):
        loss = strategy.training_step({k: v for k, v in batch.items() if k != "index"}, i)
        strategy.backward(loss, model, optimizer)
        strategy.optimizer_step(optimizer, model)
        losses.append(loss.item())
        indices.append(batch["index"].tolist())
    state = {k: _full(v) for k, v in model.state_dict().items()}
    return {"losses": losses, "indices": indices, "state": state, "attn": model.config._attn_implementation}


def fresh(config: torchacc.Config, seed: int) -> tuple[torch.nn.Module, Any, torch.optim.Optimizer]:
    model, loader = torchacc.accelerate(tiny_llama(seed=seed), DataLoader(token_dataset(32), batch_size=2), config)
    return model, loader, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict) -> float:
    loss = model(**{k: v for k, v in batch.items() if k != "index"}).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def checkpoint_cp2(out: Path) -> dict:
    """2 steps at CP 2, save (model, AdamW, loader position), a 3rd step; a fresh CP 2 job loads and takes it."""
    model, loader, optimizer = fresh(cp_config(), seed=0)
    batches = iter(loader)
    step(model, optimizer, next(batches))
    step(model, optimizer, next(batches))
    torchacc.save_checkpoint(out / "ckpt-cp2", model=model, optimizer=optimizer, dataloader=loader)
    saved = snapshot(model, optimizer)
    third = next(batches)
    if torchacc.dist.rank() == 0:  # for the FSDP 4 job, which takes the same third step
        torch.save(third["index"], out / "third.pt")
    straight_loss = step(model, optimizer, third)
    straight = snapshot(model, optimizer)
    model, loader, optimizer = fresh(cp_config(), seed=5)
    torchacc.load_checkpoint(out / "ckpt-cp2", model=model, optimizer=optimizer, dataloader=loader)
    loaded = snapshot(model, optimizer)
    resumed_batch = next(iter(loader))
    resumed_loss = step(model, optimizer, resumed_batch)
    try:  # a mistake inside a forward: the same ValueError on both ranks, before any collective
        model(input_ids=resumed_batch["input_ids"], labels=resumed_batch["labels"])
        labels_only = None
    except ValueError as exc:
        labels_only = str(exc)
    return {
        "labels_only": labels_only,
        "saved": saved,
        "loaded": loaded,
        "straight": straight,
        "resumed": snapshot(model, optimizer),
        "losses": (straight_loss, resumed_loss),
        "third": (third["index"].tolist(), resumed_batch["index"].tolist()),
    }


def moe_aux_loss() -> dict:
    """The CP 2 loss of pp_scenarios.moe_with_aux_loss() (its routers' load-balancing loss added) on 4 samples."""
    from pp_scenarios import moe_with_aux_loss

    config = cp_config()
    config.dist.fsdp.wrap_layer_cls = {"MixtralDecoderLayer"}
    try:
        model, loader = torchacc.accelerate(moe_with_aux_loss(), DataLoader(token_dataset(4), batch_size=4), config)
    except ValueError as exc:
        return {"error": str(exc)}
    batch = next(iter(loader))
    loss = model(**{k: v for k, v in batch.items() if k != "index"}).loss
    return {"loss": loss.item(), "indices": batch["index"].tolist()}


DYNAMIC_ROPE = dict(
    max_position_embeddings=8,  # shorter than the 16-token sequences: the rotary frequencies scale with the length
    rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    initializer_range=0.3,  # large weights: the attention (and so the loss) depends on the frequencies clearly
)


def dynamic_rope() -> dict:
    """The CP 2 loss and this rank's chunk of logits of a Llama with dynamic NTK rope scaling on 2 sequences."""
    try:
        model, loader = torchacc.accelerate(
            tiny_llama(seed=0, **DYNAMIC_ROPE), DataLoader(token_dataset(2), batch_size=2), cp_config()
        )
    except ValueError as exc:
        return {"error": str(exc)}
    batch = next(iter(loader))
    output = model(**{k: v for k, v in batch.items() if k != "index"})
    return {"loss": output.loss.item(), "logits": output.logits.detach(), "indices": batch["index"].tolist()}


def two_rank_suite(out: str) -> dict:
    return {
        "cp2": train(cp_config()),
        "cp2_qwen2_sft": train(cp_config(kind="qwen2"), kind="qwen2", data="sft"),
        "cp2_bf16": train(cp_config(bf16=True)),  # FSDP's bf16 input casting must not copy the CP context
        "strategy_cp2": train_strategy(cp_config()),
        "checkpoint": checkpoint_cp2(Path(out)),
        "moe_aux_loss": moe_aux_loss(),
        "dynamic_rope": dynamic_rope(),
    }


def four_rank_suite(out: str) -> dict:
    model = torchacc.accelerate(tiny_llama(seed=7), config=cp_config(fsdp=4, cp=1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torchacc.load_checkpoint(Path(out) / "ckpt-cp2", model=model, optimizer=optimizer)
    loaded = snapshot(model, optimizer)
    dataset = token_dataset(32)  # every rank takes CP 2's third batch whole: the mean gradient is its gradient
    ids = torch.stack([dataset[i]["input_ids"] for i in torch.load(Path(out) / "third.pt").tolist()])
    step(model, optimizer, {"input_ids": ids, "labels": ids})
    return {
        "fsdp2_cp2": train(cp_config(fsdp=2)),
        "fsdp2_cp2_qwen2": train(cp_config(fsdp=2, kind="qwen2"), kind="qwen2"),
        "cp2_tp2": train(cp_config(tp=2), num_key_value_heads=4),
        "dp2_cp2_gc": train(cp_config(fsdp=1, gc=True)),  # HSDP over (dp, fsdp x cp); recomputed attention
        "fsdp4_loaded": loaded,
        "fsdp4_resumed": snapshot(model, optimizer),
    }


def cuda_cp2(method: str) -> dict:
    """CP 2 on 2 GPUs (NCCL) with ``method``, and the same steps on one unsharded model on this GPU."""
    result = train(cp_config(method=method))
    device = torchacc.dist.device()
    model = tiny_llama(seed=0).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    dataset, losses = token_dataset(32), []
    for indices in result["indices"]:
        ids = torch.stack([dataset[i]["input_ids"] for i in indices]).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    result["reference"] = {"losses": losses, "state": {k: v.detach().cpu() for k, v in model.state_dict().items()}}
    result["state"] = {k: v.cpu() for k, v in result["state"].items()}
    return result
