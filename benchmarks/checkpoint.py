"""How long a save stops training: ``save_checkpoint(blocking=False)`` against a synchronous save of the same state.

    .venv/bin/python benchmarks/checkpoint.py            # 2 ranks, ~300 MB per rank, 5 rounds of each mode
    .venv/bin/python benchmarks/checkpoint.py --quick    # smoke run: a tiny model, 1 round (~20 s)

Two ranks (torchrun, gloo, CPU) train an FSDP2 MLP with AdamW; model and optimizer state make ``--mb`` MB per
rank. Each round takes ``--steps`` training steps, then saves (the modes alternate, and the order flips every
round). "Blocked" is the time the training loop spends inside ``save_checkpoint`` and, for a save in the
background, inside the ``wait()`` after the next ``--steps`` steps: the time the loop cannot train. The
saves go to ``--workdir`` (``keep=1``), on disk, with DCP's fsync of every file. Medians over rounds of the
slower rank; the steps around a background save are timed too (they share the CPUs with the writing).
"""

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_summary, markdown_table, median, print_result, run_torchrun  # noqa: E402

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
MODES = ["blocking", "background"]


def build(mb: int) -> tuple[Any, Any, Any]:
    """An MLP whose parameters and AdamW state come to ``mb`` MB per rank over 2 ranks (fp32: 3 x 4 bytes each)."""
    import torch

    import torchacc

    width = 1024
    layers = max(1, round(mb * 1e6 * 2 / (3 * 4 * width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    config = torchacc.Config()
    config.dist.fsdp.size = torchacc.dist.world_size()
    config.dist.fsdp.wrap_layer_cls = {"Linear"}
    model = torchacc.accelerate(model, config=config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(16, width)
    return model, optimizer, x


def worker(args: argparse.Namespace) -> None:

    import torchacc

    rank = torchacc.dist.rank()
    model, optimizer, x = build(args.mb)

    def steps(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        return time.perf_counter() - start

    steps(2)  # the optimizer state exists before the first save
    local = sum(t.to_local().numel() * 4 for t in model.parameters())
    local += sum(v.to_local().numel() * 4 for s in optimizer.state.values() for v in s.values() if v.dim() > 0)
    root = args.workdir
    torchacc.save_checkpoint(root, model=model, optimizer=optimizer, keep=1)  # warm: the save group, the stager
    torchacc.save_checkpoint(root, model=model, optimizer=optimizer, keep=1, blocking=False).wait()
    for round_index in range(args.rounds):
        order = MODES if round_index % 2 == 0 else MODES[::-1]
        for mode in order:
            torchacc.dist.barrier()
            start = time.perf_counter()
            handle = torchacc.save_checkpoint(
                root, model=model, optimizer=optimizer, keep=1, blocking=mode == "blocking"
            )
            in_call = time.perf_counter() - start
            step_time = steps(args.steps)
            start = time.perf_counter()
            if mode == "background":
                handle.wait()
            in_wait = time.perf_counter() - start
            result = {"rank": rank, "round": round_index, "mode": mode, "in_call": in_call, "in_wait": in_wait}
            print_result({**result, "steps_s": step_time, "state_bytes": local})
    quiet = steps(args.steps)  # the same steps with no save around: the steps' own time
    print_result({"rank": rank, "mode": "no save", "steps_s": quiet, "state_bytes": local})


def summarize(results: list[dict[str, Any]], steps: int) -> str:
    rows = []
    blocked: dict[str, float] = {}
    for mode in [*MODES, "no save"]:
        mine = [r for r in results if r["mode"] == mode]
        by_round: dict[int, list[dict[str, Any]]] = {}
        for r in mine:
            by_round.setdefault(r.get("round", 0), []).append(r)
        slowest = [max(rs, key=lambda r: r.get("in_call", 0) + r.get("in_wait", 0)) for rs in by_round.values()]
        call = median(r.get("in_call", 0.0) for r in slowest)
        wait = median(r.get("in_wait", 0.0) for r in slowest)
        blocked[mode] = call + wait
        step_s = median(max(r["steps_s"] for r in rs) for rs in by_round.values()) / steps
        ratio = f"{blocked[mode] / blocked['blocking']:.3f}" if mode != "no save" else ""
        mb = mine[0]["state_bytes"] / 1e6
        rows.append([mode, f"{mb:.0f}", len(by_round), f"{call:.3f}", f"{wait:.3f}", f"{blocked[mode]:.3f}", ratio,
                     f"{step_s * 1e3:.1f}"])  # fmt: skip
    headers = ["mode", "MB per rank", "rounds", "in save s", "in wait s", "blocked s", "blocked / blocking",
               "step ms (after the save)"]  # fmt: skip
    return markdown_table(headers, rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a tiny model, 1 round (~20 s)")
    p.add_argument("--mb", type=int, default=None, help="model + optimizer state per rank, MB (default 300)")
    p.add_argument("--steps", type=int, default=None, help="training steps between saves (default 20)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of both modes (default 5, quick 1)")
    p.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--out", default=os.path.join(OUT_DIR, "checkpoint.json"), help="raw results (JSON)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.mb = args.mb or (4 if args.quick else 300)
    args.steps = args.steps or (2 if args.quick else 20)
    args.rounds = args.rounds or (1 if args.quick else 5)
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        passed = [a for a in sys.argv[1:] if a not in ("--worker",)]
        cmd = [*passed, "--worker", "--workdir", os.path.join(workdir, "ckpt")]
        results = run_torchrun(os.path.abspath(__file__), cmd, nproc=2, echo=False)
    info = machine_summary()
    load = os.getloadavg()[0]
    print(f"\n## Saving: blocking against background, 2 ranks on CPU/gloo, medians over {args.rounds} round(s)\n")
    print(f"{info['date']}; {info['cpu']}, {info['cores']} cores, {info['mem_gib']} GiB; torch {info['torch']}; ")
    print(f"1-minute load average at the end {load:.1f}; wall {time.monotonic() - started:.0f} s\n")
    print(summarize(results, args.steps))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "machine": info, "load": load, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
