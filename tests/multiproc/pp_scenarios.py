"""Pipeline-parallel runs inside each rank (see tests/_launch.py); test_pp.py compares them with one process.

Each suite returns plain data; the assertions live in test_pp.py. The models have 4 blocks, so that every
schedule has at least one block per stage (Interleaved1F1B at 2 ranks runs 4 stages).
"""

import itertools
import os
from pathlib import Path

import torch
from _models import SEQ, VOCAB, tiny_llama, token_dataset
from scenarios import full_state
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import torchacc

NUM_STEPS = 3
LR = 1e-3
MAX_NORM = 1.0
NUM_LAYERS = 4
BLOCKS = {"llama": "LlamaDecoderLayer", "qwen2": "Qwen2DecoderLayer"}


def pp_config(*, kind: str = "llama", pp: int = 2, fsdp: int = 1, tp: int = 1, **pp_fields) -> torchacc.Config:
    config = torchacc.Config()
    config.dist.pp.size = pp
    for key, value in pp_fields.items():
        setattr(config.dist.pp, key, value)
    config.dist.fsdp.size, config.dist.tp.size = fsdp, tp
    config.dist.fsdp.wrap_layer_cls = {BLOCKS[kind]}
    config.dist.timeout = 120.0
    return config


def model_of(kind: str, seed: int) -> torch.nn.Module:
    return tiny_llama(seed=seed, kind=kind, num_hidden_layers=NUM_LAYERS)


def optim_full(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every optimizer state tensor, gathered to its full value, by ``<param name>/<key>``."""
    out = {}
    for name, values in torchacc.optim_state_dict(model, optimizer)["state"].items():
        for key, value in values.items():
            value = value.full_tensor() if isinstance(value, DTensor) else value
            out[f"{name}/{key}"] = value.detach().cpu().clone()
    return out


def batch_of(batch: dict) -> dict:
    return {"input_ids": batch["input_ids"], "labels": batch["labels"]}


def save_all(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loader, out: str, result: dict) -> None:
    """A DCP checkpoint (``out``/dcp) and the seed's per-rank files (``out``/shards), with the state they hold."""
    result["saved"], result["saved_optim"] = full_state(model), optim_full(model, optimizer)
    torchacc.save_checkpoint(f"{out}/dcp", model=model, optimizer=optimizer, dataloader=loader)
    rank, world = torchacc.dist.rank(), torchacc.dist.world_size()
    meta = model.get_shard_metadata()
    for kind, name, section in (
        ("model", "model", model.state_dict()),
        ("optim", "optimizer", torchacc.optim_state_dict(model, optimizer)),
    ):
        path = f"{out}/shards/rank-{rank}-of-{world}-{kind}.pth"
        torchacc.save({name: section, "shard_metadata": meta}, path, master_only=False)


def train(config: torchacc.Config, kind: str = "llama", *, save: str | None = None) -> dict:
    """3 AdamW steps with clipping through ``train_step``; each rank starts from different weights (rank 0's win).

    With ``save``, also writes after step 2: a DCP checkpoint (``save``/dcp) and the seed's per-rank files
    (``save``/shards), and records the state then and after step 3.
    """
    model = model_of(kind, seed=torchacc.dist.rank())
    loader = DataLoader(token_dataset(32), batch_size=4)
    model, loader = torchacc.accelerate(model, loader, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    result: dict = {"losses": [], "norms": [], "indices": []}
    for step, batch in enumerate(itertools.islice(loader, NUM_STEPS)):
        loss = torchacc.train_step(model, batch_of(batch))
        result["norms"].append(torchacc.clip_grad_norm_(model.parameters(), MAX_NORM))
        optimizer.step()
        optimizer.zero_grad()
        result["losses"].append(loss.item())
        result["indices"].append(batch["index"].tolist())
        if save is not None and step == NUM_STEPS - 2:  # after 2 of 3 steps, before the loader yields the last batch
            save_all(model, optimizer, loader, save, result)
    result["state"] = full_state(model)
    model.eval()
    output = model(batch["input_ids"], labels=batch["labels"])  # no torch.no_grad() needed in eval mode
    result["eval"] = {"loss": output.loss.item(), "logits": None if output.logits is None else output.logits.shape}
    result["mesh"] = torchacc.accelerated_state(model).mesh.mesh_dim_names
    return result


def resume(config: torchacc.Config, out: str, *, samples: list[int] | None = None) -> dict:
    """A fresh model (other weights) loads the step-2 checkpoint and runs step 3 on the next batch of the loader,
    or on ``samples`` without one (this rank's part of the third global batch, at another layout)."""
    model = model_of("llama", seed=99)
    loader = DataLoader(token_dataset(32), batch_size=4)
    model, loader = torchacc.accelerate(model, loader, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    position = {"dataloader": loader} if samples is None else {}
    torchacc.load_checkpoint(f"{out}/dcp", model=model, optimizer=optimizer, **position)
    loaded = full_state(model)
    loaded_optim = optim_full(model, optimizer)
    if samples is None:
        batch = next(iter(loader))
    else:
        data = token_dataset(32)
        batch = {"input_ids": torch.stack([data[i]["input_ids"] for i in samples]), "index": torch.tensor(samples)}
        batch["labels"] = batch["input_ids"]
    loss = torchacc.train_step(model, batch_of(batch))
    torchacc.clip_grad_norm_(model.parameters(), MAX_NORM)
    optimizer.step()
    optimizer.zero_grad()
    return {
        "loaded": loaded,
        "optim": loaded_optim,
        "loss": loss.item(),
        "index": batch["index"].tolist(),
        "state": full_state(model),
    }


def refusals() -> dict:
    """The errors a pipelined model raises on every rank before any collective."""
    model = torchacc.accelerate(model_of("llama", seed=0), config=pp_config(microbatches=2))
    batch = batch_of(token_dataset(3)[0])
    errors = {}
    three = {k: torch.stack([v] * 3) for k, v in batch.items()}
    config = pp_config(microbatches=2)
    for name, call in (
        ("microbatches", lambda: torchacc.train_step(model, three)),
        ("no_labels", lambda: torchacc.train_step(model, {"input_ids": three["input_ids"]})),
        ("training_forward", lambda: model(**three)),
        ("strategy_loss_fn", lambda: torchacc.FSDP2Strategy(config, loss_fn=print).setup_environment()),
        ("strategy_micro", lambda: torchacc.FSDP2Strategy(config, micro_train_batch_size=3).setup_environment()),
    ):
        try:
            call()
        except (ValueError, RuntimeError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    return errors


def strategy_run() -> dict:
    """FSDP2Strategy's loop, unchanged, on PP 2: accumulation over 2 micro-batches, clipping, validation."""
    config = pp_config(microbatches=2)
    strategy = torchacc.FSDP2Strategy(
        config, micro_train_batch_size=4, train_batch_size=8, max_norm=MAX_NORM, sharding_strategy="NO_SHARD"
    )
    strategy.setup_environment()
    model = strategy.parallelize(model_of("llama", seed=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    data = token_dataset(32)
    losses, norms = [], []
    for i in range(4):  # 2 optimizer steps of 2 micro-batches
        batch = {k: torch.stack([data[4 * i + j][k] for j in range(4)]) for k in ("input_ids", "labels")}
        loss = strategy.training_step(batch, i)
        strategy.backward(loss, model, optimizer)
        norm = strategy.optimizer_step(optimizer, model)
        losses.append(loss.item())
        if norm is not None:
            norms.append(norm)
    validation = strategy.validation_step(batch, 0).item()
    try:
        strategy.model_state_dict()  # state_dict_type="full" (the default) gathers the whole model on rank 0
    except ValueError as exc:
        full = str(exc)
    return {"losses": losses, "norms": norms, "state": full_state(model), "validation": validation, "full": full}


def meta_init(config: torchacc.Config) -> dict[str, torch.Tensor]:
    """This rank's stages of a Llama built on the meta device after seeding 7 + rank, then accelerated: they must
    hold one process's draw (seeded 7), as if the whole model had been initialized in one process."""
    with torchacc.init_empty_weights():
        model = model_of("llama", seed=7 + torchacc.dist.rank())
    return full_state(torchacc.accelerate(model, config=config))


def init_from(out: str) -> dict[str, torch.Tensor]:
    """This rank's stages of a meta Llama filled by ``dist.fsdp.init_from`` (rank 0 reads and sends every stage's
    tensors); the file holds ``model_of("llama", seed=11)``."""
    path = os.path.join(out, "init.pth")
    if torchacc.dist.rank() == 0:
        os.makedirs(out, exist_ok=True)
        torch.save({"model": model_of("llama", seed=11).state_dict()}, path)
    torchacc.dist.barrier()
    config = pp_config()
    config.dist.fsdp.init_from = path
    return meta_init(config)


def moe_with_aux_loss(seed: int = 0) -> torch.nn.Module:
    """A tiny Mixtral that adds its routers' load-balancing loss to the loss (``output_router_logits=True``, as MoE
    training does), with NUM_LAYERS blocks."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=1.0,
        tie_word_embeddings=False,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
        pad_token_id=None,
    )
    return MixtralForCausalLM(cfg)


def moe_aux_loss() -> dict:
    """One train_step of moe_with_aux_loss() at PP 2 on the first 4 samples: the loss every rank returns."""
    config = pp_config(microbatches=2)
    config.dist.fsdp.wrap_layer_cls = {"MixtralDecoderLayer"}
    try:
        model = torchacc.accelerate(moe_with_aux_loss(), config=config)
    except ValueError as exc:
        return {"error": str(exc)}
    ids = torch.stack([s["input_ids"] for s in token_dataset(4)])
    return {"loss": torchacc.train_step(model, {"input_ids": ids, "labels": ids}).item()}


def uneven_last_batch() -> dict:
    """PP 2 over a DataLoader of 10 samples in batches of 4 (drop_last=False, the default): batches of 4, 4 and 2
    samples, each divisible into dist.pp.microbatches=2. A short timeout: a rank left waiting fails in seconds."""
    config = pp_config(microbatches=2)
    config.dist.timeout = 10.0
    data = token_dataset(32)[:10]
    model, loader = torchacc.accelerate(model_of("llama", seed=0), DataLoader(data, batch_size=4), config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, indices = [], []
    try:
        for batch in loader:
            indices.append(batch["index"].tolist())
            losses.append(torchacc.train_step(model, batch_of(batch)).item())
            torchacc.clip_grad_norm_(model.parameters(), MAX_NORM)
            optimizer.step()
            optimizer.zero_grad()
    except Exception as exc:  # noqa: BLE001 - the test reads what each rank got
        return {"losses": losses, "indices": indices, "error": (type(exc).__name__, str(exc))}
    return {"losses": losses, "indices": indices, "error": None}


def pp_x_cp() -> str | None:
    """accelerate() at PP 2 x CP 2: the ValueError it raises, or None when it accepts the layout (the first
    train_step then fails inside the schedule: see test_pp.py)."""
    config = pp_config(microbatches=2)
    config.dist.cp.size = 2
    try:
        torchacc.accelerate(model_of("llama", seed=0), config=config)
    except ValueError as exc:
        return str(exc)
    return None


def two_rank_suite(out: str) -> dict:
    return {
        "meta_pp2_rank_seeds": meta_init(pp_config()),
        "meta_pp2_interleaved_rank_seeds": meta_init(pp_config(schedule="Interleaved1F1B", stages_per_rank=2)),
        "init_from_pp2": init_from(out),
        "pp2_llama_1f1b": train(pp_config()),
        "pp2_qwen2_gpipe": train(pp_config(kind="qwen2", schedule="GPipe"), kind="qwen2"),
        "pp2_llama_interleaved": train(pp_config(schedule="Interleaved1F1B", stages_per_rank=2)),
        "strategy": strategy_run(),
        "refusals": refusals(),
        "moe_aux_loss": moe_aux_loss(),
    }


def four_rank_suite(out: str) -> dict:
    os.makedirs(Path(out) / "shards", exist_ok=True)
    meta = meta_init(pp_config(fsdp=2))  # first, as in the two-rank suite
    trained = train(pp_config(fsdp=2), save=out)
    batches: list = [None] * torchacc.dist.world_size()
    torch.distributed.all_gather_object(batches, trained["indices"][-1])
    third = sorted({i for batch in batches for i in batch})  # the global batch of step 3: 8 samples
    rank = torchacc.dist.rank()
    return {
        "meta_pp2_fsdp2_rank_seeds": meta,
        "pp2_fsdp2_llama_1f1b": trained,
        "pp2_fsdp2_qwen2_interleaved": train(
            pp_config(kind="qwen2", fsdp=2, schedule="Interleaved1F1B", stages_per_rank=2), kind="qwen2"
        ),
        "pp2_tp2_llama": train(pp_config(tp=2)),
        "pp2_dp2_llama_gpipe": train(pp_config(schedule="GPipe")),  # replicas of each stage (dist.dp.size=2)
        "resume_pp2_fsdp2": resume(pp_config(fsdp=2), out),
        "resume_fsdp4": resume(pp_config(pp=1, fsdp=4), out, samples=third[2 * rank : 2 * rank + 2]),
        "pp2_cp2": pp_x_cp(),  # last: if accepted, the layout's groups stay unused
    }
