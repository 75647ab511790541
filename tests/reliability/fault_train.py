"""A small FSDP training script for the torchrun reliability tests; behaviour is set by environment variables.

    FAULT=raise|hang     rank FAULT_RANK raises (or blocks forever) before step FAULT_STEP, in the first attempt only
    TIMEOUT=seconds      config.dist.timeout
    CKPT=dir             resume from its latest checkpoint at start-up; save every SAVE_EVERY steps
    OUT=dir              rank 0 writes final.pt (the full state) and attempt-<n>.json there
    REFERENCE=1          then also train a fresh model for STEPS steps without checkpoints: reference.pt

Launch: ``torchrun --standalone --nproc_per_node=2 tests/reliability/fault_train.py``.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _models import TinyNet  # noqa: E402

import torchacc  # noqa: E402

STEPS = int(os.environ.get("STEPS", "10"))
SAVE_EVERY = int(os.environ.get("SAVE_EVERY", "2"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def dataset() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(24, 16, generator=gen)
    return list(zip(x, x.sum(dim=1, keepdim=True), strict=True))


def build():
    config = torchacc.Config()
    config.dist.fsdp.size = 2
    config.dist.fsdp.wrap_layer_cls = {"Block"}
    config.dist.timeout = float(os.environ.get("TIMEOUT", "60"))
    torch.manual_seed(0)
    loader = DataLoader(dataset(), batch_size=2, shuffle=True)
    model, loader = torchacc.accelerate(TinyNet(), loader, config)
    return model, loader, torch.optim.AdamW(model.parameters(), lr=1e-2)


def maybe_fail(step: int) -> None:
    fault = os.environ.get("FAULT")
    if not fault or ATTEMPT > 0 or step != int(os.environ["FAULT_STEP"]):
        return
    if torchacc.dist.rank() == int(os.environ.get("FAULT_RANK", "1")):
        if fault == "hang":
            print(f"injected hang at step {step} (t={time.time():.3f})", flush=True)
            time.sleep(3600)
        raise RuntimeError(f"injected failure at step {step} (t={time.time():.3f})")


def train(ckpt: str | None, out: Path | None = None) -> dict[str, torch.Tensor]:
    model, loader, optimizer = build()
    extra = torchacc.resume_latest(ckpt, model, optimizer, dataloader=loader) if ckpt else None
    step = (extra or {}).get("step", 0)
    if out is not None and torchacc.dist.rank() == 0:
        (out / f"attempt-{ATTEMPT}.json").write_text(json.dumps({"attempt": ATTEMPT, "resumed_step": step}))
    while step < STEPS:
        for x, y in loader:
            maybe_fail(step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if ckpt and step % SAVE_EVERY == 0:
                torchacc.save_checkpoint(
                    ckpt, model=model, optimizer=optimizer, dataloader=loader, extra={"step": step}
                )
            if step == STEPS:
                break
    state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    return state


def main() -> None:
    out = Path(os.environ["OUT"])
    state = train(os.environ.get("CKPT"), out)
    if torchacc.dist.rank() == 0:
        torch.save(state, out / "final.pt")
    if os.environ.get("REFERENCE"):
        reference = train(None)
        if torchacc.dist.rank() == 0:
            torch.save(reference, out / "reference.pt")
    print(f"rank {torchacc.dist.rank()} finished {STEPS} steps (attempt {ATTEMPT})", flush=True)


if __name__ == "__main__":
    main()
