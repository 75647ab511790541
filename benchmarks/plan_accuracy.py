"""Planning accuracy: ``torchacc.estimate_memory`` and ``torchacc plan`` against real steps, and the planner at scale.

Run (from the repository root)::

    .venv/bin/python benchmarks/plan_accuracy.py            # 14 configurations at 2 and 4 ranks (~15 min loaded)
    .venv/bin/python benchmarks/plan_accuracy.py --only "llama pp=2" "llama cp=2"   # some of them
    .venv/bin/python benchmarks/plan_accuracy.py --quick    # smoke run: one tiny configuration at 2 ranks
    .venv/bin/python benchmarks/plan_accuracy.py --scale    # torchacc plan: Llama-3-70B shape on 512 GPUs, timed

The claims:

1. The estimate's peak is within 10% of the peak a real step reaches, and its parameter, gradient and optimizer
   bytes equal ``memory_report``'s. Each configuration trains for real on CPU/gloo (``torchrun``, real tensors):
   one AdamW step creates the optimizer state, the next runs inside ``torchacc.track_memory()``, and rank 0 (the
   busiest) reports ``memory_report(model, optimizer)``. ``estimate_memory(..., device_type="cpu")`` runs the
   same config and model in this process (fake process group, meta model, one fake step).
2. The planner's per-block scaling (3- and 4-block fake steps at 2 shards, the state at the real size: see
   [Note: per-block scaling] in torchacc/planning/scaling.py) agrees with a full fake step of the whole model at
   the real size, for a CUDA plan (``device_type="cuda"``: 512-byte blocks, foreach AdamW).
3. ``--scale``: ``torchacc plan`` for a Llama-3-70B shape on 512 GPUs at seq 8192 finishes in under 2 minutes, and
   the best layout's per-rank parameter bytes equal the arithmetic (torch.chunk shares of each weight).
"""

import argparse
import gc
import json
import os
import resource
import sys
import time
from typing import Any

from _common import emit_result, machine_summary, markdown_table, run_torchrun

# name -> (model, world size, settings); models: GPT-2 and Llama shapes, 6 blocks, vocabulary 8192
CONFIGS = {
    "gpt2 fsdp=2": ("gpt2", 2, {"dist.fsdp.size": 2}),
    "gpt2 fsdp=2 AC": ("gpt2", 2, {"dist.fsdp.size": 2, "memory.gc": True}),
    "llama fsdp=2 bf16": ("llama", 2, {"dist.fsdp.size": 2, "compute.bf16": True}),
    "llama tp=2": ("llama", 2, {"dist.tp.size": 2}),
    "llama tp=2 AC": ("llama", 2, {"dist.tp.size": 2, "memory.gc": True}),
    "gpt2 dp=2 x fsdp=2": ("gpt2", 4, {"dist.fsdp.size": 2, "dist.dp.size": 2}),
    "gpt2 dp=2 x fsdp=2 AC 1/2": (
        "gpt2",
        4,
        {"dist.fsdp.size": 2, "dist.dp.size": 2, "memory.gc": True, "memory.gc_interval": 2},
    ),  # fmt: skip
    "llama fsdp=2 x tp=2": ("llama", 4, {"dist.fsdp.size": 2, "dist.tp.size": 2}),
    "llama fsdp=2 x tp=2 AC": ("llama", 4, {"dist.fsdp.size": 2, "dist.tp.size": 2, "memory.gc": True}),
    "llama fsdp=4 AC 1/2 bf16": (
        "llama",
        4,
        {"dist.fsdp.size": 4, "memory.gc": True, "memory.gc_interval": 2, "compute.bf16": True},
    ),  # fmt: skip
    # context parallelism and pipelines (a pipeline's batch: `batch` sequences per microbatch, one per stage);
    # the pipelines last: a pipelined model's memory is partly freed only during the next configuration
    "llama cp=2": ("llama", 2, {"dist.cp.size": 2, "dist.fsdp.size": 1}),
    "llama fsdp=2 x cp=2 AC": ("llama", 4, {"dist.cp.size": 2, "dist.fsdp.size": 2, "memory.gc": True}),
    "llama pp=2": ("llama", 2, {"dist.pp.size": 2, "dist.fsdp.size": 1}),
    "llama pp=2 x fsdp=2 AC bf16": (
        "llama",
        4,
        {"dist.pp.size": 2, "dist.fsdp.size": 2, "memory.gc": True, "compute.bf16": True},
    ),  # fmt: skip
}
QUICK = ("llama tp=2",)
SHAPE = {"layers": 6, "hidden": 256, "heads": 8, "vocab": 8192, "seq": 256, "batch": 2}
QUICK_SHAPE = {"layers": 3, "hidden": 64, "heads": 4, "vocab": 512, "seq": 32, "batch": 2}


def hf_config(kind: str, shape: dict) -> Any:
    from transformers import GPT2Config, LlamaConfig

    if kind == "gpt2":
        return GPT2Config(vocab_size=shape["vocab"], n_positions=shape["seq"], n_embd=shape["hidden"],
                          n_layer=shape["layers"], n_head=shape["heads"], resid_pdrop=0.0, embd_pdrop=0.0,
                          attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    ffn = shape["hidden"] * 11 // 4
    return LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=ffn,
                       num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                       num_key_value_heads=shape["heads"] // 2, max_position_embeddings=shape["seq"], bos_token_id=0,
                       eos_token_id=0, pad_token_id=None, tie_word_embeddings=False)  # fmt: skip


def build_config(kind: str, settings: dict) -> Any:
    import torchacc

    config = torchacc.Config()
    config.dist.fsdp.wrap_layer_cls = {"GPT2Block" if kind == "gpt2" else "LlamaDecoderLayer"}
    for dotted, value in settings.items():
        *path, leaf = dotted.split(".")
        node = config
        for part in path:
            node = getattr(node, part)
        setattr(node, leaf, value)
    return config


def worker(args: argparse.Namespace) -> None:
    """Inside each rank: every configuration of this world size, for real."""
    import torch
    from transformers import AutoModelForCausalLM

    import torchacc
    from torchacc.data.context import split_sequences

    torchacc.dist.init_distributed()
    shape = QUICK_SHAPE if args.quick else SHAPE
    for name in args.names:
        kind, _, settings = CONFIGS[name]
        torch.manual_seed(0)
        model = torchacc.accelerate(AutoModelForCausalLM.from_config(hf_config(kind, shape)),
                                    config=build_config(kind, settings))  # fmt: skip
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        pp, cp = settings.get("dist.pp.size", 1), settings.get("dist.cp.size", 1)
        ids = torch.randint(0, shape["vocab"], (shape["batch"] * pp, shape["seq"]))
        batch = {"input_ids": ids, "labels": ids}
        if cp > 1:  # what the loader gives a CP rank: its chunk of every sequence
            batch = split_sequences(batch, rank=torchacc.dist.rank() % cp, size=cp)
        torchacc.train_step(model, batch)
        optimizer.step()
        optimizer.zero_grad()
        gc.collect()
        with torchacc.track_memory():
            torchacc.train_step(model, batch)
            optimizer.step()
        report = torchacc.memory_report(model, optimizer)
        # every rank reports: the estimate of a pipeline speaks for its busiest stage's first rank
        emit_result({"name": name, "rank": torchacc.dist.rank(), "parameters": report.parameters.held_bytes,
                     "gradients": report.gradients.held_bytes, "optimizer_state": report.optimizer_state.held_bytes,
                     "peak": report.peak_bytes})  # fmt: skip
        del model, optimizer
        gc.collect()
    torchacc.dist.teardown()


def planner_peak(kind: str, world: int, settings: dict, shape: dict) -> Any:
    """The planner's estimate for exactly this layout: one candidate, scaled from 3- and 4-block fake steps."""
    from torchacc.planning.candidates import Choice, Cluster
    from torchacc.planning.plan import plan_layouts

    layout = {k: v for k, v in settings.items() if k.startswith("dist.")}
    rest = {k: v for k, v in settings.items() if not k.startswith("dist.")}
    plan = plan_layouts(hf_config(kind, shape), cluster=Cluster(num_gpus=world, gpus_per_node=world),
                        micro_batch_size=shape["batch"], seq_len=shape["seq"], config=build_config(kind, rest),
                        axes=[lambda _: [Choice("", {"dist.dp.size": None, **layout})]])  # fmt: skip
    (row,) = plan.layouts
    return row.estimate


def accuracy(args: argparse.Namespace) -> None:
    import torchacc

    names = list(QUICK if args.quick else args.only or CONFIGS)
    shape = QUICK_SHAPE if args.quick else SHAPE
    real: dict[str, dict] = {}
    for world in (2, 4):
        mine = [n for n in names if CONFIGS[n][1] == world]
        if mine:
            for result in run_torchrun(__file__, ["--worker", *(["--quick"] if args.quick else []), "--names", *mine],
                                       nproc=world, timeout=1800):  # fmt: skip
                real[(result["name"], result["rank"])] = result
    rows, scaled_rows = [], []
    for name in names:
        kind, world, settings = CONFIGS[name]
        config, step = build_config(kind, settings), {"micro_batch_size": shape["batch"], "seq_len": shape["seq"]}
        start = time.perf_counter()
        cpu = torchacc.estimate_memory(hf_config(kind, shape), config, world_size=world, device_type="cpu", **step)
        seconds = time.perf_counter() - start
        measured = real[(name, cpu.rank)]
        exact = all(getattr(cpu, k) == measured[k] for k in ("parameters", "gradients", "optimizer_state"))
        busiest = max(r["peak"] for (n, _), r in real.items() if n == name)
        rows.append([name, world, cpu.rank, _mib(measured["peak"]), _mib(cpu.peak),
                     f"{cpu.peak / measured['peak'] - 1:+.1%}", "yes" if exact else "NO",
                     "yes" if measured["peak"] == busiest else f"NO ({_mib(busiest)})", f"{seconds:.1f}"])  # fmt: skip
        full = torchacc.estimate_memory(hf_config(kind, shape), config, world_size=world, **step)
        scaled = planner_peak(kind, world, settings, shape)
        scaled_rows.append([name, _mib(full.peak), _mib(scaled.peak), f"{scaled.peak / full.peak - 1:+.1%}"])
    print(f"### Estimate against a real step (rank 0, CPU/gloo; {shape})\n")
    print(markdown_table(["config", "ranks", "rank", "measured peak MiB", "estimated peak MiB", "error",
                          "params, grads, optimizer exact", "busiest rank", "estimate s"], rows))  # fmt: skip
    print("\n### The planner's per-block scaling against a full fake step (CUDA plan)\n")
    print(markdown_table(["config", "full fake step MiB", "planner (scaled) MiB", "difference"], scaled_rows))
    print(f"\n{json.dumps(machine_summary())}")


def scale(args: argparse.Namespace) -> None:
    from transformers import LlamaConfig

    from torchacc.planning.candidates import Cluster
    from torchacc.planning.command import format_plan
    from torchacc.planning.plan import plan_layouts

    cfg = LlamaConfig(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                      intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False)  # fmt: skip
    start, load = time.perf_counter(), os.getloadavg()
    plan = plan_layouts(
        cfg, cluster=Cluster(num_gpus=512, gpus_per_node=8), micro_batch_size=1, seq_len=8192, bf16=True
    )
    wall = time.perf_counter() - start
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
    print(format_plan(plan, model_name="Llama-3-70B shape"))
    best = plan.best
    dims = best.config.dist
    expected = _llama_rank0_bytes(cfg, fsdp=dims.fsdp.size, tp=dims.tp.size)
    print(f"\nbest layout's parameters per rank: {best.estimate.parameters} bytes; arithmetic: {expected} "
          f"({'equal' if expected == best.estimate.parameters else 'DIFFERENT'})")  # fmt: skip
    print(f"plan: {wall:.1f} s wall, {cpu:.1f} s CPU (this process and its workers, imports included); "
          f"load average at the start {load[0]:.1f}")  # fmt: skip
    print(json.dumps(machine_summary()))


def _llama_rank0_bytes(cfg: Any, *, fsdp: int, tp: int) -> int:
    """Rank 0's float32 parameter bytes: TP splits (colwise and embedding rows, rowwise columns), then FSDP rows."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    kv = cfg.num_key_value_heads * d // cfg.num_attention_heads
    block = [(d, d, 0), (kv, d, 0), (kv, d, 0), (d, d, 1), (f, d, 0), (f, d, 0), (d, f, 1), (d, 1, None), (d, 1, None)]
    rest = [(v, d, 0), (d, 1, None), (v, d, 0)]

    def held(rows: int, cols: int, split: int | None) -> int:
        rows, cols = (rows // tp, cols) if split == 0 else (rows, cols // tp) if split == 1 else (rows, cols)
        return 4 * min(-(-rows // fsdp), rows) * cols

    return cfg.num_hidden_layers * sum(held(*p) for p in block) + sum(held(*p) for p in rest)


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one tiny configuration at 2 ranks")
    parser.add_argument("--scale", action="store_true", help="torchacc plan for a Llama-3-70B shape on 512 GPUs")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--names", nargs="*", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--only", nargs="*", default=[], choices=list(CONFIGS), help="these configurations only")
    args = parser.parse_args()
    if args.worker:
        worker(args)
    elif args.scale:
        scale(args)
    else:
        accuracy(args)


if __name__ == "__main__":
    sys.exit(main())
