"""Training throughput (tokens/s) of GPT-2: torchacc against hand-written FSDP2, DDP and one process.

Run (from the repository root)::

    .venv/bin/python benchmarks/throughput.py            # full: 3 GPT-2 sizes, 3 rounds (about 10 min on 2 cores)
    .venv/bin/python benchmarks/throughput.py --quick    # smoke run: one tiny size, 1 round, < 60 s

Contenders, all training a ``transformers.GPT2LMHeadModel`` (built from ``GPT2Config``, float32, dropout
off, the same seed) with ``torch.optim.AdamW`` on the same synthetic tokens:

* ``(a) torchacc``: ``torchacc.accelerate(model, loader, config)`` with ``dist.fsdp.size = 2`` and
  ``dist.fsdp.wrap_layer_cls = {"GPT2Block"}``; its loader delivers the batches on the device.
* ``(b) FSDP2``:    the same by hand: ``fully_shard`` on every ``GPT2Block``, then the root, on a 1-D
  ``("fsdp",)`` mesh with ``MixedPrecisionPolicy(reduce_dtype=float32)``, a ``DistributedSampler`` loader,
  and the batch moved to the device in the loop (what torchacc's loader does).
* ``(c) DDP``:      ``torch.nn.parallel.DistributedDataParallel`` over the same ranks and loader.
* ``(d) 1 process``: the plain model on rank 0 with the same per-rank batch, while rank 1 sleeps in a gloo
  barrier (its CPU time is reported, to show it leaves the core alone).

One ``torchrun --nproc_per_node=2`` job runs every measurement, so process start-up is paid once. Each
measurement builds a fresh model, runs ``--warmup`` untimed steps (FSDP lazy init, AdamW state), then
times ``--steps`` steps between a barrier and the slowest rank's end. The order of the contenders rotates
every round (a b c d, b c d a, ...). Tokens/s counts the tokens of all ranks (``ranks x batch x seq``
per step); tables show medians over rounds. On CUDA (when available) the same code runs with NCCL,
one GPU per rank, and ``torch.cuda.synchronize()`` before reading the clock.
"""

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from _common import (
    emit_result,
    gpt2_model,
    machine_summary,
    markdown_table,
    median,
    num_params,
    process_group_backend,
    random_tokens,
    run_torchrun,
)

CONTENDERS = ("torchacc", "fsdp2", "ddp", "single")
LABELS = {"torchacc": "(a) torchacc", "fsdp2": "(b) FSDP2", "ddp": "(c) DDP", "single": "(d) 1 process"}
# name -> (n_layer, n_embd, n_head, timed steps); the vocabulary is --vocab, the context --seq.
FULL_SIZES = {
    "L2-E128": (2, 128, 4, 30),
    "L4-E256": (4, 256, 4, 12),
    "L6-E512": (6, 512, 8, 5),
}
QUICK_SIZES = {"L2-E128": (2, 128, 4, 4)}
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


# ------------------------------------------------------------------------------------------------
# Inside a rank
# ------------------------------------------------------------------------------------------------


def _move(batch: dict[str, Any], device: Any) -> dict[str, Any]:
    return {key: value.to(device) for key, value in batch.items()}


def _keep(batch: Any) -> Any:
    return batch


def _sharded_loader(dataset: Any, batch: int) -> Any:
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(dataset, dist.get_world_size(), dist.get_rank(), shuffle=False, drop_last=True)
    return DataLoader(dataset, batch_size=batch, sampler=sampler, drop_last=True)


def setup_torchacc(model: Any, dataset: Any, batch: int, device: Any) -> tuple[Any, Any, Callable[[Any], Any]]:
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    import torchacc

    config = torchacc.Config()
    config.dist.fsdp.size = dist.get_world_size()
    config.dist.fsdp.wrap_layer_cls = {"GPT2Block"}
    model, loader = torchacc.accelerate(model, DataLoader(dataset, batch_size=batch, drop_last=True), config)
    return model, loader, _keep  # torchacc's loader already yields batches on the device


def setup_fsdp2(model: Any, dataset: Any, batch: int, device: Any) -> tuple[Any, Any, Callable[[Any], Any]]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model.to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    return model, _sharded_loader(dataset, batch), lambda b: _move(b, device)


def setup_ddp(model: Any, dataset: Any, batch: int, device: Any) -> tuple[Any, Any, Callable[[Any], Any]]:
    from torch.nn.parallel import DistributedDataParallel

    model.to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return ddp, _sharded_loader(dataset, batch), lambda b: _move(b, device)


def setup_single(model: Any, dataset: Any, batch: int, device: Any) -> tuple[Any, Any, Callable[[Any], Any]]:
    from torch.utils.data import DataLoader

    model.to(device)
    return model, DataLoader(dataset, batch_size=batch, drop_last=True), lambda b: _move(b, device)


SETUPS = {"torchacc": setup_torchacc, "fsdp2": setup_fsdp2, "ddp": setup_ddp, "single": setup_single}


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_steps(model: Any, optimizer: Any, batches: Any, move: Callable[[Any], Any], num_steps: int) -> float:
    """``num_steps`` training steps; the last loss (``.item()``, which waits for the device), or nan for none."""
    loss = None
    for _ in range(num_steps):
        loss = model(**move(next(batches))).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return float("nan") if loss is None else loss.item()


def measure(contender: str, size: tuple[int, int, int, int], args: argparse.Namespace, device: Any, gloo: Any) -> dict:
    """Train ``contender`` for ``warmup + steps`` steps; the timed part's tokens/s (all ranks) and last loss."""
    import torch
    import torch.distributed as dist

    n_layer, n_embd, n_head, steps = size
    steps = args.steps or steps
    world, rank = dist.get_world_size(), dist.get_rank()
    dataset = random_tokens(world * args.batch * (args.warmup + steps), args.seq, args.vocab)
    if contender == "single" and rank != 0:
        cpu = time.process_time()
        dist.barrier(group=gloo)  # rank 0 trains alone; this one sleeps until it is done
        return {"idle_cpu_s": time.process_time() - cpu}
    model = gpt2_model(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab=args.vocab, seq=args.seq)
    params = num_params(model)
    model, loader, move = SETUPS[contender](model, dataset, args.batch, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = iter(loader)
    run_steps(model, optimizer, batches, move, args.warmup)
    _sync(device)
    if contender != "single":
        dist.barrier(group=gloo)
    start = time.perf_counter()
    last_loss = run_steps(model, optimizer, batches, move, steps)
    _sync(device)
    elapsed = time.perf_counter() - start
    if contender == "single":
        dist.barrier(group=gloo)  # release rank 1
        num_ranks = 1
    else:
        slowest = torch.tensor([elapsed], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=gloo)
        elapsed, num_ranks = slowest.item(), world
    del model, optimizer, loader, batches
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    tokens = num_ranks * args.batch * args.seq * steps
    return {"tokens_per_s": tokens / elapsed, "seconds": elapsed, "steps": steps, "loss": last_loss, "params": params}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(process_group_backend(device.type))
    gloo = dist.new_group(backend="gloo")  # barriers and timings on the CPU, also next to NCCL
    rank = dist.get_rank()
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    names = args.sizes or list(sizes)
    for round_index in range(args.rounds):
        shift = round_index % len(CONTENDERS)
        order = CONTENDERS[shift:] + CONTENDERS[:shift]
        for name in names:
            for contender in order:
                result = measure(contender, sizes[name], args, device, gloo)
                result.update(
                    round=round_index,
                    size=name,
                    contender=contender,
                    rank=rank,
                    order="".join("abcd"[CONTENDERS.index(c)] for c in order),
                )
                if rank == 0 and "tokens_per_s" in result:
                    print(
                        f"[round {round_index + 1}/{args.rounds}] {name} {LABELS[contender]}: "
                        f"{result['tokens_per_s']:,.0f} tok/s ({result['steps']} steps in {result['seconds']:.2f} s,"
                        f" loss {result['loss']:.4f})",
                        flush=True,
                    )
                if rank == 0 or "idle_cpu_s" in result:
                    emit_result(result)
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# The driver: one torchrun job, then the tables
# ------------------------------------------------------------------------------------------------


def summarize(results: list[dict[str, Any]], args: argparse.Namespace) -> tuple[str, str, str, dict]:
    """The medians table, the per-round table, a fairness line, and the medians for the plot."""
    timed = [r for r in results if "tokens_per_s" in r]
    sizes = list(dict.fromkeys(r["size"] for r in timed))
    tok = {
        (s, c): [r["tokens_per_s"] for r in timed if r["size"] == s and r["contender"] == c]
        for s in sizes
        for c in CONTENDERS
    }
    med = {key: median(values) for key, values in tok.items() if values}
    rows, round_rows, loss_gap = [], [], 0.0
    for s in sizes:
        params = next(r["params"] for r in timed if r["size"] == s)
        ratios = []
        for round_index in sorted({r["round"] for r in timed if r["size"] == s}):
            this = {r["contender"]: r for r in timed if r["size"] == s and r["round"] == round_index}
            if "torchacc" in this and "fsdp2" in this:
                ratios.append(this["torchacc"]["tokens_per_s"] / this["fsdp2"]["tokens_per_s"])
                loss_gap = max(loss_gap, abs(this["torchacc"]["loss"] - this["fsdp2"]["loss"]))
            order = next(iter(this.values()))["order"]
            round_rows.append(
                [
                    s,
                    round_index + 1,
                    order,
                    *(f"{this[c]['tokens_per_s']:,.0f}" if c in this else "-" for c in CONTENDERS),
                    f"{ratios[-1]:.3f}" if ratios else "-",
                ]
            )
        ratio = med[(s, "torchacc")] / med[(s, "fsdp2")]
        spread = f" ({min(ratios):.3f}-{max(ratios):.3f})" if len(ratios) > 1 else ""
        single = med[(s, "single")]
        rows.append(
            [
                s,
                f"{params / 1e6:.2f}M",
                args.nproc * args.batch * args.seq,
                *(f"{med[(s, c)]:,.0f}" for c in CONTENDERS),
                f"**{ratio:.3f}**{spread}",
                *(f"{med[(s, c)] / single:.2f}x" for c in ("torchacc", "fsdp2", "ddp")),
            ]
        )
    headers = [
        "model",
        "params",
        "tokens/step",
        *(LABELS[c] + " tok/s" for c in CONTENDERS),
        "(a)/(b) (range)",
        "speed-up (a)",
        "speed-up (b)",
        "speed-up (c)",
    ]
    idle = [r["idle_cpu_s"] for r in results if "idle_cpu_s" in r]
    notes = (
        f"max |final loss (a) - final loss (b)| over rounds: {loss_gap:.2e} (same data, same init); "
        f"CPU time of the idle rank during (d): max {max(idle, default=0.0):.3f} s"
    )
    per_round = markdown_table(["model", "round", "order", *(LABELS[c] for c in CONTENDERS), "(a)/(b)"], round_rows)
    return markdown_table(headers, rows), per_round, notes, med


def plot(med: dict, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    sizes = list(dict.fromkeys(s for s, _ in med))
    width = 0.8 / len(CONTENDERS)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, c in enumerate(CONTENDERS):
        xs = [j + (i - 1.5) * width for j in range(len(sizes))]
        ax.bar(xs, [med.get((s, c), 0) for s in sizes], width, label=LABELS[c])
    ax.set_xticks(range(len(sizes)), sizes)
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s (median, all ranks)")
    ax.set_title("GPT-2 training throughput, fp32 AdamW, 2 ranks")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one tiny size, 1 round, few steps (< 60 s)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of all contenders (default 3, quick 1)")
    p.add_argument("--steps", type=int, default=0, help="timed steps per measurement (default: per size)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2, quick 1)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary size (GPT-2's is 50257)")
    p.add_argument("--sizes", nargs="*", help=f"subset of {list(FULL_SIZES)}")
    p.add_argument("--nproc", type=int, default=2, help="ranks")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--plot", default=os.path.join(OUT_DIR, "throughput.png"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < args.nproc:
            sys.exit(f"--device cuda needs {args.nproc} GPUs, found {torch.cuda.device_count()}; pass --nproc")
    passed = [a for a in sys.argv[1:] if a != "--worker"]
    started = time.monotonic()
    results = run_torchrun(os.path.abspath(__file__), [*passed, "--worker", "--device", args.device], nproc=args.nproc)
    table, per_round, notes, med = summarize(results, args)
    info = machine_summary()
    print(
        f"\n## Training throughput: GPT-2, fp32 AdamW, {args.nproc} ranks on {args.device} "
        f"(batch {args.batch}/rank, seq {args.seq}, vocab {args.vocab}, {args.rounds} rounds, "
        f"{args.warmup} warm-up steps)\n"
    )
    print(
        f"{info['date']}; {info['cpu']}, {info['cores']} cores, {info['mem_gib']} GiB; torch {info['torch']}; "
        f"wall {time.monotonic() - started:.0f} s\n"
    )
    print("Medians over rounds; speed-up = tokens/s against (d) one process.\n")
    print(table)
    print("\nPer round (tokens/s):\n")
    print(per_round)
    print("\n" + notes)
    os.makedirs(OUT_DIR, exist_ok=True)
    with open(os.path.join(OUT_DIR, "throughput.json"), "w") as f:
        json.dump({"args": vars(args), "machine": info, "results": results}, f, indent=1)
    path = plot(med, args.plot)
    print(f"plot: {path}" if path else "plot: skipped (matplotlib is not installed)")


if __name__ == "__main__":
    main()
