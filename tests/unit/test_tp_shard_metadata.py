"""Shard metadata for tensor-parallel layouts: the new placement names, per-tensor meshes and their errors.

The round trips of real TP and FSDP x TP runs are in tests/multiproc/test_tp_checkpoint.py; these are the
refusals, on a world of one rank where a DTensor can be built without launching processes.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from torchacc.checkpoint import state
from torchacc.checkpoint.offline._checks import check_metadata


@pytest.fixture
def mesh(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
    dist.destroy_process_group()


def one_param(value: torch.Tensor) -> nn.Module:
    module = nn.Module()
    module.weight = nn.Parameter(value)
    return module


def entry(**changes):
    base = {"shape": [4, 6], "dtype": "torch.float32", "offset": [0, 0], "local_shape": [2, 6]}
    return {**base, "placements": ["strided_shard:0:2", "shard:0"], **changes}


def metadata(**changes) -> dict:
    return {"format": state.FORMAT, "world_size": 4, "rank": 0, "tensors": {"w": entry(**changes)}}


def test_placement_names():
    assert state._placement_name("w", _StridedShard(0, split_factor=2)) == "strided_shard:0:2"
    assert state._placement_name("w", Shard(1)) == "shard:1"
    assert state.is_sharded(["replicate", "strided_shard:0:2"]) and not state.is_sharded(["replicate"])
    with pytest.raises(ValueError, match=r"w: placement Partial\(sum\) cannot be saved as shards .*save the full"):
        state._placement_name("w", Partial())


def test_strided_placements_and_a_tensors_own_mesh_pass_the_checks():
    check_metadata("f.pth", metadata(), "model")
    own_mesh = {"shape": [2, 2], "dim_names": ["fsdp", "tp"], "coordinate": [0, 0]}
    check_metadata("f.pth", metadata(mesh=own_mesh), "model")


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"placements": ["strided_shard:0", "shard:0"]}, r"'placements' is .*'strided_shard:<dim>:<split factor>'"),
        ({"placements": ["strided_shard:2:2"]}, r"'placements' is \['strided_shard:2:2'\].*\(dim < 2\)"),
        ({"mesh": "tp"}, r"'mesh' is 'tp', expected a dict with a 'shape' list"),
        ({"mesh": {"shape": [4]}}, r"'mesh' has shape \[4\], expected 2 int\(s\) >= 1 \(one per placement\)"),
    ],
)
def test_damaged_tensor_parallel_metadata_is_refused(changes, problem):
    with pytest.raises(ValueError, match=rf"f\.pth: shard_metadata is damaged: tensors\['w'\] {problem}"):
        check_metadata("f.pth", metadata(**changes), "model")


def test_a_layout_that_is_not_a_block_is_refused(mesh):
    odd = DTensor.from_local(torch.zeros(3, 4), mesh, [Shard(0)], shape=torch.Size([6, 4]), stride=(4, 1))
    with pytest.raises(ValueError, match=r"weight: its placements \['shard:0'\] give a local shape \[6, 4\], but"):
        state.get_shard_metadata(one_param(odd))


def test_local_shards_of_another_block_are_refused(mesh):
    model = one_param(DTensor.from_local(torch.zeros(4, 4), mesh, [Shard(0)]))
    meta = state.get_shard_metadata(model)
    moved = {**meta, "tensors": {"weight": {**meta["tensors"]["weight"], "offset": [1, 0]}}}
    with pytest.raises(ValueError, match=r"weight: the saved local shard is the block at offset \[1, 0\] of shape"):
        state.load_state_dict(model, {"weight": torch.ones(4, 4)}, shard_metadata=moved)
    with pytest.raises(ValueError, match=r"weight: shard_metadata has no entry for it, but this rank holds the block"):
        state.load_state_dict(model, {"weight": torch.ones(4, 4)}, shard_metadata={**meta, "tensors": {}})
    state.load_state_dict(model, {"weight": torch.ones(4, 4)}, shard_metadata=meta)
    assert torch.equal(model.weight.to_local(), torch.ones(4, 4))


def test_a_full_tensor_is_cut_to_a_strided_block(mesh):
    grid = init_device_mesh("cpu", (1, 1), mesh_dim_names=("fsdp", "tp"))
    target = DTensor.from_local(torch.zeros(4, 6), grid, [_StridedShard(0, split_factor=1), Shard(0)])
    full = torch.arange(24.0).reshape(4, 6)
    converted = state.dtensor_like(target, full)
    assert converted.placements == target.placements and torch.equal(converted.to_local(), full)
    assert converted.to_local().data_ptr() != full.data_ptr(), "a copy: assign=True must not pin the full tensor"
