"""The cost model of one training step: FLOPs at the device's dense peak, bytes at the links' bandwidths.

[Note: cost model] Per GPU and per step of ``B`` sequences of ``S`` tokens (the ranks of one TP group share
them, so a GPU works on ``B * S / tp`` tokens):

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

Tokens per second per GPU = ``B * S / tp / step``; MFU = the model's FLOPs (without recomputation) over
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
    tp, fsdp, dp = dims.tp, dims.fsdp, dims.dp
    low = layout.param_dtype is not None
    peak = hardware.peak_flops_bf16 if low else hardware.peak_flops_fp32
    act_bytes = 2 if low else 4
    tokens = micro_batch_size * seq_len
    attention = 12 * shape.num_blocks * shape.hidden_size * seq_len
    model_flops = (6 * shape.num_params + attention) * tokens / tp
    ckpt = _num_checkpointed(layout, shape.num_blocks)
    per_block = shape.num_block_params / max(shape.num_blocks, 1)
    recompute = ckpt * (2 * per_block + attention / shape.num_blocks / 3) * tokens / tp
    compute_s = (model_flops + recompute) / peak

    params_per_gpu = shape.num_params / tp
    fsdp_s = 0.0
    if dims.sharded and fsdp > 1:
        gathers = 1 + (layout.reshard_after_forward is not False)
        volume = params_per_gpu * (gathers * act_bytes + layout.reduce_dtype.itemsize) * (fsdp - 1) / fsdp
        inside = fsdp * tp <= gpus_per_node
        fsdp_s = volume / (hardware.intra_node_bandwidth if inside else hardware.inter_node_bandwidth)
    if dims.sharded and dp > 1:
        shard = params_per_gpu / fsdp * layout.reduce_dtype.itemsize
        inside = dp * fsdp * tp <= gpus_per_node
        fsdp_s += (
            2 * shard * (dp - 1) / dp / (hardware.intra_node_bandwidth if inside else hardware.inter_node_bandwidth)
        )

    tp_s = 0.0
    if tp > 1:
        activation = tokens * shape.hidden_size * act_bytes
        reduces = 4 * shape.num_blocks + 2 * ckpt
        logits = 2 * tokens * shape.vocab_size * act_bytes
        tp_s = (reduces * activation + logits) * 2 * (tp - 1) / tp / hardware.intra_node_bandwidth

    offload_s = 0.0
    if layout.offload_params:
        shard_params = params_per_gpu / max(fsdp, 1)
        offload_s = shard_params * (2 * 4 + 4) / hardware.pcie_bandwidth + shard_params * 28 / hardware.host_bandwidth

    step_s = max(compute_s, fsdp_s) + tp_s + offload_s
    return StepCost(
        compute_s=compute_s,
        fsdp_s=fsdp_s,
        tp_s=tp_s,
        offload_s=offload_s,
        step_s=step_s,
        tokens_per_s=tokens / tp / step_s,
        mfu=model_flops / (step_s * peak),
    )
