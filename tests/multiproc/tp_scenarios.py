"""Tensor-parallel runs inside each rank (see tests/_launch.py); test_tp.py compares them with one process."""

import itertools

import torch
from _models import SEQ, TinyNet, tiny_decoder, token_dataset
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import torchacc

NUM_STEPS = 5
LR = 1e-3
MAX_NORM = 1.0
# The Megatron pairs of a Llama-style decoder, as a user writes them: no norm, no output layer.
DECODER_PLAN = {
    **{f"model.layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"},
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}


def llama_config(*, fsdp: int = 1, tp: int = 2, kind: str = "llama", **tp_extra) -> torchacc.Config:
    config = torchacc.Config()
    config.dist.fsdp.size = fsdp
    config.dist.tp.size = tp
    layer = type(tiny_decoder(kind).base_model.layers[0]).__name__
    config.dist.fsdp.wrap_layer_cls = {layer}
    config.dist.timeout = 120.0
    for key, value in tp_extra.items():
        setattr(config.dist.tp, key, value)
    return config


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()
    }


def train(
    config: torchacc.Config, kind: str = "llama", *, optimizer_first: bool = False, num_steps: int = NUM_STEPS
) -> dict:
    """AdamW steps with clipping; each rank starts from different weights (rank 0's win: sync_module_states)."""
    model = tiny_decoder(kind, seed=torchacc.dist.rank())
    loader = DataLoader(token_dataset(32), batch_size=2)
    if optimizer_first:  # built on the unsplit parameters: accelerate() must move it onto the DTensors
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        model, loader, optimizer = torchacc.accelerate(model, loader, config, optimizer=optimizer)
    else:
        model, loader = torchacc.accelerate(model, loader, config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms, indices = [], [], []
    for batch in itertools.islice(loader, num_steps):
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        partial = [
            n for n, p in model.named_parameters() if isinstance(p.grad, DTensor) and p.grad.placements[-1].is_partial()
        ]
        norms.append(torchacc.clip_grad_norm_(model.parameters(), MAX_NORM))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        indices.append(batch["index"].tolist())
    return {
        "losses": losses,
        "norms": norms,
        "indices": indices,
        "partial_grads": partial,  # after the last backward: gradients still waiting for their TP sum
        "state": full_state(model),
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


def train_with_dropout() -> dict:
    """Phi with dropout on the residual stream, each rank seeded differently before accelerate() (as
    docs/checkpoints.md shows): the ranks of the TP group must keep the weights they hold whole equal."""
    rank = torchacc.dist.rank()
    model = tiny_decoder("phi", seed=rank, resid_pdrop=0.1)
    torch.manual_seed(100 + rank)
    model = torchacc.accelerate(model, config=llama_config(kind="phi"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    ids = torch.stack([sample["input_ids"] for sample in token_dataset(4)])
    with torch.no_grad():  # two forwards in training mode differ only if dropout is on
        dropout_on = not torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    whole = {
        name: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
        if not isinstance(p, DTensor) or all(placement.is_replicate() for placement in p.placements)
    }
    return {"dropout_on": dropout_on, "whole": whole}


def _error(run) -> str | None:
    try:
        run()
    except ValueError as err:
        return str(err)
    return None


def reseeded_after_accelerate() -> dict:
    """A script that seeds each rank differently after accelerate(): refused at the first training forward."""
    rank = torchacc.dist.rank()
    model = torchacc.accelerate(tiny_decoder("phi", resid_pdrop=0.1), config=llama_config(kind="phi"))
    ids = torch.stack([sample["input_ids"] for sample in token_dataset(2)])
    model.eval()
    model(input_ids=ids)  # not in training mode: no check yet
    model.train()
    torch.manual_seed(100 + rank)
    first = _error(lambda: model(input_ids=ids, labels=ids))
    torch.manual_seed(7)
    model(input_ids=ids, labels=ids).loss.backward()  # seeded alike: trains
    torch.manual_seed(100 + rank)
    later = _error(lambda: model(input_ids=ids, labels=ids))  # checked once only: no collective per step
    return {"first": first, "later": later}


def sequence_not_divisible() -> dict:
    """Sequence parallelism with 15 tokens at TP 2: a ValueError on every rank before any collective, and the
    model still trains on 16 tokens afterwards (no rank was left inside a collective)."""
    model = torchacc.accelerate(tiny_decoder("llama"), config=llama_config(sequence_parallel=True))
    ids = torch.stack([sample["input_ids"] for sample in token_dataset(2)])
    assert ids.shape[1] == SEQ == 16
    errors = {
        "input_ids": _error(lambda: model(input_ids=ids[:, :15], labels=ids[:, :15])),
        "first_block": _error(lambda: model.model.layers[0](torch.zeros(2, 15, 64))),
    }
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return {"errors": errors, "loss_after": loss.item()}


def compiled(config: torchacc.Config) -> dict:
    """``train`` with compute.compile=True; a crash in training is returned (the same on every rank)."""
    config.compute.compile = True
    try:
        return train(config, num_steps=3)
    except RuntimeError as exc:  # AttributeError inside DTensor's backward is re-raised by autograd as it is
        return {"crashed": f"{type(exc).__name__}: {exc}"}
    except AttributeError as exc:
        return {"crashed": f"{type(exc).__name__}: {exc}"}


def two_rank_suite() -> dict:
    return {
        "tp2": train(llama_config()),
        "tp2_optimizer_first": train(llama_config(), optimizer_first=True),
        "tp2_sp_qwen2": train(llama_config(kind="qwen2", sequence_parallel=True), kind="qwen2"),
        "dict_plan": train_dict_plan(),
        "qwen3_dict": train(llama_config(kind="qwen3", plan=DECODER_PLAN), kind="qwen3", num_steps=3),
        "qwen3_auto": train(llama_config(kind="qwen3"), kind="qwen3", num_steps=3),
        "phi_auto": train(llama_config(kind="phi"), kind="phi", num_steps=3),
        "phi3_auto": train(llama_config(kind="phi3"), kind="phi3", num_steps=3),
        "phi3_auto_sp": train(llama_config(kind="phi3", sequence_parallel=True), kind="phi3", num_steps=3),
        "gpt_neox_auto": train(llama_config(kind="gpt_neox"), kind="gpt_neox", num_steps=3),
        "dropout": train_with_dropout(),
        "reseeded": reseeded_after_accelerate(),
        "sequence_15": sequence_not_divisible(),
    }


def compiled_suite() -> dict:
    config = llama_config()
    config.compute.compile = True
    try:  # Llama's own plan also splits embed_tokens and lm_head, outside the compiled blocks: refused up front
        torchacc.accelerate(tiny_decoder("llama"), config=config)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return {"refused": refused, "compiled": compiled(llama_config(plan=DECODER_PLAN))}


def four_rank_suite() -> dict:
    return {
        "fsdp2_tp2": train(llama_config(fsdp=2)),
        "fsdp2_tp2_sp": train(llama_config(fsdp=2, sequence_parallel=True)),
        "dp2_tp2": train(llama_config(fsdp=1)),
        "fsdp2_tp2_qwen3": train(llama_config(fsdp=2, kind="qwen3", plan=DECODER_PLAN), kind="qwen3", num_steps=3),
    }
