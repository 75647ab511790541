"""Bad input, one process: every wrong input raises an error that names the field or file and says how to fix it.

The table is complete on its own (some cases re-check what tests/unit covers). Each case is a function of a
``Ctx`` (a temporary directory and pytest's monkeypatch) that must raise ``exc`` matching ``match``.
Multi-rank behaviour of these errors (every rank raises the same one) is in test_rank_failures.py.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from _models import Block, TinyNet
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
)

import torchacc
from torchacc.checkpoint.state import FORMAT
from torchacc.cli import main
from torchacc.config import ComputeConfig
from torchacc.data import shard_dataloader
from torchacc.dist import env

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@dataclass
class Ctx:
    tmp: Path
    monkeypatch: pytest.MonkeyPatch


@dataclass
class Case:
    name: str
    exc: type[BaseException]
    match: str
    trigger: Callable[[Ctx], Any]


def config(**fields: Any) -> torchacc.Config:
    """A Config with dotted-path fields set by attribute, as a user would."""
    cfg = torchacc.Config()
    for path, value in fields.items():
        *parents, name = path.split("__")
        node = cfg
        for parent in parents:
            node = getattr(node, parent)
        setattr(node, name, value)
    return cfg


def validate(world_size: int = 4, **fields: Any) -> Callable[[Ctx], None]:
    return lambda ctx: config(**fields).validate(world_size)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def a_file(ctx: Ctx) -> Path:
    """A regular file, so that any path below it cannot be created, even by root."""
    return write(ctx.tmp / "a-file", "not a directory")


def samples(n: int = 8) -> list[torch.Tensor]:
    return [torch.full((16,), float(i)) for i in range(n)]


class Stream(IterableDataset):
    def __iter__(self):
        yield from samples()


def write_shard_set(
    directory: Path, ranks: dict[int, int], *, run_ids: dict[int, str] | None = None, name: str = "r{rank}.pth"
) -> str:
    """Hand-made per-rank files of a 2-parameter model: ``{rank: world_size}``; returns their glob.

    ``run_ids`` gives a rank's file a ``"run_id"`` (files without one are as saved before run ids existed);
    ``name`` is formatted with the rank and the world size.
    """
    full = torch.arange(8.0).reshape(4, 2)
    for rank, world in ranks.items():
        rows = 4 // world
        rows_here = full[rank * rows : (rank + 1) * rows].clone()
        tensors = {
            "w": {"kind": "param", "shape": [4, 2], "dtype": "torch.float32", "placements": ["shard:0"]},
            "b": {"kind": "param", "shape": [2], "dtype": "torch.float32", "placements": ["replicate"]},
        }
        tensors["w"].update(offset=[rank * rows, 0], local_shape=list(rows_here.shape))
        tensors["b"].update(offset=[0], local_shape=[2])
        mesh = {"shape": [world], "dim_names": ["fsdp"], "coordinate": [rank]}
        meta = {"format": FORMAT, "world_size": world, "rank": rank, "mesh": mesh, "tensors": tensors}
        if run_ids and rank in run_ids:
            meta["run_id"] = run_ids[rank]
        shard = {"model": {"w": rows_here, "b": torch.ones(2)}, "shard_metadata": meta}
        torch.save(shard, directory / name.format(rank=rank, world=world))
    return str(directory / name.format(rank="*", world="*"))


def write_blocks(directory: Path, blocks: list[tuple[list[int], list[int]]], *, name: str = "r{rank}.pth") -> str:
    """Hand-made per-rank files of one 4x2 tensor ``w`` cut into 2-D blocks: rank r holds ``blocks[r]`` =
    (offset, local shape), its values taken from the full tensor; returns the files' glob."""
    full = torch.arange(8.0).reshape(4, 2)
    world = len(blocks)
    for rank, (offset, local) in enumerate(blocks):
        piece = full[offset[0] : offset[0] + local[0], offset[1] : offset[1] + local[1]]
        piece = torch.cat([piece, torch.zeros(local[0] - piece.shape[0], piece.shape[1])])  # past the last row
        entry = {"kind": "param", "shape": [4, 2], "dtype": "torch.float32", "placements": ["shard:0", "shard:1"]}
        entry.update(offset=offset, local_shape=local)
        mesh = {"shape": [world], "dim_names": ["fsdp"], "coordinate": [rank]}
        entry["mesh"] = {"shape": [1, world], "dim_names": ["fsdp", "tp"], "coordinate": [0, rank]}
        meta = {"format": FORMAT, "world_size": world, "rank": rank, "mesh": mesh, "tensors": {"w": entry}}
        torch.save({"model": {"w": piece.clone()}, "shard_metadata": meta}, directory / name.format(rank=rank))
    return str(directory / name.format(rank="*"))


def consolidate_blocks(*blocks: tuple[list[int], list[int]]) -> Callable[[Ctx], Any]:
    return lambda ctx: torchacc.consolidate(write_blocks(ctx.tmp, list(blocks)))


def reshard_overlapping_rows(ctx: Ctx) -> None:
    write_blocks(ctx.tmp, [([0, 0], [2, 2]), ([1, 0], [2, 2])], name="rank-{rank}-of-2-model.pth")
    torchacc.reshard_checkpoint(ctx.tmp, ctx.tmp / "re", num_shards=1)


def consolidate_shards(ranks: dict[int, int]) -> Callable[[Ctx], Any]:
    return lambda ctx: torchacc.consolidate(write_shard_set(ctx.tmp, ranks))


def duplicate_shard(ctx: Ctx) -> None:
    pattern = write_shard_set(ctx.tmp, {0: 2, 1: 2})
    (ctx.tmp / "r1-copy.pth").write_bytes((ctx.tmp / "r1.pth").read_bytes())
    torchacc.consolidate(pattern)


def consolidate_into_a_shard_via_a_symlink(ctx: Ctx) -> None:
    write_shard_set(ctx.tmp, {0: 2, 1: 2})
    (ctx.tmp / "alias").symlink_to(ctx.tmp)
    torchacc.dist.fsdp.consolidate_sharded_model_checkpoints(
        ckpt_prefix=f"{ctx.tmp}/", ckpt_suffix="r*.pth", save_path=str(ctx.tmp / "alias" / "r1.pth")
    )


def reshard_into_the_source(ctx: Ctx) -> None:
    write_shard_set(ctx.tmp, {0: 2, 1: 2}, name="rank-{rank}-of-{world}-model.pth")
    torchacc.reshard_checkpoint(ctx.tmp, f"{ctx.tmp}/.", num_shards=2)


# --- trust review: configs that read wrongly, models FSDP2 cannot shard, tags and extras that load wrongly ---


def two_ranks_planned(model: torch.nn.Module, **fields: Any) -> Callable[[Ctx], Any]:
    """accelerate() as rank 0 of 2 would run it, up to the checks that precede every collective."""

    def trigger(ctx: Ctx) -> Any:
        ctx.monkeypatch.setenv("WORLD_SIZE", "2")
        return torchacc.accelerate(model, config=config(dist__fsdp__size=2, **fields))

    return trigger


class MixedDtypes(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.block.fc2.to(torch.bfloat16)
        self.head = torch.nn.Linear(16, 1)


class EmptyParameter(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.Parameter(torch.zeros(0))


class RunsCode:
    """A pickle payload: loading it would create a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


def numpy_in_extra(ctx: Ctx) -> None:
    import numpy

    torchacc.save_checkpoint(ctx.tmp / "ckpt", model=TinyNet(), extra={"rng": numpy.random.get_state()})


def damage_metadata(path: Path, edit: Callable[[dict], Any]) -> None:
    shard = torch.load(path, weights_only=True)
    edit(shard["shard_metadata"])
    torch.save(shard, path)


def damaged_metadata(edit: Callable[[dict], Any]) -> Callable[[Ctx], Any]:
    """Consolidate a shard set whose rank-1 file has ``edit`` applied to its ``shard_metadata``."""

    def trigger(ctx: Ctx) -> Any:
        pattern = write_shard_set(ctx.tmp, {0: 2, 1: 2})
        damage_metadata(ctx.tmp / "r1.pth", edit)
        return torchacc.consolidate(pattern)

    return trigger


def saved_checkpoint(ctx: Ctx, model: torch.nn.Module | None = None) -> Path:
    torchacc.save_checkpoint(ctx.tmp / "ckpt", model=model or TinyNet())
    return ctx.tmp / "ckpt"


def accelerated(ctx: Ctx) -> torch.nn.Module:
    return torchacc.accelerate(TinyNet())


def loader_state_mismatch(ctx: Ctx) -> None:
    saved = shard_dataloader(DataLoader(samples(), batch_size=2), num_replicas=1, rank=0, device=torch.device("cpu"))
    other = shard_dataloader(DataLoader(samples(), batch_size=4), num_replicas=1, rank=0, device=torch.device("cpu"))
    other.load_state_dict(saved.state_dict())


def dangling_latest(ctx: Ctx) -> None:
    directory = saved_checkpoint(ctx)
    write(directory / "latest", "checkpoint-9")
    torchacc.resume_latest(directory, TinyNet())


def strategy_dangling_latest(ctx: Ctx) -> None:
    directory = saved_checkpoint(ctx)
    write(directory / "latest", "global_step9")
    torchacc.FSDP2Strategy().load_ckpt(TinyNet(), directory)


def partial_torchrun_env(ctx: Ctx) -> None:
    ctx.monkeypatch.setenv("WORLD_SIZE", "2")
    env.init_distributed()


def non_integer_rank(ctx: Ctx) -> None:
    ctx.monkeypatch.setenv("RANK", "zero")
    env.rank()


def strategy_batch_sizes(ctx: Ctx) -> None:
    torchacc.FSDP2Strategy(micro_train_batch_size=2, train_batch_size=3).setup_environment()


def yaml_file(ctx: Ctx, data: Any) -> Path:
    return write(ctx.tmp / "run.yaml", yaml.safe_dump(data))


CASES = [
    # --- config values and cross-field rules (validate) ---
    Case(
        "bf16-and-fp16",
        ValueError,
        "compute.bf16 and compute.fp16 are both True.*set one to False",
        validate(compute__bf16=True, compute__fp16=True),
    ),
    Case(
        "fsdp-size-does-not-divide-world",
        ValueError,
        r"dist.fsdp.size=3 does not divide world size 4; choose a divisor of 4: 1, 2, 4",
        validate(dist__fsdp__size=3),
    ),
    Case(
        "fsdp-size-exceeds-world",
        ValueError,
        "dist.fsdp.size=8 exceeds world size 4; choose a divisor",
        validate(dist__fsdp__size=8),
    ),
    Case(
        "fsdp-size-zero",
        ValueError,
        "dist.fsdp.size must be >= 1, got 0; use 1 to disable sharding",
        validate(dist__fsdp__size=0),
    ),
    Case(
        "dp-times-fsdp-is-not-world",
        ValueError,
        r"dist.dp.size \* dist.fsdp.size must equal world size 4.*"
        r"set dist.dp.size=2",
        validate(dist__fsdp__size=2, dist__dp__size=3),
    ),
    Case(
        "topology-not-a-permutation",
        ValueError,
        r"dist.topology must be a permutation of \['dp', 'fsdp'\]",
        validate(dist__topology=["dp", "tp"]),
    ),
    Case(
        "timeout-not-positive",
        ValueError,
        "dist.timeout must be > 0 seconds, got 0.0; the default is 1800",
        validate(dist__timeout=0.0),
    ),
    Case(
        "gc-cnt-zero",
        ValueError,
        "memory.gc_cnt must be None or >= 1, got 0",
        validate(memory__gc=True, memory__gc_cnt=0, dist__fsdp__wrap_layer_cls={"Block"}),
    ),
    Case(
        "gc-cls-without-gc",
        ValueError,
        "memory.gc_cls={'Block'} is set but memory.gc is False; set memory.gc=True",
        validate(memory__gc_cls={"Block"}),
    ),
    Case("gc-interval-zero", ValueError, "memory.gc_interval must be >= 1, got 0", validate(memory__gc_interval=0)),
    Case(
        "gc-with-nothing-to-checkpoint",
        ValueError,
        "nothing would be checkpointed; set one of them",
        validate(memory__gc=True),
    ),
    Case(
        "negative-prefetch",
        ValueError,
        "dist.fsdp.forward_prefetch must be >= 0, got -1",
        validate(dist__fsdp__forward_prefetch=-1),
    ),
    Case(
        "unknown-reduce-dtype",
        ValueError,
        "dist.fsdp.reduce_dtype='int8' is not supported; use 'float32'",
        validate(dist__fsdp__reduce_dtype="int8"),
    ),
    Case(
        "reshard-group-not-a-divisor",
        ValueError,
        "dist.fsdp.reshard_after_forward=3 must be True, False or a "
        "divisor of dist.fsdp.size=4.*possible values: \\[2\\]",
        validate(dist__fsdp__size=4, dist__fsdp__reshard_after_forward=3),
    ),
    Case("world-size-argument", ValueError, "world_size must be an int >= 1, got 0", validate(world_size=0)),
    # --- config types and keys, from code, dicts, YAML and the command line ---
    Case(
        "wrong-type-assigned",
        ValueError,
        r"dist.fsdp.size: expected int, got '2' \(str\); use an integer",
        validate(dist__fsdp__size="2"),
    ),
    Case(
        "wrong-type-constructed",
        ValueError,
        r"compute.bf16: expected bool, got 'yes' \(str\); use True or False",
        lambda ctx: ComputeConfig(bf16="yes"),
    ),
    Case(
        "typo-in-attribute",
        AttributeError,
        "compute.bf61: unknown key.*did you mean compute.bf16",
        lambda ctx: setattr(torchacc.Config().compute, "bf61", True),
    ),
    Case(
        "unknown-key-in-dict",
        ValueError,
        "dist.fsdp.sise: unknown key; valid keys under dist.fsdp.*did you mean dist.fsdp.size",
        lambda ctx: torchacc.Config.from_dict({"dist": {"fsdp": {"sise": 2}}}),
    ),
    Case(
        "section-not-a-mapping",
        ValueError,
        "dist: expected a mapping with keys pp, dp, fsdp",
        lambda ctx: torchacc.Config.from_dict({"dist": 3}),
    ),
    Case(
        "unknown-key-in-yaml",
        ValueError,
        r"compute.bf61: unknown key.*did you mean compute.bf16\?.*\(in .*run.yaml\)",
        lambda ctx: torchacc.Config.from_yaml(yaml_file(ctx, {"compute": {"bf61": True}})),
    ),
    Case(
        "wrong-type-in-yaml",
        ValueError,
        r"dist.fsdp.size: expected int, got 'two'.*\(in .*run.yaml\)",
        lambda ctx: torchacc.Config.from_yaml(yaml_file(ctx, {"dist": {"fsdp": {"size": "two"}}})),
    ),
    Case(
        "missing-yaml-file",
        FileNotFoundError,
        "nope.yaml",
        lambda ctx: torchacc.Config.from_yaml(ctx.tmp / "nope.yaml"),
    ),
    Case(
        "unknown-key-on-cli",
        ValueError,
        "compte: unknown key; valid keys at the top level.*did you mean compute",
        lambda ctx: torchacc.Config.from_cli(["compte.bf16=true"]),
    ),
    Case(
        "cli-argument-not-key-value",
        ValueError,
        "'dist.fsdp.size': expected KEY=VALUE such as dist.fsdp.size=2",
        lambda ctx: torchacc.Config.from_cli(["dist.fsdp.size"]),
    ),
    Case(
        "cli-value-not-yaml",
        ValueError,
        re.escape("'dist.fsdp.size=[1,': the value is not valid YAML"),
        lambda ctx: torchacc.Config.from_cli(["dist.fsdp.size=[1,"]),
    ),
    # --- accelerate(): model, dataloader, optimizer ---
    Case(
        "wrap-class-not-in-model",
        ValueError,
        "dist.fsdp.wrap_layer_cls: no module of class 'GPT2Block' in TinyNet; "
        "the model contains: Block, Linear, ModuleList, TinyNet; set dist.fsdp.wrap_layer_cls to names",
        lambda ctx: torchacc.accelerate(TinyNet(), config=config(dist__fsdp__wrap_layer_cls={"GPT2Block"})),
    ),
    Case(
        "checkpoint-class-not-in-model",
        ValueError,
        "memory.gc_cls: no module of class 'Nope' in TinyNet",
        lambda ctx: torchacc.accelerate(TinyNet(), config=config(memory__gc=True, memory__gc_cls={"Nope"})),
    ),
    Case(
        "model-not-a-module",
        TypeError,
        "model must be a torch.nn.Module, got str",
        lambda ctx: torchacc.accelerate("model"),
    ),
    Case(
        "config-not-a-config",
        TypeError,
        "config must be a torchacc.Config, got dict; build one with",
        lambda ctx: torchacc.accelerate(TinyNet(), config={"compute": {}}),
    ),
    Case(
        "dataloader-not-a-dataloader",
        TypeError,
        r"dataloader must be a torch.utils.data.DataLoader or None, got "
        r"list; wrap your dataset: DataLoader\(dataset",
        lambda ctx: torchacc.accelerate(TinyNet(), samples()),
    ),
    Case(
        "iterable-dataset",
        ValueError,
        r"cannot split an iterable dataset \(Stream\).*config.dataloader.shard=False",
        lambda ctx: torchacc.accelerate(TinyNet(), DataLoader(Stream(), batch_size=2)),
    ),
    Case(
        "custom-sampler",
        ValueError,
        r"custom sampler \(SubsetRandomSampler\). torchacc replaces the sampler.*shard=False",
        lambda ctx: torchacc.accelerate(TinyNet(), DataLoader(samples(), sampler=SubsetRandomSampler([0, 1]))),
    ),
    Case(
        "sampler-over-part-of-the-dataset",
        ValueError,
        r"custom sampler \(SequentialSampler\)",
        lambda ctx: torchacc.accelerate(TinyNet(), DataLoader(samples(), sampler=SequentialSampler(range(3)))),
    ),
    Case(
        "optimizer-of-another-model",
        ValueError,
        "not parameters of TinyNet.*build the optimizer from model.param",
        lambda ctx: torchacc.accelerate(TinyNet(), optimizer=torch.optim.SGD(TinyNet().parameters(), lr=0.1)),
    ),
    Case(
        "model-accelerated-twice",
        ValueError,
        "TinyNet is already accelerated.*once per model",
        lambda ctx: torchacc.accelerate(accelerated(ctx)),
    ),
    Case(
        "compile-without-wrap-classes",
        ValueError,
        "compute.compile=True compiles each dist.fsdp.wrap_layer_cls block; set wrap_layer_cls too",
        lambda ctx: torchacc.accelerate(TinyNet(), config=config(compute__compile=True)),
    ),
    Case(
        "dataloader-state-of-another-loader",
        ValueError,
        r"batch_size \(saved 2, current 4\).*Build the DataLoader",
        loader_state_mismatch,
    ),
    # --- the launch environment ---
    Case(
        "partial-torchrun-environment",
        ValueError,
        "WORLD_SIZE is set but RANK, MASTER_ADDR, MASTER_PORT is not: launch with `torchrun",
        partial_torchrun_env,
    ),
    Case(
        "non-integer-rank",
        ValueError,
        "environment variable RANK='zero' is not an integer; launch with torchrun",
        non_integer_rank,
    ),
    # --- checkpoint files and directories ---
    Case(
        "load-missing-file",
        FileNotFoundError,
        "no checkpoint file at .*nope.pth",
        lambda ctx: torchacc.load(ctx.tmp / "nope.pth"),
    ),
    Case(
        "load-not-a-checkpoint",
        ValueError,
        r"notes.txt: cannot be read as a torch checkpoint \(truncated or corrupt",
        lambda ctx: torchacc.load(write(ctx.tmp / "notes.txt", "hello")),
    ),
    Case(
        "save-into-missing-directory",
        RuntimeError,
        r"the directory '.*/no/such' does not exist; create it first "
        r"\(os.makedirs\)",
        lambda ctx: torchacc.save({"x": torch.ones(1)}, ctx.tmp / "no" / "such" / "m.pth"),
    ),
    Case(
        "save-below-a-file",
        RuntimeError,
        "torchacc.save.*a-file/m.pth.*'.*a-file' is a file, not a directory, so .*a-file/m.pth' cannot be written; fix",
        lambda ctx: torchacc.save({"x": torch.ones(1)}, a_file(ctx) / "m.pth"),
    ),
    Case(
        "save-checkpoint-below-a-file",
        RuntimeError,
        r"save_checkpoint\('.*a-file/ckpt'\) failed: '.*a-file' is a file, not a directory, so .*a-file/ckpt' "
        "cannot be written; fix the path",
        lambda ctx: torchacc.save_checkpoint(a_file(ctx) / "ckpt", model=TinyNet()),
    ),
    Case(
        "save-checkpoint-tag-with-slash",
        ValueError,
        "tag='../x' is not a plain directory name; use e.g. 'checkpoint-7'",
        lambda ctx: torchacc.save_checkpoint(ctx.tmp, model=TinyNet(), tag="../x"),
    ),
    Case(
        "save-checkpoint-plain-dataloader",
        ValueError,
        "dataloader= must have state_dict.*got DataLoader; pass the loader returned by torchacc.accelerate",
        lambda ctx: torchacc.save_checkpoint(ctx.tmp, model=TinyNet(), dataloader=DataLoader(samples())),
    ),
    Case(
        "save-checkpoint-extra-not-a-dict",
        ValueError,
        "extra= must be a dict of tensors, containers, numbers, strings; got list",
        lambda ctx: torchacc.save_checkpoint(ctx.tmp, model=TinyNet(), extra=[1]),
    ),
    Case(
        "load-checkpoint-missing-directory",
        FileNotFoundError,
        "no complete checkpoint at .*nowhere.*pass the directory given to save_checkpoint",
        lambda ctx: torchacc.load_checkpoint(ctx.tmp / "nowhere", model=TinyNet()),
    ),
    Case(
        "load-checkpoint-into-another-model",
        ValueError,
        r"the model does not match the checkpoint: missing \[\], "
        r"unexpected \['blocks.2.fc1.bias'",
        lambda ctx: torchacc.load_checkpoint(saved_checkpoint(ctx), model=TinyNet(num_blocks=2)),
    ),
    Case(
        "load-checkpoint-optimizer-not-saved",
        ValueError,
        "no optimizer state was saved in this checkpoint; do not pass optimizer=",
        lambda ctx: torchacc.load_checkpoint(
            saved_checkpoint(ctx), model=(m := TinyNet()), optimizer=torch.optim.SGD(m.parameters(), lr=0.1)
        ),
    ),
    Case(
        "resume-from-dangling-latest",
        FileNotFoundError,
        "latest names 'checkpoint-9', which is not a complete checkpoint.*load an earlier checkpoint-N",
        dangling_latest,
    ),
    Case(
        "strategy-resume-from-dangling-latest",
        FileNotFoundError,
        "latest names 'global_step9', which is not a complete checkpoint",
        strategy_dangling_latest,
    ),
    # --- per-rank shard sets (offline consolidation) ---
    Case(
        "shard-set-missing-rank",
        ValueError,
        r"missing rank\(s\) \[1\] of a 2-rank checkpoint.*copy the missing",
        consolidate_shards({0: 2}),
    ),
    Case(
        "shard-set-duplicate-rank",
        ValueError,
        "duplicate rank 1: .*r1-copy.pth and .*r1.pth; keep one run's files",
        duplicate_shard,
    ),
    Case(
        "shard-set-foreign-rank",
        ValueError,
        "r2.pth: rank 2 does not belong to a 2-rank checkpoint.*remove it",
        consolidate_shards({0: 2, 1: 2, 2: 2}),
    ),
    Case(
        "shard-set-mixed-world-sizes",
        ValueError,
        "mixed world sizes: .* is from a 2-rank run but .* is from a 1-rank run; keep one run's files per directory",
        consolidate_shards({0: 2, 1: 1}),
    ),
    # tiling: pieces that add up to the right volume inside the bounds, but overlap and so leave a gap
    Case(
        "shard-set-overlapping-rows",
        ValueError,
        r"w: the pieces in .*r0\.pth \(block \[0:2, 0:2\]\) and .*r1\.pth \(block \[1:3, 0:2\]\) overlap on "
        r"\[1:2, 0:2\].*re-save the shards",
        consolidate_blocks(([0, 0], [2, 2]), ([1, 0], [2, 2])),
    ),
    Case(
        "shard-set-overlapping-2d-blocks",
        ValueError,
        r"w: the pieces in .*r1\.pth \(block \[0:2, 1:2\]\) and .*r3\.pth \(block \[1:3, 1:2\]\) overlap on "
        r"\[1:2, 1:2\]",
        consolidate_blocks(([0, 0], [2, 1]), ([0, 1], [2, 1]), ([2, 0], [2, 1]), ([1, 1], [2, 1])),
    ),
    Case(
        "shard-set-gap-behind-a-replica",
        ValueError,
        r"w: no piece in .* covers \[3:4, 0:2\] of its full shape \[4, 2\].*re-save the shards",
        consolidate_blocks(([0, 0], [2, 2]), ([0, 0], [2, 2]), ([2, 0], [1, 2])),
    ),
    Case(
        "shard-set-piece-outside-the-tensor",
        ValueError,
        r"w: the piece in .*r1\.pth \(block \[3:5, 0:2\]\) reaches outside its full shape \[4, 2\]",
        consolidate_blocks(([0, 0], [2, 2]), ([3, 0], [2, 2])),
    ),
    Case(
        "reshard-overlapping-rows",
        ValueError,
        r"w: the pieces in .*rank-0-of-2-model\.pth \(block \[0:2, 0:2\]\) and .*rank-1-of-2-model\.pth",
        reshard_overlapping_rows,
    ),
    Case(
        "shard-set-no-files",
        ValueError,
        "no checkpoint files match .*nothing-.*; check the directory",
        lambda ctx: torchacc.consolidate(str(ctx.tmp / "nothing-*.pth")),
    ),
    Case(
        "consolidate-unknown-format",
        ValueError,
        "fmt='onnx' is not supported; use 'torch' or 'safetensors'",
        lambda ctx: torchacc.consolidate("x", fmt="onnx"),
    ),
    # --- the strategy API and collectives ---
    Case(
        "strategy-unknown-sharding",
        ValueError,
        "sharding_strategy='FOO' is not one of FULL_SHARD",
        lambda ctx: torchacc.FSDP2Strategy(sharding_strategy="FOO"),
    ),
    Case(
        "strategy-batch-sizes-do-not-divide",
        ValueError,
        "train_batch_size=3 is not a multiple of micro_train_batch_size=2.*choose a multiple",
        strategy_batch_sizes,
    ),
    Case(
        "strategy-tensor-parallel",
        ValueError,
        "tensor_parallel_size must be an int >= 1, got 0; use a positive count",
        lambda ctx: torchacc.FSDP2Strategy(tensor_parallel_size=0),
    ),
    Case(
        "all-reduce-unknown-op",
        ValueError,
        "op='avg' is not supported; use one of 'sum', 'mean'",
        lambda ctx: torchacc.dist.all_reduce(torch.ones(1), op="avg"),
    ),
    Case(
        "batch-sampler-argument",
        ValueError,
        r"custom batch_sampler \(BatchSampler\).*batch_size is None.*batch_size= and shuffle=.*shard=False",
        lambda ctx: torchacc.accelerate(
            TinyNet(), DataLoader(samples(), batch_sampler=BatchSampler(RandomSampler(samples()), 4, False))
        ),
    ),
    # --- offline consolidation: outputs that are inputs, shards of two runs, damaged metadata ---
    Case(
        "consolidate-out-is-an-input-shard",
        ValueError,
        r"the output path '.*r0.pth' is the input shard file .*r0.pth: writing it would destroy the shards; "
        "choose another output path",
        lambda ctx: torchacc.consolidate(write_shard_set(ctx.tmp, {0: 2, 1: 2}), out=ctx.tmp / "r0.pth"),
    ),
    Case(
        "consolidate-save-path-is-an-input-shard-via-a-symlink",
        ValueError,
        r"the output path '.*alias/r1.pth' is the input shard file .*r1.pth.*choose another output path",
        consolidate_into_a_shard_via_a_symlink,
    ),
    Case(
        "reshard-into-its-source-directory",
        ValueError,
        r"the output directory '.*/\.' is the source directory .*: the resharded files would replace "
        r".*rank-0-of-2-model.pth.*choose another output directory",
        reshard_into_the_source,
    ),
    Case(
        "shard-set-of-two-runs",
        ValueError,
        "shards of different training runs: .*r0.pth is from run 'run-a' but .*r1.pth is from run 'run-b'; "
        "keep one run's files per directory, or narrow the pattern",
        lambda ctx: torchacc.consolidate(write_shard_set(ctx.tmp, {0: 2, 1: 2}, run_ids={0: "run-a", 1: "run-b"})),
    ),
    Case(
        "shard-set-run-id-beside-none",
        ValueError,
        "shards of different training runs: .*r0.pth is from a run with no run id .* but .*r1.pth is from run 'run-b'",
        lambda ctx: torchacc.consolidate(write_shard_set(ctx.tmp, {0: 2, 1: 2}, run_ids={1: "run-b"})),
    ),
    Case(
        "shard-metadata-without-tensors",
        ValueError,
        r"r1.pth: shard_metadata is damaged: it has no 'tensors'; re-save the shards with torchacc.save\(.*"
        r"model.get_shard_metadata\(\).*master_only=False\)",
        damaged_metadata(lambda meta: meta.pop("tensors")),
    ),
    Case(
        "shard-metadata-entry-without-offset",
        ValueError,
        r"r1.pth: shard_metadata is damaged: tensors\['w'\] has no 'offset'; re-save the shards",
        damaged_metadata(lambda meta: meta["tensors"]["w"].pop("offset")),
    ),
    Case(
        "shard-metadata-rank-not-an-int",
        ValueError,
        r"r1.pth: shard_metadata is damaged: 'rank' is '1' \(str\), expected an int; re-save the shards",
        damaged_metadata(lambda meta: meta.update(rank="1")),
    ),
    Case(
        "yaml-set-literal-on-the-command-line",
        ValueError,
        r"dist.fsdp.wrap_layer_cls: got \{GPT2Block\}, which YAML reads as a mapping, not a set; write a YAML "
        r"list: \[GPT2Block\] \(on the command line: dist.fsdp.wrap_layer_cls=\[GPT2Block\]\)",
        lambda ctx: torchacc.Config.from_cli(["dist.fsdp.wrap_layer_cls={GPT2Block}"]),
    ),
    Case(
        "yaml-set-literal-in-a-file",
        ValueError,
        r"dist.fsdp.wrap_layer_cls: got \{GPT2Block\}, which YAML reads as a mapping.*\(in .*set.yaml\)",
        lambda ctx: torchacc.Config.from_yaml(
            write(ctx.tmp / "set.yaml", "dist:\n  fsdp:\n    wrap_layer_cls: {GPT2Block}\n")
        ),
    ),
    Case(
        "yaml-file-holding-a-scalar",
        ValueError,
        r"config: the file holds 'fsdp' \(str\), not a mapping of sections; write e.g. 'dist: .*\(in .*scalar.yaml\)",
        lambda ctx: torchacc.Config.from_yaml(write(ctx.tmp / "scalar.yaml", "fsdp\n")),
    ),
    Case(
        "timeout-infinite",
        ValueError,
        "dist.timeout must be a finite number of seconds, got inf; .* use e.g. 1800.0",
        validate(dist__timeout=float("inf")),
    ),
    Case(
        "timeout-nan",
        ValueError,
        "dist.timeout must be a finite number of seconds, got nan",
        validate(dist__timeout=float("nan")),
    ),
    Case(
        "mixed-dtypes-in-one-fsdp-unit",
        ValueError,
        r"the FSDP unit 'block' holds parameters of different dtypes: float32 \(block.fc1.weight\), bfloat16 "
        r"\(block.fc2.weight\);.*add the odd submodule's class to dist.fsdp.wrap_layer_cls",
        two_ranks_planned(MixedDtypes(), dist__fsdp__wrap_layer_cls={"Block"}),
    ),
    Case(
        "zero-element-parameter",
        ValueError,
        r"parameter 'unused' has no elements \(shape \(0,\)\), which FSDP2 cannot shard; remove it, or register it "
        "as a buffer",
        two_ranks_planned(EmptyParameter(), dist__fsdp__wrap_layer_cls={"Block"}),
    ),
    Case(
        "checkpoint-tag-with-surrounding-whitespace",
        ValueError,
        r"tag='final ' is not a plain directory name; .*no surrounding whitespace",
        lambda ctx: torchacc.save_checkpoint(ctx.tmp / "ckpt", model=TinyNet(), tag="final "),
    ),
    Case(
        "checkpoint-extra-that-would-not-load-safely",
        ValueError,
        r"extra= holds values that could not be loaded back without running code .*torch.from_numpy",
        numpy_in_extra,
    ),
    Case(
        "torchacc-load-of-pickled-code",
        ValueError,
        r"code.pth: refused to load: it holds pickled objects that could run code .*weights_only=False",
        lambda ctx: (
            torch.save({"x": RunsCode(ctx.tmp / "ran")}, ctx.tmp / "code.pth"),
            torchacc.load(ctx.tmp / "code.pth"),
        ),
    ),
    Case(
        "fsdp-size-two-without-torchrun",
        ValueError,
        r"dist.fsdp.size=2 asks for 2 processes, but this one was not started by torchrun and runs alone; launch it "
        r"with `torchrun --nproc_per_node=2 .*`, or set dist.fsdp.size=1",
        lambda ctx: torchacc.accelerate(TinyNet(), config=config(dist__fsdp__size=2)),
    ),
]


def test_the_table_has_at_least_30_distinct_cases():
    assert len({case.name for case in CASES}) == len(CASES) >= 30


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_bad_input_is_named_with_a_fix(case, tmp_path, monkeypatch):
    with pytest.raises(case.exc, match=case.match):
        case.trigger(Ctx(tmp_path, monkeypatch))


def test_a_consistent_hand_made_shard_set_consolidates(tmp_path):
    """The shard-set cases above fail for the reason named, not because the hand-made files are malformed."""
    full = torchacc.consolidate(write_shard_set(tmp_path, {0: 2, 1: 2}))["model"]
    assert torch.equal(full["w"], torch.arange(8.0).reshape(4, 2))
    grid = [([0, 0], [2, 1]), ([0, 1], [2, 1]), ([2, 0], [2, 1]), ([2, 1], [2, 1]), ([0, 1], [2, 1])]  # a replica
    full = torchacc.consolidate(write_blocks(tmp_path, grid, name="grid{rank}.pth"))["model"]
    assert torch.equal(full["w"], torch.arange(8.0).reshape(4, 2))


@pytest.mark.parametrize("damage", ["out-is-an-input", "metadata-without-tensors"])
def test_the_cli_refuses_bad_shards_in_one_line_and_writes_nothing(tmp_path, capsys, damage):
    write_shard_set(tmp_path, {0: 2, 1: 2})
    args = ["consolidate", "--ckpt-dir", str(tmp_path), "--pattern", "r*.pth", "--quiet"]
    if damage == "out-is-an-input":
        args += ["--out", str(tmp_path / "r0.pth")]
        expected = "is the input shard file"
    else:
        damage_metadata(tmp_path / "r1.pth", lambda meta: meta.pop("tensors"))
        expected = "shard_metadata is damaged: it has no 'tensors'"
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    assert main(args) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("torchacc: error: ") and captured.err.count("\n") == 1, captured.err
    assert expected in captured.err and "Traceback" not in captured.out + captured.err
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == before


def test_one_run_s_shards_consolidate_and_resharding_keeps_the_run_id(tmp_path):
    write_shard_set(tmp_path, {0: 2, 1: 2}, run_ids={0: "run-a", 1: "run-a"}, name="rank-{rank}-of-{world}-model.pth")
    full = torchacc.consolidate(str(tmp_path / "rank-*-of-2-model.pth"))["model"]
    assert torch.equal(full["w"], torch.arange(8.0).reshape(4, 2))
    for path in torchacc.reshard_checkpoint(tmp_path, tmp_path / "re", num_shards=3):
        assert torch.load(path, weights_only=True)["shard_metadata"]["run_id"] == "run-a"
