"""Metrics inside each rank (see tests/_launch.py); test_metrics_ranks.py checks the records against a hand
computation.

Each scenario returns what the hand computation needs (the losses, tokens, learning rates and gradient norms
the rank saw) next to the records ``torchacc.last_metrics()`` gave after each logged step.
"""

import itertools
import os
import resource

import torch
import torch.distributed as dist
from _models import SEQ, VOCAB, tiny_gpt2, tiny_llama, token_dataset
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import torchacc
from torchacc.metrics import close_metrics

EVERY, NUM_STEPS, BATCH = 3, 6, 2


def full_grad_norm(model: torch.nn.Module) -> float:
    """The oracle: the 2-norm of the full (gathered) gradients, computed apart from torchacc's clip_grad."""
    grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
    return float(torch.stack([g.double().square().sum() for g in grads if g is not None]).sum().sqrt())


def masked_dataset(num_samples: int = 32) -> list[dict[str, torch.Tensor]]:
    """token_dataset with an attention mask that hides the last ``i % 4`` positions of sample ``i``."""
    samples = []
    for i, sample in enumerate(token_dataset(num_samples)):
        mask = torch.ones(SEQ, dtype=torch.long)
        mask[SEQ - i % 4 :] = 0
        samples.append({"input_ids": sample["input_ids"], "labels": sample["labels"], "attention_mask": mask})
    return samples


def fsdp_all_sinks(out: str) -> dict:
    """FSDP over 2 ranks, every sink; step 3 clipped (the record must reuse the clip's norm), step 6 not."""
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
    config = torchacc.Config()
    config.dist.fsdp.size = 2
    config.dist.fsdp.wrap_layer_cls = {"GPT2Block"}
    config.dist.timeout = 120.0
    config.metrics.every = EVERY
    config.metrics.sinks = {"console", "jsonl", "tensorboard", "wandb"}
    config.metrics.dir = out
    config.metrics.peak_flops = 1e12
    config.metrics.run_name = "fsdp-test"
    model, loader = torchacc.accelerate(
        tiny_gpt2(seed=torchacc.dist.rank()), DataLoader(masked_dataset(), batch_size=BATCH), config
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    seen: dict[str, list] = {"losses": [], "tokens": [], "lrs": [], "records": [], "norms": {}}
    for step, batch in enumerate(itertools.islice(loader, NUM_STEPS), start=1):
        loss = model(**batch).loss
        loss.backward()
        if step == 3:
            seen["norms"][step] = torchacc.clip_grad_norm_(model.parameters(), max_norm=1e6)
        elif step == 6:
            seen["norms"][step] = full_grad_norm(model)
        seen["losses"].append(loss.item())
        seen["tokens"].append(int(batch["attention_mask"].sum()))
        seen["lrs"].append(optimizer.param_groups[0]["lr"])
        torchacc.log_metrics({"rank_value": torchacc.dist.rank()})  # rank 0's value is the one written
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if step % EVERY == 0:
            seen["records"].append(torchacc.last_metrics())
    torchacc.log_metrics({"eval_loss": 1.25}, step=NUM_STEPS)
    close_metrics()  # flush W&B now: the test launcher ends the process without running the exit hooks
    seen["maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return seen


def _two_logged_steps(model: torch.nn.Module, loader: DataLoader) -> dict:
    """Two AdamW steps with metrics every 2 steps: each step's loss and full gradient norm, and the record."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen: dict[str, list] = {"losses": [], "norms": []}
    for batch in itertools.islice(loader, 2):
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        seen["norms"].append(full_grad_norm(model))
        seen["losses"].append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    seen["record"] = torchacc.last_metrics()
    close_metrics()
    return seen


def tp_tokens() -> dict:
    """Tensor parallelism over 2 ranks: both see the same batches, which count once."""
    config = torchacc.Config()
    config.dist.tp.size = 2
    config.dist.timeout = 120.0
    config.metrics.every = 2
    config.metrics.sinks = set()
    model, loader = torchacc.accelerate(tiny_llama(seed=0), DataLoader(token_dataset(32), batch_size=BATCH), config)
    return _two_logged_steps(model, loader)


def strategy_accumulation() -> dict:
    """FSDP2Strategy with 2 accumulation steps and clipping; its loader built before the model."""
    config = torchacc.Config()
    config.dist.fsdp.wrap_layer_cls = {"GPT2Block"}
    config.dist.timeout = 120.0
    config.metrics.every = 2
    config.metrics.sinks = set()
    strategy = torchacc.FSDP2Strategy(config, micro_train_batch_size=BATCH, train_batch_size=8, max_norm=1.0, seed=0)
    strategy.setup_environment()
    loader = strategy.process_dataloader(DataLoader(token_dataset(64), batch_size=BATCH))
    model = strategy.parallelize(tiny_gpt2(seed=0))
    optimizer = strategy.create_optimizer(model, lr=1e-3)
    seen: dict[str, list] = {"losses": [], "norms": [], "records": [], "steps": []}
    for i, batch in enumerate(itertools.islice(loader, 4 * strategy.accumulation_steps)):
        loss = strategy.training_step({"input_ids": batch["input_ids"], "labels": batch["labels"]}, i)
        strategy.backward(loss, model, optimizer)
        norm = strategy.optimizer_step(optimizer, model)
        seen["losses"].append(loss.item())
        if norm is not None:
            seen["norms"].append(norm)
            seen["steps"].append(strategy.global_step)
            if strategy.global_step % 2 == 0:
                seen["records"].append(torchacc.last_metrics())
    seen["accumulation_steps"] = strategy.accumulation_steps
    close_metrics()
    return seen


def hsdp_metrics() -> dict:
    """HSDP at 4 ranks (2 replicas of 2 shards; run from scenarios.hsdp_suite): the norm sums the shards, not
    the replicas; every rank's batch counts."""
    config = torchacc.Config()
    config.dist.fsdp.size, config.dist.dp.size = 2, 2
    config.dist.fsdp.wrap_layer_cls = {"GPT2Block"}
    config.dist.timeout = 120.0
    config.metrics.every = 2
    config.metrics.sinks = set()
    model, loader = torchacc.accelerate(tiny_gpt2(seed=0), DataLoader(token_dataset(32), batch_size=BATCH), config)
    return _two_logged_steps(model, loader)


def _layout_run(config: torchacc.Config, model: torch.nn.Module, dataset: list, *, batch_size: int) -> dict:
    """4 steps of ``train_step`` with a record every 2 steps, step 2 clipped (the record reuses the clip's norm) and
    step 4 not (the recorder computes it); an evaluation in eval mode with gradients enabled before step 4, whose
    loss is no training loss. Returns what the hand computation needs, beside the records."""
    config.dist.timeout = 120.0
    config.metrics.every = 2
    config.metrics.sinks = set()
    config.metrics.peak_flops = 1e12
    seen: dict = {"losses": [], "norms": {}, "records": [], "lrs": [], "tokens": [], "positions": []}
    seen["num_params"] = sum(p.numel() for p in model.parameters())  # the whole model, before any split
    seen["shape"] = (model.config.num_hidden_layers, model.config.hidden_size)
    model, loader = torchacc.accelerate(model, DataLoader(dataset, batch_size=batch_size), config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step, batch in enumerate(itertools.islice(loader, 4), start=1):
        if step == 1:
            first = {k: v for k, v in batch.items() if k != "index"}
        if step == 4:  # another batch's loss: the record must not take it for step 4's
            model.eval()
            seen["eval_loss"] = model(**first).loss.item()  # gradients enabled (allowed under a pipeline)
            model.train()
        loss = torchacc.train_step(model, {k: v for k, v in batch.items() if k != "index"})
        if step == 2:
            seen["norms"][step] = torchacc.clip_grad_norm_(model.parameters(), max_norm=1e6)
        elif step == 4:
            seen["norms"][step] = stage_grad_norm(model)
        seen["losses"].append(loss.item())
        seen["lrs"].append(optimizer.param_groups[0]["lr"])
        # what this rank's loader read: the whole sequences (before a context-parallel split)
        whole = [dataset[i] for i in batch["index"].tolist()]
        mask = torch.stack([s.get("attention_mask", torch.ones_like(s["input_ids"])) for s in whole])
        seen["tokens"].append(int(mask.sum()))
        seen["positions"].append(int(mask.sum()) * mask.shape[1])
        optimizer.step()
        optimizer.zero_grad()
        if step % 2 == 0:
            seen["records"].append(torchacc.last_metrics())
    dims = torchacc.accelerated_state(model).layout.dims
    seen["data_rank"], seen["num_data_ranks"] = dims.data_parallel_rank(torchacc.dist.rank()), dims.num_data_ranks
    close_metrics()
    return seen


def stage_grad_norm(model: torch.nn.Module) -> float:
    """The oracle under any layout: each rank's full (gathered) gradients, squared and summed over the ranks that
    hold different parameters (the stages of a pipeline), apart from torchacc's clip_grad."""
    grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
    squares = torch.stack([g.double().square().sum() for g in grads if g is not None]).sum().reshape(1)
    dims = torchacc.accelerated_state(model).layout.dims
    if dims.pp > 1:
        everyone = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, squares)
        # the pipeline is the outermost axis: the ranks of one pipeline are world / pp apart
        per_stage = dist.get_world_size() // dims.pp
        rank = dist.get_rank()
        squares = sum(everyone[r] for r in range(rank % per_stage, dist.get_world_size(), per_stage))
    return float(squares.sqrt())


def padded_dataset(num_samples: int = 16, length: int = SEQ - 1, *, masked: bool = True) -> list[dict]:
    """Samples of an odd length (context parallelism pads them); ``masked``: with right padding, sample ``i``
    hiding its last ``i % 3`` positions from attention and loss; else without an attention mask."""
    gen = torch.Generator().manual_seed(3)
    samples = []
    for i in range(num_samples):
        ids = torch.randint(0, VOCAB - 1, (length,), generator=gen)
        sample = {"input_ids": ids, "labels": ids, "index": torch.tensor(i)}
        if masked:
            mask = (torch.arange(length) < length - i % 3).long()
            sample.update(attention_mask=mask, labels=torch.where(mask == 1, ids, torch.tensor(-100)))
        samples.append(sample)
    return samples


def pp_records() -> dict:
    """Pipeline parallelism over 2 ranks (1F1B, 2 microbatches): each rank holds half the model's parameters."""
    config = torchacc.Config()
    config.dist.pp.size = 2
    config.dist.fsdp.wrap_layer_cls = {"LlamaDecoderLayer"}
    return _layout_run(config, tiny_llama(seed=0, num_hidden_layers=4), token_dataset(32), batch_size=4)


def cp_records() -> dict:
    """Context parallelism over 2 ranks: each rank sees one chunk of every (padded) sequence."""
    config = torchacc.Config()
    config.dist.cp.size = 2
    config.dist.fsdp.wrap_layer_cls = {"LlamaDecoderLayer"}
    return _layout_run(config, tiny_llama(seed=0), padded_dataset(), batch_size=2)


def fsdp_tp_records() -> dict:
    """FSDP 2 x TP 2 at 4 ranks (run from scenarios.hsdp_suite)."""
    config = torchacc.Config()
    config.dist.fsdp.size, config.dist.tp.size = 2, 2
    config.dist.fsdp.wrap_layer_cls = {"LlamaDecoderLayer"}
    return _layout_run(config, tiny_llama(seed=0), padded_dataset(length=SEQ), batch_size=2)


def pp_fsdp_records() -> dict:
    """PP 2 x FSDP 2 at 4 ranks (run from scenarios.hsdp_suite): 2 data-parallel ranks, each a pipeline."""
    config = torchacc.Config()
    config.dist.pp.size, config.dist.fsdp.size = 2, 2
    config.dist.fsdp.wrap_layer_cls = {"LlamaDecoderLayer"}
    return _layout_run(config, tiny_llama(seed=0, num_hidden_layers=4), token_dataset(32), batch_size=4)


def strategy_layout(kind: str) -> dict:
    """FSDP2Strategy under PP 2 (2 accumulation steps, clipping: the record takes optimizer_step's norm) or CP 2
    (no clipping: the record's norm is the recorder's); 2 optimizer steps, one record."""
    config = torchacc.Config()
    config.dist.fsdp.wrap_layer_cls = {"LlamaDecoderLayer"}
    config.dist.timeout = 120.0
    config.metrics.every = 2
    config.metrics.sinks = set()
    config.metrics.peak_flops = 1e12
    pipelined = kind == "pp"
    config.dist.pp.size, config.dist.cp.size = (2, 1) if pipelined else (1, 2)
    micro = 4 if pipelined else 2
    accumulation = 2 if pipelined else 1
    strategy = torchacc.FSDP2Strategy(
        config,
        micro_train_batch_size=micro,
        train_batch_size=accumulation * micro,
        max_norm=1e6 if pipelined else 0.0,
        seed=0,
    )
    strategy.setup_environment()
    plain = tiny_llama(seed=0, num_hidden_layers=4 if pipelined else 2)
    seen: dict = {"losses": [], "norms": [], "tokens": [], "positions": []}
    seen["num_params"] = sum(p.numel() for p in plain.parameters())
    seen["shape"] = (plain.config.num_hidden_layers, plain.config.hidden_size)
    dataset = token_dataset(32) if pipelined else padded_dataset(masked=False)
    model = strategy.parallelize(plain)
    loader = strategy.process_dataloader(DataLoader(dataset, batch_size=micro))
    optimizer = strategy.create_optimizer(model, lr=1e-3)
    for i, batch in enumerate(itertools.islice(loader, 2 * accumulation)):
        loss = strategy.training_step({k: v for k, v in batch.items() if k != "index"}, i)
        strategy.backward(loss, model, optimizer)
        if not pipelined and i == 1:
            seen["norms"].append(stage_grad_norm(model))  # the oracle, before step 2
        norm = strategy.optimizer_step(optimizer, model)
        if pipelined and norm is not None:
            seen["norms"].append(norm)
        seen["losses"].append(loss.item())
        whole = [dataset[j] for j in batch["index"].tolist()]
        mask = torch.stack([s.get("attention_mask", torch.ones_like(s["input_ids"])) for s in whole])
        seen["tokens"].append(int(mask.sum()))
        seen["positions"].append(int(mask.sum()) * mask.shape[1])
    seen["record"] = torchacc.last_metrics()
    dims = torchacc.accelerated_state(model).layout.dims
    seen["data_rank"], seen["num_data_ranks"] = dims.data_parallel_rank(torchacc.dist.rank()), dims.num_data_ranks
    seen["accumulation_steps"] = strategy.accumulation_steps
    seen["lr"] = optimizer.param_groups[0]["lr"]
    close_metrics()
    return seen


def suite(out: str) -> dict:
    return {
        "fsdp": fsdp_all_sinks(out),
        "tp": tp_tokens(),
        "strategy": strategy_accumulation(),
        "pp": pp_records(),
        "cp": cp_records(),
        "strategy_pp": strategy_layout("pp"),
        "strategy_cp": strategy_layout("cp"),
    }
