"""Planning in one process: the fake process group, ``estimate_memory``, ``track_memory``, the per-rank arithmetic
the planner scales to 70B, the planner against full fake steps, ``torchacc plan``, and every planning error.

The exact oracle against real runs is tests/multiproc/test_plan_oracle.py; the 10% comparison on larger shapes
is benchmarks/plan_accuracy.py.
"""

import contextlib
import gc
import json
import math
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn as nn
import yaml
from _models import SEQ, TinyNet, tiny_gpt2, tiny_llama

import torchacc
from torchacc.cli import main
from torchacc.distributed.fake import fake_process_group
from torchacc.parallel import memory_tracking
from torchacc.parallel.layout import Layout
from torchacc.parallel.memory_tracking import LiveBytes
from torchacc.planning.candidates import Cluster, checkpointing_axis, parallel_axis
from torchacc.planning.command import format_plan, parse_bytes
from torchacc.planning.models import build_meta_model
from torchacc.planning.plan import plan_layouts
from torchacc.planning.scaling import held_state

LLAMA = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": SEQ, "tie_word_embeddings": False}  # fmt: skip


def llama_config(num_layers: int, **overrides):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=num_layers, **{**LLAMA, **overrides})


@pytest.fixture(autouse=True)
def _forget_tracked_peaks():
    """memory_report reads the latest track_memory() block of the process: other test modules expect none."""
    yield
    memory_tracking._last = None


def config_of(**settings) -> torchacc.Config:
    config = torchacc.Config()
    config.dist.fsdp.wrap_layer_cls = {"LlamaDecoderLayer"}
    for dotted, value in settings.items():
        *path, leaf = dotted.split("__")
        node = config
        for part in path:
            node = getattr(node, part)
        setattr(node, leaf, value)
    return config


def _gather(mesh) -> float:
    """A DTensor op that communicates over ``mesh``: DTensor caches how it did it, by mesh (and meshes of one shape
    compare equal whatever their groups)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    doubled = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]) * 2  # its spec (and mesh) from DTensor's cache
    return doubled.redistribute(mesh, [Replicate()]).to_local().sum()


def _dtensor_state(mesh) -> tuple:
    """DTensor's caches as the caller finds them: each Python cache (the object and its size), ``DeviceMesh``'s
    constructor, and the mesh that a cached decision gives an op on ``mesh`` (the equal mesh it was made on)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard, _redistribute, distribute_tensor
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    caches = [
        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache,
        ShardingPropagator._propagate_tensor_meta_cached,
        MeshTopoInfo.build_from_mesh,
        _redistribute._gen_transform_infos,
    ]
    decided = (distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]) * 2)._spec.mesh
    return (*[(id(c), c.cache_info().currsize) for c in caches], dict(_redistribute._planner_cache),
            DeviceMesh.__init__, id(decided))  # fmt: skip


def test_fake_group_inside_a_real_one_leaves_it_working():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    world, names, hook = c10d._world, dict(c10d._world.pg_names), sys.excepthook
    real_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    assert _gather(real_mesh) == 16.0
    # an equal mesh of a later model: its ops get real_mesh's cached decisions, and must go on getting them (an
    # estimate on one rank that emptied the caches sent that rank to the later mesh's groups, the others not)
    later_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    found = _dtensor_state(later_mesh)
    with fake_process_group(world_size=1):  # a mesh equal to the real one, on a fake group
        _gather(init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)))
    for _ in range(2):  # the second world's mesh equals the first's, whose groups are gone
        with fake_process_group(world_size=8, rank=3):
            assert (dist.get_world_size(), dist.get_rank()) == (8, 3)
            _gather(init_device_mesh("cpu", (8,), mesh_dim_names=("tp",)))
    assert (c10d._world, dict(c10d._world.pg_names), sys.excepthook) == (world, names, hook)
    assert _dtensor_state(later_mesh) == found
    tensor = torch.ones(3)
    dist.all_reduce(tensor)
    assert dist.get_world_size() == 1 and _gather(real_mesh) == 16.0  # not sent to the fake world's groups


def test_estimate_leaves_the_process_as_found_and_the_model_unchanged():
    torch.manual_seed(7)
    model, rng = TinyNet(), torch.get_rng_state()
    weight = model.head.weight.detach().clone()
    found = torchacc.estimate_memory(model, config_of(dist__fsdp__size=2, dist__fsdp__wrap_layer_cls={"Block"}),
                                     world_size=2, micro_batch_size=4, seq_len=1, device_type="cpu",
                                     batch_fn=lambda batch, _: (torch.randn(batch, 16),))  # fmt: skip
    assert not dist.is_initialized() and torch.equal(torch.get_rng_state(), rng)
    assert torch.get_default_device() == torch.device("cpu") and torch.get_default_dtype() == torch.float32
    assert type(model) is TinyNet and torch.equal(model.head.weight, weight)  # a copy was sharded, not the model
    # TinyNet: 3 blocks of 2128 elements (1064 on rank 0) and a 1-row head (all 17 on rank 0), float32
    assert (found.parameters, found.gradients) == (4 * (3 * 1064 + 17), 4 * (3 * 1064 + 17))
    assert found.optimizer_state == 2 * found.parameters + 4 * 14  # two moments, and a 4-byte step per tensor
    assert found.peak > found.parameters + found.gradients + found.optimizer_state
    assert str(found).splitlines()[0] == "rank 0 of 2, fsdp=2, micro batch 4 x 1 tokens"


def test_tied_weights_count_once_without_fsdp():
    model = tiny_gpt2()  # lm_head.weight is transformer.wte.weight
    found = torchacc.estimate_memory(model, torchacc.Config(), world_size=1, micro_batch_size=2, seq_len=SEQ,
                                     device_type="cpu")  # fmt: skip
    held = torchacc.memory_report(model).parameters.held_bytes
    assert (found.parameters, found.gradients) == (held, held)


def test_foreach_adamw_holds_one_temporary_like_the_parameters_in_fake_and_real_steps():
    def step_bytes(fake: bool) -> int:
        with fake_process_group(world_size=2):
            mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,))
            with torch.device("meta" if fake else "cpu"):
                model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 32, bias=False))
            torch.distributed.fsdp.fully_shard(model, mesh=mesh)
            mode = torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)
            with mode if fake else contextlib.nullcontext():
                if fake:
                    model.to_empty(device="cpu")
                optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
                for param in model.parameters():
                    param.grad = torch.zeros_like(param)
                live = LiveBytes()
                live.track(list(model.parameters()), [p.grad for p in model.parameters()])
                with live:  # the first step: DTensor derives its foreach shapes now (see [Note: shape propagation])
                    optimizer.step()  # makes the state, which stays, and the temporaries, which go
                return live.peak - live.current

    shards = (32 * 64 + 16 * 64) * 4  # this rank's parameter bytes
    assert step_bytes(fake=False) == shards
    assert step_bytes(fake=True) == shards


def test_track_memory_counts_live_cpu_tensors_and_memory_report_reads_it():
    model = TinyNet()
    with fake_process_group(world_size=2):
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,))
        with torch._subclasses.fake_tensor.FakeTensorMode():
            shards = [torch.distributed.tensor.Shard(0)]
            ghost = torch.distributed.tensor.DTensor.from_local(torch.empty(1 << 28), mesh, shards, run_check=False)
    gc.collect()  # a collection inside the block would free earlier tests' tensors and lower the peak
    gc.disable()
    try:
        with torchacc.track_memory("cpu") as tracked:
            first = torch.empty(1 << 20, dtype=torch.uint8)
            second = torch.empty(2 << 20, dtype=torch.uint8)
            del first
            third = torch.empty(1 << 20, dtype=torch.uint8)
    finally:
        gc.enable()
    assert tracked.peak_bytes - tracked.baseline_bytes == 3 << 20
    # a DTensor of fake shards (left by an estimate) is no memory: 1 GiB here
    assert sum(4 * p.numel() for p in model.parameters()) <= tracked.baseline_bytes < ghost.to_local().nbytes
    assert torchacc.memory_report(model).peak_bytes == tracked.peak_bytes
    del second, third


def _rows(dim0: int, parts: int) -> int:
    """Rows of rank 0 when ``dim0`` is split like torch.chunk into ``parts``."""
    return min(math.ceil(dim0 / parts), dim0)


def test_per_rank_parameter_bytes_at_64_gpus_equal_the_arithmetic():
    """The planner's exact state (the engine on 3- and 4-block cuts at the real size, extrapolated) for a cheap
    Llama shape on 64 GPUs; torchacc plan does the same for the 70B shape on 512 (docs/planning.md)."""
    vocab, d, f, layers, kv_dim = 1000, 96, 200, 7, 96
    model = build_meta_model(llama_config(layers, vocab_size=vocab, hidden_size=d, intermediate_size=f,
                                          num_attention_heads=8, num_key_value_heads=8))  # fmt: skip
    classes = (type(model.model.layers[0]),)
    sizes = ((64, 1), (8, 8), (8, 1))
    layouts = {(f, t): Layout.from_config(config_of(dist__fsdp__size=f, dist__tp__size=t), world_size=64,
                                          device_type="cuda") for f, t in sizes}  # fmt: skip
    found = dict(zip(layouts, held_state(model, list(layouts.values()), classes, num_blocks=layers), strict=True))
    for (fsdp, tp), line in found.items():
        # (rows, columns, TP split dim): colwise and embedding_rowwise split dim 0, rowwise dim 1, norms none
        block = [(d, d, 0), (kv_dim, d, 0), (kv_dim, d, 0), (d, d, 1), (f, d, 0), (f, d, 0), (d, f, 1), (d, 1, None),
                 (d, 1, None)]  # fmt: skip
        rest = [(vocab, d, 0), (d, 1, None), (vocab, d, 0)]  # embeddings, final norm, lm_head

        def held(rows: int, cols: int, split: int | None, fsdp=fsdp, tp=tp) -> int:
            rows, cols = (rows // tp, cols) if split == 0 else (rows, cols // tp) if split == 1 else (rows, cols)
            return 4 * _rows(rows, fsdp) * cols

        expected = layers * sum(held(*p) for p in block) + sum(held(*p) for p in rest)
        assert line.at(layers).parameters == expected, (fsdp, tp)
        assert line.at(layers).optimizer_state == 2 * expected + 4 * (9 * layers + 3)


@pytest.fixture(scope="module")
def tiny_plan():
    """4 GPUs, nodes of 4: FSDP, HSDP, FSDP x TP 2 and TP 4 (refused: 2 KV heads), AC none / every block."""
    axes = [parallel_axis, lambda c: checkpointing_axis(c)[:2]]
    return plan_layouts(llama_config(5), cluster=Cluster(num_gpus=4, gpus_per_node=4), micro_batch_size=2,
                        seq_len=SEQ, axes=axes)  # fmt: skip


def test_planner_matches_full_fake_steps_and_lists_what_accelerate_refuses(tiny_plan):
    assert [c.label for c, _ in tiny_plan.refused] == ["tp=4", "tp=4, AC every block"]
    assert all("does not divide num_key_value_heads=2" in error for _, error in tiny_plan.refused)
    assert len(tiny_plan.layouts) == 4
    (row,) = [row for row in tiny_plan.layouts if row.candidate.label == "fsdp=2 x tp=2, AC every block"]
    # scaled from 3- and 4-block fake steps at 2 x 2 ranks, against the full 5-block fake step of accelerate()'s path
    full = torchacc.estimate_memory(llama_config(5), row.config, world_size=4, micro_batch_size=2, seq_len=SEQ)
    scaled = row.estimate
    assert (scaled.parameters, scaled.gradients, scaled.optimizer_state) == (
        full.parameters, full.gradients, full.optimizer_state)  # fmt: skip
    assert scaled.peak == pytest.approx(full.peak, rel=0.05)


def test_the_plan_as_text(tiny_plan):
    text = format_plan(tiny_plan, model_name="tiny")
    assert "4 layouts fit, fastest first" in text
    assert "| layout | peak per GPU | activations | step s | tokens/s per GPU | MFU |" in text
    assert "Layouts that cannot exist (what accelerate() would raise):\n- tp=4: dist.tp.size=4 does not divide" in text
    best = torchacc.Config.from_dict(yaml.safe_load(text.split("for Config.from_yaml:\n\n")[1]))
    assert best.to_dict() == tiny_plan.best.config.to_dict()
    assert best.dist.fsdp.wrap_layer_cls == {"LlamaDecoderLayer"}


def test_torchacc_plan_on_a_model_directory(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 3, **LLAMA}))
    argv = ["plan", "--model", str(tmp_path), "--gpus", "1", "--gpu-memory", "1GB", "--seq-len", str(SEQ),
            "--micro-batch", "2", "--bf16"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{tmp_path}: 127.42K parameters, 3 blocks; 1 GPU (1 node of 1)")
    assert yaml.safe_load(out.split("for Config.from_yaml:\n\n")[1])["compute"]["bf16"] is True


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpus", "12"], "--gpus 12 is not a whole number of nodes of --gpus-per-node 8; use a multiple of 8"),
        (["--gpu-memory", "eighty"], "--gpu-memory 'eighty' is not a size; write e.g. 80GB or 80GiB"),
        (["--gpu-memory", "0GB"], "--gpu-memory '0GB' is no memory; write the memory of one GPU, e.g. 80GB"),
        (["--seq-len", "0"], "--seq-len must be >= 1, got 0"),
        (["--model", "no_such_module:build"], "cannot import 'no_such_module'"),
    ],
)
def test_torchacc_plan_errors_are_one_line(argv, message, tmp_path, capsys):
    base = {"--model": str(tmp_path), "--gpus": "8", "--seq-len": "16", "--micro-batch": "1"}
    base.update(dict(zip(argv[::2], argv[1::2], strict=True)))
    assert main(["plan", *[x for pair in base.items() for x in pair]]) == 1
    assert message in capsys.readouterr().err


class _ReadsItsWeights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.scale = float(self.proj.weight.abs().max().item())  # a value: there is none on the meta device


@pytest.mark.parametrize(
    ("model", "kwargs", "error"),
    [
        (
            _ReadsItsWeights,
            {},
            r"could not build _ReadsItsWeights \(in __init__\) on the meta device .*its "
            r"constructor must not read weight values",
        ),
        ("/no/such/dir", {}, r"model path '/no/such/dir' holds no config.json"),
        (lambda: TinyNet(), {"dist__fsdp__wrap_layer_cls": {"Block"}}, r"TinyNet has no config.vocab_size"),
        (lambda: tiny_llama(), {"dist__fsdp__size": 3}, r"dist.fsdp.size=3 does not divide world size 4"),
        (lambda: tiny_llama(), {"dist__tp__size": 4}, r"dist.tp.size=4 does not divide num_key_value_heads=2"),
    ],
)
def test_estimate_errors_name_the_module_or_the_constraint(model, kwargs, error):
    with pytest.raises(ValueError, match=error):
        torchacc.estimate_memory(model, config_of(**kwargs), world_size=4, micro_batch_size=1, seq_len=8)


def test_sizes_and_clusters_that_cannot_be():
    assert (parse_bytes("80GB"), parse_bytes("80GiB"), parse_bytes("0.5")) == (80 * 10**9, 80 * 2**30, 5 * 10**8)
    with pytest.raises(ValueError, match="--ac-interval must be >= 2"):
        Cluster(num_gpus=8, ac_interval=1)
    with pytest.raises(ValueError, match=r"micro_batch_size must be an int >= 1, got 0"):
        torchacc.estimate_memory(TinyNet(), config_of(), world_size=1, micro_batch_size=0, seq_len=8)


# --- pipeline and context parallelism -------------------------------------------------------------------------


def test_stage_actions_follow_the_schedules():
    from torchacc.planning.stage_step import stage_actions

    # 1F1B: stage s runs min(M, S - s) forwards before its first backward, then one backward, one forward
    assert stage_actions("1F1B", stage=0, num_stages=2, microbatches=4) == [
        ("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]  # fmt: skip
    assert stage_actions("1F1B", stage=1, num_stages=2, microbatches=2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert stage_actions("GPipe", stage=1, num_stages=2, microbatches=2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


def test_pipeline_and_context_layouts_are_candidates():
    from torchacc.planning.candidates import CP_MIN_SEQ_LEN, enumerate_candidates, layout_axis, worth_trying

    labels = [choice.label for choice in layout_axis(Cluster(num_gpus=64, gpus_per_node=8))]
    # stages over nodes (8 nodes: 2 and 4 stages, max_pp), CP inside a node
    assert {"pp=2 x fsdp=32", "pp=4 x fsdp=16"} <= set(labels)
    assert {"fsdp=32 x cp=2", "fsdp=16 x cp=4", "fsdp=8 x cp=8"} <= set(labels)
    assert not any(label.startswith("pp=8") for label in labels)
    deeper = [choice.label for choice in layout_axis(Cluster(num_gpus=64, gpus_per_node=8, max_pp=16))]
    assert "pp=8 x fsdp=8" in deeper and not any(label.startswith("pp=16") for label in deeper)  # 8 nodes
    (cp,) = [c for c in enumerate_candidates(Cluster(num_gpus=16), axes=[layout_axis]) if c.label == "fsdp=8 x cp=2"]
    assert not worth_trying(cp, seq_len=CP_MIN_SEQ_LEN - 1) and worth_trying(cp, seq_len=CP_MIN_SEQ_LEN)


def _cost(**settings):
    from torchacc.planning.costs import Hardware, ModelShape, step_cost

    # the Llama-style model of benchmarks/README.md's PP and CP sections: 4 blocks of width 512, 8 heads, 4 KV heads
    shape = ModelShape(num_params=20_200_000, num_block_params=4 * 3_000_000, num_blocks=4, hidden_size=512,
                       vocab_size=8192, num_heads=8, num_kv_heads=4)  # fmt: skip
    step = settings.pop("step")
    layout = Layout.from_config(config_of(**settings), world_size=4 if "dist__pp__size" in settings else 2,
                                device_type="cuda")  # fmt: skip
    return step_cost(shape, layout, Hardware(), gpus_per_node=8, **step)


def test_pipeline_costs_its_bubble_and_its_boundary_bytes():
    from torchacc.planning.costs import Hardware

    # PP 4, 4 microbatches of 2 x 128 tokens: benchmarks/README.md measured 4.2 MB sent by a middle stage per step
    cost = _cost(dist__pp__size=4, dist__fsdp__size=1, step={"micro_batch_size": 2, "seq_len": 128})
    assert cost.pp_s * Hardware().intra_node_bandwidth == 2 * 4 * (2 * 128 * 512 * 4)  # 4.19 MB
    assert cost.bubble == pytest.approx(3 / 7)  # (S - 1) / (M + S - 1)
    assert cost.step_s == pytest.approx((max(cost.compute_s, cost.fsdp_s) + cost.pp_s) / (1 - 3 / 7))
    more = _cost(dist__pp__size=4, dist__fsdp__size=1, dist__pp__microbatches=8,
                 step={"micro_batch_size": 1, "seq_len": 128})  # fmt: skip
    assert more.bubble == pytest.approx(3 / 11)


def test_context_parallelism_costs_its_all_to_alls():
    from torchacc.planning.costs import Hardware

    # CP 2 at seq 2048, one sequence: benchmarks/README.md measured 25.2 MB of all-to-alls per rank and step
    cost = _cost(dist__cp__size=2, dist__fsdp__size=1, step={"micro_batch_size": 1, "seq_len": 2048})
    assert cost.cp_s * Hardware().intra_node_bandwidth == pytest.approx(2 * (2 * 8 + 2 * 4) * 1024 * 64 * 4 / 2 * 4)
    assert cost.cp_s * Hardware().intra_node_bandwidth / 1e6 == pytest.approx(25.2, abs=0.05)
    plain = _cost(dist__fsdp__size=2, step={"micro_batch_size": 1, "seq_len": 2048})
    assert cost.compute_s == pytest.approx(plain.compute_s / 2)  # each CP rank computes half the tokens


def test_pipeline_estimate_speaks_for_the_busiest_stage():
    # a large vocabulary: the last stage (the head, every microbatch's logits) is the busiest
    model = llama_config(4, vocab_size=4096)
    config = config_of(dist__pp__size=2, dist__fsdp__size=1)
    found = torchacc.estimate_memory(model, config, world_size=2, micro_batch_size=1, seq_len=SEQ, device_type="cpu")
    assert found.rank == 1 and found.layout == "pp=2"
    assert str(found).startswith("rank 1 of 2, pp=2")
    # the last stage holds two blocks, the norm and the head, float32
    block = 4 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128 + 2 * 64)
    assert found.parameters == 2 * block + 4 * (64 + 4096 * 64)


def test_planner_pipeline_and_context_rows_match_full_fake_steps():
    from torchacc.planning.candidates import context_layouts, pipeline_layouts

    axes = [lambda c: pipeline_layouts(c)[:1] + context_layouts(c)[:1], lambda c: checkpointing_axis(c)[:2]]
    plan = plan_layouts(llama_config(5), cluster=Cluster(num_gpus=4, gpus_per_node=4), micro_batch_size=2,
                        seq_len=SEQ, axes=axes, num_workers=1)  # fmt: skip
    assert sorted(row.candidate.label for row in plan.layouts) == [
        "fsdp=2 x cp=2", "fsdp=2 x cp=2, AC every block", "pp=2 x fsdp=2", "pp=2 x fsdp=2, AC every block"]  # fmt: skip
    # Two of the four rows against full fake steps (each costs seconds): each axis once, each AC setting once.
    checked = {"pp=2 x fsdp=2", "fsdp=2 x cp=2, AC every block"}
    for row in (row for row in plan.layouts if row.candidate.label in checked):
        full = torchacc.estimate_memory(llama_config(5), row.config, world_size=4, micro_batch_size=2, seq_len=SEQ)
        scaled = row.estimate
        assert (scaled.rank, scaled.parameters, scaled.gradients, scaled.optimizer_state) == (
            full.rank, full.parameters, full.gradients, full.optimizer_state), row.candidate.label  # fmt: skip
        assert scaled.peak == pytest.approx(full.peak, rel=0.05), row.candidate.label


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"dist__pp__size": 4, "dist__fsdp__size": 1}, r"has 2 block\(s\) in model.layers but the pipeline has 4"),
        ({"dist__cp__size": 4, "dist__fsdp__size": 1}, r"dist.cp.size=4 does not divide num_key_value_heads=2"),
        ({"dist__cp__size": 2, "dist__cp__method": "ring", "dist__fsdp__size": 2}, r"needs CUDA.*use dist.cp.method="),
    ],
)
def test_pipeline_and_context_layouts_that_cannot_exist(kwargs, error):
    with pytest.raises(ValueError, match=error):
        torchacc.estimate_memory(lambda: tiny_llama(), config_of(**kwargs), world_size=4, micro_batch_size=1,
                                 seq_len=8, device_type="cpu")  # fmt: skip


# --- what an outside review found (each failed before its fix) -------------------------------------------------


def test_estimate_refuses_compile_with_tp_as_accelerate_does():
    config = config_of(dist__tp__size=2, compute__compile=True)
    with pytest.raises(ValueError, match=r"compute.compile=True with dist.tp.size=2: dist.tp.plan splits .*lm_head"):
        torchacc.estimate_memory(llama_config(2), config, world_size=2, micro_batch_size=1, seq_len=8)


@pytest.mark.parametrize("compile_first", [False, True])
def test_planner_refusals_do_not_depend_on_the_candidate_order(compile_first):
    from torchacc.planning.candidates import Choice

    compiled = [Choice("", {"compute.compile": False}), Choice("compiled", {"compute.compile": True})]
    tp2 = [Choice("tp=2", {"dist.fsdp.size": 1, "dist.dp.size": None, "dist.tp.size": 2})]
    order = compiled[::-1] if compile_first else compiled
    plan = plan_layouts(llama_config(2), cluster=Cluster(num_gpus=2, gpus_per_node=2), micro_batch_size=1,
                        seq_len=8, axes=[lambda c: tp2, lambda c: order])  # fmt: skip
    assert [row.candidate.label for row in plan.layouts] == ["tp=2"]
    assert [(c.label, "compute.compile=True with dist.tp.size=2" in e) for c, e in plan.refused] == [
        ("tp=2, compiled", True)]  # fmt: skip


def test_tp_cp_and_pipeline_groups_stay_inside_nodes_and_ddp_is_no_candidate():
    from torchacc.planning.candidates import context_layouts, pipeline_layouts

    labels = [c.label for c in parallel_axis(Cluster(num_gpus=12, gpus_per_node=6))]
    assert "fsdp=6 x tp=2" in labels and not any("tp=4" in label for label in labels)  # 4 does not divide 6
    assert not any("cp=4" in c.label for c in context_layouts(Cluster(num_gpus=12, gpus_per_node=6)))
    # 3 nodes: no stage boundary may cut a node, so no pipeline of 2 or 4 stages
    assert pipeline_layouts(Cluster(num_gpus=24, gpus_per_node=8)) == []
    assert [c.label for c in pipeline_layouts(Cluster(num_gpus=32, gpus_per_node=8))] == [
        "pp=2 x fsdp=16", "pp=4 x fsdp=8"]  # fmt: skip
    # one GPU per node: replicas of fsdp=1 would be plain DDP, which the planner does not offer
    assert [c.label for c in parallel_axis(Cluster(num_gpus=2, gpus_per_node=1))] == ["fsdp=2"]


def test_offload_is_no_layout_of_its_own_where_accelerate_ignores_it():
    from torchacc.planning.candidates import Choice, offload_axis

    layouts = [Choice("fsdp=2", {"dist.fsdp.size": 2, "dist.tp.size": 1}),
               Choice("tp=2", {"dist.fsdp.size": 1, "dist.dp.size": None, "dist.tp.size": 2})]  # fmt: skip
    plan = plan_layouts(llama_config(2), cluster=Cluster(num_gpus=2, gpus_per_node=2), micro_batch_size=1,
                        seq_len=8, axes=[lambda c: layouts, offload_axis])  # fmt: skip
    assert sorted(row.candidate.label for row in plan.layouts) == ["fsdp=2", "fsdp=2, CPU offload", "tp=2"]


def test_a_base_config_that_cannot_be_is_one_error_not_an_empty_plan(tmp_path, capsys):
    config = config_of(compute__bf16=True, compute__fp16=True)
    with pytest.raises(ValueError, match=r"compute.bf16 and compute.fp16 are both True"):
        plan_layouts(llama_config(2), cluster=Cluster(num_gpus=2), micro_batch_size=1, seq_len=8, config=config)


class _BranchesOnValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = type("Config", (), {"vocab_size": 16})()
        self.embed = nn.Embedding(16, 8)

    def forward(self, input_ids, labels):
        hidden = self.embed(input_ids)
        if hidden.mean().item() > 0:  # a value: a fake tensor has none
            hidden = hidden * 2
        return hidden.float().pow(2).mean()


def test_a_forward_that_reads_values_is_a_clear_error():
    with pytest.raises(ValueError, match=r"_BranchesOnValues's forward reads tensor values .*\.item\(\).*track_memory"):
        torchacc.estimate_memory(_BranchesOnValues, torchacc.Config(), world_size=1, micro_batch_size=1, seq_len=4)


def test_planner_traces_an_int_reshard_after_forward_as_it_is():
    from torchacc.planning.candidates import Choice

    base = config_of(dist__fsdp__reshard_after_forward=2)
    layouts = [Choice("fsdp=8", {"dist.fsdp.size": 8, "dist.tp.size": 1})]
    plan = plan_layouts(llama_config(3), cluster=Cluster(num_gpus=8), micro_batch_size=2, seq_len=SEQ, config=base,
                        axes=[lambda c: layouts])  # fmt: skip
    (row,) = plan.layouts
    full = torchacc.estimate_memory(llama_config(3), row.config, world_size=8, micro_batch_size=2, seq_len=SEQ)
    assert row.estimate.peak == pytest.approx(full.peak, rel=0.05)


def test_the_sync_leaves_no_digest_weights_behind():
    from torchacc.distributed import _digest
    from torchacc.distributed.sync import sync_tensors

    with fake_process_group(world_size=2, rank=0):
        sync_tensors([torch.ones(70_000), torch.ones(3)], shard_of_rank=[0, 1])
    assert _digest._weights_cache == {} and _digest._weights.cache_info().currsize == 0


def test_a_checkpointed_step_is_estimated_like_the_real_one_at_long_sequences():
    # transformers checks the position ids for packed sequences when there is no KV cache (as under
    # checkpointing); on fake tensors it could not read them and built a [seq, seq] mask per layer: 2.5x the peak
    hf, seq = llama_config(2, max_position_embeddings=2048), 2048
    peaks = {}
    for checkpointed in (False, True):
        config = config_of(memory__gc=checkpointed)
        torch.manual_seed(0)
        model = torchacc.accelerate(transformers_model(hf), config=config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        ids = torch.randint(0, hf.vocab_size, (1, seq))
        for _ in range(2):  # the second step is the estimated one: the optimizer state exists from its start
            with torchacc.track_memory() as tracked:
                model(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
            optimizer.zero_grad()
        # the peak counts every tensor alive in the process (other tests' garbage too): keep the model's own
        held = [*model.parameters(), *(t for state in optimizer.state.values() for t in state.values())]
        others = tracked.baseline_bytes - sum(t.numel() * t.element_size() for t in held)
        step = {"world_size": 1, "micro_batch_size": 1, "seq_len": seq, "device_type": "cpu"}
        estimate = torchacc.estimate_memory(hf, config, **step)
        peaks[checkpointed] = (tracked.peak_bytes - others, estimate.peak)
    assert peaks[True][1] == pytest.approx(peaks[True][0], rel=0.02)
    assert peaks[False][1] == pytest.approx(peaks[False][0], rel=0.02)
    assert peaks[True][1] < 0.7 * peaks[False][1]


def transformers_model(hf_config):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(hf_config)


def test_a_base_config_with_a_tp_plan_of_its_own_is_planned():
    from torchacc.planning.candidates import Choice

    mlp = {"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}
    base = config_of(dist__tp__plan={f"model.layers.*.mlp.{name}": style for name, style in mlp.items()})
    tp2 = [Choice("tp=2", {"dist.fsdp.size": 1, "dist.dp.size": None, "dist.tp.size": 2})]
    plan = plan_layouts(llama_config(2), cluster=Cluster(num_gpus=2, gpus_per_node=2), micro_batch_size=1, seq_len=8,
                        config=base, axes=[lambda c: tp2])  # fmt: skip
    assert [row.candidate.label for row in plan.layouts] == ["tp=2"]


def test_an_offload_the_layout_ignores_is_dropped_only_beside_the_same_layout_without_it():
    from torchacc.planning.candidates import Choice

    base = config_of(memory__offload_params=True)  # custom axes without the offload axis
    tp2 = [Choice("tp=2", {"dist.fsdp.size": 1, "dist.dp.size": None, "dist.tp.size": 2})]
    plan = plan_layouts(llama_config(2), cluster=Cluster(num_gpus=2, gpus_per_node=2), micro_batch_size=1, seq_len=8,
                        config=base, axes=[lambda c: tp2])  # fmt: skip
    assert [row.candidate.label for row in plan.layouts] == ["tp=2"]


def test_the_packed_sequence_guard_nests_and_leaves_real_tensors_alone():
    from transformers import masking_utils

    from torchacc.planning.real_paths import unpacked_batches

    real = masking_utils.find_packed_sequence_indices
    packed = torch.tensor([[0, 1, 2, 0, 1]])  # two sequences packed in one row
    first, second = unpacked_batches(True), unpacked_batches(True)
    first.__enter__()
    second.__enter__()  # two fake steps that overlap (threads), leaving in the order they came
    first.__exit__(None, None, None)
    assert masking_utils.find_packed_sequence_indices(packed) is not None, "a real tensor is read as before"
    second.__exit__(None, None, None)
    assert masking_utils.find_packed_sequence_indices is real, "restored once the last one leaves"


def test_offload_with_every_block_checkpointed_scales_from_peaks_of_one_kind():
    # at 2 blocks the first block of the backward is also the one after the last: the 2- and 3-block traces peaked
    # at moments of different kinds, and their difference carried to 8 blocks gave negative activations
    from torchacc.planning.candidates import Choice

    axes = [lambda c: [Choice("fsdp=2", {"dist.fsdp.size": 2, "dist.tp.size": 1})],
            lambda c: [Choice("AC every block", {"memory.gc": True, "memory.gc_interval": 1})],
            lambda c: [Choice("CPU offload", {"memory.offload_params": True})]]  # fmt: skip
    odd = {"hidden_size": 120, "intermediate_size": 250, "num_attention_heads": 6, "num_key_value_heads": 3,
           "vocab_size": 1001, "max_position_embeddings": 64, "tie_word_embeddings": True}  # fmt: skip
    hf = llama_config(8, **odd)
    plan = plan_layouts(hf, cluster=Cluster(num_gpus=2), micro_batch_size=2, seq_len=64, bf16=True, axes=axes)
    (row,) = plan.layouts
    full = torchacc.estimate_memory(hf, row.config, world_size=2, micro_batch_size=2, seq_len=64)
    assert row.estimate.activations >= 0
    assert row.estimate.peak == pytest.approx(full.peak, rel=0.05)
