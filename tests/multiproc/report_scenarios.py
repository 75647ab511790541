"""``torchacc.memory_report`` inside the ranks (run from the launches of scenarios.py; asserted in
test_memory_report.py): TinyNet, whose 1-row head weight shards unevenly, in each layout."""

import logging

import torch
from _models import TinyNet

import torchacc


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def reports(*, fsdp: int, dp: int | None = None) -> dict:
    """Reports before training, after one AdamW step (gradients alive) and after zero_grad (none)."""
    config = torchacc.Config()
    config.dist.fsdp.size = fsdp
    config.dist.dp.size = dp
    config.dist.fsdp.wrap_layer_cls = {"Block"}
    config.dist.timeout = 120.0
    logger = logging.getLogger("torchacc")
    handler, level = _Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        torch.manual_seed(0)
        model = torchacc.accelerate(TinyNet(), config=config)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    result = {"log": handler.lines, "plain": torchacc.memory_report(model)}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(torchacc.dist.rank()))
    model(x).sum().backward()
    optimizer.step()
    result["stepped"] = torchacc.memory_report(model, optimizer)
    result["stepped_model_only"] = torchacc.memory_report(model)
    optimizer.zero_grad()
    result["zeroed"] = torchacc.memory_report(model, optimizer)
    return result


def fsdp_reports() -> dict:
    """At 2 ranks: FSDP (dist.fsdp.size=2) and plain DP (dist.fsdp.size=1)."""
    return {"fsdp": reports(fsdp=2), "dp": reports(fsdp=1)}


def hsdp_reports() -> dict:
    """At 4 ranks: HSDP, 2 replicas of 2 shards."""
    return {"hsdp": reports(fsdp=2, dp=2)}
