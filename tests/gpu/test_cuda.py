"""The CUDA path in one process (one GPU). Skipped, with the need stated, on machines without one.

The multi-GPU runs (NCCL) are in test_cuda_ranks.py.
"""

import pytest
import torch
import torch.nn as nn
from _gpus import needs_gpus
from _models import TinyNet, tiny_gpt2, token_dataset
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import torchacc
from torchacc import FSDP2Strategy


@needs_gpus(1)
def test_single_gpu_bf16_places_model_and_batches_on_the_device():
    config = torchacc.Config()
    config.compute.bf16 = True
    model, loader = torchacc.accelerate(tiny_gpt2(), DataLoader(token_dataset(8), batch_size=4), config)
    assert model.device == torch.device("cuda", 0)
    batch = next(iter(loader))
    assert batch["input_ids"].device == model.device
    out = model(input_ids=batch["input_ids"], labels=batch["labels"])
    # One process: bf16 autocast. The logits stay in the compute dtype, the loss (a scalar) comes back in
    # float32 (docs/precision.md).
    assert out.logits.dtype == torch.bfloat16 and out.logits.device == model.device
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)


@needs_gpus(1)
@pytest.mark.parametrize("prefetch", [True, False])
def test_a_pinned_loader_delivers_every_batch_intact_on_the_device(prefetch):
    data = token_dataset(64)
    config = torchacc.Config()
    config.dataloader.prefetch = prefetch
    pinned = DataLoader(data, batch_size=4, shuffle=True, pin_memory=True, num_workers=2)
    _, loader = torchacc.accelerate(nn.Linear(2, 2), pinned, config)
    assert loader.loader.pin_memory, "the rebuilt loader keeps pin_memory"
    seen = []
    for batch in loader:
        ids = batch["input_ids"]
        assert ids.device == torch.device("cuda", 0)
        work = ids.float() @ ids.float().T  # compute on the current stream while the next batch is copied
        expected = torch.stack([data[i]["input_ids"] for i in batch["index"].tolist()])
        assert torch.equal(ids.cpu(), expected), "a batch copied asynchronously must arrive whole"
        assert torch.isfinite(work).all()
        seen += batch["index"].tolist()
    assert sorted(seen) == list(range(64))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _where(optimizer: torch.optim.Optimizer) -> set[tuple[str, str | None]]:
    """(device type of the local tensor, device type of the mesh or None) of every non-scalar state tensor."""
    return {
        (_local(v).device.type, v.device_mesh.device_type if isinstance(v, DTensor) else None)
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    }


def _shard_blocks(model, mesh, mp_policy):
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def _train(*, sharded: bool, round_trip: bool) -> dict:
    """4 AdamW steps of TinyNet on one GPU; with ``round_trip`` the state goes to CPU memory and back after step 2."""
    strategy = FSDP2Strategy(
        cpu_offload=True,
        parallelize_fn=_shard_blocks if sharded else None,
        loss_fn=lambda model, batch: model(batch).square().mean(),
    )
    strategy.setup_environment()
    torch.manual_seed(0)
    model = strategy.parallelize(TinyNet())
    optimizer = strategy.create_optimizer(model, lr=1e-2)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).cuda()
    seen = {}
    for step in range(4):
        strategy.backward(strategy.training_step(x, step), model, optimizer)
        strategy.optimizer_step(optimizer, model)
        if round_trip and step == 1:
            seen["before"] = _where(optimizer)
            torch.cuda.synchronize()
            allocated = torch.cuda.memory_allocated()
            strategy.maybe_offload_optimizer(optimizer)
            seen["freed"] = allocated - torch.cuda.memory_allocated()
            seen["offloaded"] = _where(optimizer)
            strategy.maybe_load_optimizer(optimizer)
            seen["loaded"] = _where(optimizer)
    seen["state"] = {k: _local(v).detach().cpu().clone() for k, v in model.state_dict().items()}
    seen["param_bytes"] = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    return seen


@needs_gpus(1)
@pytest.mark.filterwarnings("ignore:memory.offload_params=True needs FSDP")
@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "dtensor"])
def test_strategy_optimizer_offload_round_trip_on_one_gpu(sharded):
    """Without sharding cpu_offload leaves the parameters on the GPU, so maybe_offload_optimizer really moves the
    state: to CPU memory, each DTensor keeping its CUDA mesh; maybe_load_optimizer brings it back, and training goes
    on exactly as without the round trip. (``dtensor``: a parallelize_fn shards over the one-rank mesh.)"""
    mesh = "cuda" if sharded else None
    plain = _train(sharded=sharded, round_trip=False)
    moved = _train(sharded=sharded, round_trip=True)
    assert moved["before"] == {("cuda", mesh)}
    assert moved["offloaded"] == {("cpu", mesh)}, "offloaded state stays in CPU memory, off the mesh's GPU"
    assert moved["freed"] >= 2 * moved["param_bytes"], "AdamW's two moments left GPU memory"
    assert moved["loaded"] == {("cuda", mesh)}
    for key, value in plain["state"].items():
        assert torch.equal(moved["state"][key], value), key
