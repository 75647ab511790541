"""The CUDA/NCCL path. Skipped, with the need stated, on machines without enough GPUs."""

from pathlib import Path

import pytest
import torch
from _launch import launch
from _models import tiny_gpt2, token_dataset
from _parity import assert_parity
from torch.utils.data import DataLoader

import torchacc

SCENARIOS = str(Path(__file__).parents[1] / "multiproc" / "scenarios.py")
needs_one_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices for NCCL FSDP"
)


@needs_one_gpu
def test_single_gpu_bf16_places_model_and_batches_on_the_device():
    config = torchacc.Config()
    config.compute.bf16 = True
    model, loader = torchacc.accelerate(tiny_gpt2(), DataLoader(token_dataset(8), batch_size=4), config)
    assert model.device == torch.device("cuda", 0)
    batch = next(iter(loader))
    assert batch["input_ids"].device == model.device
    out = model(input_ids=batch["input_ids"], labels=batch["labels"])
    assert out.logits.dtype == torch.float32 and torch.isfinite(out.loss)


@needs_two_gpus
def test_nccl_fsdp_matches_single_process(tmp_path):
    results = launch(f"{SCENARIOS}:train_gpt2_fsdp", 2, tmp_path)
    assert all(r["device"].startswith("cuda") for r in results)
    assert_parity(results)
