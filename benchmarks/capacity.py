"""The largest GPT-2-style model that trains one step: DDP vs torchacc FSDP (meta-device init), 2 ranks.

    python benchmarks/capacity.py            # full mode (several minutes)
    python benchmarks/capacity.py --quick    # a smoke run (tiny budget)

Each attempt is a fresh ``torchrun --nproc_per_node=2`` job that builds a GPT-2 of a given depth,
runs one AdamW step and exits 0, or runs out of memory. The depth is found by bisection per
contender. So that an out-of-memory attempt never reaches the kernel's OOM killer (which could
kill anything on this shared 24 GB machine), this script watches every rank's resident memory
(``/proc/<pid>/status``, every few milliseconds) and kills the attempt as soon as one rank passes
``--budget-gib``: that attempt counts as out of memory. The figure is therefore "parameters that
train within B GiB of RSS per rank", the same B for both contenders. (A per-process
``RLIMIT_AS`` cap was tried first: allocation failures inside gloo's threads then hung the job.)
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

RESULT = "CAPACITY "


def worker(args: argparse.Namespace) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import torchacc

    torch.distributed.init_process_group("gloo")
    cfg = GPT2Config(
        n_layer=args.layers, n_embd=args.width, n_head=args.width // 64, n_positions=64, vocab_size=args.vocab
    )
    if args.contender == "torchacc":
        with torchacc.init_empty_weights():
            model = GPT2LMHeadModel(cfg)
        config = torchacc.Config()
        config.dist.fsdp.size = 2
        config.dist.fsdp.wrap_layer_cls = {"GPT2Block"}
        model = torchacc.accelerate(model, config=config)
    else:
        model = torch.nn.parallel.DistributedDataParallel(GPT2LMHeadModel(cfg))
    params = sum(p.numel() for p in GPT2LMHeadModel(GPT2Config(**{**cfg.to_dict(), "n_layer": 0})).parameters())
    params += args.layers * (12 * args.width**2 + 13 * args.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab, (1, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        print(RESULT + json.dumps({"ok": True, "params": params}), flush=True)
    torch.distributed.destroy_process_group()


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                continue
    return kids


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS")), 0)
    except (FileNotFoundError, ProcessLookupError):
        return 0


def attempt(contender: str, layers: int, args: argparse.Namespace) -> tuple[bool, int, float]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        __file__,
        "--worker",
        "--contender",
        contender,
        "--layers",
        str(layers),
        "--width",
        str(args.width),
        "--vocab",
        str(args.vocab),
        "--budget-gib",
        str(args.budget_gib),
    ]
    start = time.monotonic()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    budget = args.budget_gib * 2**30
    with (
        open(os.devnull, "w") as devnull,
        subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=devnull, text=True, env=env, start_new_session=True
        ) as proc,
    ):
        over = False
        while proc.poll() is None:
            ranks = _children(proc.pid)
            if any(_rss(pid) > budget for pid in ranks) or time.monotonic() - start > args.attempt_timeout:
                over = True
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.003)
        stdout = proc.stdout.read() if proc.stdout else ""
        proc.wait()
    if over:
        return False, 0, time.monotonic() - start
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT)]
    if not lines:  # a rank died without reporting (e.g. a fault outside the guarded region): a failure
        return False, 0, time.monotonic() - start
    result = json.loads(lines[-1][len(RESULT) :])
    return result["ok"], result["params"], time.monotonic() - start


def largest(contender: str, args: argparse.Namespace, log: list[dict]) -> tuple[int, int]:
    """Bisection on depth: the largest number of layers whose attempt succeeds, and its parameter count."""
    lo, hi, best = 0, args.max_layers + 1, (0, 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ok, params, seconds = attempt(contender, mid, args)
        log.append({"contender": contender, "layers": mid, "ok": ok, "seconds": round(seconds, 1)})
        print(f"  {contender:8s} layers={mid:3d} {'ok' if ok else 'out of memory'} ({seconds:.0f} s)", flush=True)
        if ok:
            lo, best = mid, (mid, params)
        else:
            hi = mid
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one tiny attempt per contender: a smoke test only")
    parser.add_argument("--budget-gib", type=float, default=10.0, help="resident memory allowed per rank")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--max-layers", type=int, default=127)
    parser.add_argument("--attempt-timeout", type=float, default=600.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--contender", choices=["ddp", "torchacc"], help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.budget_gib, args.width, args.vocab, args.max_layers = 2.0, 256, 1024, 1
    import torch

    log: list[dict] = []
    rows = {c: largest(c, args, log) for c in ("ddp", "torchacc")}
    print(f"\nbudget {args.budget_gib} GiB/rank, width {args.width}, torch {torch.__version__}, 2 ranks (gloo, fp32)\n")
    print("| contender | largest depth | parameters (M) |")
    print("| --- | --- | --- |")
    for name, (layers, params) in rows.items():
        print(f"| {name} | {layers} | {params / 1e6:.0f} |")
    ddp, acc = rows["ddp"][1], rows["torchacc"][1]
    ratio = acc / ddp if ddp else float("inf")
    print(f"\ntorchacc / DDP parameters: {ratio:.2f}x (goal >= 1.8x: {'met' if ratio >= 1.8 else 'NOT met'})")
    out = Path(__file__).with_name("out")
    out.mkdir(exist_ok=True)
    (out / "capacity.json").write_text(json.dumps({"rows": rows, "attempts": log, "ratio": ratio}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(list(rows), [p / 1e6 for _, p in rows.values()], color=["tab:gray", "tab:blue"])
    ax.set_ylabel("parameters (M)")
    ax.set_title(f"largest trainable GPT-2, {args.budget_gib} GiB/rank, 2 ranks")
    fig.tight_layout()
    fig.savefig(out / "capacity.png", dpi=120)


if __name__ == "__main__":
    main()
