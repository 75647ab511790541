"""Context parallelism against none: bytes sent per rank per step, per-rank peak memory, tokens/s.

Run (from the repository root)::

    .venv/bin/python benchmarks/context_parallel.py            # L4-H512 Llama, seq 2048, 2 ranks: a few minutes
    .venv/bin/python benchmarks/context_parallel.py --seq 4096
    .venv/bin/python benchmarks/context_parallel.py --quick    # smoke run, tiny model, seq 256

Two layouts on 2 ranks (CPU/gloo, ``OMP_NUM_THREADS=1``), one ``torchrun`` job each so that every peak is its
own. Both shard the parameters over the 2 ranks (FSDP over ``fsdp x cp``), so they hold the same state and
differ only in what a rank computes on:

* ``FSDP2``: ``dist.fsdp.size = 2``; each rank trains on one whole sequence (2 sequences per step).
* ``CP2``: ``dist.cp.size = 2`` (Ulysses); one sequence per step, each rank holds half of it.

Each rank holds ``--seq`` tokens under FSDP2 and half as many under CP2, which is what context parallelism is
for: a sequence whose activations do not fit on one rank. The training peak is ``VmHWM`` over the timed steps
minus ``VmRSS`` before them (after set-up and one warm-up step, so parameters, gradients and optimizer state
are already allocated): the activations and temporaries. One more step runs under a dispatch mode that adds
up the payload of every collective: FSDP's weights (all-gathers, reduce-scatters), CP's all-to-alls, and the
rest (the CP forward's small all-gather of positions and masks, the loss all-reduce). "Sent" is what a rank
sends: (n-1)/n of the payload of an all-gather, a reduce-scatter or an all-to-all, 2(n-1)/n of an all-reduce.
The table also gives the all-to-all bytes the formula of docs/context_parallel.md predicts.
"""

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    allocator_env,
    emit_result,
    machine_summary,
    malloc_trim,
    markdown_table,
    median,
    num_params,
    random_tokens,
    read_status,
    reset_peak_rss,
    run_torchrun,
)
from _tp import llama_model  # noqa: E402

RANKS = 2
# name -> (dist.fsdp.size, dist.cp.size, sequences per step)
CONTENDERS = {"FSDP2": (2, 1, 2), "CP2": (1, 2, 1)}
# (layers, hidden, intermediate, heads, kv heads)
SHAPE, QUICK_SHAPE = (4, 512, 1408, 8, 4), (2, 128, 256, 4, 2)
KINDS = ("weights (FSDP)", "all-to-all (CP)", "other")


def comm_counter(group_size: int) -> Any:
    """A dispatch mode adding up collective payloads by kind; see the module docstring for "sent"."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.payload = dict.fromkeys(KINDS, 0)
            self.sent = dict.fromkeys(KINDS, 0.0)

        def _add(self, kind: str, nbytes: int, factor: float) -> None:
            self.payload[kind] += nbytes
            self.sent[kind] += nbytes * factor * (group_size - 1) / group_size

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            name, namespace = func.__name__.split(".")[0], func.namespace

            def size(t: Any) -> int:
                return t.numel() * t.element_size()

            if namespace == "c10d":
                if name == "_allgather_base_":
                    self._add("weights (FSDP)", size(args[0]), 1.0)
                elif name == "_reduce_scatter_base_":
                    self._add("weights (FSDP)", size(args[1]), 1.0)
                elif name == "alltoall_base_":
                    self._add("all-to-all (CP)", size(args[1]), 1.0)
                elif name == "allgather_":
                    self._add("other", sum(size(t) for t in args[0][0]), 1.0)
                elif name == "allreduce_":
                    self._add("other", sum(size(t) for t in args[0]), 2.0)
            return func(*args, **(kwargs or {}))

    return Counter()


def all_to_all_formula(shape: tuple[int, ...], *, seq: int, cp: int, sequences: int) -> float:
    """Bytes an all-to-all rank sends per step (fp32): per layer 4 exchanges forward (q, k, v, the output) and
    4 backward, each of (heads or kv heads) x (this rank's tokens) x head_dim, (cp-1)/cp of it leaving."""
    layers, hidden, _, heads, kv_heads = shape
    if cp == 1:
        return 0.0
    head_dim = hidden // heads
    per_pass = (2 * heads + 2 * kv_heads) * sequences * (seq // cp) * head_dim * 4
    return layers * 2 * per_pass * (cp - 1) / cp


def worker(args: argparse.Namespace) -> None:
    import torch
    from torch.utils.data import DataLoader

    import torchacc

    torchacc.dist.init_distributed()
    malloc_trim()
    fsdp, cp, sequences = CONTENDERS[args.only]
    layers, hidden, intermediate, heads, kv_heads = shape = QUICK_SHAPE if args.quick else SHAPE
    model = llama_model(
        layers=layers,
        hidden=hidden,
        intermediate=intermediate,
        heads=heads,
        kv_heads=kv_heads,
        vocab=args.vocab,
        seq=args.seq,
    )
    params = num_params(model)
    config = torchacc.Config()
    config.dist.fsdp.size, config.dist.cp.size = fsdp, cp
    config.dist.fsdp.wrap_layer_cls = {"LlamaDecoderLayer"}
    per_rank = sequences // (RANKS // cp)  # the batch of one data-parallel rank: 1 sequence in both layouts
    dataset = random_tokens(sequences * (args.steps + 2), args.seq, args.vocab)
    model, loader = torchacc.accelerate(model, DataLoader(dataset, batch_size=per_rank), config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = iter(loader)

    def step() -> float:
        batch = next(batches)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    step()  # warm-up: gradients and optimizer state exist from here on
    malloc_trim()
    reset_peak_rss()
    before = read_status()["VmRSS"]
    torchacc.dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        step()
    seconds = torch.tensor([time.perf_counter() - start, time.process_time() - cpu], dtype=torch.float64)
    torch.distributed.all_reduce(seconds, op=torch.distributed.ReduceOp.MAX)
    peak = read_status()["VmHWM"] - before
    with comm_counter(RANKS) as counter:
        loss = step()
    emit_result(
        {
            "contender": args.only,
            "rank": torchacc.dist.rank(),
            "params": params,
            "tokens_per_rank": per_rank * args.seq // cp,
            "tokens_per_s": sequences * args.seq * args.steps / float(seconds[0]),
            "cpu_s_per_step": float(seconds[1]) / args.steps,
            "peak_gb": peak / 1e9,
            "payload": counter.payload,
            "sent": counter.sent,
            "formula": all_to_all_formula(shape, seq=args.seq, cp=cp, sequences=per_rank),
            "loss": loss,
            "loadavg": os.getloadavg()[0],
        }
    )


def table(results: list[dict[str, Any]]) -> str:
    rows = []
    for name in CONTENDERS:
        ranks = [r for r in results if r["contender"] == name]
        r0 = min(ranks, key=lambda r: r["rank"])
        mb = {kind: r0["sent"][kind] / 1e6 for kind in KINDS}
        rows.append(
            [
                name,
                f"{r0['params'] / 1e6:.1f}M",
                r0["tokens_per_rank"],
                f"{median(r['tokens_per_s'] for r in ranks):,.0f}",
                f"{r0['cpu_s_per_step']:.2f}",
                f"{mb['weights (FSDP)']:.1f}",
                f"{mb['all-to-all (CP)']:.1f} ({r0['formula'] / 1e6:.1f})",
                f"{mb['other'] * 1e3:.1f}",
                f"{max(r['peak_gb'] for r in ranks):.3f}",
            ]
        )
    headers = ["layout", "params", "tokens/rank/step", "tok/s", "CPU s/step", "sent MB weights (FSDP)"]
    headers += ["sent MB all-to-all (formula)", "sent KB other", "training peak GB/rank (activations)"]
    return markdown_table(headers, rows)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, seq 256 (< 1 min)")
    p.add_argument("--seq", type=int, default=0, help="tokens per sequence (default 2048; quick 256)")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary size")
    p.add_argument("--steps", type=int, default=0, help="timed steps (default 2; quick 1)")
    p.add_argument("--allocator", default="mmap64k-thp", help="malloc setting (see benchmarks/_common.py)")
    p.add_argument("--only", choices=list(CONTENDERS), help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.seq = args.seq or (256 if args.quick else 2048)
    args.steps = args.steps or (1 if args.quick else 2)
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    started = time.monotonic()
    results: list[dict[str, Any]] = []
    env = {**allocator_env(args.allocator), "CUDA_VISIBLE_DEVICES": ""}
    for name in CONTENDERS:
        print(f"running {name} on {RANKS} ranks, malloc {args.allocator}...", file=sys.stderr, flush=True)
        cmd = ["--worker", "--only", name, "--seq", str(args.seq), "--vocab", str(args.vocab)]
        cmd += ["--steps", str(args.steps), *(["--quick"] if args.quick else [])]
        results += run_torchrun(os.path.abspath(__file__), cmd, nproc=RANKS, env=env)
    info = machine_summary()
    print(
        f"\n## Context parallelism: Llama-style model, fp32 AdamW, {RANKS} ranks on CPU/gloo (seq {args.seq}, vocab "
        f"{args.vocab}, {args.steps} timed steps, malloc {args.allocator})\n"
    )
    print(
        f"{info['date']}; {info['cpu']}, {info['cores']} cores, {info['mem_gib']} GiB; torch {info['torch']}; "
        f"load {max(r['loadavg'] for r in results):.1f}; wall {time.monotonic() - started:.0f} s\n"
    )
    print(table(results))


if __name__ == "__main__":
    main()
