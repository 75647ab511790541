"""``FSDP2Strategy``'s Lightning-style options: checked at construction, written into its ``Config`` at setup.

The options (``sharding_strategy``, ``mp_policy``, ``cpu_offload``, ...) are another spelling of
``Config`` fields. :func:`check_options` rejects bad values before anything starts;
:func:`apply_options` translates the rest into the strategy's own copy of the ``Config``, which the
shared code path (``torchacc/parallel/engine.py``) then reads.
"""

from collections.abc import Mapping
from typing import Any

from torch.distributed.fsdp import MixedPrecisionPolicy

from ..config import Config
from ..distributed import env

__all__ = ["SHARDING_STRATEGIES", "apply_options", "check_options", "check_pipeline_options"]

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}; use a positive count (or 'auto' where allowed)")


def check_options(
    *,
    config: Config | None,
    data_parallel_size: int | str,
    tensor_parallel_size: int | str,
    tensor_parallel_plan: str | Mapping[str, str],
    sharding_strategy: str | None,
    mp_policy: MixedPrecisionPolicy | str | None,
    state_dict_type: str,
    max_norm: float,
    micro_train_batch_size: int,
    train_batch_size: int | None,
) -> None:
    """Check the ``FSDP2Strategy`` constructor arguments that can be checked without a process group.

    Raises:
        TypeError: ``config`` is not a ``torchacc.Config``.
        ValueError: the first invalid option, named with its value and the allowed ones.
    """
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be a torchacc.Config, got {type(config).__name__}")
    if sharding_strategy is not None and sharding_strategy not in SHARDING_STRATEGIES:
        raise ValueError(f"sharding_strategy={sharding_strategy!r} is not one of {', '.join(SHARDING_STRATEGIES)}")
    if state_dict_type not in ("full", "sharded"):
        raise ValueError(f"state_dict_type={state_dict_type!r} must be 'full' or 'sharded'")
    if tensor_parallel_size != "auto":
        _positive_int("tensor_parallel_size", tensor_parallel_size)
    if isinstance(tensor_parallel_plan, str) and tensor_parallel_plan != "auto":
        raise ValueError(
            f"tensor_parallel_plan={tensor_parallel_plan!r} must be 'auto' (a Hugging Face model's own plan) or a "
            "mapping of module-name patterns to styles, e.g. {'layers.*.mlp.up_proj': 'colwise'}"
        )
    if not isinstance(tensor_parallel_plan, (str, Mapping)):
        raise ValueError(
            f"tensor_parallel_plan must be 'auto' or a mapping of module-name patterns to styles, got "
            f"{type(tensor_parallel_plan).__name__}"
        )
    if data_parallel_size != "auto":
        _positive_int("data_parallel_size", data_parallel_size)
    if isinstance(mp_policy, str) and mp_policy not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"mp_policy={mp_policy!r} must be a MixedPrecisionPolicy or 'bf16', 'fp16', 'fp32'")
    if max_norm < 0:
        raise ValueError(f"max_norm={max_norm} must be >= 0 (0 disables clipping)")
    _positive_int("micro_train_batch_size", micro_train_batch_size)
    if train_batch_size is not None:
        _positive_int("train_batch_size", train_batch_size)


def apply_options(
    config: Config,
    *,
    world_size: int,
    data_parallel_size: int | str,
    tensor_parallel_size: int | str = "auto",
    tensor_parallel_plan: str | Mapping[str, str] = "auto",
    sequence_parallel: bool = False,
    sharding_strategy: str | None,
    mp_policy: MixedPrecisionPolicy | str | None,
    cpu_offload: bool,
    activation_checkpointing_policy: Any,
) -> None:
    """Write the options into ``config`` in place; None or falsy options leave its fields as they are.

    With tensor parallelism the ``world_size / tensor_parallel_size`` data-parallel ranks are what the
    sharding strategy lays out (FSDP shards over them, DDP replicates over them); the ranks of one TP
    group hold the same batch.

    Raises:
        ValueError: ``tensor_parallel_size`` does not divide ``world_size`` (or, with HYBRID_SHARD, the ranks of a
            node); ``data_parallel_size`` is neither ``"auto"`` nor ``world_size / tensor_parallel_size``.
    """
    dist_cfg = config.dist
    if tensor_parallel_size != "auto":
        if world_size % tensor_parallel_size:
            divisors = [n for n in range(1, world_size + 1) if world_size % n == 0]
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size} does not divide the world size {world_size}; choose "
                f"one of {divisors}"
            )
        dist_cfg.tp.size = tensor_parallel_size
    if dist_cfg.tp.size > 1:
        if not isinstance(tensor_parallel_plan, str):  # "auto" keeps config.dist.tp.plan (itself "auto" by default)
            dist_cfg.tp.plan = dict(tensor_parallel_plan)
        dist_cfg.tp.sequence_parallel = dist_cfg.tp.sequence_parallel or sequence_parallel
    tp, pp = dist_cfg.tp.size, dist_cfg.pp.size
    split = tp * pp * dist_cfg.cp.size  # the ranks of a TP or CP group, or of a pipeline, share their batches
    data_ranks = world_size // split if world_size % split == 0 else world_size
    if data_parallel_size not in ("auto", data_ranks):
        raise ValueError(
            f"data_parallel_size={data_parallel_size} must equal the world size {world_size}"
            + (f" / tensor_parallel_size={tp}" if tp > 1 else "")
            + (f" / config.dist.pp.size={pp}" if pp > 1 else "")
            + (f" / config.dist.cp.size={dist_cfg.cp.size}" if dist_cfg.cp.size > 1 else "")
            + (f" = {data_ranks}" if split > 1 else " (no tensor, pipeline or context parallelism)")
            + "; use 'auto'"
        )
    fsdp = dist_cfg.fsdp
    if sharding_strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        fsdp.size, dist_cfg.dp.size = data_ranks, 1
        fsdp.reshard_after_forward = sharding_strategy == "FULL_SHARD"
    elif sharding_strategy == "NO_SHARD":
        fsdp.size, dist_cfg.dp.size = 1, data_ranks
    elif sharding_strategy == "HYBRID_SHARD":
        per_node = env.local_world_size()
        inner = tp * dist_cfg.cp.size  # inside a node; the pipeline stages may cross nodes
        if per_node % inner:
            cp_part = f" x config.dist.cp.size={dist_cfg.cp.size}" if dist_cfg.cp.size > 1 else ""
            raise ValueError(
                f"tensor_parallel_size={tp}{cp_part} does not divide the {per_node} ranks of a node: HYBRID_SHARD "
                f"shards inside a node and a TP{' or CP' if cp_part else ''} group must stay inside one; choose a "
                "divisor of the ranks per node"
            )
        fsdp.size, dist_cfg.dp.size = per_node // inner, max(1, world_size // (per_node * pp))
    if isinstance(mp_policy, str):
        config.compute.bf16 = mp_policy == "bf16"
        config.compute.fp16 = mp_policy == "fp16"
    config.memory.offload_params = config.memory.offload_params or cpu_offload
    if activation_checkpointing_policy:
        config.memory.gc = True
        config.memory.gc_cls = {c if isinstance(c, str) else c.__name__ for c in activation_checkpointing_policy}


def check_pipeline_options(
    *, loss_fn: Any, parallelize_fn: Any, micro_train_batch_size: int, microbatches: int
) -> None:
    """Strategy options a pipelined model cannot honour (config.dist.pp.size > 1), refused before any collective."""
    for name, value in (("loss_fn", loss_fn), ("parallelize_fn", parallelize_fn)):
        if value is not None:
            raise ValueError(
                f"{name}= does not combine with config.dist.pp.size > 1: the pipeline splits a Hugging Face decoder "
                "into stages itself and computes its causal-LM loss on the last stage; drop it, or set dist.pp.size=1"
            )
    if micro_train_batch_size % microbatches:
        raise ValueError(
            f"micro_train_batch_size={micro_train_batch_size} does not divide into "
            f"config.dist.pp.microbatches={microbatches}: each micro-batch runs through the pipeline in that many "
            "pieces; choose a multiple"
        )
