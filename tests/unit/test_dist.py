"""torchacc.dist in one process: a world of one without torchrun, and the errors a user can hit."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import torchacc
from torchacc.dist import env
from torchacc.distributed.mesh import build_mesh
from torchacc.parallel.fsdp import resolve_module_classes, wrap_fsdp


def test_world_of_one_without_environment():
    assert (torchacc.dist.rank(), torchacc.dist.world_size(), torchacc.dist.local_rank()) == (0, 1, 0)
    assert torchacc.dist.is_master_ordinal() and torchacc.dist.is_master_ordinal(local=False)
    assert not env.init_distributed()
    torchacc.dist.rendezvous("anything")
    torchacc.dist.barrier()
    torchacc.dist.mark_step()
    assert torchacc.dist.broadcast({"a": 1}) == {"a": 1}
    assert torchacc.dist.reduce(2.5) == 2.5
    t = torch.tensor([1.0, 2.0])
    assert torchacc.dist.all_reduce(t, op="mean") is t and t.tolist() == [1.0, 2.0]
    assert not dist.is_initialized(), "a world of one must not start a process group"


def test_partial_torchrun_environment_says_how_to_launch(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="MASTER_ADDR.*is not: launch with `torchrun --nproc_per_node=N"):
        env.init_distributed()


def test_non_integer_rank_variable(monkeypatch):
    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(ValueError, match="RANK='zero' is not an integer"):
        torchacc.dist.rank()


def test_reduction_op_errors():
    with pytest.raises(ValueError, match="op='avg' is not supported; use one of 'sum', 'mean', 'max', 'min'"):
        torchacc.dist.all_reduce(torch.ones(1), op="avg")
    with pytest.raises(
        ValueError, match=r"op='mean' needs a floating tensor, got torch.int64; convert with .float\(\)"
    ):
        torchacc.dist.all_reduce(torch.ones(1, dtype=torch.long), op="mean")


def test_mesh_topology_must_name_both_axes():
    with pytest.raises(ValueError, match=r"topology=\['dp', 'tp'\] must be a permutation of \['dp', 'fsdp'\]"):
        build_mesh(device_type="cpu", dp_size=1, fsdp_size=1, topology=["dp", "tp"])


def test_resolve_module_classes_lists_what_exists():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert resolve_module_classes(model, {"Linear"}, what="x") == {nn.Linear}
    with pytest.raises(ValueError, match=r"x: no module of class 'Conv2d' in Sequential; .*Linear, ReLU, Sequential"):
        resolve_module_classes(model, {"Conv2d"}, what="x")


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight


@pytest.fixture
def world_of_one_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_tied_weights_stay_in_one_group(world_of_one_group):
    model = Tied()
    mesh = build_mesh(device_type="cpu", dp_size=1, fsdp_size=1)
    with pytest.warns(UserWarning, match="not sharding embed as its own unit: its parameter is tied to head.weight"):
        wrap_fsdp(model, mesh, {nn.Embedding, nn.Linear})
    from torch.distributed.fsdp import FSDPModule

    assert isinstance(model.body, FSDPModule) and not isinstance(model.embed, FSDPModule)
    assert model.head.weight is model.embed.weight
