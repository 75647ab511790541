"""Set-up time of ``torchacc.accelerate()`` for GPT-2 on 2 ranks, against hand-written FSDP2 and a full broadcast.

Run (from the repository root)::

    .venv/bin/python benchmarks/setup_time.py            # full: ~23M and ~162M parameters, 7 rounds (~1 min)
    .venv/bin/python benchmarks/setup_time.py --quick    # smoke run: one tiny size, 1 round (~10 s)

The claim: with ``dist.fsdp.sync_module_states = True`` (the default), ranks that already hold the same weights
send none of them, so ``accelerate()`` costs about what hand-written FSDP2 costs. Contenders, each sharding a
``transformers.GPT2LMHeadModel`` (from ``GPT2Config``, float32, the same seed on every rank) with
``dist.fsdp.size = 2`` and ``wrap_layer_cls = {"GPT2Block"}`` on CPU/gloo:

* ``torchacc``: ``torchacc.accelerate(model, config=config)``, the default: digests compared, differing tensors sent.
* ``torchacc full broadcast``: the same, with the sync replaced by the previous code path: ``broadcast_tensors`` of
  every parameter and buffer from rank 0 (what ``accelerate()`` did before digests).
* ``torchacc whole digests``: the same, with every rank digesting every tensor whole (the sync before it compared
  only the chunk each rank keeps).
* ``torchacc no sync``: ``sync_module_states = False``, the floor (nothing compared, nothing sent).
* ``FSDP2``: by hand: ``init_device_mesh`` and ``fully_shard`` on every ``GPT2Block``, then on the root, with
  ``MixedPrecisionPolicy(reduce_dtype=float32)``; it does not synchronize the ranks' weights at all.
* ``torchacc, ranks differ``: ``accelerate()`` where rank 1 changed the last element of every parameter (in the
  chunk it keeps), so every parameter is sent: the worst case for the digest, against ``torchacc full broadcast``.

Method. One ``torchrun --nproc_per_node=2`` job. Each rank builds the model once per size and keeps it; each
measurement shards a ``copy.deepcopy`` of it (untimed), between a barrier and a barrier, and records the
slowest rank's wall time. An untimed warm-up of every contender comes first, on a 1-layer model (lazy imports,
first mesh) and again at each size: the first ``fully_shard`` of a size grows the process's heap, which took
~1 s at 162M parameters, whichever contender came first. The contender order rotates every round; the table
shows medians over rounds with the min-max, and "vs FSDP2 by round" the median over rounds of each round's ratio
to FSDP2 (the machine's speed drifts less within a round than across rounds). ``sync s`` is the time inside the
sync (digests, all-gather, broadcasts), slowest rank. A second table times ``tensor_digest`` over the model's
parameters on one rank against ``torch.sum`` of the same tensors (one read of the same bytes, the memory-speed
bound).
"""

import argparse
import copy
import gc
import json
import os
import sys
import time
from typing import Any

from _common import emit_result, gpt2_model, machine_summary, markdown_table, median, num_params, run_torchrun

CONTENDERS = (
    "torchacc",
    "torchacc whole digests",
    "torchacc full broadcast",
    "torchacc no sync",
    "FSDP2",
    "torchacc, ranks differ",
)
FULL_SIZES = {"L6-E512": (6, 512, 8192), "L22-E768": (22, 768, 8192)}  # ~23.2M and ~162.3M parameters
QUICK_SIZES = {"L2-E128": (2, 128, 1024)}
SEQ = 128
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


# ------------------------------------------------------------------------------------------------
# Inside a rank
# ------------------------------------------------------------------------------------------------


def shard(contender: str, model: Any, timings: dict[str, float]) -> Any:
    """Shard ``model`` the way ``contender`` does; the sync's time and count go into ``timings``."""
    import torch
    import torch.distributed as dist

    import torchacc
    import torchacc.parallel.engine
    from torchacc.distributed.collectives import broadcast_tensors

    if contender == "FSDP2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
        policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model

    real_sync = torchacc.parallel.engine.sync_tensors

    def full_broadcast(tensors: Any, src: int = 0, whole: Any = (), **_: Any) -> int:  # everything, whatever is kept
        tensors = [*tensors, *whole]
        broadcast_tensors(tensors, src=src)
        return len(tensors)

    def whole_digests(tensors: Any, src: int = 0, whole: Any = (), **_: Any) -> int:  # every rank reads all
        return real_sync([*tensors, *whole], src=src)

    sync = {"torchacc full broadcast": full_broadcast, "torchacc whole digests": whole_digests}.get(
        contender, torchacc.parallel.engine.sync_tensors
    )

    def timed_sync(tensors: Any, **kwargs: Any) -> int:
        start = time.perf_counter()
        num_sent = sync(tensors, **kwargs)
        timings["sent"] += num_sent
        timings["sync_s"] += time.perf_counter() - start
        return num_sent

    config = torchacc.Config()
    config.dist.fsdp.size = dist.get_world_size()
    config.dist.fsdp.wrap_layer_cls = {"GPT2Block"}
    config.dist.fsdp.sync_module_states = contender != "torchacc no sync"
    torchacc.parallel.engine.sync_tensors = timed_sync
    try:
        return torchacc.accelerate(model, config=config)
    finally:
        torchacc.parallel.engine.sync_tensors = real_sync


def measure(contender: str, pristine: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    model = copy.deepcopy(pristine)
    if contender == "torchacc, ranks differ" and dist.get_rank() != 0:
        with torch.no_grad():
            for param in model.parameters():
                param.view(-1)[-1] += 1.0  # the last row: in rank 1's own chunk, which it must not keep
    timings: dict[str, float] = {"sent": 0, "sync_s": 0.0}
    gc.collect()
    dist.barrier()
    start = time.perf_counter()
    model = shard(contender, model, timings)
    dist.barrier()
    elapsed = time.perf_counter() - start
    del model
    gc.collect()
    return {"setup_s": elapsed, **timings}


def digest_speed(model: Any, repeats: int) -> dict[str, float]:
    """Seconds to digest every parameter once, and to ``torch.sum`` them (a read of the same bytes): best of N."""
    from torchacc.distributed._digest import tensor_digest

    params = [p.detach() for p in model.parameters()]
    best = {"digest_s": float("inf"), "sum_s": float("inf")}
    for _ in range(repeats):
        for key, fn in (("digest_s", tensor_digest), ("sum_s", lambda t: t.sum())):
            start = time.perf_counter()
            for p in params:
                fn(p)
            best[key] = min(best[key], time.perf_counter() - start)
    best["bytes"] = sum(p.numel() * p.element_size() for p in params)
    return best


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    warm = gpt2_model(n_layer=1, n_embd=64, n_head=1, vocab=256, seq=SEQ)
    for contender in CONTENDERS:
        measure(contender, warm)
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    for name in args.sizes or list(sizes):
        layers, width, vocab = sizes[name]
        pristine = gpt2_model(n_layer=layers, n_embd=width, n_head=width // 64, vocab=vocab, seq=SEQ)
        for contender in CONTENDERS:  # the first sharding of a new size grows the heap: ~1 s at 162M, untimed
            measure(contender, pristine)
        for round_index in range(args.rounds):
            shift = round_index % len(CONTENDERS)
            for contender in CONTENDERS[shift:] + CONTENDERS[:shift]:
                result = measure(contender, pristine)
                emit_result({"rank": rank, "size": name, "round": round_index, "contender": contender, **result})
                print(f"rank {rank} {name} round {round_index} {contender}: {result['setup_s']:.3f} s", flush=True)
        if rank == 0:
            speed = digest_speed(pristine, repeats=args.rounds)
            emit_result({"rank": rank, "size": name, "params": num_params(pristine), "digest": speed})
        del pristine
        gc.collect()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# The driver
# ------------------------------------------------------------------------------------------------


def summarize(results: list[dict[str, Any]], sizes: list[str]) -> tuple[str, str]:
    """The set-up table (medians over rounds of the slowest rank) and the digest-speed table."""
    params = {r["size"]: r["params"] for r in results if "digest" in r}
    rows, speed_rows = [], []
    for size in sizes:
        runs = [r for r in results if r.get("size") == size and "contender" in r]
        slowest: dict[str, list[dict[str, float]]] = {}
        for round_index in sorted({r["round"] for r in runs}):
            for contender in CONTENDERS:
                ranks = [r for r in runs if r["round"] == round_index and r["contender"] == contender]
                slowest.setdefault(contender, []).append(
                    {key: max(r[key] for r in ranks) for key in ("setup_s", "sync_s", "sent")}
                )
        fsdp2 = median(r["setup_s"] for r in slowest["FSDP2"])
        fsdp2_rounds = [r["setup_s"] for r in slowest["FSDP2"]]
        for contender in CONTENDERS:
            setup = [r["setup_s"] for r in slowest[contender]]
            sync = median(r["sync_s"] for r in slowest[contender])
            sent = sorted({int(r["sent"]) for r in slowest[contender]})
            rows.append(
                [
                    size,
                    f"{params[size] / 1e6:.1f}M",
                    contender,
                    f"**{median(setup):.3f}**",
                    f"{min(setup):.3f}-{max(setup):.3f}",
                    f"{sync:.3f}" if contender not in ("FSDP2", "torchacc no sync") else "-",
                    "/".join(map(str, sent)) if contender != "FSDP2" else "-",
                    f"{median(setup) / fsdp2:.2f}x",
                    f"{median(a / b for a, b in zip(setup, fsdp2_rounds, strict=True)):.2f}x",
                ]
            )
        speed = next(r["digest"] for r in results if r.get("size") == size and "digest" in r)
        speed_rows.append(
            [
                size,
                f"{speed['bytes'] / 1e9:.3f}",
                f"{speed['digest_s'] * 1e3:.1f}",
                f"{speed['bytes'] / speed['digest_s'] / 1e9:.1f}",
                f"{speed['sum_s'] * 1e3:.1f}",
                f"{speed['bytes'] / speed['sum_s'] / 1e9:.1f}",
            ]
        )
    headers = ["model", "params", "contender", "setup s", "min-max s", "sync s", "tensors sent", "vs FSDP2"]
    headers.append("vs FSDP2 by round")  # the median of each round's ratio: the machine's drift cancels within a round
    speed_headers = ["model", "param GB", "digest ms", "digest GB/s", "torch.sum ms", "torch.sum GB/s"]
    return markdown_table(headers, rows), markdown_table(speed_headers, speed_rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one tiny size, 1 round (~10 s)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of all contenders (default 7, quick 1)")
    p.add_argument("--sizes", nargs="*", help=f"subset of {list(FULL_SIZES)}")
    p.add_argument("--out", default=os.path.join(OUT_DIR, "setup_time.json"), help="raw results (JSON)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 7)
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    started = time.monotonic()
    passed = [a for a in sys.argv[1:] if a != "--worker"]
    results = run_torchrun(os.path.abspath(__file__), [*passed, "--worker"], nproc=2, echo=False)
    sizes = args.sizes or list(QUICK_SIZES if args.quick else FULL_SIZES)
    table, speed_table = summarize(results, sizes)
    info = machine_summary()
    print(f"\n## Set-up time: GPT-2 fp32, 2 ranks on CPU/gloo, rounds: {args.rounds}, medians of the slowest rank\n")
    print(
        f"{info['date']}; {info['cpu']}, {info['cores']} cores, {info['mem_gib']} GiB; torch {info['torch']}; "
        f"wall {time.monotonic() - started:.0f} s\n"
    )
    print(table)
    print("\n### tensor_digest over every parameter, one rank (best of the rounds)\n")
    print(speed_table)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "machine": info, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
