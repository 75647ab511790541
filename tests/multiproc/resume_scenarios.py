"""Issue 24 inside each rank (see tests/_launch.py): exact resume, saves in the background, rotation, the epoch
length after a resume and the live Hugging Face export; the assertions live in test_resume.py."""

import itertools
import os

import torch
from _models import tiny_gpt2, token_dataset
from scenarios import full_state, gpt2_config
from torch.utils.data import DataLoader

import torchacc

STEPS, RESUME_AT = 20, 11  # 16 batches per rank and epoch: the resume is mid-epoch, the run crosses an epoch


def build_gpt2():
    """GPT-2 with dropout 0.1 everywhere and a shuffled loader; each rank draws its own dropout masks."""
    model = tiny_gpt2(seed=0, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    loader = DataLoader(token_dataset(64), batch_size=2, shuffle=True)
    model, loader = torchacc.accelerate(model, loader, gpt2_config(fsdp=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(100 + torchacc.dist.rank())
    return model, loader, optimizer


def train(model, loader, optimizer, step: int, until: int) -> list[float]:
    losses = []
    while step < until:
        for batch in loader:
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            step += 1
            if step == until:
                break
    return losses


def restart() -> None:
    """What a new process would do before resuming: its own random state, unrelated to the saved one."""
    import random

    torch.manual_seed(12345)
    random.seed(12345)


def exact_resume(out: str) -> dict:
    """Uninterrupted against save at RESUME_AT, restart, resume: save_checkpoint/resume_latest and the strategy."""
    model, loader, optimizer = build_gpt2()
    reference = train(model, loader, optimizer, 0, STEPS)
    result = {"reference": {"losses": reference, "state": full_state(model)}}

    model, loader, optimizer = build_gpt2()
    first = train(model, loader, optimizer, 0, RESUME_AT)
    torchacc.save_checkpoint(
        os.path.join(out, "exact"), model=model, optimizer=optimizer, dataloader=loader, extra={"step": RESUME_AT}
    )
    restart()
    model, loader, optimizer = build_gpt2()
    restart()
    step = torchacc.resume_latest(os.path.join(out, "exact"), model, optimizer, dataloader=loader)["step"]
    result["lengths_after_resume"] = (len(loader), loader.num_batches_remaining)
    result["resumed"] = {"losses": first + train(model, loader, optimizer, step, STEPS), "state": full_state(model)}
    return result


def strategy_resume(out: str) -> dict:
    """The same with FSDP2Strategy's save_ckpt / load_ckpt."""

    def build():
        strategy = torchacc.FSDP2Strategy(sharding_strategy="FULL_SHARD", micro_train_batch_size=2, seed=0)
        strategy.config.dist.fsdp.wrap_layer_cls = {"GPT2Block"}
        strategy.setup_environment()
        model = strategy.parallelize(tiny_gpt2(seed=0, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1))
        loader = strategy.process_dataloader(DataLoader(token_dataset(64), batch_size=2, shuffle=True))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        torch.manual_seed(100 + torchacc.dist.rank())
        return strategy, model, loader, optimizer

    def run(strategy, model, loader, optimizer, until):
        losses = []
        for batch in itertools.islice(loader, until):
            loss = strategy.training_step({"input_ids": batch["input_ids"], "labels": batch["labels"]}, 0)
            strategy.backward(loss, model, optimizer)
            strategy.optimizer_step(optimizer, model)
            losses.append(loss.item())
        return losses

    strategy, model, loader, optimizer = build()
    reference = run(strategy, model, loader, optimizer, 12)
    result = {"reference": {"losses": reference, "state": full_state(model)}}
    strategy, model, loader, optimizer = build()
    first = run(strategy, model, loader, optimizer, 5)
    strategy.save_ckpt(model, os.path.join(out, "strategy"), optimizer=optimizer)
    restart()
    strategy, model, loader, optimizer = build()
    restart()
    strategy.load_ckpt(model, os.path.join(out, "strategy"), optimizer=optimizer)
    result["resumed"] = {"losses": first + run(strategy, model, loader, optimizer, 7), "state": full_state(model)}
    return result


def suite(out: str) -> dict:
    return {"exact": exact_resume(out), "strategy": strategy_resume(out)}
