"""Unit tests for torchacc.config: defaults, round trips, every error message, and the surface snapshot."""

import dataclasses
import re
import sys
import typing

import pytest

from torchacc import config as config_module
from torchacc.config import (
    ComputeConfig,
    Config,
    CPConfig,
    DataLoaderConfig,
    DistConfig,
    DPConfig,
    FSDPConfig,
    MemoryConfig,
    MetricsConfig,
    PPConfig,
    field_docs,
)

ALL_CLASSES = [
    Config,
    ComputeConfig,
    MemoryConfig,
    DPConfig,
    FSDPConfig,
    PPConfig,
    CPConfig,
    DistConfig,
    DataLoaderConfig,
    MetricsConfig,
]


def _custom() -> Config:
    """A config with every section moved off its defaults."""
    cfg = Config()
    cfg.compute.bf16 = True
    cfg.memory.gc = True
    cfg.memory.gc_cls = {"MLP", "Attention"}
    cfg.memory.gc_cnt = 3
    cfg.dist.dp.size = 2
    cfg.dist.fsdp.size = 4
    cfg.dist.fsdp.wrap_layer_cls = {"GPT2Block", "Embedding"}
    cfg.dist.fsdp.reshard_after_forward = False
    cfg.dist.topology = ["fsdp", "dp"]
    cfg.dist.timeout = 60.0
    cfg.dataloader.shuffle = False
    cfg.dataloader.seed = 7
    cfg.dataloader.prefetch = False
    return cfg


# ---- defaults and round trips ----


def test_defaults():
    cfg = Config()
    assert (cfg.compute.bf16, cfg.compute.fp16) == (False, False)
    assert (cfg.memory.gc, cfg.memory.gc_cls, cfg.memory.gc_cnt) == (False, set(), None)
    assert cfg.dist.dp.size is None
    assert cfg.dist.fsdp == FSDPConfig(
        size=1, wrap_layer_cls=set(), reshard_after_forward=True, sync_module_states=True
    )
    assert cfg.dist.topology == ["dp", "fsdp"]
    assert cfg.dist.timeout == 1800.0
    assert cfg.dataloader == DataLoaderConfig(shuffle=None, drop_last=None, seed=0, prefetch=True, shard=True)
    cfg.validate(world_size=1)
    # Mutable defaults are not shared between instances.
    Config().dist.topology.append("x")
    assert Config().dist.topology == ["dp", "fsdp"]


def test_dict_round_trip():
    cfg = _custom()
    d = cfg.to_dict()
    assert d["dist"]["fsdp"]["wrap_layer_cls"] == ["Embedding", "GPT2Block"]  # sets become sorted lists
    assert d["memory"]["gc_cls"] == ["Attention", "MLP"]
    back = Config.from_dict(d)
    assert back == cfg
    assert back.dist.fsdp.wrap_layer_cls == {"GPT2Block", "Embedding"}
    assert Config.from_dict({}) == Config()


def test_from_dict_accepts_sets_and_partial_sections():
    cfg = Config.from_dict({"dist": {"fsdp": {"size": 2, "wrap_layer_cls": {"GPT2Block"}}}})
    assert cfg.dist.fsdp.size == 2
    assert cfg.dist.fsdp.wrap_layer_cls == {"GPT2Block"}
    assert cfg.dist.fsdp.reshard_after_forward is True
    assert cfg.dist.timeout == 1800.0


def test_yaml_round_trip(tmp_path):
    cfg = _custom()
    text = cfg.to_yaml()
    assert "!!" not in text and "set" not in text  # plain YAML, no Python tags
    assert "- Embedding\n    - GPT2Block" in text
    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert Config.from_yaml(path) == cfg
    assert Config.from_yaml(str(path)) == cfg


def test_empty_yaml_gives_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert Config.from_yaml(path) == Config()


def test_from_cli_overrides():
    cfg = Config.from_cli(
        [
            "dist.fsdp.size=2",
            "compute.bf16=true",
            "dist.fsdp.wrap_layer_cls=[GPT2Block,GPT2MLP]",
            "dist.timeout=60",
            "dataloader.shuffle=false",
            "dist.dp.size=null",
        ]
    )
    assert cfg.dist.fsdp.size == 2
    assert cfg.compute.bf16 is True
    assert cfg.dist.fsdp.wrap_layer_cls == {"GPT2Block", "GPT2MLP"}
    assert isinstance(cfg.dist.timeout, float) and cfg.dist.timeout == 60.0
    assert cfg.dataloader.shuffle is False
    assert cfg.dist.dp.size is None


def test_from_cli_layers_base_then_files_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("dist:\n  fsdp:\n    size: 4\n    wrap_layer_cls: [GPT2Block]\ncompute:\n  bf16: true\n")
    base = Config()
    base.dataloader.seed = 5
    base.dist.fsdp.size = 8
    # The override stands before the file but still wins over it.
    cfg = Config.from_cli(["dist.fsdp.size=2", f"config={path}"], base=base)
    assert cfg.dataloader.seed == 5  # from base
    assert cfg.compute.bf16 is True  # from the file
    assert cfg.dist.fsdp.wrap_layer_cls == {"GPT2Block"}  # from the file
    assert cfg.dist.fsdp.size == 2  # from the override
    assert base.dist.fsdp.size == 8  # base is not modified


def test_from_cli_reads_sys_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py", "compute.fp16=true"])
    assert Config.from_cli().compute.fp16 is True
    assert Config.from_cli([]) == Config()


@pytest.mark.parametrize("arg", ["dist.fsdp.size", "--dist.fsdp.size", "=2", "dist..size=2"])
def test_from_cli_rejects_malformed_argument(arg):
    with pytest.raises(ValueError, match=re.escape(f"{arg!r}: expected KEY=VALUE such as dist.fsdp.size=2")):
        Config.from_cli([arg])


def test_from_cli_rejects_unparsable_value():
    with pytest.raises(ValueError, match=re.escape("'dist.fsdp.size=[1,': the value is not valid YAML")):
        Config.from_cli(["dist.fsdp.size=[1,"])


def test_from_cli_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        Config.from_cli([f"config={tmp_path / 'missing.yaml'}"])


# ---- TorchAcc-style use ----


def test_torchacc_style_assignment_then_validate():
    cfg = Config()
    cfg.compute.bf16 = True
    cfg.memory.gc = True
    cfg.dist.fsdp.size = 4
    cfg.dist.fsdp.wrap_layer_cls = ["GPT2Block"]  # a list is accepted and normalized to a set
    cfg.dist.timeout = 600  # an int is accepted for a float field
    cfg.validate(world_size=8)
    assert cfg.dist.fsdp.wrap_layer_cls == {"GPT2Block"}
    assert isinstance(cfg.dist.timeout, float)
    assert cfg.resolved_dp_size(8) == 2
    cfg.dist.dp.size = 2
    assert cfg.resolved_dp_size(8) == 2


@pytest.mark.parametrize(
    ("obj", "attr"),
    [(Config().compute, "bf61"), (Config().dist.fsdp, "wrap_layer_class"), (Config(), "computes")],
)
def test_slots_reject_typos(obj, attr):
    with pytest.raises(AttributeError):
        setattr(obj, attr, True)


def test_constructors_are_keyword_only():
    with pytest.raises(TypeError):
        FSDPConfig(2)  # type: ignore[misc]


# ---- every validate() error ----


def _set(path: str, value):
    def mutate(cfg: Config) -> None:
        *parents, name = path.split(".")
        node = cfg
        for part in parents:
            node = getattr(node, part)
        setattr(node, name, value)

    return mutate


def _chain(*mutations):
    def mutate(cfg: Config) -> None:
        for m in mutations:
            m(cfg)

    return mutate


VALIDATE_ERRORS = [
    (
        _chain(_set("compute.bf16", True), _set("compute.fp16", True)),
        4,
        "compute.bf16 and compute.fp16 are both True, but they exclude each other; set one to False",
    ),
    (_set("dist.fsdp.size", 0), 4, "dist.fsdp.size must be >= 1, got 0; use 1 to disable sharding"),
    (_set("dist.fsdp.size", 3), 4, "dist.fsdp.size=3 does not divide world size 4; choose a divisor of 4: 1, 2, 4"),
    (_set("dist.fsdp.size", 8), 4, "dist.fsdp.size=8 exceeds world size 4; choose a divisor of 4: 1, 2, 4"),
    (_set("dist.dp.size", 0), 4, "dist.dp.size must be None or >= 1, got 0; leave it None to infer it"),
    (_set("dist.cp.size", 0), 4, "dist.cp.size must be >= 1, got 0; use 1 to disable context parallelism"),
    (
        _set("dist.cp.size", 3),
        4,
        "dist.fsdp.size=1 * dist.cp.size=3 = 3 does not divide world size 4; choose a divisor of 4: 1, 2, 4",
    ),
    (
        _chain(_set("dist.fsdp.size", 2), _set("dist.cp.size", 2), _set("dist.tp.size", 2)),
        4,
        "dist.fsdp.size=2 * dist.tp.size=2 * dist.cp.size=2 = 8 exceeds world size 4",
    ),
    (
        _chain(_set("dist.dp.size", 2), _set("dist.cp.size", 4)),
        4,
        "dist.dp.size * dist.fsdp.size * dist.cp.size must equal world size 4, got dist.dp.size=2 * "
        "dist.fsdp.size=1 * dist.cp.size=4 = 8; set dist.dp.size=1 or leave it None",
    ),
    (
        _set("dist.cp.method", "megatron"),
        4,
        "dist.cp.method='megatron' is not supported; use 'ulysses' (all-to-all, CPU and GPU) or 'ring'",
    ),
    (
        _chain(_set("dist.dp.size", 3), _set("dist.fsdp.size", 2)),
        4,
        "dist.dp.size * dist.fsdp.size must equal world size 4, got dist.dp.size=3 * dist.fsdp.size=2 = 6; "
        "set dist.dp.size=2 or leave it None",
    ),
    (
        _set("dist.topology", ["dp"]),
        4,
        "dist.topology must be a permutation of ['dp', 'fsdp'] or of ['dp', 'fsdp', 'tp'], got ['dp']; ",
    ),
    (
        _set("dist.topology", ["dp", "dp"]),
        4,
        "dist.topology must be a permutation of ['dp', 'fsdp'] or of ['dp', 'fsdp', 'tp'], got ['dp', 'dp']",
    ),
    (_set("dist.timeout", 0), 4, "dist.timeout must be > 0 seconds, got 0.0"),
    (_set("dist.timeout", -1.5), 4, "dist.timeout must be > 0 seconds, got -1.5"),
    (
        _chain(_set("memory.gc", True), _set("memory.gc_cls", {"Block"}), _set("memory.gc_cnt", 0)),
        4,
        "memory.gc_cnt must be None or >= 1, got 0; None checkpoints every layer",
    ),
    (
        _set("memory.gc_cnt", 2),
        4,
        "memory.gc_cnt=2 is set but memory.gc is False; set memory.gc=True to enable activation checkpointing, "
        "or unset memory.gc_cnt",
    ),
    (
        _set("memory.gc_cls", {"B", "A"}),
        4,
        "memory.gc_cls={'A', 'B'} is set but memory.gc is False; set memory.gc=True",
    ),
    (
        _set("memory.gc", True),
        4,
        "memory.gc=True but memory.gc_cls and dist.fsdp.wrap_layer_cls are both empty, so nothing would be "
        "checkpointed; set one of them",
    ),
]


@pytest.mark.parametrize(("mutate", "world_size", "message"), VALIDATE_ERRORS)
def test_validate_errors(mutate, world_size, message):
    cfg = Config()
    mutate(cfg)
    with pytest.raises(ValueError, match=re.escape(message)):
        cfg.validate(world_size)


@pytest.mark.parametrize(
    ("mutate", "world_size"),
    [
        (_set("dist.fsdp.size", 4), 8),
        (_chain(_set("dist.dp.size", 2), _set("dist.fsdp.size", 4)), 8),
        (_chain(_set("memory.gc", True), _set("dist.fsdp.wrap_layer_cls", {"Block"})), 1),
        (_chain(_set("memory.gc", True), _set("memory.gc_cls", {"Block"}), _set("memory.gc_cnt", 1)), 1),
        (_set("dist.topology", ("fsdp", "dp")), 2),
    ],
)
def test_validate_accepts(mutate, world_size):
    cfg = Config()
    mutate(cfg)
    cfg.validate(world_size)


@pytest.mark.parametrize("world_size", [0, -1, 2.0, "4", True, None])
def test_validate_rejects_bad_world_size(world_size):
    with pytest.raises(ValueError, match=re.escape(f"world_size must be an int >= 1, got {world_size!r}")):
        Config().validate(world_size)


def test_validate_messages_are_deterministic():
    messages = set()
    for _ in range(3):
        cfg = Config()
        cfg.memory.gc_cls = {"Zeta", "Alpha", "Mid"}
        with pytest.raises(ValueError) as info:
            cfg.validate(2)
        messages.add(str(info.value))
    assert messages == {
        "memory.gc_cls={'Alpha', 'Mid', 'Zeta'} is set but memory.gc is False; set memory.gc=True to enable "
        "activation checkpointing, or unset memory.gc_cls"
    }


# ---- type errors: on assignment (caught by validate) and on construction ----

TYPE_ERRORS = [
    ("compute.bf16", 1, "compute.bf16: expected bool, got 1 (int); use True or False"),
    ("dist.fsdp.size", "two", "dist.fsdp.size: expected int, got 'two' (str); use an integer such as 2"),
    ("dist.fsdp.size", True, "dist.fsdp.size: expected int, got True (bool)"),
    ("dist.fsdp.size", 2.0, "dist.fsdp.size: expected int, got 2.0 (float)"),
    ("dist.dp.size", "2", "dist.dp.size: expected int or None, got '2' (str); use an integer such as 2 or None"),
    ("dist.timeout", "60", "dist.timeout: expected float, got '60' (str); use a number such as 1800.0"),
    ("dist.timeout", False, "dist.timeout: expected float, got False (bool)"),
    ("dist.fsdp.wrap_layer_cls", "GPT2Block", "dist.fsdp.wrap_layer_cls: expected set of str, got 'GPT2Block' (str)"),
    ("memory.gc_cls", {1}, "memory.gc_cls: expected set of str, got {1} (set); use a set of class names"),
    ("dist.topology", {"dp", "fsdp"}, "dist.topology: expected list of str, got {'dp', 'fsdp'} (set)"),
    ("dataloader.shuffle", "yes", "dataloader.shuffle: expected bool or None, got 'yes' (str)"),
    ("dist.fsdp", {"size": 2}, "dist.fsdp: expected FSDPConfig, got {'size': 2} (dict); use a FSDPConfig instance"),
]


@pytest.mark.parametrize(("path", "value", "message"), TYPE_ERRORS)
def test_validate_type_checks_assigned_attributes(path, value, message):
    cfg = Config()
    _set(path, value)(cfg)
    with pytest.raises(ValueError, match=re.escape(message)):
        cfg.validate(world_size=1)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ComputeConfig(fp16="no"), "compute.fp16: expected bool, got 'no' (str)"),
        (lambda: MemoryConfig(gc_cnt=1.5), "memory.gc_cnt: expected int or None, got 1.5 (float)"),
        (lambda: DistConfig(dp=FSDPConfig()), "dist.dp: expected DPConfig, got FSDPConfig("),
        (lambda: Config(compute={"bf16": True}), "compute: expected ComputeConfig, got {'bf16': True} (dict)"),
    ],
)
def test_construction_type_checks(build, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build()


# ---- unknown keys and wrong types in dict / YAML / CLI input ----


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"compute": {"bf17": True}}, "compute.bf17: unknown key; valid keys under compute: bf16, fp16"),
        ({"bogus": 1}, "bogus: unknown key; valid keys at the top level: compute, memory, dist, dataloader"),
        (
            {"dist": {"fsdp": {"sise": 2}}},
            "dist.fsdp.sise: unknown key; valid keys under dist.fsdp: size, wrap_layer_cls, reshard_after_forward, "
            "forward_prefetch, backward_prefetch, reduce_dtype, broadcast_buffers, sync_module_states, init_from; "
            "did you mean dist.fsdp.size?",
        ),
        ({"dist": {"fsdp": {"size": "two"}}}, "dist.fsdp.size: expected int, got 'two'"),
        ({"compute": 3}, "compute: expected a mapping with keys bf16, fp16, compile, got 3"),
        ({"dist": {"dp": []}}, "dist.dp: expected a mapping with keys size, got []"),
        ({"compute": {"bf16": "${nope}"}}, "compute.bf16: Interpolation key 'nope' not found"),
    ],
)
def test_from_dict_errors(data, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Config.from_dict(data)


def test_from_dict_rejects_non_mapping():
    with pytest.raises(ValueError, match=re.escape("config: expected a mapping with keys compute, memory, dist")):
        Config.from_dict([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("compute:\n  bf17: true\n", "compute.bf17: unknown key; valid keys under compute: bf16, fp16"),
        ("dist:\n  fsdp:\n    size: two\n", "dist.fsdp.size: expected int, got 'two' (str)"),
        ("compute:\n  bf16: maybe\n", "compute.bf16: expected bool, got 'maybe' (str); use True or False"),
        (
            "dist:\n  fsdp:\n    wrap_layer_cls: GPT2Block\n",
            "dist.fsdp.wrap_layer_cls: expected set of str, got 'GPT2Block' (str); use a set of class names such as "
            "{'GPT2Block'} (in YAML or on the command line: [GPT2Block])",
        ),
        ("- compute\n", "holds ['compute'] (list), not a mapping of sections; write e.g. 'dist: {fsdp: {size: 2}}'"),
    ],
)
def test_from_yaml_errors(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(message) + ".*" + re.escape(f"(in {path})")):
        Config.from_yaml(path)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["compute.bf17=true"], "compute.bf17: unknown key; valid keys under compute: bf16, fp16"),
        (
            ["dist.fspd.size=2"],
            "dist.fspd: unknown key; valid keys under dist: pp, dp, fsdp, tp, cp, topology, timeout",
        ),
        (["dist.fsdp.size=two"], "dist.fsdp.size: expected int, got 'two' (str); use an integer such as 2"),
        (["memory.gc_cnt=1.5"], "memory.gc_cnt: expected int or None, got 1.5 (float)"),
        (["compute.bf16=maybe"], "compute.bf16: expected bool, got 'maybe' (str)"),
        (["dist.fsdp.wrap_layer_cls=GPT2Block"], "dist.fsdp.wrap_layer_cls: expected set of str, got 'GPT2Block'"),
        (["compute=3"], "compute: expected a mapping with keys bf16, fp16, compile, got 3"),
    ],
)
def test_from_cli_errors(argv, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Config.from_cli(argv)


# ---- surface snapshot and docs ----


def _type_name(tp) -> str:
    return tp.__name__ if typing.get_origin(tp) is None and isinstance(tp, type) else str(tp)


def _field_tree(node, prefix: str = "") -> list[str]:
    lines = []
    hints = typing.get_type_hints(type(node))
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            lines.append(f"{prefix}{f.name}: {_type_name(hints[f.name])}")
            lines += _field_tree(value, f"{prefix}{f.name}.")
        else:
            lines.append(f"{prefix}{f.name}: {_type_name(hints[f.name])} = {value!r}")
    return lines


def test_field_tree_snapshot():
    """Growing or changing the config surface must be a deliberate edit of this literal."""
    assert _field_tree(Config()) == [
        "compute: ComputeConfig",
        "compute.bf16: bool = False",
        "compute.fp16: bool = False",
        "compute.compile: bool = False",
        "memory: MemoryConfig",
        "memory.gc: bool = False",
        "memory.gc_cls: set[str] = set()",
        "memory.gc_cnt: int | None = None",
        "memory.gc_interval: int = 1",
        "memory.offload_params: bool = False",
        "dist: DistConfig",
        "dist.pp: PPConfig",
        "dist.pp.size: int = 1",
        "dist.pp.schedule: str = '1F1B'",
        "dist.pp.stages_per_rank: int = 1",
        "dist.pp.microbatches: int | None = None",
        "dist.pp.split: list[str] = []",
        "dist.dp: DPConfig",
        "dist.dp.size: int | None = None",
        "dist.fsdp: FSDPConfig",
        "dist.fsdp.size: int = 1",
        "dist.fsdp.wrap_layer_cls: set[str] = set()",
        "dist.fsdp.reshard_after_forward: bool | int = True",
        "dist.fsdp.forward_prefetch: int = 0",
        "dist.fsdp.backward_prefetch: int = 0",
        "dist.fsdp.reduce_dtype: str = 'float32'",
        "dist.fsdp.broadcast_buffers: bool = True",
        "dist.fsdp.sync_module_states: bool = True",
        "dist.fsdp.init_from: str | None = None",
        "dist.tp: TPConfig",
        "dist.tp.size: int = 1",
        "dist.tp.plan: str | dict[str, str] = 'auto'",
        "dist.tp.sequence_parallel: bool = False",
        "dist.cp: CPConfig",
        "dist.cp.size: int = 1",
        "dist.cp.method: str = 'ulysses'",
        "dist.topology: list[str] = ['dp', 'fsdp']",
        "dist.timeout: float = 1800.0",
        "dataloader: DataLoaderConfig",
        "dataloader.shuffle: bool | None = None",
        "dataloader.drop_last: bool | None = None",
        "dataloader.seed: int = 0",
        "dataloader.prefetch: bool = True",
        "dataloader.shard: bool = True",
        "metrics: MetricsConfig",
        "metrics.every: int = 0",
        "metrics.sinks: set[str] = {'console'}",
        "metrics.dir: str = 'runs'",
        "metrics.peak_flops: float | None = None",
        "metrics.run_name: str | None = None",
    ]


def test_all_snapshot():
    assert sorted(config_module.__all__) == [
        "CPConfig",
        "ComputeConfig",
        "Config",
        "DPConfig",
        "DataLoaderConfig",
        "DistConfig",
        "FSDPConfig",
        "MemoryConfig",
        "MetricsConfig",
        "PPConfig",
        "TPConfig",
        "field_docs",
    ]


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_every_field_has_an_attribute_docstring(cls):
    assert dataclasses.is_dataclass(cls)
    assert all(f.kw_only for f in dataclasses.fields(cls)) and "__dict__" not in dir(cls())
    docs = field_docs(cls)
    assert list(docs) == [f.name for f in dataclasses.fields(cls)]
    for name, doc in docs.items():
        assert doc.strip(), f"{cls.__name__}.{name} has no attribute docstring"
        assert doc.isascii(), f"{cls.__name__}.{name} docstring is not ASCII"


def test_memory_docstring_states_the_gc_contract():
    docs = field_docs(MemoryConfig)
    assert "dist.fsdp.wrap_layer_cls" in docs["gc"]
    assert "first N" in docs["gc_cnt"] and "None" in docs["gc_cnt"]


def test_field_docs_reports_missing_docstrings_and_rejects_non_dataclasses():
    @dataclasses.dataclass
    class Partial:
        documented: int = 0
        """Has one."""
        bare: int = 0

    assert field_docs(Partial) == {"documented": "Has one.", "bare": ""}
    with pytest.raises(TypeError, match="field_docs expects a dataclass"):
        field_docs(int)


@pytest.mark.parametrize(
    "attr, value, message",
    [
        ("memory.gc_interval", 0, "memory.gc_interval must be >= 1, got 0"),
        ("dist.fsdp.forward_prefetch", -1, "dist.fsdp.forward_prefetch must be >= 0, got -1"),
        ("dist.fsdp.backward_prefetch", -2, "dist.fsdp.backward_prefetch must be >= 0, got -2"),
        ("dist.fsdp.reduce_dtype", "float64", "dist.fsdp.reduce_dtype='float64' is not supported"),
        ("dist.fsdp.reshard_after_forward", 3, r"reshard_after_forward=3 must be .*possible values: \[2\]"),
        ("dist.fsdp.reshard_after_forward", 4, r"other than 1 and 4"),
        ("dist.fsdp.reshard_after_forward", "yes", r"reshard_after_forward: expected bool or int, got 'yes'"),
    ],
)
def test_scale_feature_validation(attr, value, message):
    config = Config()
    config.dist.fsdp.size = 4
    if attr.startswith("memory."):
        config.memory.gc = True
        config.dist.fsdp.wrap_layer_cls = {"Block"}
    *parents, leaf = attr.split(".")
    node = config
    for part in parents:
        node = getattr(node, part)
    setattr(node, leaf, value)
    with pytest.raises(ValueError, match=message):
        config.validate(4)


def test_reshard_after_forward_accepts_a_node_size():
    config = Config()
    config.dist.fsdp.size = 4
    config.dist.fsdp.reshard_after_forward = 2
    config.validate(4)
    assert Config.from_cli(["dist.fsdp.reshard_after_forward=2"]).dist.fsdp.reshard_after_forward == 2
    assert Config.from_cli(["dist.fsdp.reshard_after_forward=false"]).dist.fsdp.reshard_after_forward is False
