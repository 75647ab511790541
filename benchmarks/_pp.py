"""The pipeline-parallel comparison of ``throughput.py --pp`` and ``memory.py --pp``: FSDP 4 against PP 2 x FSDP 2,
PP 2 x DP 2 and PP 4, on 4 ranks, training the Llama-style model of ``_tp.py``.

Every contender trains the same global batch (``--pp-batch`` sequences per step, split over its data-parallel
ranks: 4 for FSDP 4, 2 for the PP 2 layouts, 1 for PP 4) with the same loop, ``torchacc.train_step``; a pipeline
cuts its batch into one microbatch per stage (``dist.pp.microbatches`` left at its default), so every microbatch
holds the same number of sequences. One extra step runs under ``CommBytes`` (``_tp.py``), which counts the payload
of every collective: the weights FSDP moves (all-gathers, reduce-scatters, HSDP's all-reduce) and the activations a
pipeline sends at its stage boundaries (point-to-point sends: activations forward, their gradients backward).
"""

import argparse
import os
import time
from typing import Any

from _common import emit_result, malloc_trim, median, num_params, random_tokens, read_status, reset_peak_rss
from _tp import CommBytes, llama_model

# name -> (dist.pp.size, dist.fsdp.size); dist.dp.size is inferred (4 ranks)
PP_CONTENDERS = {"FSDP4": (1, 4), "PP2 x FSDP2": (2, 2), "PP2 x DP2": (2, 1), "PP4": (4, 1)}
PP_RANKS = 4
# (layers, hidden, intermediate, heads, kv heads): 4 layers, so that PP 4 has a block per stage
PP_SIZES = {"L4-H512": (4, 512, 1408, 8, 4)}
PP_QUICK = {"L4-H128": (4, 128, 256, 4, 2)}


def _build(name: str, shape: tuple[int, ...], args: argparse.Namespace) -> tuple[Any, Any, Any, int]:
    import torch
    from torch.utils.data import DataLoader

    import torchacc

    pp, fsdp = PP_CONTENDERS[name]
    data_ranks = PP_RANKS // pp
    layers, hidden, intermediate, heads, kv = shape
    model = llama_model(
        layers=layers,
        hidden=hidden,
        intermediate=intermediate,
        heads=heads,
        kv_heads=kv,
        vocab=args.vocab,
        seq=args.seq,
    )
    params = num_params(model)
    steps = args.warmup + args.rounds * args.pp_steps + 1
    dataset = random_tokens(args.pp_batch * steps, args.seq, args.vocab)
    config = torchacc.Config()
    config.dist.pp.size, config.dist.fsdp.size = pp, fsdp
    config.dist.fsdp.wrap_layer_cls = {"LlamaDecoderLayer"}
    loader = DataLoader(dataset, batch_size=args.pp_batch // data_ranks, drop_last=True)
    model, loader = torchacc.accelerate(model, loader, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer, iter(loader), params


def _steps(model: Any, optimizer: Any, batches: Any, num: int) -> float:
    import torchacc

    loss = None
    for _ in range(num):
        loss = torchacc.train_step(model, next(batches))  # the one loop, with or without a pipeline
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return float("nan") if loss is None else loss.item()


def _state_bytes(model: Any) -> int:
    """Bytes this rank stores for parameters, gradients and AdamW's two moments: 16 B per local parameter."""
    from torch.distributed.tensor import DTensor

    return 16 * sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


def pp_worker(args: argparse.Namespace, *, memory: bool) -> None:
    """Every contender of ``PP_CONTENDERS`` (``--pp-only`` for one), built side by side (throughput) or alone
    (memory: one contender per launch, so each rank's peak RSS is its own)."""
    import torch
    import torch.distributed as dist

    import torchacc

    torchacc.dist.init_distributed()
    rank = dist.get_rank()
    for size_name, shape in (PP_QUICK if args.quick else PP_SIZES).items():
        names = [args.pp_only] if args.pp_only else list(PP_CONTENDERS)
        if memory:
            malloc_trim()
            reset_peak_rss()
            base = read_status()["VmHWM"]
        runs = {}
        for name in names:
            runs[name] = _build(name, shape, args)
            _steps(*runs[name][:3], args.warmup)
        timings: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
        for round_index in range(args.rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                model, optimizer, batches, _ = runs[name]
                dist.barrier()
                start, cpu = time.perf_counter(), time.process_time()
                _steps(model, optimizer, batches, args.pp_steps)
                slowest = torch.tensor([time.perf_counter() - start, time.process_time() - cpu], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                timings[name].append(tuple(slowest.tolist()))
        for name in names:
            model, optimizer, batches, params = runs[name]
            pp, fsdp = PP_CONTENDERS[name]
            with CommBytes({"fsdp": fsdp, "tp": 1, "dp": PP_RANKS // (pp * fsdp)}) as counter:
                loss = _steps(model, optimizer, batches, 1)
            result = {
                "pp_size": size_name,
                "contender": name,
                "rank": rank,
                "params": params,
                "tokens_per_s": [args.pp_batch * args.seq * args.pp_steps / t for t, _ in timings[name]],
                "cpu_s_per_step": [c / args.pp_steps for _, c in timings[name]],
                "payload": counter.payload,
                "sent": counter.sent,
                "state_bytes": _state_bytes(model),
                "loss": loss,
                "loadavg": os.getloadavg()[0],
            }
            if memory:
                result["peak_gb"] = (read_status()["VmHWM"] - base) / 1e9
            if rank == 0:
                print(f"[pp] {size_name} {name}: {median(result['tokens_per_s']):,.0f} tok/s", flush=True)
            emit_result(result)
        del runs
    dist.destroy_process_group()


def pp_table(results: list[dict[str, Any]], *, memory: bool) -> str:
    """The markdown table of the PP comparison: per layout, the busiest rank's bytes, the largest rank's memory."""
    from _common import markdown_table

    rows = []
    for size in dict.fromkeys(r["pp_size"] for r in results):
        mine = [r for r in results if r["pp_size"] == size]
        ref = None
        for name in PP_CONTENDERS:
            ranks = [r for r in mine if r["contender"] == name]
            if not ranks:
                continue
            r0 = min(ranks, key=lambda r: r["rank"])
            tps = median(r0["tokens_per_s"])
            ref = ref or tps
            weights = max(r["sent"]["weights (FSDP)"] for r in ranks) / 1e6
            acts = max(r["sent"]["activations (PP)"] for r in ranks) / 1e6
            total = max(r["sent"]["weights (FSDP)"] + r["sent"]["activations (PP)"] for r in ranks) / 1e6
            row = [size, f"{r0['params'] / 1e6:.1f}M", name, f"{tps:,.0f}", f"{tps / ref:.2f}x"]
            row += [f"{median(r0['cpu_s_per_step']):.2f}", f"{weights:.1f} / {acts:.2f}", f"{total:.1f}"]
            row += [f"{max(r['state_bytes'] for r in ranks) / 1e9:.3f}"]
            if memory:
                row += [f"{max(r.get('peak_gb', 0) for r in ranks):.3f}"]
            rows.append(row)
    headers = ["model", "params", "layout", "tok/s (median)", "vs first", "CPU s/step"]
    headers += ["sent MB/step weights / activations (busiest rank)", "sent MB/step total (busiest rank)"]
    headers += ["state GB/rank (largest)"]
    if memory:
        headers += ["peak GB/rank (largest rank)"]
    return markdown_table(headers, rows)
