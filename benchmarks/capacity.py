"""The largest GPT-2 that trains one step in B GiB per rank: plain DDP vs torchacc FSDP (meta-device init), 2 ranks.

Run (from the repository root)::

    .venv/bin/python benchmarks/capacity.py --budget-gib 8                      # every contender (~15 min)
    .venv/bin/python benchmarks/capacity.py --budget-gib 8 --contenders ddp     # one contender at a time: the
    .venv/bin/python benchmarks/capacity.py --budget-gib 8 --contenders torchacc  # table covers all run so far
    .venv/bin/python benchmarks/capacity.py --quick                             # smoke run: one job, no figures

Contenders (both: ``transformers.GPT2LMHeadModel`` from ``GPT2Config`` of the same width, vocabulary and
context, fp32, ``torch.optim.AdamW``, one forward/backward/step on one 1x64 sequence per rank, gloo, 2 ranks):

* ``ddp``: every rank builds the full model on the CPU and wraps it in ``torch.nn.parallel.DistributedDataParallel``
  (its defaults: 25 MB buckets, ``gradient_as_bucket_view=False``, so gradients also sit in a bucket copy).
* ``ddp-bv``: the same with ``gradient_as_bucket_view=True`` (gradients are views into the buckets): the
  strongest plain DDP, 16 bytes per parameter instead of 20. The goal (>= 1.8x) is stated against ``ddp``;
  the ratio to ``ddp-bv`` is printed beside it.
* ``torchacc``: the model is built under ``torchacc.init_empty_weights()`` (meta device) and
  ``torchacc.accelerate()`` shards it with ``dist.fsdp.size = 2`` and ``wrap_layer_cls = {"GPT2Block"}``; each rank
  allocates and initializes only its shards.

Method. Each attempt is a fresh ``torchrun --standalone --nproc_per_node=2`` job of a given depth (number of
layers), so an out-of-memory attempt costs nothing to the next. So that no attempt ever reaches the kernel's OOM
killer (this machine is shared), this script polls every process of the job (``VmRSS`` in ``/proc/<pid>/status``,
every 3 ms) and kills the job as soon as one rank passes ``--budget-gib``: the attempt counts as out of memory
("oom"). A job that finishes counts as "ok" only if every rank's kernel peak (``VmHWM``, exact) stayed within the
budget too; a rank that fails with an allocator error is "oom" as well; any other failure stops the run with the
rank's error. The depth is found by bisection per contender, between ``--lo`` (a depth taken to fit) and ``--hi``
(a depth taken not to fit); attempts are kept in the JSON beside the plot and reused by a later run with the same
settings (``--fresh`` drops them), so a long search can be split into several runs. The parameter count is exact:
``sum(p.numel() for p in model.parameters())`` (tied ``wte``/``lm_head`` once) of the very model each rank builds,
and for every depth, from the model built on the meta device. The same budget, model family and step apply to both.
"""

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from _common import emit_result, gpt2_model, machine_summary, markdown_table, num_params, read_status

GIB = 2**30
CONTENDERS = ("ddp", "ddp-bv", "torchacc")
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
POLL_S = 0.003  # the watchdog's sampling interval
RESERVE_GIB = 1.5  # stop everything if the machine's MemAvailable falls below this (someone else's job)
ALLOC_ERRORS = ("can't allocate memory", "MemoryError", "std::bad_alloc", "Cannot allocate memory")


# ------------------------------------------------------------------------------------------------
# Inside a rank
# ------------------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    t0 = time.monotonic()  # the (first) contender's set-up time includes starting the process group
    dist.init_process_group("gloo")
    for contender in args.contender:  # one, but --quick runs every contender in one job
        emit_result({"contender": contender, **one_step(contender, args, t0)})
        gc.collect()
        t0 = time.monotonic()
    dist.destroy_process_group()


def one_step(contender: str, args: argparse.Namespace, t0: float) -> dict[str, Any]:
    """Build ``contender``'s model at ``--layers`` and train one step (set-up timed from ``t0``); this rank's
    figures."""
    import torch
    import torch.distributed as dist

    import torchacc

    rank = dist.get_rank()
    shape = {"n_layer": args.layers, "n_embd": args.width, "n_head": args.width // 64, "vocab": args.vocab}
    if contender == "torchacc":
        with torchacc.init_empty_weights():
            model = gpt2_model(**shape, seq=args.seq)
        params = num_params(model)
        config = torchacc.Config()
        config.dist.fsdp.size = 2
        config.dist.fsdp.wrap_layer_cls = {"GPT2Block"}
        model = torchacc.accelerate(model, config=config)
    else:
        model = gpt2_model(**shape, seq=args.seq)
        params = num_params(model)
        bucket_view = contender == "ddp-bv"
        model = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dist.barrier()
    t1 = time.monotonic()
    ids = torch.randint(args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(rank))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    dist.barrier()
    t2 = time.monotonic()
    status = read_status()
    return {
        "rank": rank,
        "params": params,
        "loss": loss.item(),
        "hwm": status["VmHWM"],
        "setup_s": t1 - t0,
        "step_s": t2 - t1,
    }


def count_worker(args: argparse.Namespace) -> None:
    """Print the exact parameter count of the model at depth 0, 1 and 2, built on the meta device."""
    import torch

    counts = []
    for n_layer in (0, 1, 2):
        with torch.device("meta"):
            model = gpt2_model(
                n_layer=n_layer, n_embd=args.width, n_head=args.width // 64, vocab=args.vocab, seq=args.seq
            )
        counts.append(num_params(model))
    emit_result({"counts": counts})


# ------------------------------------------------------------------------------------------------
# The driver
# ------------------------------------------------------------------------------------------------


def param_counter(args: argparse.Namespace) -> Any:
    """``layers -> exact parameters``: every block of the model is the same, so base + layers * block (checked)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--count", *shape_args(args)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    counts = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])["counts"]
    base, block = counts[0], counts[1] - counts[0]
    assert counts[2] == base + 2 * block, counts
    return lambda layers: base + layers * block


def shape_args(args: argparse.Namespace) -> list[str]:
    return ["--width", str(args.width), "--vocab", str(args.vocab), "--seq", str(args.seq)]


def _descendants(pid: int) -> dict[int, int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found: dict[int, int] = {}  # pid -> parent
    frontier = [pid]
    while frontier:
        kids = {child: parent for child, parent in parents.items() if parent in frontier}
        found.update(kids)
        frontier = list(kids)
    return found


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))


def attempt(contenders: list[str], layers: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One torchrun job under the RSS watchdog; a record per contender: status ok/oom/timeout, peaks, seconds.

    Several contenders (``--quick``) train one after the other in the one job and share its watchdog peaks.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [os.path.abspath(__file__), "--worker", "--contender", *contenders, "--layers", str(layers)]
    cmd += shape_args(args)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    budget = args.budget_gib * GIB
    peaks: dict[int, int] = {}  # pid -> sampled peak VmRSS (every process of the job: the agent and the ranks)
    killed_by = ""
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True
        )  # its own process group, so one killpg ends the agent and both ranks
        try:
            pids: dict[int, int] = {}
            last_scan = last_mem = 0.0
            while proc.poll() is None:
                now = time.monotonic()
                if now - last_scan > (0.02 if len(pids) < 3 else 0.5):  # the agent's children appear after a while
                    pids, last_scan = _descendants(proc.pid), now
                for pid in pids:
                    rss = read_status(pid).get("VmRSS", 0)
                    peaks[pid] = max(peaks.get(pid, 0), rss)
                    if rss > budget:
                        killed_by = "oom"
                if now - last_mem > 0.05:
                    last_mem = now
                    if _mem_available() < RESERVE_GIB * GIB:
                        killed_by = "machine"
                if now - start > args.attempt_timeout:
                    killed_by = "timeout"
                if killed_by:
                    os.killpg(proc.pid, signal.SIGKILL)
                    break
                time.sleep(POLL_S)
            stdout = proc.stdout.read() if proc.stdout else ""
            proc.wait()
        finally:
            if proc.poll() is None:  # interrupted: never leave the ranks behind
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        err.seek(0)
        stderr = err.read()
    seconds = time.monotonic() - start
    results = sorted((json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("RESULT ")), key=str)
    ranks = sorted((peaks.get(pid, 0) for pid, parent in pids.items() if parent == proc.pid), reverse=True)
    return [
        _record(c, layers, args, seconds, ranks, peaks, killed_by, proc.returncode, results, stderr) for c in contenders
    ]


def _record(
    contender: str,
    layers: int,
    args: argparse.Namespace,
    seconds: float,
    ranks: list[int],
    peaks: dict[int, int],
    killed_by: str,
    returncode: int,
    results: list[dict[str, Any]],
    stderr: str,
) -> dict[str, Any]:
    """``contender``'s record of one attempt (see ``attempt``)."""
    results = [r for r in results if r["contender"] == contender]
    record: dict[str, Any] = {
        "contender": contender,
        "layers": layers,
        "params": args.count(layers),
        "seconds": round(seconds, 1),
        "peak_rss": ranks,  # sampled, bytes, largest first (the agent's own children: the ranks)
        "job_peak_rss": sum(peaks.values()),  # agent and ranks, each at its own peak: an upper bound
    }
    if killed_by == "machine":
        raise SystemExit(f"stopped: MemAvailable fell below {RESERVE_GIB} GiB (another job?); attempt {record}")
    if killed_by:
        record.update(status=killed_by, killed=True)
    elif returncode == 0 and len(results) == 2:
        hwm = [r["hwm"] for r in results]
        record.update(
            status="ok" if max(hwm) <= args.budget_gib * GIB else "oom",  # a spike between two samples still counts
            peak_rss=sorted(hwm, reverse=True),  # exact
            setup_s=round(max(r["setup_s"] for r in results), 1),
            step_s=round(max(r["step_s"] for r in results), 1),
            loss=results[0]["loss"],
        )
        if {r["params"] for r in results} != {record["params"]}:
            raise SystemExit(f"parameter count mismatch: ranks counted {results}, meta count {record['params']}")
    elif any(text in stderr for text in ALLOC_ERRORS):
        record["status"] = "oom"
    else:
        raise SystemExit(f"attempt {record} failed (exit {returncode}):\n{stderr[-6000:]}")
    return record


def bracket(attempts: list[dict[str, Any]], contender: str, lo: int, hi: int) -> tuple[int, int]:
    """The largest depth known to fit and the smallest known not to, from ``attempts`` and the given bounds."""
    mine = [a for a in attempts if a["contender"] == contender]
    lo = max([lo] + [a["layers"] for a in mine if a["status"] == "ok"])
    hi = min([hi] + [a["layers"] for a in mine if a["status"] != "ok"])
    return lo, hi


def search(contender: str, args: argparse.Namespace, attempts: list[dict[str, Any]], save: Any) -> None:
    lo, hi = bracket(attempts, contender, args.lo, args.hi)
    if hi <= lo:
        print(f"  {contender}: attempts disagree (ok at {lo}, failed at {hi}): noise near the budget", file=sys.stderr)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        (record,) = attempt([contender], mid, args)
        attempts.append(record)
        save()
        rss = "/".join(f"{r / GIB:.2f}" for r in record["peak_rss"])
        print(
            f"  {contender:8s} layers={mid:3d} {record['params'] / 1e6:7.1f}M {record['status']:7s} "
            f"peak RSS {rss} GiB, {record['seconds']:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        lo, hi = bracket(attempts, contender, lo, hi)


def summarize(attempts: list[dict[str, Any]], args: argparse.Namespace) -> tuple[str, str, dict[str, Any]]:
    def rss(record: dict[str, Any]) -> str:
        peaks = "/".join(f"{r / GIB:.2f}" for r in record["peak_rss"])
        if record.get("killed"):
            return f"{peaks} (killed)"
        return peaks + (" (over budget)" if record["status"] == "oom" and max(record["peak_rss"]) > budget else "")

    budget = args.budget_gib * GIB

    rows = [
        [
            a["contender"],
            a["layers"],
            f"{a['params'] / 1e6:.1f}",
            a["status"],
            rss(a),
            a["seconds"],
            a.get("setup_s", ""),
            a.get("step_s", ""),
        ]
        for a in attempts
    ]
    headers = ["contender", "layers", "params (M)", "result", "peak RSS per rank (GiB)", "s", "set-up s", "step s"]
    log = markdown_table(headers, rows)
    best: dict[str, Any] = {}
    summary_rows = []
    for contender in CONTENDERS:
        mine = [a for a in attempts if a["contender"] == contender]
        if not mine:
            continue
        ok = [a for a in mine if a["status"] == "ok"]
        top = max(ok, key=lambda a: a["layers"]) if ok else None
        layers = top["layers"] if top else 0
        failed = min((a["layers"] for a in mine if a["status"] != "ok"), default=None)
        resolved = failed == layers + 1
        best[contender] = {"layers": layers, "params": args.count(layers), "resolved": resolved}
        summary_rows.append(
            [
                contender,
                layers,
                f"{args.count(layers) / 1e6:.1f}",
                f"{layers + 1} ({'failed' if resolved else 'not tried'})",
                rss(top) if top else "",
            ]
        )
    table = markdown_table(
        ["contender", "largest depth", "parameters (M)", "depth + 1", "its peak RSS per rank (GiB)"], summary_rows
    )
    return log, table, best


def plot(attempts: list[dict[str, Any]], best: dict[str, Any], args: argparse.Namespace, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    colors = {"ddp": "tab:gray", "ddp-bv": "tab:olive", "torchacc": "tab:blue"}
    names = list(best)
    bars = left.bar(names, [best[c]["params"] / 1e6 for c in names], color=[colors[c] for c in names])
    for bar, c in zip(bars, names, strict=True):
        label = f"{best[c]['params'] / 1e6:.0f}M\n{best[c]['layers']} layers"
        left.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    left.set_ylim(0, 1.25 * max(best[c]["params"] for c in names) / 1e6)
    left.set_ylabel("parameters (M)")
    left.set_title("largest GPT-2 that trains one step")
    for c in names:
        for status, marker in (("ok", "o"), ("oom", "x"), ("timeout", "s")):
            pts = [a for a in attempts if a["contender"] == c and a["status"] == status]
            right.scatter(
                [a["params"] / 1e6 for a in pts],
                [a["peak_rss"][0] / GIB for a in pts],
                marker=marker,
                color=colors[c],
                label=f"{c} {status}" if pts else None,
            )
    right.axhline(args.budget_gib, color="tab:red", linestyle="--", label="budget (attempt killed)")
    right.set_xlabel("parameters (M)")
    right.set_ylabel("peak RSS, largest rank (GiB)")
    right.set_title("every attempt")
    right.legend(fontsize=8)
    fig.suptitle(f"{args.budget_gib:g} GiB per rank, 2 ranks, fp32 AdamW, width {args.width} (CPU, gloo)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: every contender at depth 1 (2 GiB, width 256), one after the other in one job; no figures",
    )
    p.add_argument("--budget-gib", type=float, default=8.0, help="resident memory allowed per rank (default 8)")
    p.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS), help="whom to search")
    p.add_argument("--lo", type=int, default=0, help="a depth taken to fit (the search starts above it)")
    p.add_argument("--hi", type=int, default=128, help="a depth taken not to fit (the search stays below it)")
    p.add_argument("--width", type=int, default=1024, help="n_embd (n_head = width / 64)")
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq", type=int, default=64, help="tokens in the one sequence per rank (also n_positions)")
    p.add_argument("--attempt-timeout", type=float, default=900.0, help="seconds; a slower attempt is a failure")
    p.add_argument("--fresh", action="store_true", help="ignore the attempts a previous run saved")
    p.add_argument("--plot", default="", help="PNG path, raw JSON beside it (default out/capacity[-quick].png)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--count", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--contender", nargs="+", choices=CONTENDERS, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.budget_gib, args.width, args.vocab, args.lo, args.hi, args.fresh = 2.0, 256, 1024, 0, 2, True
    args.plot = args.plot or os.path.join(OUT_DIR, "capacity-quick.png" if args.quick else "capacity.png")
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    if args.count:
        count_worker(args)
        return
    args.count = param_counter(args)
    info = machine_summary()
    settings = {"budget_gib": args.budget_gib, "width": args.width, "vocab": args.vocab, "seq": args.seq}
    settings["torch"] = info["torch"]
    # The malloc environment the ranks inherit (e.g. MALLOC_MMAP_THRESHOLD_): runs under another never mix.
    settings["malloc"] = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_") or k == "LD_PRELOAD"}
    raw = os.path.splitext(args.plot)[0] + ".json"
    attempts: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    if os.path.exists(raw) and not args.fresh:
        with open(raw) as f:
            saved = json.load(f)
        if saved.get("settings") == settings:
            attempts, runs = saved["attempts"], saved.get("runs", [])
            print(f"reusing {len(attempts)} attempt(s) from {raw}", file=sys.stderr)
    runs.append({"machine": info, "contenders": args.contenders, "lo": args.lo, "hi": args.hi})

    def save() -> None:
        os.makedirs(os.path.dirname(os.path.abspath(raw)), exist_ok=True)
        with open(raw, "w") as f:
            json.dump({"settings": settings, "runs": runs, "attempts": attempts}, f, indent=1)

    started = time.monotonic()
    if args.quick:  # the smoke run: every contender at depth 1, one after the other in one job
        attempts += attempt(list(args.contenders), 1, args)
    for contender in [] if args.quick else args.contenders:
        search(contender, args, attempts, save)
    save()
    log, table, best = summarize(attempts, args)
    print(
        f"\n## Largest GPT-2 (width {args.width}, vocab {args.vocab}, seq {args.seq}) that trains one fp32 AdamW step "
        f"within {args.budget_gib:g} GiB RSS per rank, 2 ranks (CPU, gloo)\n"
    )
    print(
        f"{info['date']}; {info['cpu']}, {info['cores']} cores, {info['mem_gib']} GiB; torch {info['torch']}; "
        f"this run {time.monotonic() - started:.0f} s\n"
    )
    print("Every attempt, in order (killed: the watchdog killed the job when a rank passed the budget):\n")
    print(log + "\n")
    print(table)
    print()
    for baseline in ("ddp", "ddp-bv"):
        if {baseline, "torchacc"} <= set(best):
            base, acc = best[baseline]["params"], best["torchacc"]["params"]
            ratio = acc / base if base else float("inf")
            resolved = best[baseline]["resolved"] and best["torchacc"]["resolved"]
            goal = f"goal >= 1.8x: {'met' if ratio >= 1.8 else 'NOT met'}" if baseline == "ddp" else "for comparison"
            print(
                f"torchacc / {baseline} parameters: {ratio:.2f}x ({goal})"
                + ("" if resolved else "; the search is not finished (depth + 1 not tried), run again to finish it")
            )
    path = plot(attempts, best, args, args.plot)
    print(f"plot: {path}" if path else "plot: skipped (matplotlib is not installed)")


if __name__ == "__main__":
    main()
