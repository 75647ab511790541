"""The sections of the torchacc configuration tree, one dataclass each, with a docstring under every field
(``field_docs`` reads them back for docs/config.md). ``Config`` (``torchacc.config``) holds them."""

import ast
import dataclasses
import inspect
import textwrap
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ._io import Node

__all__ = [
    "ComputeConfig",
    "MemoryConfig",
    "DPConfig",
    "FSDPConfig",
    "TPConfig",
    "PPConfig",
    "CPConfig",
    "DistConfig",
    "DataLoaderConfig",
    "MetricsConfig",
    "SINKS",
    "field_docs",
]

SINKS = ("console", "jsonl", "tensorboard", "wandb")


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
    A Hugging Face model's training forwards run with ``use_cache=False`` (with a warning): a KV cache makes every
    block recompile. ``config.use_cache`` itself is unchanged, so ``generate()`` still uses a cache."""


@dataclass(kw_only=True, slots=True)
class MemoryConfig(Node):
    """Memory savings: activation checkpointing ("gc", gradient checkpointing in TorchAcc's words)."""

    _path: ClassVar[str] = "memory"
    gc: bool = False
    """Enable activation checkpointing. gc=True with an empty gc_cls checkpoints the dist.fsdp.wrap_layer_cls layers.
    A Hugging Face model's training forwards then run with ``use_cache=False`` (with a warning): a recomputed layer
    would append its keys to the KV cache again. ``config.use_cache`` itself is unchanged, for ``generate()``."""
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
    than 1 and the size itself, e.g. the ranks of one node), so the backward all-gather stays inside them.
    The root unit (parameters outside every wrap_layer_cls layer) always stays gathered from forward to backward,
    FSDP2's default for a root: backward needs it first."""
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
    digest of each tensor (under plain FSDP/HSDP, of the chunk each rank keeps), and only the tensors that differ
    from rank 0's are broadcast (nothing when all ranks built the same model); plain DP leaves it to DDP, which
    broadcasts them all."""
    init_from: str | None = None
    """A consolidated ``.pth`` file or a Hugging Face directory (safetensors) to load the weights from, after
    sharding: each rank reads only its slices (where only rank 0 can read it, rank 0 sends each tensor). Fills a
    model built with ``torchacc.init_empty_weights()``, and replaces the weights of a model built normally.
    Every tensor must have the model's shape, or every rank raises a ValueError naming the key, both shapes and
    the file, before any rank loads; a floating-point tensor may have another floating-point dtype and is
    converted to the model's (a bfloat16 checkpoint into a float32 model), any other dtype difference is refused.
    None: a meta-device model gets its own init (``reset_parameters``, or the Hugging Face init)."""


@dataclass(kw_only=True, slots=True)
class TPConfig(Node):
    """Tensor parallelism: each layer's weights split across the ranks of a node (DTensor ``parallelize_module``)."""

    _path: ClassVar[str] = "dist.tp"
    size: int = 1
    """Number of ranks that split every tensor-parallel layer; 1 disables it. dist.dp.size * dist.fsdp.size *
    dist.tp.size must equal the world size; keep a TP group inside one node (it communicates in every layer)."""
    plan: str | dict[str, str] = "auto"
    """Which module gets which split: "auto" takes a Hugging Face model's own plan (``model.tp_plan``, from
    ``config.base_model_tp_plan``); otherwise a mapping of module-name patterns (``*`` matches one name, e.g.
    ``"layers.*.mlp.up_proj"``) to "colwise", "rowwise", "colwise_gather_output", "rowwise_split_input",
    "embedding_rowwise", "replicated_with_grad_allreduce", "replicate" or "sequence_parallel". Norms inside the
    split layers (Qwen3's q_norm) are found without being named. See docs/tensor_parallel.md."""
    sequence_parallel: bool = False
    """Also split the activations between the TP layers along the sequence dimension (norms and residuals run
    on 1/tp of the tokens): less activation memory, the same communication volume."""


@dataclass(kw_only=True, slots=True)
class PPConfig(Node):
    """Pipeline parallelism: the model's blocks split into stages on different ranks (``torch.distributed.pipelining``).
    Train with ``loss = torchacc.train_step(model, batch)``; see docs/pipeline_parallel.md."""

    _path: ClassVar[str] = "dist.pp"
    size: int = 1
    """Number of pipeline ranks, each holding a different part of the model (the outermost mesh axis); 1 disables
    it. dist.pp.size * dist.dp.size * dist.fsdp.size * dist.tp.size must equal the world size. Under a pipeline each
    stage keeps its parameters gathered from forward to backward (dist.fsdp.reshard_after_forward is False)."""
    schedule: str = "1F1B"
    """The pipeline schedule: "1F1B" (one forward, one backward in the steady state: activations of at most
    dist.pp.size microbatches are alive), "GPipe" (all forwards, then all backwards: activations of every
    microbatch are alive) or "Interleaved1F1B" (dist.pp.stages_per_rank stages per rank: a smaller bubble for
    more transfers)."""
    stages_per_rank: int = 1
    """Stages each rank holds: 1 for "1F1B" and "GPipe", 2 or more for "Interleaved1F1B" (rank r then holds
    stages r, r + size, r + 2 * size, ...)."""
    microbatches: int | None = None
    """Microbatches each batch is cut into (it must divide the batch size); None: the number of stages
    (dist.pp.size * dist.pp.stages_per_rank), the fewest that 1F1B accepts. More microbatches shrink the bubble,
    (stages - 1) / (microbatches + stages - 1) of the step."""
    split: list[str] = field(default_factory=list)
    """Where stages begin: the names of the blocks that start stage 1, 2, ... (one fewer than the stages), e.g.
    ["model.layers.6"] for 2 stages. Empty: the blocks (the dist.fsdp.wrap_layer_cls modules) are divided evenly,
    earlier stages taking one more when they do not divide; the embedding goes with the first stage, the final
    norm and the head with the last."""


@dataclass(kw_only=True, slots=True)
class CPConfig(Node):
    """Context parallelism: each sequence split along its length over a group of ranks (see
    docs/context_parallel.md)."""

    _path: ClassVar[str] = "dist.cp"
    size: int = 1
    """Number of ranks that split each sequence; 1 disables it. They take the same samples, each its own chunk of
    every sequence, and FSDP shards the parameters over dist.fsdp.size * dist.cp.size ranks. dist.dp.size *
    dist.fsdp.size * dist.cp.size * dist.tp.size must equal the world size. A sequence whose length is not a
    multiple of the size (twice the size with "ring") is padded at its end; the padding has no targets."""
    method: str = "ulysses"
    """How attention sees the whole sequence: "ulysses" (two all-to-alls around each attention: the chunks of all
    ranks are exchanged for a share of the heads, so dist.cp.size, times dist.tp.size with TP, must divide the
    attention and key/value heads; CPU and GPU) or "ring" (torch's ring attention, which passes key/value chunks
    around the ranks; CUDA only, causal attention without padding)."""


@dataclass(kw_only=True, slots=True)
class DistConfig(Node):
    """Distributed layout: the parallel axes, their sizes and order, and the process-group timeout."""

    _path: ClassVar[str] = "dist"
    pp: PPConfig = field(default_factory=PPConfig)
    """Pipeline parallelism (stages of the model on different ranks)."""
    dp: DPConfig = field(default_factory=DPConfig)
    """Data parallelism (replicas)."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Fully sharded data parallelism (sharding within one replica)."""
    tp: TPConfig = field(default_factory=TPConfig)
    """Tensor parallelism (splitting each layer)."""
    cp: CPConfig = field(default_factory=CPConfig)
    """Context parallelism (splitting each sequence)."""
    topology: list[str] = field(default_factory=lambda: ["dp", "fsdp"])
    """Order of the parallel axes in the rank layout, outermost first: a permutation of ["dp", "fsdp"] ("tp" is
    then innermost) or of ["dp", "fsdp", "tp"]. With the default, the ranks of one TP group are contiguous (one
    node), then the ranks that shard one model. The ranks of one CP group (dist.cp) sit just outside "tp"."""
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
class MetricsConfig(Node):
    """Watching a run: a record of loss, throughput, MFU, memory and gradient norm every few optimizer steps
    (docs/watching.md)."""

    _path: ClassVar[str] = "metrics"
    every: int = 0
    """Write a record every N optimizer steps; 0 (the default) turns metrics off: no hook, no collective. A logged
    step costs one small all-gather over the ranks (and the gradient norm, unless the step was clipped with
    ``torchacc.clip_grad_norm_``); the other steps cost no collective and no host-device sync."""
    sinks: set[str] = field(default_factory=lambda: {"console"})
    """Where records go (rank 0 writes them): any of "console" (one line on stdout), "jsonl"
    (``<dir>/metrics.jsonl``, appended), "tensorboard" (``<dir>/tensorboard/<run_name>``; needs
    ``pip install 'torchacc[tensorboard]'``) and "wandb" (Weights & Biases, its files under ``<dir>``; needs
    ``pip install 'torchacc[wandb]'``). Empty: records are only kept for ``torchacc.last_metrics()``."""
    dir: str = "runs"
    """Directory of the file sinks (created on rank 0); ``torchacc plot <dir>`` draws ``<dir>/metrics.png`` from
    its ``metrics.jsonl``."""
    peak_flops: float | None = None
    """Peak FLOP/s of one device, the denominator of MFU; None takes it from the device name for known
    accelerators (bf16 dense: A100 312e12, H100 SXM and H200 989e12, H100 PCIe 756e12, B200 2.25e15) and
    leaves MFU out on the others (CPU included)."""
    run_name: str | None = None
    """The run's name in every sink: the TensorBoard run directory, the W&B run name and the ``run_name`` of each
    JSONL line; None makes one from the start time, e.g. "run-20261124-153012"."""


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
