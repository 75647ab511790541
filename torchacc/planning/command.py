"""``torchacc plan``: the layouts of a model on N GPUs that fit, fastest first, and the config of the best.

Example::

    torchacc plan --model meta-llama-3-70b/ --gpus 512 --gpu-memory 80GB --seq-len 8192 --micro-batch 1 --bf16

The subcommand is self-contained: ``add_plan_arguments`` declares its arguments on the sub-parser that
``torchacc.cli`` makes for it and ``run_plan`` runs it (``torchacc.cli`` turns its errors into one line on
stderr and exit code 1, like the other subcommands').
"""

import argparse
import re

from ..config import Config
from ..parallel.memory_report import format_bytes
from .candidates import Cluster
from .costs import Hardware
from .models import resolve_factory
from .plan import Plan, plan_layouts

__all__ = ["PLAN_HELP", "add_plan_arguments", "run_plan", "format_plan", "parse_bytes"]

_UNITS = {"": 10**9, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_bytes(text: str) -> int:
    """``"80GB"`` -> 80e9, ``"80GiB"`` -> 80 * 2**30, ``"80"`` -> 80e9 (a bare number is GB).

    Raises:
        ValueError: not a size, or no bytes.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"--gpu-memory {text!r} is not a size; write e.g. 80GB or 80GiB")
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size < 1:
        raise ValueError(f"--gpu-memory {text!r} is no memory; write the memory of one GPU, e.g. 80GB")
    return size


PLAN_HELP = "the layouts that fit a model on N GPUs, fastest first (runs on one CPU)"


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """Declare ``torchacc plan``'s arguments on its sub-parser."""
    p.add_argument("--model", required=True, help="a Hugging Face model directory, its config.json, or module:factory")
    p.add_argument("--gpus", type=int, required=True, help="the number of GPUs of the job")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-memory", default="80GB", help="memory per GPU (80GB, 80GiB; default 80GB)")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    p.add_argument("--micro-batch", type=int, required=True, help="sequences per GPU (per TP group) and step")
    p.add_argument("--optimizer", choices=["adamw"], default="adamw")
    p.add_argument("--bf16", action="store_true", help="compute in bf16 (compute.bf16=True)")
    p.add_argument("--config", help="a base config YAML (wrap classes, precision...); the plan sets the layout on it")
    p.add_argument("--ac-interval", type=int, default=2, help="k of the 'checkpoint 1 block in k' layouts (2)")
    hw = Hardware()
    p.add_argument("--peak-tflops", type=float, help="dense peak of the compute dtype (H100 SXM: 989 bf16, 67 fp32)")
    p.add_argument("--intra-node-bandwidth", type=float, default=hw.intra_node_bandwidth / 1e9,
                   help="GB/s per GPU inside a node (NVLink 4: 450)")  # fmt: skip
    p.add_argument("--inter-node-bandwidth", type=float, default=hw.inter_node_bandwidth / 1e9,
                   help="GB/s per GPU across nodes (400 Gb/s InfiniBand: 50)")  # fmt: skip
    p.add_argument("--pcie-bandwidth", type=float, default=hw.pcie_bandwidth / 1e9, help="GB/s for CPU offload (50)")
    p.add_argument("--host-bandwidth", type=float, default=hw.host_bandwidth / 1e9,
                   help="host memory GB/s per GPU for the offloaded optimizer step (25)")  # fmt: skip
    p.add_argument("--memory-reserve", type=float, default=hw.memory_reserve,
                   help="share of --gpu-memory kept free for the CUDA context, NCCL, fragmentation (0.1)")  # fmt: skip


def _hardware(args: argparse.Namespace) -> Hardware:
    if not 0 <= args.memory_reserve < 1:
        raise ValueError(f"--memory-reserve must be in [0, 1), got {args.memory_reserve}")
    peak = {} if args.peak_tflops is None else {"peak_flops_bf16": args.peak_tflops * 1e12,
                                                "peak_flops_fp32": args.peak_tflops * 1e12}  # fmt: skip
    return Hardware(
        memory_bytes=parse_bytes(args.gpu_memory),
        intra_node_bandwidth=args.intra_node_bandwidth * 1e9,
        inter_node_bandwidth=args.inter_node_bandwidth * 1e9,
        pcie_bandwidth=args.pcie_bandwidth * 1e9,
        host_bandwidth=args.host_bandwidth * 1e9,
        memory_reserve=args.memory_reserve,
        **peak,
    )


def run_plan(args: argparse.Namespace) -> list[str]:
    """Run ``torchacc plan``: print the plan; returns no paths (it writes no file).

    Raises:
        ValueError: a size below 1, a model that cannot be read or laid out (``torchacc.cli`` prints it).
    """
    for name in ("seq_len", "micro_batch"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    model = resolve_factory(args.model) if _is_factory(args.model) else args.model
    config = None
    if args.config:
        config = Config.from_yaml(args.config)
        config.compute.bf16 = config.compute.bf16 or args.bf16
    cluster = Cluster(num_gpus=args.gpus, gpus_per_node=args.gpus_per_node, ac_interval=args.ac_interval)
    hardware = _hardware(args)
    plan = plan_layouts(model, cluster=cluster, micro_batch_size=args.micro_batch, seq_len=args.seq_len,
                        hardware=hardware, config=config, bf16=args.bf16, optimizer=args.optimizer)  # fmt: skip
    print(format_plan(plan, model_name=args.model))
    return []


def _is_factory(text: str) -> bool:
    return ":" in text and not text.endswith(".json") and "/" not in text.split(":")[0]


def _count(num: int) -> str:
    """``70.55B``, ``124.44M``, ``8.40K``: the largest unit that leaves a whole number in front."""
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if num >= size:
            return f"{num / size:.2f}{unit}"
    return str(num)


def format_plan(plan: Plan, *, model_name: str = "the model") -> str:
    """The plan as text: the fitting layouts (a markdown table), the others, the refused, the best config."""
    shape, cluster, hw = plan.shape, plan.cluster, plan.hardware
    nodes = max(1, cluster.num_gpus // cluster.gpus_per_node)
    lines = [
        f"{model_name}: {_count(shape.num_params)} parameters, {shape.num_blocks} blocks; {cluster.num_gpus} "
        f"GPU{'s' if cluster.num_gpus > 1 else ''} "
        f"({nodes} node{'s' if nodes > 1 else ''} of {cluster.node_size}), {format_bytes(hw.memory_bytes)} each "
        f"({format_bytes(hw.usable_bytes)} usable)",
        "",
    ]
    fitting = plan.fitting
    if fitting:
        first = fitting[0].estimate
        lines.append(f"{len(fitting)} layouts fit, fastest first (micro batch {first.micro_batch_size} x "
                     f"{first.seq_len} tokens per GPU or TP group):")  # fmt: skip
        lines.append("")
        lines.append("| layout | peak per GPU | activations | step s | tokens/s per GPU | MFU |")
        lines.append("|---|---|---|---|---|---|")
        for row in fitting:
            e, c = row.estimate, row.cost
            lines.append(f"| {row.candidate.label} | {format_bytes(e.peak)} | {format_bytes(e.activations)} | "
                         f"{c.step_s:.3g} | {c.tokens_per_s:,.0f} | {c.mfu:.1%} |")  # fmt: skip
    else:
        lines.append(f"No layout fits in {format_bytes(hw.usable_bytes)} per GPU: use more GPUs, a shorter --seq-len "
                     "or a smaller --micro-batch.")  # fmt: skip
    too_big = sorted((row for row in plan.layouts if not row.fits), key=lambda row: row.estimate.peak)
    if too_big:
        lines += ["", f"{len(too_big)} layouts do not fit (peak per GPU over {format_bytes(hw.usable_bytes)}), "
                      "closest first:"]  # fmt: skip
        lines += [f"- {row.candidate.label}: {format_bytes(row.estimate.peak)}" for row in too_big]
    if plan.refused:
        lines += ["", "Layouts that cannot exist (what accelerate() would raise):"]
        lines += [f"- {candidate.label}: {error}" for candidate, error in plan.refused]
    best = plan.best
    if best is not None:
        lines += ["", f"The config of the best layout ({best.candidate.label}), for Config.from_yaml:", ""]
        lines.append(best.config.to_yaml().rstrip())
    return "\n".join(lines)
