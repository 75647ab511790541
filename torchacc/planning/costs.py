"""The cost model of one training step: FLOPs at the device's dense peak, bytes at the links' bandwidths.

[Note: cost model] Per GPU and per step of ``B`` sequences of ``S`` tokens (the ranks of one TP group share
them, so a GPU works on ``B * S / tp`` tokens; pipelines and CP below):

* compute: ``6 * N`` FLOPs per token for the ``N`` parameters (2 forward, 4 backward) plus ``12 * L * d * S``
  for attention (``L`` blocks of width ``d``), divided by ``tp``; checkpointed blocks run their forward again
  (``2 * N_block`` per token, plus their attention's forward). Time: FLOPs over the dense peak of the compute
  dtype (``--peak-tflops``; H100 SXM: 989 bf16, 67 fp32, as torch's default fp32 matmuls use no TF32).
* FSDP: each unit's parameters are all-gathered in the forward and again in the backward (``reshard_after_forward``)
  in the compute dtype, and the gradients reduce-scattered in ``reduce_dtype``: ``(f - 1) / f`` of those bytes
  per GPU for a shard group of ``f``, at the NVLink bandwidth when the group sits inside a node, at the
  InfiniBand one when it spans nodes. HSDP adds an all-reduce of the gradient shards across the ``dp``
  replicas (``2 * (dp - 1) / dp`` of them). FSDP prefetches, so this overlaps the compute: the step takes the
  longer of the two.
* TP: per block, two all-reduces of the activations (``B * S * d`` in the compute dtype) in the forward and two
  in the backward (two more per recomputed block), plus the gathered logits in the forward and backward:
  ``2 * (tp - 1) / tp`` of the bytes each, at the NVLink bandwidth (TP stays inside a node). They sit on the
  critical path and add to the step.
* CPU offload: the shards go to the device before each all-gather (forward and backward) and the gradients
  come back, at the PCIe bandwidth, and AdamW runs on the host (about 28 bytes of host memory traffic per
  parameter of the shard, at ``host_bandwidth``): both add to the step.

* Pipeline (``pp`` stages, ``M = dist.pp.microbatches`` microbatches of ``B`` sequences: a pipeline's step
  takes ``M * B`` sequences): each GPU computes its stage, the busier of the first (one more block when the
  stages do not divide the blocks) and the last (the head). FSDP inside a stage moves only the stage's weights,
  and gathers them once per step (``reshard_after_forward=False`` under a pipeline). The stage boundaries move
  ``B * S * d`` in the compute dtype per microbatch and direction (a middle stage sends the activations forward
  and their gradients back: ``2 * M`` of them), at the InfiniBand bandwidth when a stage fills a node or more
  (the stages then sit on different nodes), else at NVLink's; they add to the step. The stages idle for the
  bubble, ``(pp - 1) / (M + pp - 1)`` of the step under 1F1B and GPipe: the step is the busy time over
  ``1 - bubble``.
* Context parallelism (``cp`` ranks, Ulysses): each GPU computes ``S / cp`` tokens of every sequence (its share
  of the heads over whole sequences in the attention: the same FLOPs), FSDP shards over ``fsdp * cp``, and each
  block sends, forward and backward, ``(2 H + 2 K) * B * (S / cp) * D`` in the compute dtype (the queries, keys and
  values in and the output back, ``H`` heads and ``K`` key/value heads of ``D`` dimensions, divided by ``tp``)
  times ``(cp - 1) / cp``, once more for a recomputed block, at the NVLink bandwidth (a CP group stays inside a
  node), on the critical path.

Tokens per second per GPU = ``M * B * S / (pp * tp * cp) / step``; MFU = the model's FLOPs (without recomputation) over
``step * peak``. The model ignores kernel efficiency (every FLOP at the peak), latency, the optimizer step on the
device and the data loader, so its absolute figures are optimistic; it ranks layouts by what they move and
recompute.
"""

import math
from dataclasses import dataclass

from ..parallel.layout import Layout

__all__ = ["Hardware", "ModelShape", "StepCost", "step_cost"]


@dataclass(frozen=True)
class Hardware:
    """The GPUs and their links (defaults: H100 SXM with NVLink 4 and 400 Gb/s InfiniBand per GPU)."""

    memory_bytes: int = 80 * 10**9
    peak_flops_bf16: float = 989e12
    peak_flops_fp32: float = 67e12
    intra_node_bandwidth: float = 450e9
    """Bytes/s per GPU and direction inside a node (NVLink 4: 900 GB/s both ways)."""
    inter_node_bandwidth: float = 50e9
    """Bytes/s per GPU across nodes (one 400 Gb/s NDR InfiniBand port per GPU)."""
    pcie_bandwidth: float = 50e9
    host_bandwidth: float = 25e9
    """Host memory bytes/s per GPU for the offloaded optimizer step."""
    memory_reserve: float = 0.1
    """The share of the memory kept free for the CUDA context, NCCL and allocator fragmentation."""

    @property
    def usable_bytes(self) -> int:
        return int(self.memory_bytes * (1 - self.memory_reserve))


@dataclass(frozen=True)
class ModelShape:
    """What the cost model reads of a model."""

    num_params: int
    num_block_params: int
    """Parameters in the repeated blocks (all of them)."""
    num_blocks: int
    hidden_size: int
    vocab_size: int
    num_heads: int = 0
    num_kv_heads: int = 0


@dataclass(frozen=True)
class StepCost:
    """Seconds of one step on one GPU, and what they give."""

    compute_s: float
    fsdp_s: float
    tp_s: float
    offload_s: float
    step_s: float
    tokens_per_s: float
    """Per GPU."""
    mfu: float
    cp_s: float = 0.0
    """Context parallelism's all-to-alls."""
    pp_s: float = 0.0
    """A pipeline's stage-boundary transfers."""
    bubble: float = 0.0
    """The share of the step a pipeline stage idles: ``(S - 1) / (M + S - 1)``."""


def _num_checkpointed(layout: Layout, num_blocks: int) -> int:
    ac = layout.checkpointing
    if ac is None:
        return 0
    count = math.ceil(num_blocks / ac.interval)
    return count if ac.num_layers is None else min(count, ac.num_layers)


def step_cost(
    shape: ModelShape, layout: Layout, hardware: Hardware, *, micro_batch_size: int, seq_len: int, gpus_per_node: int
) -> StepCost:
    """The cost of one step of ``layout``: see [Note: cost model]."""
    dims = layout.dims
    tp, fsdp, dp, cp, pp = dims.tp, dims.fsdp, dims.dp, dims.cp, dims.pp
    low = layout.param_dtype is not None
    peak = hardware.peak_flops_bf16 if low else hardware.peak_flops_fp32
    act_bytes = 2 if low else 4
    microbatches = layout.pipeline.microbatches if layout.pipeline is not None else 1
    tokens = micro_batch_size * seq_len * microbatches  # of one step of one TP (x CP) group or pipeline
    split = tp * cp  # the ranks that share these tokens' work inside a stage
    per_block = shape.num_block_params / max(shape.num_blocks, 1)
    attention = 12 * shape.hidden_size * seq_len  # per block and token
    # the busiest stage: the first (one more block when they do not divide) or the last (the head)
    first, last = -(-shape.num_blocks // pp), shape.num_blocks // pp
    rest = shape.num_params - shape.num_block_params  # the embedding and the head (half each when untied)
    end = rest / 2 if pp > 1 else rest
    stage_params = max(first, last) * per_block + end  # what the busiest stage gathers and reduces
    compute_params = max(first * per_block, last * per_block + end)  # the head computes, the embedding looks up
    stage_blocks = max(first, last)
    model_flops = (6 * shape.num_params + attention * shape.num_blocks) * tokens / split / pp
    stage_flops = (6 * compute_params + attention * stage_blocks) * tokens / split
    ckpt = _num_checkpointed(layout, stage_blocks)
    recompute = ckpt * (2 * per_block + attention / 3) * tokens / split
    compute_s = (stage_flops + recompute) / peak

    params_per_gpu = stage_params / tp
    fsdp_s = 0.0
    shards = fsdp * cp  # FSDP shards over fsdp x cp
    if dims.sharded and shards > 1:
        gathers = 1 + (layout.reshard_after_forward is not False)  # a stage gathers once (see costs' note)
        volume = params_per_gpu * (gathers * act_bytes + layout.reduce_dtype.itemsize) * (shards - 1) / shards
        inside = shards * tp <= gpus_per_node
        fsdp_s = volume / (hardware.intra_node_bandwidth if inside else hardware.inter_node_bandwidth)
    if dims.sharded and dp > 1:
        shard = params_per_gpu / shards * layout.reduce_dtype.itemsize
        inside = dp * shards * tp <= gpus_per_node
        fsdp_s += (
            2 * shard * (dp - 1) / dp / (hardware.intra_node_bandwidth if inside else hardware.inter_node_bandwidth)
        )

    tp_s = 0.0
    local_tokens = tokens / cp
    if tp > 1:
        activation = local_tokens * shape.hidden_size * act_bytes
        reduces = 4 * stage_blocks + 2 * ckpt
        logits = 2 * local_tokens * shape.vocab_size * act_bytes
        tp_s = (reduces * activation + logits) * 2 * (tp - 1) / tp / hardware.intra_node_bandwidth

    cp_s = 0.0
    if cp > 1:  # Ulysses: q, k, v in and the output back, forward and backward (again for a recomputed block)
        heads = shape.num_heads + shape.num_kv_heads
        head_dim = shape.hidden_size // max(shape.num_heads, 1)
        per_pass = 2 * heads * local_tokens * head_dim * act_bytes / tp * (cp - 1) / cp
        cp_s = (2 * stage_blocks + ckpt) * per_pass / hardware.intra_node_bandwidth

    pp_s, bubble = 0.0, 0.0
    if pp > 1:
        boundary = local_tokens / microbatches * shape.hidden_size * act_bytes  # one microbatch, one direction
        across = dims.world_size // pp >= gpus_per_node  # a stage fills a node or more: the boundary crosses nodes
        bandwidth = hardware.inter_node_bandwidth if across else hardware.intra_node_bandwidth
        pp_s = 2 * microbatches * boundary / bandwidth  # a middle stage: forward out, gradients back
        bubble = (pp - 1) / (microbatches + pp - 1)

    offload_s = 0.0
    if layout.offload_params:
        shard_params = params_per_gpu / max(shards, 1)
        offload_s = shard_params * (2 * 4 + 4) / hardware.pcie_bandwidth + shard_params * 28 / hardware.host_bandwidth

    busy_s = max(compute_s, fsdp_s) + tp_s + cp_s + pp_s + offload_s
    step_s = busy_s / (1 - bubble)
    return StepCost(
        compute_s=compute_s,
        fsdp_s=fsdp_s,
        tp_s=tp_s,
        offload_s=offload_s,
        step_s=step_s,
        tokens_per_s=tokens / split / pp / step_s,
        mfu=model_flops / (step_s * peak),
        cp_s=cp_s,
        pp_s=pp_s,
        bubble=bubble,
    )
