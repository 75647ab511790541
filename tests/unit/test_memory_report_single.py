"""torchacc.memory_report in one process, and the summary line accelerate() logs.

The multi-rank layouts (FSDP with an uneven shard, HSDP, DP) are in tests/multiproc/test_memory_report.py.
Every expected number is worked out from TinyNet(dim=16, 3 blocks): per block fc1 weight (64, 16) and
bias (64,), fc2 weight (16, 64) and bias (16,); head weight (1, 16) and bias (1,); float32 throughout.
"""

import importlib
import logging
import math

import pytest
import torch
from _models import TinyNet, tiny_gpt2

import torchacc
from torchacc.parallel.memory_report import Footprint, format_bytes

NUM_PARAMS = 3 * (64 * 16 + 64 + 16 * 64 + 16) + 16 + 1  # 6401 elements in 14 tensors
NUM_STATE = 2 * NUM_PARAMS + 14  # AdamW: exp_avg and exp_avg_sq like the parameters, one 0-dim step each
NOTHING = Footprint(0, 0, 0, 0)


def whole(numel: int) -> Footprint:
    """What one process holds: everything, float32."""
    return Footprint(numel, 4 * numel, numel, 4 * numel)


def stepped_tinynet() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torchacc.accelerate(TinyNet())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_hand_counts_are_what_they_say():
    assert (NUM_PARAMS, NUM_STATE) == (6401, 12816)
    assert whole(NUM_PARAMS) == Footprint(6401, 25604, 6401, 25604)


def test_one_process_before_training_holds_the_parameters_only():
    torch.manual_seed(0)
    report = torchacc.memory_report(torchacc.accelerate(TinyNet()))
    assert report == torchacc.MemoryReport(
        parameters=Footprint(6401, 25604, 6401, 25604),
        gradients=NOTHING,
        optimizer_state=NOTHING,
        num_units=0,
        mesh_shape=None,
        mesh_dim_names=None,
        rank=0,
        world_size=1,
    )
    assert report.reduction == 1.0


def test_one_process_after_an_adamw_step_counts_gradients_and_state():
    model, optimizer = stepped_tinynet()
    report = torchacc.memory_report(model, optimizer)
    assert report.parameters == whole(6401)
    assert report.gradients == whole(6401)
    assert report.optimizer_state == Footprint(12816, 51264, 12816, 51264)  # 56 bytes of it are the 14 steps
    assert report.total == Footprint(25618, 102472, 25618, 102472)
    assert (report.reduction, report.num_units, report.mesh_shape) == (1.0, 0, None)
    assert torchacc.memory_report(model).optimizer_state == NOTHING, "no optimizer: no state counted"
    optimizer.zero_grad()
    assert torchacc.memory_report(model, optimizer).gradients == NOTHING, "gradients set to None do not count"


def test_table_shows_the_sizes():
    model, optimizer = stepped_tinynet()
    assert str(torchacc.memory_report(model, optimizer)) == (
        "rank 0 of 1, one process (no mesh), 0 units\n"
        "                 held on this rank  full model  reduction\n"
        "parameters                25.0 KiB    25.0 KiB      1.00x\n"
        "gradients                 25.0 KiB    25.0 KiB      1.00x\n"
        "optimizer state           50.1 KiB    50.1 KiB      1.00x\n"
        "total                    100.1 KiB   100.1 KiB      1.00x"
    )
    assert "optimizer state                0 B         0 B          -" in str(torchacc.memory_report(model))


def test_tied_parameters_count_once_and_a_plain_model_works():
    model = tiny_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    # wte (128, 64) + wpe (16, 64) + 2 blocks of 49984 (ln 2*128, c_attn 64*192+192, attn c_proj 64*64+64,
    # c_fc 64*256+256, mlp c_proj 256*64+64) + ln_f 128; the tied lm_head adds nothing
    assert torchacc.memory_report(model).parameters == whole(8192 + 1024 + 2 * 49984 + 128) == whole(109312)


def test_sizes_and_ratios_at_the_edges():
    assert [format_bytes(n) for n in (0, 1023, 1024, 12836, 3 * 1024**2 // 2, 5 * 1024**4)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "12.5 KiB",
        "1.5 MiB",
        "5.0 TiB",
    ]
    assert NOTHING.reduction == 1.0
    assert Footprint(0, 0, 16, 64).reduction == math.inf, "a rank that holds none of it"
    assert Footprint(3209, 12836, 6401, 25604).reduction == pytest.approx(25604 / 12836)


class _Lines(logging.Handler):
    """Collects the "torchacc" logger's messages (pytest's caplog is absent under ``-p no:logging``)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def torchacc_log():
    logger = logging.getLogger("torchacc")
    handler, level = _Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_accelerate_logs_one_summary_line(torchacc_log):
    torchacc.accelerate(TinyNet())
    assert torchacc_log == ["torchacc: one process, nothing sharded; parameters 25.0 KiB per rank"]


def test_accelerate_computes_no_summary_when_info_is_off(monkeypatch):
    calls = []
    module = importlib.import_module("torchacc.parallel.memory_report")
    monkeypatch.setattr(module, "memory_report", lambda *args: calls.append(args))
    assert not logging.getLogger("torchacc").isEnabledFor(logging.INFO)
    torchacc.accelerate(TinyNet())
    assert calls == []
