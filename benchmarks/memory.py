"""Per-rank peak memory of training state under torchacc FSDP against world size, measured and in theory.

Run (from the repository root)::

    .venv/bin/python benchmarks/memory.py                # full: a 209M-param GPT-2 (3.3 GB of state), ~5 min
    .venv/bin/python benchmarks/memory.py --vocab 8192   # the same blocks with a small vocabulary (176M params)
    .venv/bin/python benchmarks/memory.py --gc --vocab 8192  # activation checkpointing off / every / 1 in 2 blocks
    .venv/bin/python benchmarks/memory.py --quick        # smoke run: a tiny GPT-2, both tables from one launch
    .venv/bin/python benchmarks/memory.py --tp           # tensor parallelism against FSDP 4 (4 ranks, Llama-style)
    .venv/bin/python benchmarks/memory.py --pp           # pipeline parallelism against FSDP 4 (4 ranks, Llama-style)

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

Every configuration runs under each malloc setting of ``--allocator`` (default ``glibc mmap64k-thp``):
``glibc`` is the default, what a user gets; ``mmap64k`` (``MALLOC_MMAP_THRESHOLD_=65536``) maps every block of
64 KiB or more on its own and unmaps it when freed. glibc's default raises its mmap threshold up to 32 MiB as
large blocks are freed, after which blocks below that (an FSDP unit's all-gather and reduce-scatter buffers,
gradients, activations) come from the heap, where freed space stays resident; ``mmap64k`` shows what the
tensors themselves need. ``mmap64k-thp``, the recommended setting, is the same threshold plus transparent huge
pages for the mapped blocks, in one variable
(``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=65536:glibc.malloc.hugetlb=1``, glibc >= 2.35): the same peak,
about 4x fewer page faults, and so less of mmap64k's extra CPU time. ``mmap4m``, ``mmap16m``, ``jemalloc`` and
``tcmalloc`` (preloaded system libraries) are there to compare; ``throughput.py --allocator`` measures their CPU
cost. (``MALLOC_ARENA_MAX=1`` or ``2`` does not help: the retention is the dynamic threshold, not per-thread
arenas.)

``--gc`` measures activation checkpointing instead (``memory.gc = True`` on the ``GPT2Block`` layers): torchacc
FSDP at N = 2 with checkpointing off, on every block, and on one block in ``--gc-interval`` (selective), at a
batch and sequence where activations are as large as the sharded state (default ``--gc-batch 2 --gc-seq 512``).
Each round runs a baseline and the three variants (order rotated each round); ``--rounds`` gives medians.

Theory for fp32 AdamW: 16 bytes per parameter (param 4 + grad 4 + exp_avg 4 + exp_avg_sq 4) divided by
N, plus, when sharded, one unsharded FSDP unit (the largest unit's full parameters and gradients,
8 bytes per parameter, during its forward/backward). Activations are not in the theory: the batch is
kept small (``--batch 1 --seq 64``) so they stay a few percent of the state. The theory leaves out, on purpose,
three things FSDP2 also holds at the peak: the prefetched next unit's parameters and the previous unit's
reduce-scatter input (4 bytes per parameter each, backward), and the root unit's unsharded parameters for the
whole forward and backward (the root is never resharded after forward); with a tied embedding the root also
holds the ``lm_head`` gradient through backward and a second, embedding gradient at its end.
"""

import argparse
import gc
import json
import os
import resource
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
    median,
    num_params,
    random_tokens,
    read_status,
    reset_peak_rss,
    run_torchrun,
)
from _pp import PP_CONTENDERS, PP_RANKS, pp_table, pp_worker
from _tp import TP_CONTENDERS, TP_RANKS, tp_table, tp_worker

# (n_layer, n_embd, n_head, vocab): full is GPT-2's vocabulary with 24 layers of width 768 (GPT-2 medium depth).
FULL_MODEL = (24, 768, 12, 50257)
QUICK_MODEL = (4, 64, 2, 1024)
# (kind, world size): run in this order, once per allocator setting.
RUNS = (("baseline", 1), ("fsdp", 1), ("baseline", 2), ("fsdp", 2), ("dp", 2))
LABELS = {"fsdp": "torchacc FSDP", "dp": "torchacc DP (replicated)"}
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
BYTES_STATE = 16  # fp32 AdamW: param, grad, exp_avg, exp_avg_sq
BYTES_UNIT = 8  # an unsharded unit: full params and full grads
# The recommended malloc setting (see the module docstring), in the default runs beside glibc's default.
DEFAULT_ALLOCATOR = "mmap64k-thp"
# memory.gc variants of the activation-checkpointing comparison.
GC_MODES = ("off", "full", "selective")


# ------------------------------------------------------------------------------------------------
# Inside a rank
# ------------------------------------------------------------------------------------------------


def unit_sizes(model: Any) -> dict[str, int]:
    """Parameters of every FSDP unit torchacc makes with wrap_layer_cls={"GPT2Block"}: blocks, then the root."""
    blocks = [sum(p.numel() for p in block.parameters()) for block in model.transformer.h]
    return {"block": max(blocks), "root": num_params(model) - sum(blocks)}


def worker(args: argparse.Namespace) -> None:
    import torchacc

    torchacc.dist.init_distributed()
    # ``--specs`` (--quick): several configurations one after the other in this one launch, each with its peaks
    # reset first; otherwise the one configuration of ``--kind`` and ``--gc-mode``.
    specs = args.specs or [f"{args.kind}:{args.gc_mode}"]
    for index, spec in enumerate(specs):
        kind, gc_mode = spec.split(":")
        if index:
            gc.collect()
            malloc_trim()
            reset_peak_rss()
        emit_result(measure(args, kind, gc_mode))
    torchacc.dist.teardown()


def measure(args: argparse.Namespace, kind: str, gc_mode: str) -> dict[str, Any]:
    """Set up ``kind`` (baseline, fsdp or dp) with memory.gc ``gc_mode``, train ``--steps`` steps; the peaks."""
    import torch
    from torch.utils.data import DataLoader

    import torchacc

    rank, world = torchacc.dist.rank(), torchacc.dist.world_size()
    n_layer, n_embd, n_head, vocab = model_shape(args)
    allocator = os.environ.get("BENCH_ALLOCATOR", "glibc")
    result: dict[str, Any] = {
        "kind": kind,
        "world": world,
        "rank": rank,
        "allocator": allocator,
        "gc": gc_mode,
        "batch": args.batch,
        "seq": args.seq,
        "round": args.round,
        "steps": args.steps,
    }
    if kind == "baseline":
        torchacc.dist.barrier()
    else:
        model = gpt2_model(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab=vocab, seq=args.seq)
        result.update(params=num_params(model), units=unit_sizes(model))
        data = random_tokens(world * args.batch * args.steps, args.seq, vocab)
        config = torchacc.Config()
        config.dist.fsdp.size = world if kind == "fsdp" else 1
        config.dist.fsdp.wrap_layer_cls = {"GPT2Block"}
        if gc_mode != "off":  # checkpoints the wrap_layer_cls blocks: all, or every gc_interval-th
            config.memory.gc = True
            config.memory.gc_interval = args.gc_interval if gc_mode == "selective" else 1
        model, loader = torchacc.accelerate(model, DataLoader(data, batch_size=args.batch, drop_last=True), config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        gc.collect()
    status = read_status()
    result.update(setup_hwm=status["VmHWM"], setup_end_rss=status["VmRSS"])
    result["trimmed"] = malloc_trim()
    result["hwm_reset"] = reset_peak_rss()
    result["start_rss"] = read_status()["VmRSS"]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    with MemorySampler("self", interval=0.002) as sampler:
        if kind == "baseline":
            torchacc.dist.barrier()
            time.sleep(0.2)
        else:
            for batch in loader:
                model(**batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        torchacc.dist.barrier()
    status, end = read_status(), resource.getrusage(resource.RUSAGE_SELF)
    result.update(
        cpu_s=end.ru_utime + end.ru_stime - usage.ru_utime - usage.ru_stime,
        sys_s=end.ru_stime - usage.ru_stime,
        minflt=end.ru_minflt - usage.ru_minflt,
        train_hwm=status["VmHWM"],
        train_sampled=sampler.peak("VmRSS"),
        train_anon=sampler.peak("RssAnon"),
        train_file=sampler.peak("RssFile"),
        num_samples=len(sampler.samples),
    )
    return result


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


def summarize_gc(results: list[dict[str, Any]], n_layer: int, interval: int) -> str:
    """The activation-checkpointing table: per malloc and memory.gc variant, the median over rounds of the per-rank
    training peak minus the same round's baseline."""
    blocks = {"off": 0, "full": n_layer, "selective": len(range(0, n_layer, interval))}
    names = {"off": "off", "full": "every block", "selective": f"1 block in {interval}"}
    rows = []
    for allocator in dict.fromkeys(r["allocator"] for r in results):
        peaks: dict[str, list[int]] = {}
        cpu: dict[str, list[float]] = {}
        for round_ in sorted({r["round"] for r in results}):
            mine = [r for r in results if (r["allocator"], r["round"]) == (allocator, round_)]
            base = max(r["train_hwm"] for r in mine if r["kind"] == "baseline")
            for mode in GC_MODES:
                ranks = [r for r in mine if r["kind"] == "fsdp" and r["gc"] == mode]
                peaks.setdefault(mode, []).append(max(r["train_hwm"] for r in ranks) - base)
                cpu.setdefault(mode, []).append(max(r["cpu_s"] for r in ranks))
        first = next(r for r in results if r["kind"] == "fsdp")
        state, unit = theory(first["params"], first["units"], first["world"], "fsdp")
        off = median(peaks["off"])
        for mode in GC_MODES:
            peak = median(peaks[mode])
            rows.append(
                [
                    allocator,
                    names[mode],
                    f"{blocks[mode]}/{n_layer}",
                    f"{(state + unit) / GB:.3f}",
                    f"{peak / GB:.3f}",
                    f"{(peak - state - unit) / GB:.3f}",
                    f"**{(off - peak) / GB:.3f}**" if mode != "off" else "-",
                    f"{(off - peak) / off:.1%}" if mode != "off" else "-",
                    f"{median(cpu[mode]) / first.get('steps', 1):.2f}",
                    len(peaks[mode]),
                ]
            )
    headers = [
        "malloc",
        "memory.gc",
        "checkpointed",
        "theory, state (GB)",
        "training peak (GB)",
        "peak - theory (GB)",
        "saving vs off (GB)",
        "saving vs off",
        "CPU s/step",
        "rounds",
    ]
    return markdown_table(headers, rows)


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
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: a tiny model at N = 2 only, the baseline and the three memory.gc variants in one launch "
        "(the main table is its gc-off rows); no figures",
    )
    p.add_argument("--steps", type=int, default=0, help="training steps (default 2, quick 1)")
    p.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=0, help="vocabulary size (default: GPT-2's 50257; quick 1024)")
    p.add_argument(
        "--allocator",
        nargs="+",
        choices=list(ALLOCATORS),
        help="malloc settings, one after the other (default: glibc mmap64k-thp; --gc: mmap64k-thp; quick: glibc)",
    )
    p.add_argument("--no-dp", action="store_true", help="skip the replicated (DP) contrast run (quick skips it)")
    p.add_argument(
        "--gc",
        action="store_true",
        help="only the activation-checkpointing comparison: FSDP at N = 2 with memory.gc off, on every block and on "
        "every --gc-interval-th block, at --gc-batch x --gc-seq (quick: from its one launch)",
    )
    p.add_argument("--gc-batch", type=int, default=0, help="batch of the gc comparison (default 2; quick --batch)")
    p.add_argument("--gc-seq", type=int, default=0, help="seq of the gc comparison (default 512; quick --seq)")
    p.add_argument("--gc-interval", type=int, default=2, help="selective checkpointing: every k-th block (default 2)")
    p.add_argument("--rounds", type=int, default=1, help="rounds of the gc comparison (medians; contenders alternate)")
    p.add_argument("--plot", default=os.path.join(OUT_DIR, "memory.png"), help="PNG path; raw JSON beside it")
    p.add_argument("--tp", action="store_true", help="only the tensor-parallel comparison (4 ranks, Llama-style)")
    p.add_argument("--tp-batch", type=int, default=8, help="--tp: global batch (sequences per step, all layouts)")
    p.add_argument("--tp-steps", type=int, default=0, help="--tp: timed steps (default 2, quick 1)")
    p.add_argument("--tp-only", help=argparse.SUPPRESS)
    p.add_argument("--pp", action="store_true", help="only the pipeline-parallel comparison (4 ranks, Llama-style)")
    p.add_argument("--pp-batch", type=int, default=8, help="--pp: global batch (sequences per step, all layouts)")
    p.add_argument("--pp-steps", type=int, default=0, help="--pp: timed steps (default 2, quick 1)")
    p.add_argument("--pp-only", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kind", choices=("baseline", "fsdp", "dp"), help=argparse.SUPPRESS)
    p.add_argument("--gc-mode", choices=GC_MODES, default="off", help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--specs", nargs="+", help=argparse.SUPPRESS)  # kind:gc_mode, one after the other (--quick)
    args = p.parse_args(argv)
    default = [DEFAULT_ALLOCATOR] if args.gc else ["glibc", DEFAULT_ALLOCATOR]
    args.allocator = args.allocator or (["glibc"] if args.quick else default)
    args.gc_batch = args.gc_batch or (args.batch if args.quick else 2)
    args.gc_seq = args.gc_seq or (args.seq if args.quick else 512)
    args.no_dp = args.no_dp or args.quick
    args.steps = args.steps or (1 if args.quick else 2)
    args.tp_steps = args.tp_steps or (1 if args.quick else 2)
    args.pp_steps = args.pp_steps or (1 if args.quick else 2)
    args.warmup = 1
    return args


def run(args: argparse.Namespace, kind: str, world: int, allocator: str, extra: list[str]) -> list[dict[str, Any]]:
    """One torchrun job of ``world`` ranks; ``extra`` are worker arguments."""
    print(f"running {kind} on {world} rank(s), malloc {allocator} {' '.join(extra)}...", file=sys.stderr, flush=True)
    worker_args = ["--worker", "--steps", str(args.steps), "--vocab", str(args.vocab), "--kind", kind, *extra]
    # Host memory only: GPUs are hidden from the ranks.
    env = {**allocator_env(allocator), "BENCH_ALLOCATOR": allocator, "CUDA_VISIBLE_DEVICES": ""}
    quick = ["--quick"] if args.quick else []
    return run_torchrun(os.path.abspath(__file__), [*worker_args, *quick], nproc=world, env=env)


def main() -> None:
    args = parse_args()
    if args.worker and args.tp:
        tp_worker(args, memory=True)
        return
    if args.worker and args.pp:
        pp_worker(args, memory=True)
        return
    if args.worker:
        worker(args)
        return
    if args.tp:
        main_tp(args)
        return
    if args.pp:
        main_pp(args)
        return
    for name in args.allocator:
        allocator_env(name)  # fail early on an unknown name or a missing library
    started = time.monotonic()
    info = machine_summary()
    n_layer, n_embd, n_head, vocab = model_shape(args)
    results: list[dict[str, Any]] = []
    gc_results: list[dict[str, Any]] = []
    if args.quick and not args.gc:
        # The smoke run: one launch of 2 ranks measures the baseline and the three memory.gc variants one after
        # the other (the peaks are reset between them); the gc-off rows also make the main table.
        shape = ["--batch", str(args.gc_batch), "--seq", str(args.gc_seq), "--gc-interval", str(args.gc_interval)]
        specs = ["baseline:off", *(f"fsdp:{mode}" for mode in GC_MODES)]
        gc_results = run(args, "fsdp", 2, args.allocator[0], [*shape, "--specs", *specs])
        results = [r for r in gc_results if r["gc"] == "off"]
    elif not args.gc:
        shape = ["--batch", str(args.batch), "--seq", str(args.seq)]
        for allocator in args.allocator:
            for kind, world in RUNS:
                if not (kind == "dp" and args.no_dp):
                    results += run(args, kind, world, allocator, shape)
    if args.gc:
        # Contenders alternate: each round runs the baseline, then the three variants in a rotated order.
        shape = ["--batch", str(args.gc_batch), "--seq", str(args.gc_seq), "--gc-interval", str(args.gc_interval)]
        for round_ in range(args.rounds):
            for allocator in args.allocator:
                gc_results += run(args, "baseline", 2, allocator, [*shape, "--round", str(round_)])
                for i in range(len(GC_MODES)):
                    mode = GC_MODES[(i + round_) % len(GC_MODES)]
                    gc_results += run(args, "fsdp", 2, allocator, [*shape, "--round", str(round_), "--gc-mode", mode])
    wall = time.monotonic() - started
    header = f"{info['date']}; {info['cpu']}, {info['cores']} cores, {info['mem_gib']} GiB; torch {info['torch']}"
    points: list[dict[str, Any]] = []
    if results:
        table, points = summarize(results)
        print(
            f"\n## Per-rank training memory: GPT-2 (n_layer {n_layer}, n_embd {n_embd}, vocab {vocab}), fp32 AdamW, "
            f"CPU/gloo (batch {args.batch}, seq {args.seq}, {args.steps} steps)\n"
        )
        print(f"{header}; wall {wall:.0f} s\n")
        print(
            "Peaks are per rank (the largest rank) minus the empty baseline rank of the same world size and malloc.\n"
        )
        print(table)
        first = next(r for r in results if r["kind"] != "baseline")
        base = [r for r in results if r["kind"] == "baseline"]
        print(
            f"\nunits (params): {first['units']}; baseline peak RSS {min(r['train_hwm'] for r in base) / GB:.3f}-"
            f"{max(r['train_hwm'] for r in base) / GB:.3f} GB; peak reset: {all(r['hwm_reset'] for r in results)}"
        )
    if gc_results:
        print(
            f"\n## Activation checkpointing (memory.gc): torchacc FSDP, N = 2, GPT-2 (n_layer {n_layer}, n_embd "
            f"{n_embd}, vocab {vocab}), batch {args.gc_batch}, seq {args.gc_seq}, {args.steps} steps\n"
        )
        print(f"{header}; wall {wall:.0f} s (whole invocation)\n")
        print(
            "Per-rank training peak minus the same round's baseline rank; medians over rounds. Theory, state: "
            "16P/N + one unsharded unit (no activations).\n"
        )
        print(summarize_gc(gc_results, n_layer, args.gc_interval))
    raw = os.path.splitext(args.plot)[0] + ".json"  # the raw results, next to the plot
    os.makedirs(os.path.dirname(os.path.abspath(raw)), exist_ok=True)
    with open(raw, "w") as f:
        json.dump({"args": vars(args), "machine": info, "results": results, "gc_results": gc_results}, f, indent=1)
    path = plot(points, args.plot) if points else None
    print(f"plot: {path}" if path else "plot: skipped (no main table, or matplotlib is not installed)")


def main_tp(args: argparse.Namespace) -> None:
    """``--tp``: one launch of 4 ranks per layout (so each peak is its own), then the table."""
    started = time.monotonic()
    args.vocab = args.vocab or 8192
    allocator = args.allocator[0] if len(args.allocator) == 1 else DEFAULT_ALLOCATOR
    results: list[dict[str, Any]] = []
    for name in TP_CONTENDERS:
        print(f"running {name} on {TP_RANKS} ranks, malloc {allocator}...", file=sys.stderr, flush=True)
        cmd = ["--worker", "--tp", "--tp-only", name, "--vocab", str(args.vocab), "--seq", str(args.seq)]
        cmd += ["--tp-batch", str(args.tp_batch), "--tp-steps", str(args.tp_steps), "--rounds", "1"]
        env = {**allocator_env(allocator), "CUDA_VISIBLE_DEVICES": ""}
        results += run_torchrun(
            os.path.abspath(__file__), [*cmd, *(["--quick"] if args.quick else [])], nproc=TP_RANKS, env=env
        )
    info = machine_summary()
    print(
        f"\n## Tensor parallelism, per-rank memory: Llama-style model, fp32 AdamW, {TP_RANKS} ranks on CPU/gloo "
        f"(global batch {args.tp_batch}, seq {args.seq}, vocab {args.vocab}, malloc {allocator})\n"
    )
    print(
        f"{info['date']}; {info['cpu']}, {info['cores']} cores, {info['mem_gib']} GiB; torch {info['torch']}; "
        f"wall {time.monotonic() - started:.0f} s\n"
    )
    print("Peak: VmHWM after set-up and training minus the rank's RSS after the process group started.\n")
    print(tp_table(results, memory=True))


def main_pp(args: argparse.Namespace) -> None:
    """``--pp``: one launch of 4 ranks per layout (so each peak is its own), then the table."""
    started = time.monotonic()
    args.vocab = args.vocab or 8192
    allocator = args.allocator[0] if len(args.allocator) == 1 else DEFAULT_ALLOCATOR
    results: list[dict[str, Any]] = []
    for name in PP_CONTENDERS:
        print(f"running {name} on {PP_RANKS} ranks, malloc {allocator}...", file=sys.stderr, flush=True)
        cmd = ["--worker", "--pp", "--pp-only", name, "--vocab", str(args.vocab), "--seq", str(args.seq)]
        cmd += ["--pp-batch", str(args.pp_batch), "--pp-steps", str(args.pp_steps), "--rounds", "1"]
        env = {**allocator_env(allocator), "CUDA_VISIBLE_DEVICES": ""}
        results += run_torchrun(
            os.path.abspath(__file__), [*cmd, *(["--quick"] if args.quick else [])], nproc=PP_RANKS, env=env
        )
    info = machine_summary()
    print(
        f"\n## Pipeline parallelism, per-rank memory: Llama-style model, fp32 AdamW, {PP_RANKS} ranks on CPU/gloo "
        f"(global batch {args.pp_batch}, seq {args.seq}, vocab {args.vocab}, malloc {allocator})\n"
    )
    print(
        f"{info['date']}; {info['cpu']}, {info['cores']} cores, {info['mem_gib']} GiB; torch {info['torch']}; "
        f"wall {time.monotonic() - started:.0f} s\n"
    )
    print("Peak: VmHWM after set-up and training minus the rank's RSS after the process group started.\n")
    print(pp_table(results, memory=True))


if __name__ == "__main__":
    main()
