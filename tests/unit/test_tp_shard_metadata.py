"""Shard metadata for tensor-parallel layouts: the new placement names, per-tensor meshes and their errors.

The round trips of real TP and FSDP x TP runs are in tests/multiproc/test_tp_checkpoint.py; these are the
refusals, on a world of one rank where a DTensor can be built without launching processes.
"""

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from torchacc.checkpoint import state
from torchacc.checkpoint.offline._checks import check_metadata
from torchacc.checkpoint.offline._tiling import check_tiling
from torchacc.checkpoint.offline.shard_set import TensorItem


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


def layout_blocks(shape, mesh_shape, placements) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """Every rank's (file, offset, local shape) of a DTensor layout, from DTensor's own arithmetic."""
    blocks = []
    for rank, coordinate in enumerate(itertools.product(*map(range, mesh_shape))):
        local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coordinate), placements)
        blocks.append((f"rank{rank}.pth", offset, local))
    return blocks


def item(*shape: int) -> TensorItem:
    return TensorItem(("w",), ("w",), tuple(shape), torch.float32, "w")


@pytest.mark.parametrize(
    ("shape", "mesh_shape", "placements"),
    [
        ((5, 3), (4,), [Shard(0)]),  # uneven: rows 2, 2, 1 and an empty piece
        ((6, 10), (2, 3), [Shard(0), Shard(1)]),  # FSDP x TP on two dims, uneven columns
        ((8, 4), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),  # FSDP over a TP shard of dim 0
        ((2, 6, 4, 7), (2, 2, 3), [Replicate(), Shard(1), Shard(3)]),  # HSDP replicas, 4 dims
        ((3, 9, 2), (2, 2, 2), [Shard(2), Shard(0), Shard(1)]),
    ],
)
def test_dtensor_layouts_tile_exactly(shape, mesh_shape, placements):
    check_tiling(item(*shape), layout_blocks(shape, mesh_shape, placements), "ckpt")


def test_tiling_is_checked_without_building_the_tensor():
    # a 2**40 x 2**30 tensor (4 EiB in float32) on a 64 x 64 FSDP x TP grid: only the 4096 blocks are looked at
    shape, rows, cols = (2**40, 2**30), 2**34, 2**24
    blocks = [(f"rank{64 * i + j}.pth", (i * rows, j * cols), (rows, cols)) for i in range(64) for j in range(64)]
    check_tiling(item(*shape), blocks, "ckpt")
    path, (row, col), (rows, cols) = blocks[-1]
    blocks[-1] = (path, (row - 1, col), (rows, cols))  # one row up: overlaps its neighbour, leaves the last row
    with pytest.raises(ValueError, match=rf"w: the pieces in rank4031.pth .* and rank4095.pth \(block \[{row - 1}:"):
        check_tiling(item(*shape), blocks, "ckpt")


@pytest.mark.parametrize(
    ("blocks", "problem"),
    [
        # pieces that cover all 24 elements of [4, 6] inside the bounds: the volume alone cannot tell
        ([((0, 0), (2, 6)), ((1, 0), (2, 6))], r"overlap on \[1:2, 0:6\]"),
        ([((0, 0), (4, 3)), ((0, 2), (4, 3))], r"overlap on \[0:4, 2:3\]"),
        ([((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 6)), ((2, 0), (2, 3))], r"overlap on \[2:4, 0:3\]"),
        ([((0, 0), (4, 6)), ((0, 0), (4, 6))], None),  # replicas
        ([((0, 0), (2, 6)), ((2, 0), (1, 6))], r"no piece in ckpt covers \[3:4, 0:6\]"),
        ([((0, 0), (4, 2)), ((0, 4), (4, 2))], r"no piece in ckpt covers \[0:4, 2:4\]"),
        ([((0, 0), (4, 6)), ((4, 0), (0, 6))], None),  # an empty piece past the end, as DTensor places one
    ],
)
def test_overlaps_and_gaps_are_found_in_any_dim(blocks, problem):
    pieces = [(f"rank{r}.pth", offset, local) for r, (offset, local) in enumerate(blocks)]
    if problem is None:
        check_tiling(item(4, 6), pieces, "ckpt")
        return
    with pytest.raises(ValueError, match=rf"^w: .*{problem}"):
        check_tiling(item(4, 6), pieces, "ckpt")
