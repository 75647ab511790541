"""Issue 24 inside each rank (see tests/_launch.py): exact resume, saves in the background, rotation, the epoch
length after a resume and the live Hugging Face export; the assertions live in test_resume.py."""

import itertools
import os

import torch
from _models import tiny_gpt2, token_dataset
from scenarios import full_state, gpt2_config
from torch.utils.data import DataLoader

import torchacc
from torchacc._utils.tree import map_tensors

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
    """Steps ``step`` to ``until`` over ``loader`` (passes over it as needed; an iterator is read on)."""
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


def background_saves(out: str) -> dict:
    """save_checkpoint(blocking=False): training goes on while the files are written; published by wait(), the
    next save and a load (at exit: tests/unit/test_checkpoint_root.py); it holds the state at the call."""
    root = os.path.join(out, "background")
    model, loader, optimizer = build_gpt2()
    batches = iter(loader)
    train(model, batches, optimizer, 0, 2)
    torchacc.save_checkpoint(root, model=model, optimizer=optimizer)
    optim = torchacc.optim_state_dict(model, optimizer, full=True)  # Adam's step: the live tensor, not a copy
    at_call = {"state": full_state(model), "optim": map_tensors(torch.clone, optim)}
    handle = torchacc.save_checkpoint(root, model=model, optimizer=optimizer, extra={"step": 2}, blocking=False)
    result = {}
    train(model, batches, optimizer, 2, 5)  # changes the parameters and the optimizer state in place
    result["path"], result["latest_after_wait"] = handle.wait(), torchacc.latest_checkpoint(root)
    fresh, _, fresh_optimizer = build_gpt2()
    result["extra"] = torchacc.load_checkpoint(handle.path, model=fresh, optimizer=fresh_optimizer)
    result["loaded"] = {
        "state": full_state(fresh),
        "optim": torchacc.optim_state_dict(fresh, fresh_optimizer, full=True),
    }
    result["at_call"] = at_call
    torchacc.save_checkpoint(root, model=model, extra={"step": 5}, blocking=False)
    torchacc.save_checkpoint(root, model=model, extra={"step": 6}, blocking=False)  # publishes the one before
    result["latest_at_next_save"] = torchacc.latest_checkpoint(root)
    result["resumed_extra"] = torchacc.resume_latest(root, fresh)  # publishes the one in flight, loads it
    return result


def live_export(out: str) -> dict:
    """export_hf(model, dir) and model.save_pretrained(dir) on the FSDP model, at every rank."""
    model, _, _ = build_gpt2()
    model.eval()
    ids = torch.arange(12).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    torchacc.export_hf(model, os.path.join(out, "export"))
    model.save_pretrained(os.path.join(out, "pretrained"))
    try:
        model.save_pretrained(os.path.join(out, "refused"), state_dict={})
    except ValueError as exc:
        refused = str(exc)
    return {"logits": logits, "ids": ids, "refused": refused}


def suite(out: str) -> dict:
    return {
        "exact": exact_resume(out),
        "strategy": strategy_resume(out),
        "background": background_saves(out),
        "export": live_export(out),
    }
