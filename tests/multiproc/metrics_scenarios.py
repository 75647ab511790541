"""Metrics inside each rank (see tests/_launch.py); test_metrics.py checks the records against a hand computation.

Each scenario returns what the hand computation needs (the losses, tokens, learning rates and gradient norms
the rank saw) next to the records ``torchacc.last_metrics()`` gave after each logged step.
"""

import itertools
import os
import resource

import torch
from _models import SEQ, tiny_gpt2, tiny_llama, token_dataset
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


def tp_tokens() -> dict:
    """Tensor parallelism over 2 ranks: both see the same batches, which count once."""
    config = torchacc.Config()
    config.dist.tp.size = 2
    config.dist.timeout = 120.0
    config.metrics.every = 2
    config.metrics.sinks = set()
    model, loader = torchacc.accelerate(tiny_llama(seed=0), DataLoader(token_dataset(32), batch_size=BATCH), config)
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


def suite(out: str) -> dict:
    return {"fsdp": fsdp_all_sinks(out), "tp": tp_tokens(), "strategy": strategy_accumulation()}
