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
CP_SCENARIOS = str(Path(__file__).parents[1] / "multiproc" / "cp_scenarios.py")
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


@needs_two_gpus
@pytest.mark.parametrize("method", ["ulysses", "ring"])
def test_context_parallel_on_cuda_matches_one_gpu(tmp_path, method):
    """dist.cp.size=2 on 2 GPUs (ring: torch's ring attention, CUDA only) against the same steps on one GPU."""
    results = launch(f"{CP_SCENARIOS}:cuda_cp2", 2, tmp_path, args=(method,))
    for result in results:
        assert result["attn"] == f"torchacc_{method}"
        reference = result["reference"]
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), atol=1e-4, rtol=0)
        for name, value in reference["state"].items():
            torch.testing.assert_close(result["state"][name], value, atol=1e-4, rtol=0, msg=name)
