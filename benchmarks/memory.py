"""Per-rank peak memory of training state under torchacc FSDP against world size, measured and in theory.

Run (from the repository root)::

    .venv/bin/python benchmarks/memory.py                # full: a 209M-param GPT-2 (3.3 GB of state), ~5 min
    .venv/bin/python benchmarks/memory.py --vocab 8192   # the same blocks with a small vocabulary (176M params)
    .venv/bin/python benchmarks/memory.py --quick        # smoke run: a 5M-parameter GPT-2, < 60 s

Each configuration is one ``torchrun`` job (``OMP_NUM_THREADS=1`` per rank) on the CPU with gloo (GPUs, if
any, are hidden from the ranks: this measures host memory):

* ``baseline``: a rank that imports torch, transformers and torchacc, starts the process group and builds
  nothing. Its peak is measured exactly like the training ranks' and subtracted from theirs.
* ``torchacc FSDP``: a ``transformers.GPT2LMHeadModel`` built from ``GPT2Config`` (float32), then
  ``torchacc.accelerate()`` with ``dist.fsdp.size = N`` and ``wrap_layer_cls = {"GPT2Block"}`` (at N = 1
  it is left unsharded), ``torch.optim.AdamW``, and ``--steps`` training steps.
* ``torchacc DP`` (N = 2, for contrast): ``dist.fsdp.size = 1``, i.e. replicated with DDP all-reduce.

Set-up and training are measured apart. Every rank builds the full model before ``accelerate()`` shards
it (there is no meta-device init), so the set-up peak holds a transient full copy; it is reported as
"set-up peak". Then glibc's ``malloc_trim(0)`` returns the freed set-up memory to the kernel, the
kernel's peak-RSS counter is reset (``/proc/self/clear_refs`` = 5) and the training steps run: the
"training peak" is ``VmHWM`` after them (exact), cross-checked by ``VmRSS`` polled every 2 ms in a
thread. Both are per rank (the largest rank is shown) minus the baseline rank's value.

Every configuration runs under each malloc setting of ``--allocator`` (default ``glibc mmap64k``):
``glibc`` is the default, what a user gets; ``mmap64k`` (``MALLOC_MMAP_THRESHOLD_=65536``) maps every block of
64 KiB or more on its own and unmaps it when freed. glibc's default raises its mmap threshold up to 32 MiB as
large blocks are freed, after which blocks below that (an FSDP unit's all-gather and reduce-scatter buffers,
gradients, activations) come from the heap, where freed space stays resident; ``mmap64k`` shows what the
tensors themselves need. ``mmap4m``, ``mmap16m``, ``jemalloc`` and ``tcmalloc`` (preloaded system libraries)
are there to compare; ``throughput.py --allocator`` measures their CPU cost.

Theory for fp32 AdamW: 16 bytes per parameter (param 4 + grad 4 + exp_avg 4 + exp_avg_sq 4) divided by
N, plus, when sharded, one unsharded FSDP unit (the largest unit's full parameters and gradients,
8 bytes per parameter, during its forward/backward). Activations are not in the theory: the batch is
kept small (``--batch 1 --seq 64``) so they stay a few percent of the state.
"""

import argparse
import gc
import json
import os
import sys
import time
from typing import Any

from _common import (
    ALLOCATORS,
    GB,
    MemorySampler,
    allocator_env,
    emit_result,
    gpt2_model,
    machine_summary,
    malloc_trim,
    markdown_table,
    num_params,
    random_tokens,
    read_status,
    reset_peak_rss,
    run_torchrun,
)

# (n_layer, n_embd, n_head, vocab): full is GPT-2's vocabulary with 24 layers of width 768 (GPT-2 medium depth).
FULL_MODEL = (24, 768, 12, 50257)
QUICK_MODEL = (4, 256, 4, 8192)
# (kind, world size): run in this order, once per allocator setting.
RUNS = (("baseline", 1), ("fsdp", 1), ("baseline", 2), ("fsdp", 2), ("dp", 2))
LABELS = {"fsdp": "torchacc FSDP", "dp": "torchacc DP (replicated)"}
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
BYTES_STATE = 16  # fp32 AdamW: param, grad, exp_avg, exp_avg_sq
BYTES_UNIT = 8  # an unsharded unit: full params and full grads


# ------------------------------------------------------------------------------------------------
# Inside a rank
# ------------------------------------------------------------------------------------------------


def unit_sizes(model: Any) -> dict[str, int]:
    """Parameters of every FSDP unit torchacc makes with wrap_layer_cls={"GPT2Block"}: blocks, then the root."""
    blocks = [sum(p.numel() for p in block.parameters()) for block in model.transformer.h]
    return {"block": max(blocks), "root": num_params(model) - sum(blocks)}


def worker(args: argparse.Namespace) -> None:
    import torch
    from torch.utils.data import DataLoader

    import torchacc

    torchacc.dist.init_distributed()
    rank, world = torchacc.dist.rank(), torchacc.dist.world_size()
    n_layer, n_embd, n_head, vocab = model_shape(args)
    allocator = os.environ.get("BENCH_ALLOCATOR", "glibc")
    result: dict[str, Any] = {"kind": args.kind, "world": world, "rank": rank, "allocator": allocator}
    if args.kind == "baseline":
        torchacc.dist.barrier()
    else:
        model = gpt2_model(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab=vocab, seq=args.seq)
        result.update(params=num_params(model), units=unit_sizes(model))
        data = random_tokens(world * args.batch * args.steps, args.seq, vocab)
        config = torchacc.Config()
        config.dist.fsdp.size = world if args.kind == "fsdp" else 1
        config.dist.fsdp.wrap_layer_cls = {"GPT2Block"}
        model, loader = torchacc.accelerate(model, DataLoader(data, batch_size=args.batch, drop_last=True), config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        gc.collect()
    status = read_status()
    result.update(setup_hwm=status["VmHWM"], setup_end_rss=status["VmRSS"])
    result["trimmed"] = malloc_trim()
    result["hwm_reset"] = reset_peak_rss()
    result["start_rss"] = read_status()["VmRSS"]
    with MemorySampler("self", interval=0.002) as sampler:
        if args.kind == "baseline":
            torchacc.dist.barrier()
            time.sleep(0.2)
        else:
            for batch in loader:
                model(**batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        torchacc.dist.barrier()
    status = read_status()
    result.update(
        train_hwm=status["VmHWM"],
        train_sampled=sampler.peak("VmRSS"),
        train_anon=sampler.peak("RssAnon"),
        train_file=sampler.peak("RssFile"),
        num_samples=len(sampler.samples),
    )
    emit_result(result)
    torchacc.dist.teardown()


# ------------------------------------------------------------------------------------------------
# The driver
# ------------------------------------------------------------------------------------------------


def model_shape(args: argparse.Namespace) -> tuple[int, int, int, int]:
    n_layer, n_embd, n_head, vocab = QUICK_MODEL if args.quick else FULL_MODEL
    return n_layer, n_embd, n_head, args.vocab or vocab


def theory(params: int, units: dict[str, int], world: int, kind: str) -> tuple[float, float]:
    """(state bytes per rank, unsharded-unit bytes) for fp32 AdamW."""
    if kind == "fsdp" and world > 1:
        return BYTES_STATE * params / world, BYTES_UNIT * max(units.values())
    return BYTES_STATE * params, 0.0


def summarize(results: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    def peak(rows: list[dict[str, Any]], key: str) -> int:
        return max(r[key] for r in rows)

    rows, points = [], []
    for allocator in dict.fromkeys(r["allocator"] for r in results):
        for kind, world in RUNS:
            ranks = [r for r in results if (r["allocator"], r["kind"], r["world"]) == (allocator, kind, world)]
            base = [r for r in results if (r["allocator"], r["kind"], r["world"]) == (allocator, "baseline", world)]
            if kind == "baseline" or not ranks:
                continue
            params, units = ranks[0]["params"], ranks[0]["units"]
            state, unit = theory(params, units, world, kind)
            measured = peak(ranks, "train_hwm") - peak(base, "train_hwm")
            sampled = peak(ranks, "train_sampled") - peak(base, "train_sampled")
            setup = peak(ranks, "setup_hwm") - peak(base, "setup_hwm")
            diff = (measured - (state + unit)) / (state + unit)
            rows.append(
                [
                    allocator,
                    LABELS[kind],
                    world,
                    f"{params / 1e6:.1f}M",
                    f"{state / GB:.3f}",
                    f"{unit / GB:.3f}",
                    f"{(state + unit) / GB:.3f}",
                    f"{measured / GB:.3f}",
                    f"**{diff:+.1%}**",
                    f"{sampled / GB:.3f}",
                    f"{setup / GB:.3f}",
                ]
            )
            points.append(
                {
                    "allocator": allocator,
                    "kind": kind,
                    "world": world,
                    "theory": state + unit,
                    "measured": measured,
                    "diff": diff,
                }
            )
    headers = [
        "malloc",
        "config",
        "N",
        "params",
        "16P/N (GB)",
        "+ unit (GB)",
        "theory (GB)",
        "training peak (GB)",
        "vs theory",
        "sampled peak (GB)",
        "set-up peak (GB)",
    ]
    return markdown_table(headers, rows), points


def plot(points: list[dict[str, Any]], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    labels = [f"{LABELS[p['kind']].replace('torchacc ', '')}\nN={p['world']}\n{p['allocator']}" for p in points]
    xs = range(len(points))
    fig, ax = plt.subplots(figsize=(max(7, 1.4 * len(points)), 4.8))
    ax.bar([x - 0.2 for x in xs], [p["theory"] / GB for p in points], 0.4, label="theory (16P/N + unit)")
    ax.bar([x + 0.2 for x in xs], [p["measured"] / GB for p in points], 0.4, label="measured peak RSS - baseline")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("GB per rank")
    ax.set_title("Per-rank training memory, GPT-2 fp32 AdamW (CPU)")
    ax.set_ylim(0, 1.25 * max(max(p["theory"], p["measured"]) for p in points) / GB)
    ax.legend(loc="upper center", ncol=2)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a small model (< 60 s)")
    p.add_argument("--steps", type=int, default=2, help="training steps")
    p.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=0, help="vocabulary size (default: GPT-2's 50257; quick 8192)")
    p.add_argument(
        "--allocator",
        nargs="+",
        choices=list(ALLOCATORS),
        help="malloc settings to measure under, one after the other (default: glibc mmap64k; quick: glibc)",
    )
    p.add_argument("--no-dp", action="store_true", help="skip the replicated (DP) contrast run (quick skips it)")
    p.add_argument("--plot", default=os.path.join(OUT_DIR, "memory.png"), help="PNG path; raw JSON beside it")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kind", choices=("baseline", "fsdp", "dp"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.allocator = args.allocator or (["glibc"] if args.quick else ["glibc", "mmap64k"])
    args.no_dp = args.no_dp or args.quick
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    worker_args = ["--worker", "--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq)]
    worker_args += ["--vocab", str(args.vocab)] + (["--quick"] if args.quick else [])
    envs = {name: allocator_env(name) for name in args.allocator}
    started = time.monotonic()
    results = []
    for allocator in envs:
        for kind, world in RUNS:
            if kind == "dp" and args.no_dp:
                continue
            print(f"running {kind} on {world} rank(s), malloc {allocator}...", file=sys.stderr, flush=True)
            # Host memory only: GPUs are hidden from the ranks.
            env = {**envs[allocator], "BENCH_ALLOCATOR": allocator, "CUDA_VISIBLE_DEVICES": ""}
            cmd = [*worker_args, "--kind", kind]
            results += run_torchrun(os.path.abspath(__file__), cmd, nproc=world, env=env)
    table, points = summarize(results)
    info = machine_summary()
    n_layer, n_embd, n_head, vocab = model_shape(args)
    print(
        f"\n## Per-rank training memory: GPT-2 (n_layer {n_layer}, n_embd {n_embd}, vocab {vocab}), fp32 AdamW, "
        f"CPU/gloo (batch {args.batch}, seq {args.seq}, {args.steps} steps)\n"
    )
    print(
        f"{info['date']}; {info['cpu']}, {info['cores']} cores, {info['mem_gib']} GiB; torch {info['torch']}; "
        f"wall {time.monotonic() - started:.0f} s\n"
    )
    print("Peaks are per rank (the largest rank) minus the empty baseline rank of the same world size and malloc.\n")
    print(table)
    first = next(r for r in results if r["kind"] != "baseline")
    base = [r for r in results if r["kind"] == "baseline"]
    print(
        f"\nunits (params): {first['units']}; baseline peak RSS {min(r['train_hwm'] for r in base) / GB:.3f}-"
        f"{max(r['train_hwm'] for r in base) / GB:.3f} GB; peak reset: {all(r['hwm_reset'] for r in results)}"
    )
    raw = os.path.splitext(args.plot)[0] + ".json"  # the raw results, next to the plot
    os.makedirs(os.path.dirname(os.path.abspath(raw)), exist_ok=True)
    with open(raw, "w") as f:
        json.dump({"args": vars(args), "machine": info, "results": results}, f, indent=1)
    path = plot(points, args.plot)
    print(f"plot: {path}" if path else "plot: skipped (matplotlib is not installed)")


if __name__ == "__main__":
    main()
