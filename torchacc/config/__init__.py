"""The torchacc configuration tree. Field names follow the original TorchAcc, so its scripts run unchanged::

    config = torchacc.Config()
    config.compute.bf16 = True
    config.dist.fsdp.size = 4
    config.dist.fsdp.wrap_layer_cls = {"GPT2Block"}
    config.validate(world_size=8)

Construction type-checks every field; ``validate(world_size)`` type-checks again (attributes may have
been assigned since) and applies the value and cross-field rules. ``field_docs`` reads the attribute
docstrings back for the generated docs. Type checking, merging and the dict/YAML/CLI conversions live in
``torchacc.config._io``.
"""

import ast
import dataclasses
import inspect
import math
import os
import textwrap
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from . import _io as _config_io
from ._io import Node, fmt

__all__ = ["ComputeConfig", "Config", "DPConfig", "DataLoaderConfig", "DistConfig", "FSDPConfig", "MemoryConfig"]
__all__ += ["field_docs"]  # reused by the docs generator


@dataclass(kw_only=True, slots=True)
class ComputeConfig(Node):
    """Numeric precision of the forward and backward passes."""

    _path: ClassVar[str] = "compute"
    bf16: bool = False
    """Compute in bfloat16 (parameters stay float32). Mutually exclusive with fp16."""
    fp16: bool = False
    """Compute in float16 (parameters stay float32). Mutually exclusive with bf16."""
    compile: bool = False
    """``torch.compile`` every dist.fsdp.wrap_layer_cls block, after activation checkpointing and before sharding,
    in place (only its ``forward`` is compiled), so FSDP's hooks still fire and state_dict keys stay unchanged.
    A Hugging Face model's ``config.use_cache`` is set to False (with a warning): a KV cache makes every block
    recompile."""


@dataclass(kw_only=True, slots=True)
class MemoryConfig(Node):
    """Memory savings: activation checkpointing ("gc", gradient checkpointing in TorchAcc's words)."""

    _path: ClassVar[str] = "memory"
    gc: bool = False
    """Enable activation checkpointing. gc=True with an empty gc_cls checkpoints the dist.fsdp.wrap_layer_cls layers."""
    gc_cls: set[str] = field(default_factory=set)
    """Class names of the layers to checkpoint, e.g. {"GPT2Block"}; empty means dist.fsdp.wrap_layer_cls.
    Setting it while gc is False is an error."""
    gc_cnt: int | None = None
    """Checkpoint only the first N matching layers (in module order); None checkpoints all of them."""
    gc_interval: int = 1
    """Selective checkpointing: checkpoint every k-th matching layer (1 checkpoints each one)."""
    offload_params: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory (FSDP2 ``CPUOffloadPolicy``); CUDA
    only: on a CPU run everything already is in CPU memory, so it is ignored with a warning."""


@dataclass(kw_only=True, slots=True)
class DPConfig(Node):
    """Data parallelism: model replicas that train on different data."""

    _path: ClassVar[str] = "dist.dp"
    size: int | None = None
    """Number of data-parallel replicas; None infers world_size // dist.fsdp.size."""


@dataclass(kw_only=True, slots=True)
class FSDPConfig(Node):
    """Fully sharded data parallelism (FSDP2, ``torch.distributed.fsdp.fully_shard``)."""

    _path: ClassVar[str] = "dist.fsdp"
    size: int = 1
    """Number of ranks that shard one model replica; 1 disables sharding. Must divide the world size."""
    wrap_layer_cls: set[str] = field(default_factory=set)
    """Class names of the layers that each become one FSDP unit, e.g. {"GPT2Block"}; the root is wrapped last."""
    reshard_after_forward: bool | int = True
    """Free gathered parameters after forward and gather again in backward (less memory, more communication);
    False keeps them until backward; an int N reshards to groups of N ranks (a divisor of dist.fsdp.size other
    than 1 and the size itself, e.g. the ranks of one node), so the backward all-gather stays inside them."""
    forward_prefetch: int = 0
    """All-gather the next N units' parameters during forward (explicit prefetching); 0 keeps FSDP2's default."""
    backward_prefetch: int = 0
    """All-gather the next N units' parameters during backward; 0 keeps FSDP2's default (one, implicitly)."""
    reduce_dtype: str = "float32"
    """Dtype of the gradient reduce-scatter/all-reduce: "float32" (default, exact), "bfloat16" or "float16"."""
    broadcast_buffers: bool = True
    """Keep buffers (BatchNorm running statistics) equal on every rank, DDP's knob and default: the buffers that
    the forward changes are broadcast from rank 0 before each forward (one small broadcast; none for a model whose
    forward changes no buffer). False lets each rank keep the statistics of its own batches."""
    sync_module_states: bool = True
    """Make every rank start from rank 0's parameters and buffers. With FSDP or HSDP the ranks first compare a
    digest of each tensor, and only the tensors that differ from rank 0's are broadcast (nothing when all ranks
    built the same model); plain DP leaves it to DDP, which broadcasts them all."""
    init_from: str | None = None
    """A consolidated ``.pth`` file or a Hugging Face directory (safetensors) to load the weights from, after
    sharding: each rank reads only its slices (where only rank 0 can read it, rank 0 sends each tensor). Fills a
    model built with ``torchacc.init_empty_weights()``, and replaces the weights of a model built normally.
    None: a meta-device model gets its own init (``reset_parameters``, or the Hugging Face init)."""


@dataclass(kw_only=True, slots=True)
class DistConfig(Node):
    """Distributed layout: the parallel axes, their sizes and order, and the process-group timeout."""

    _path: ClassVar[str] = "dist"
    dp: DPConfig = field(default_factory=DPConfig)
    """Data parallelism (replicas)."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Fully sharded data parallelism (sharding within one replica)."""
    topology: list[str] = field(default_factory=lambda: ["dp", "fsdp"])
    """Order of the parallel axes in the rank layout, outermost first; a permutation of ["dp", "fsdp"].
    With the default, the ranks that shard one model are contiguous (fsdp innermost)."""
    timeout: float = 1800.0
    """Seconds a collective may wait before the job fails (the process-group timeout)."""


@dataclass(kw_only=True, slots=True)
class DataLoaderConfig(Node):
    """How torchacc rebuilds the user's DataLoader."""

    _path: ClassVar[str] = "dataloader"
    shuffle: bool | None = None
    """Shuffle in the DistributedSampler; None keeps what the user's DataLoader does."""
    drop_last: bool | None = None
    """Drop the uneven tail; None keeps the loader's drop_last."""
    seed: int = 0
    """DistributedSampler seed; all ranks must use the same one."""
    prefetch: bool = True
    """Copy the next batch to the device while the current one computes."""
    shard: bool = True
    """Split the dataset across data-parallel ranks; False only places batches on the device."""


@dataclass(kw_only=True, slots=True)
class Config(Node):
    """The whole torchacc configuration: build it, set attributes, then call ``validate(world_size)``."""

    compute: ComputeConfig = field(default_factory=ComputeConfig)
    """Numeric precision."""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """Activation checkpointing."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Parallel layout and process-group settings."""
    dataloader: DataLoaderConfig = field(default_factory=DataLoaderConfig)
    """DataLoader sharding and prefetching."""

    def validate(self, world_size: int) -> None:
        """Type-check every field, normalize sets given as lists, then apply the value and cross-field rules.

        Messages are deterministic, so every rank raises the same one.

        Args:
            world_size: Number of processes in the job, e.g. ``torch.distributed.get_world_size()``.

        Raises:
            ValueError: Naming the dotted path, the value given, what is allowed and how to fix it.

        Example::

            config.dist.fsdp.size = 4
            config.validate(world_size=8)  # dist.dp.size is inferred as 2
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(
                f"world_size must be an int >= 1, got {world_size!r}; pass torch.distributed.get_world_size(), "
                "or 1 for a single process"
            )
        self._check_types(recursive=True)
        c, m, d, ws = self.compute, self.memory, self.dist, world_size
        fsdp, dp = d.fsdp.size, d.dp.size
        if c.bf16 and c.fp16:
            raise ValueError(
                "compute.bf16 and compute.fp16 are both True, but they exclude each other; set one to False"
            )
        if fsdp < 1:
            raise ValueError(f"dist.fsdp.size must be >= 1, got {fsdp}; use 1 to disable sharding")
        divisors = f"choose a divisor of {ws}: {', '.join(str(n) for n in range(1, ws + 1) if ws % n == 0)}"
        if fsdp > ws:
            raise ValueError(f"dist.fsdp.size={fsdp} exceeds world size {ws}; {divisors}")
        if ws % fsdp:
            raise ValueError(f"dist.fsdp.size={fsdp} does not divide world size {ws}; {divisors}")
        if dp is not None and dp < 1:
            raise ValueError(f"dist.dp.size must be None or >= 1, got {dp}; leave it None to infer it")
        if dp is not None and dp * fsdp != ws:
            raise ValueError(
                f"dist.dp.size * dist.fsdp.size must equal world size {ws}, got dist.dp.size={dp} * "
                f"dist.fsdp.size={fsdp} = {dp * fsdp}; set dist.dp.size={ws // fsdp} or leave it None to infer it"
            )
        if sorted(d.topology) != ["dp", "fsdp"]:
            raise ValueError(
                f"dist.topology must be a permutation of ['dp', 'fsdp'], got {d.topology!r}; "
                "use ['dp', 'fsdp'] (fsdp innermost, the default) or ['fsdp', 'dp']"
            )
        if not math.isfinite(d.timeout):
            raise ValueError(
                f"dist.timeout must be a finite number of seconds, got {d.timeout}; a collective that never times "
                "out hangs the job when a rank dies: use e.g. 1800.0 (the default)"
            )
        if d.timeout <= 0:
            raise ValueError(f"dist.timeout must be > 0 seconds, got {d.timeout}; the default is 1800.0")
        if m.gc_cnt is not None and m.gc_cnt < 1:
            raise ValueError(f"memory.gc_cnt must be None or >= 1, got {m.gc_cnt}; None checkpoints every layer")
        for name, value in (("gc_cnt", m.gc_cnt), ("gc_cls", m.gc_cls or None)):
            if value is not None and not m.gc:
                raise ValueError(
                    f"memory.{name}={fmt(value)} is set but memory.gc is False; "
                    f"set memory.gc=True to enable activation checkpointing, or unset memory.{name}"
                )
        if m.gc_interval < 1:
            raise ValueError(f"memory.gc_interval must be >= 1, got {m.gc_interval}; 1 checkpoints every layer")
        for name in ("forward_prefetch", "backward_prefetch"):
            if getattr(d.fsdp, name) < 0:
                raise ValueError(f"dist.fsdp.{name} must be >= 0, got {getattr(d.fsdp, name)}; 0 keeps the default")
        if d.fsdp.reduce_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(
                f"dist.fsdp.reduce_dtype={d.fsdp.reduce_dtype!r} is not supported; use 'float32', 'bfloat16' or "
                "'float16'"
            )
        raf = d.fsdp.reshard_after_forward
        if not isinstance(raf, bool) and not (1 < raf < fsdp and fsdp % raf == 0):
            choices = [n for n in range(2, fsdp) if fsdp % n == 0]
            raise ValueError(
                f"dist.fsdp.reshard_after_forward={raf} must be True, False or a divisor of dist.fsdp.size={fsdp} "
                f"other than 1 and {fsdp} (e.g. the ranks of one node); possible values: {choices or 'none'}"
            )
        if m.gc and not m.gc_cls and not d.fsdp.wrap_layer_cls:
            raise ValueError(
                "memory.gc=True but memory.gc_cls and dist.fsdp.wrap_layer_cls are both empty, so nothing would be "
                "checkpointed; set one of them, e.g. memory.gc_cls={'GPT2Block'}"
            )

    def resolved_dp_size(self, world_size: int) -> int:
        """Return ``dist.dp.size``, or ``world_size // dist.fsdp.size`` when it is None.

        Args:
            world_size: Number of processes in the job.

        Returns:
            The number of data-parallel replicas.

        Raises:
            ValueError: If ``validate(world_size)`` fails.
        """
        self.validate(world_size)
        return self.dist.dp.size if self.dist.dp.size is not None else world_size // self.dist.fsdp.size

    def to_dict(self) -> dict[str, Any]:
        """Return the tree as nested plain dicts; sets become sorted lists, so the YAML stays plain."""
        return _config_io.to_plain(self)

    def to_yaml(self) -> str:
        """Return the tree as YAML text that ``from_yaml`` reads back."""
        return _config_io.to_yaml(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Config":
        """Build a Config from nested mappings, e.g. ``{"dist": {"fsdp": {"size": 2}}}``; absent keys keep defaults.

        OmegaConf converts values where it can ("2" -> 2, "true" -> True); lists become sets for set fields.

        Args:
            d: Section name -> {field name -> value}.

        Returns:
            The new Config.

        Raises:
            ValueError: For an unknown key (listing the valid keys at that level) or a value of the wrong type.
        """
        return _config_io.merge(cls, [d])

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> "Config":
        """Load a Config from a YAML file laid out like ``to_yaml``'s output.

        Args:
            path: The YAML file.

        Returns:
            The new Config.

        Raises:
            FileNotFoundError: If the file does not exist.
            ValueError: As ``from_dict``, with the file name appended.
        """
        return _config_io.from_yaml(cls, path)

    @classmethod
    def from_cli(cls, argv: Sequence[str] | None = None, *, base: "Config | None" = None) -> "Config":
        """Build a Config from ``KEY=VALUE`` arguments, e.g. ``["config=run.yaml", "dist.fsdp.size=2"]``.

        Layers, later wins: ``base`` (or the defaults), then every ``config=PATH.yaml`` file in the order
        given, then the dotted overrides in the order given, wherever they stand relative to the files.
        Values are parsed as YAML: ``compute.bf16=true``, ``dist.fsdp.wrap_layer_cls=[GPT2Block,GPT2MLP]``,
        ``memory.gc_cnt=null``.

        Args:
            argv: The arguments; None reads ``sys.argv[1:]``.
            base: Config to start from instead of the defaults.

        Returns:
            The new Config.

        Raises:
            FileNotFoundError: If a ``config=`` file does not exist.
            ValueError: For an argument that is not ``KEY=VALUE``, an unknown key or a value of the wrong type.
        """
        return _config_io.from_cli(cls, argv, base)


def field_docs(cls: type) -> dict[str, str]:
    """Return the attribute docstring of every field of a config dataclass, read from its source with ``ast``.

    Args:
        cls: A dataclass such as ``FSDPConfig``.

    Returns:
        ``{field name: docstring}`` in field order, ``""`` for a field without one.

    Raises:
        TypeError: If ``cls`` is not a dataclass.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"field_docs expects a dataclass, got {cls!r}")
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    body = tree.body if isinstance(tree, ast.ClassDef) else []
    docs = {}
    for stmt, nxt in zip(body, body[1:], strict=False):
        doc = nxt.value.value if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) else None
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(doc, str):
            docs[stmt.target.id] = inspect.cleandoc(doc)
    return {f.name: docs.get(f.name, "") for f in dataclasses.fields(typing.cast(Any, cls))}
