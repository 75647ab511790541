"""``Layout.from_config``: the config resolved once into what the engine does (see [Note: one layout])."""

import dataclasses

import pytest
import torch

import torchacc
from torchacc.distributed.mesh import data_parallel_rank
from torchacc.parallel.layout import ActivationCheckpointing, Layout, ParallelDims


def _config(**fields) -> torchacc.Config:
    config = torchacc.Config()
    for path, value in fields.items():
        *parents, name = path.split("__")
        node = config
        for parent in parents:
            node = getattr(node, parent)
        setattr(node, name, value)
    return config


def test_sizes_are_resolved_once_with_the_inferred_replicas():
    layout = Layout.from_config(_config(dist__fsdp__size=2, dist__tp__size=2), world_size=8, device_type="cuda")
    assert layout.dims == ParallelDims(world_size=8, dp=2, fsdp=2, tp=2, topology=("dp", "fsdp"))
    assert layout.dims.num_data_ranks == 4 and layout.dims.needs_mesh and layout.dims.sharded
    assert layout.dims.describe() == "dp=2 x fsdp=2 x tp=2"


@pytest.mark.parametrize("topology", [["dp", "fsdp"], ["fsdp", "dp"], ["tp", "dp", "fsdp"]])
def test_the_data_parallel_rank_is_the_mesh_arithmetic(topology):
    config = _config(dist__fsdp__size=2, dist__tp__size=2, dist__topology=topology)
    dims = Layout.from_config(config, world_size=8, device_type="cpu").dims
    expected = [data_parallel_rank(r, dp_size=2, fsdp_size=2, tp_size=2, topology=topology) for r in range(8)]
    assert [dims.data_parallel_rank(r) for r in range(8)] == expected
    assert sorted(set(expected)) == list(range(dims.num_data_ranks))


def test_plain_data_parallel_and_one_process_need_no_mesh():
    dp = Layout.from_config(torchacc.Config(), world_size=4, device_type="cpu").dims
    assert (dp.dp, dp.fsdp, dp.tp, dp.needs_mesh, dp.sharded) == (4, 1, 1, False, False)
    assert dp.build_mesh("cpu") is None
    assert Layout.from_config(torchacc.Config(), world_size=1, device_type="cpu").dims.describe() == "1 rank"


def test_tp_beside_replicas_shards_over_the_replicas():
    dims = Layout.from_config(_config(dist__tp__size=2), world_size=4, device_type="cpu").dims
    assert (dims.dp, dims.fsdp, dims.tp, dims.sharded) == (2, 1, 2, True)
    tp_only = Layout.from_config(_config(dist__tp__size=2), world_size=2, device_type="cpu").dims
    assert tp_only.needs_mesh and not tp_only.sharded


def test_precision_checkpointing_and_units_are_plain_values():
    config = _config(
        compute__bf16=True,
        memory__gc=True,
        memory__gc_cnt=3,
        memory__gc_interval=2,
        dist__fsdp__size=4,
        dist__fsdp__wrap_layer_cls={"GPT2Block"},
        dist__fsdp__reduce_dtype="bfloat16",
    )
    layout = Layout.from_config(config, world_size=4, device_type="cuda")
    assert layout.param_dtype == torch.bfloat16 and layout.reduce_dtype == torch.bfloat16
    assert layout.wrap_layer_cls == frozenset({"GPT2Block"})
    assert layout.checkpointing == ActivationCheckpointing(
        frozenset({"GPT2Block"}), num_layers=3, interval=2, source="dist.fsdp.wrap_layer_cls"
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.compile = True


def test_the_layout_does_not_change_when_the_config_does():
    config = _config(dist__tp__size=2, dist__tp__plan={"blocks.*.fc1": "colwise"})
    layout = Layout.from_config(config, world_size=2, device_type="cpu")
    config.dist.tp.plan["blocks.*.fc2"] = "rowwise"
    assert dict(layout.tp_plan) == {"blocks.*.fc1": "colwise"}


@pytest.mark.parametrize(
    ("device_type", "fsdp", "reason"),
    [("cpu", 2, "ignored on a CPU run"), ("cuda", 1, "needs FSDP"), ("cuda", 2, None)],
)
def test_offload_is_resolved_and_an_ignored_setting_says_why(device_type, fsdp, reason):
    config = _config(memory__offload_params=True, dist__fsdp__size=fsdp)
    layout = Layout.from_config(config, world_size=2, device_type=device_type)
    assert layout.offload_params is (reason is None)
    if reason is None:
        assert layout.ignored == ()
    else:
        assert len(layout.ignored) == 1 and reason in layout.ignored[0]


def test_an_invalid_config_is_refused_with_its_dotted_path():
    with pytest.raises(ValueError, match=r"dist.fsdp.size=3 does not divide world size 4"):
        Layout.from_config(_config(dist__fsdp__size=3), world_size=4, device_type="cpu")
