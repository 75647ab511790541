"""FSDP2Strategy.maybe_offload_optimizer / maybe_load_optimizer, shown on CPU with a "cuda" mesh.

Under FSDP's CPUOffloadPolicy a parameter is a DTensor on a CUDA mesh whose local shard lives in CPU
memory, and so is its optimizer state. Such DTensors are built here on a CUDA-less machine (the mesh's
backend is never started); a local tensor on the meta device stands in for one on the GPU. The CUDA round
trip itself is in tests/gpu/test_cuda.py.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from torchacc import FSDP2Strategy


@pytest.fixture
def cuda_mesh(tmp_path, monkeypatch):
    """A one-rank mesh of device type "cuda", and torch.cuda calls recorded instead of run."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    yield DeviceMesh("cuda", torch.arange(1), mesh_dim_names=("fsdp",), _init_backend=False), calls
    dist.destroy_process_group()


def on_mesh(local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """A DTensor on ``mesh`` whose local tensor stays where it is (DTensor.from_local would move it)."""
    meta = TensorMeta(local.shape, local.stride(), local.dtype)
    return DTensor(local, DTensorSpec(mesh, (Shard(0),), tensor_meta=meta), requires_grad=False)


def adam_state(param: torch.Tensor, state_device: str, mesh: DeviceMesh | None) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW([param], lr=0.1)

    def state_tensor(value: float) -> torch.Tensor:
        local = torch.full((4, 2), value, device=state_device)
        return on_mesh(local, mesh) if mesh is not None else local

    optimizer.state[param] = {"step": torch.tensor(3.0), "exp_avg": state_tensor(1.0), "exp_avg_sq": state_tensor(2.0)}
    return optimizer


def test_state_already_in_cpu_memory_stays_put(cuda_mesh):
    mesh, calls = cuda_mesh
    # the CPUOffloadPolicy layout: a CUDA mesh, the parameter's shard and its state in CPU memory
    param = nn.Parameter(on_mesh(torch.zeros(4, 2), mesh))
    optimizer = adam_state(param, "cpu", mesh)
    before = dict(optimizer.state[param])
    strategy = FSDP2Strategy(cpu_offload=True)
    strategy.maybe_offload_optimizer(optimizer)
    strategy.maybe_load_optimizer(optimizer)  # back next to the parameter: its shard is in CPU memory too
    after = optimizer.state[param]
    assert all(after[key] is value for key, value in before.items()), "nothing moves, nothing is rebuilt"
    assert after["exp_avg"].to_local().device.type == "cpu"
    assert calls == [], "no synchronize or empty_cache when nothing moved"


def test_load_moves_each_dtensor_itself_next_to_its_parameter(cuda_mesh):
    mesh, calls = cuda_mesh
    param = nn.Parameter(on_mesh(torch.zeros(4, 2, device="meta"), mesh))  # its shard "on the GPU"
    plain = nn.Parameter(torch.zeros(4, 2, device="meta"))
    optimizer = adam_state(param, "cpu", mesh)  # state offloaded to CPU memory
    optimizer.add_param_group({"params": [plain]})
    optimizer.state[plain] = {"exp_avg": torch.ones(4, 2)}
    FSDP2Strategy(cpu_offload=True).maybe_load_optimizer(optimizer)
    for key in ("exp_avg", "exp_avg_sq"):
        value = optimizer.state[param][key]
        assert isinstance(value, DTensor) and value.device_mesh is mesh and value.placements == (Shard(0),)
        assert value.to_local().device.type == "meta" and value.device.type == "meta", key
    assert optimizer.state[param]["step"].device.type == "cpu", "the scalar step stays where Adam keeps it"
    assert optimizer.state[plain]["exp_avg"].device.type == "meta"
    assert calls == ["synchronize", "empty_cache"]


def test_offload_and_load_need_cpu_offload_on_a_cuda_run(cuda_mesh):
    mesh, calls = cuda_mesh
    param = nn.Parameter(on_mesh(torch.zeros(4, 2, device="meta"), mesh))
    optimizer = adam_state(param, "cpu", mesh)
    FSDP2Strategy(cpu_offload=False).maybe_load_optimizer(optimizer)
    assert optimizer.state[param]["exp_avg"].to_local().device.type == "cpu" and calls == []
