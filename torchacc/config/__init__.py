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

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import _io as _config_io
from ._io import Node, fmt
from ._rules import validate_metrics, validate_pp
from .sections import (
    ComputeConfig,
    CPConfig,
    DataLoaderConfig,
    DistConfig,
    DPConfig,
    FSDPConfig,
    MemoryConfig,
    MetricsConfig,
    PPConfig,
    TPConfig,
    field_docs,
)

__all__ = [
    "ComputeConfig",
    "Config",
    "CPConfig",
    "DPConfig",
    "DataLoaderConfig",
    "DistConfig",
    "FSDPConfig",
    "MemoryConfig",
    "PPConfig",
    "MetricsConfig",
    "TPConfig",
]
__all__ += ["field_docs"]  # reused by the docs generator


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
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Records of loss, throughput, MFU, memory and gradient norm every few steps (off by default)."""

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
        tp, pp, cp = d.tp.size, d.pp.size, d.cp.size
        axes = (
            ("pp", pp, "pipeline parallelism"),
            ("fsdp", fsdp, "sharding"),
            ("tp", tp, "tensor parallelism"),
            ("cp", cp, "context parallelism"),
        )
        for name, size, what in axes[1:]:
            if size < 1:
                raise ValueError(f"dist.{name}.size must be >= 1, got {size}; use 1 to disable {what}")
        if pp < 1:
            raise ValueError(f"dist.pp.size must be >= 1, got {pp}; use 1 to disable pipeline parallelism")
        divisors = f"choose a divisor of {ws}: {', '.join(str(n) for n in range(1, ws + 1) if ws % n == 0)}"
        split = pp * fsdp * tp * cp  # the ranks of one model replica (dp multiplies it to the world size)
        named = [(f"dist.{name}.size", size) for name, size, _ in axes if name == "fsdp" or size > 1]
        what = " * ".join(f"{path}={size}" for path, size in named) + (f" = {split}" if len(named) > 1 else "")
        if split > ws:
            raise ValueError(f"{what} exceeds world size {ws}; {divisors}")
        if ws % split:
            raise ValueError(f"{what} does not divide world size {ws}; {divisors}")
        if dp is not None and dp < 1:
            raise ValueError(f"dist.dp.size must be None or >= 1, got {dp}; leave it None to infer it")
        if dp is not None and dp * split != ws:
            product = " * ".join([f"dist.dp.size={dp}", *(f"{path}={size}" for path, size in named)])
            raise ValueError(
                f"{' * '.join(['dist.dp.size', *(path for path, _ in named)])} must equal world size {ws}, "
                f"got {product} = {dp * split}; set dist.dp.size={ws // split} or leave it None to infer it"
            )
        if d.cp.method not in ("ulysses", "ring"):
            raise ValueError(
                f"dist.cp.method={d.cp.method!r} is not supported; use 'ulysses' (all-to-all, CPU and GPU) or 'ring' "
                "(torch's ring attention, CUDA only)"
            )
        validate_pp(d)
        if pp > 1 and cp > 1:
            raise ValueError(
                f"dist.pp.size={pp} with dist.cp.size={cp}: pipeline and context parallelism do not compose yet (the "
                "pipeline's stages run outside the sequence split); use one of them, e.g. dist.cp with dist.fsdp"
            )
        if sorted(d.topology) not in (["dp", "fsdp"], ["dp", "fsdp", "tp"]):
            raise ValueError(
                f"dist.topology must be a permutation of ['dp', 'fsdp'] or of ['dp', 'fsdp', 'tp'], got "
                f"{d.topology!r}; use ['dp', 'fsdp'] (the default: tp innermost, then fsdp) or e.g. ['fsdp', 'dp']"
            )
        if isinstance(d.tp.plan, str) and d.tp.plan != "auto":
            raise ValueError(
                f"dist.tp.plan={d.tp.plan!r} is not supported; use 'auto' (a Hugging Face model's own plan) or a "
                "mapping of module-name patterns to styles, e.g. {'layers.*.mlp.up_proj': 'colwise'}"
            )
        if d.tp.sequence_parallel and tp == 1:
            raise ValueError("dist.tp.sequence_parallel=True needs dist.tp.size > 1; set dist.tp.size or unset it")
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
        validate_metrics(self.metrics)

    def resolved_dp_size(self, world_size: int) -> int:
        """Return ``dist.dp.size``, or ``world_size // (dist.pp.size * dist.fsdp.size * dist.tp.size * dist.cp.size)``
        when it is None.

        Args:
            world_size: Number of processes in the job.

        Returns:
            The number of data-parallel replicas.

        Raises:
            ValueError: If ``validate(world_size)`` fails.
        """
        self.validate(world_size)
        if self.dist.dp.size is not None:
            return self.dist.dp.size
        return world_size // (self.dist.fsdp.size * self.dist.tp.size * self.dist.pp.size * self.dist.cp.size)

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
