"""Training throughput (tokens/s) of GPT-2: torchacc against hand-written FSDP2, DDP and one process.

Run (from the repository root)::

    .venv/bin/python benchmarks/throughput.py            # full: 3 GPT-2 sizes, 4 rounds (about 8 min on 2 cores)
    .venv/bin/python benchmarks/throughput.py --quick    # smoke run: one tiny size, 1 round, 1 timed step, no figures
    .venv/bin/python benchmarks/throughput.py --compile only --sizes L2-E128 L6-E512   # the compile line alone
    .venv/bin/python benchmarks/throughput.py --tp       # tensor parallelism: FSDP4, TP2 x DP2, FSDP2 x TP2 (4 ranks)
    .venv/bin/python benchmarks/throughput.py --pp       # pipeline parallelism: FSDP4, PP2 x FSDP2, PP2 x DP2, PP4

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
every round (a b c d, b c d a, ...; with the default 4 rounds each contender runs first once). Tokens/s
counts the tokens of all ranks (``ranks x batch x seq`` per step); tables show medians over rounds. The
CPU time per step (``time.process_time()``, the busiest rank) is reported beside it: it does not count the
time a rank is descheduled, so it is less sensitive to other processes on a shared machine. On CUDA (when
available) the same code runs with NCCL, one GPU per rank, and ``torch.cuda.synchronize()`` before reading
the clock.

``--compile on|only`` adds the ``compute.compile`` comparison (``--quick --compile on`` runs it at the tiny size):

* ``(a') torchacc compiled``: (a) with ``config.compute.compile = True`` (torchacc compiles every wrapped
  block's ``forward`` in place, before sharding).
* ``(b') FSDP2 compiled``: (b) with ``block.forward = torch.compile(block.forward)`` on every ``GPT2Block``
  before ``fully_shard`` (torchtitan's order, the same compiled region as (a')).

(a), (b), (a') and (b') are built side by side with ``use_cache=False`` (see ``measure_compiled``), warmed up
(at least 2 steps, each timed: the first step of (a') is the compile time, into a fresh inductor cache), then
timed in rotating order, one block of steps per contender per round. Tokens/s excludes the warm-up; the ratios
(a')/(a), (b')/(b) and (a')/(b') are medians of per-round ratios, and the losses at the same step are compared.

``--tp`` runs only the tensor-parallel comparison (``_tp.py``): a Llama-style model on 4 ranks as FSDP 4,
TP 2 x DP 2 and FSDP 2 x TP 2, built side by side, the same global batch, rotating order; plus the bytes the
collectives of one step move, weights (FSDP) against activations (TP).

``--pp`` runs only the pipeline-parallel comparison (``_pp.py``): the same model on 4 ranks as FSDP 4, PP 2 x
FSDP 2, PP 2 x DP 2 and PP 4, trained by the same ``torchacc.train_step`` loop; plus the bytes of one step,
weights (FSDP) against the activations sent at the stage boundaries.
``--metrics`` runs only the cost of watching a run (``_metrics.py``): (a) torchacc with ``metrics.every = 0``
(off) against (a*) the same with ``metrics.every = 10`` and the JSONL sink, built side by side and timed in
paired blocks of 20 steps (two records per block), the order alternating; wall and CPU time per step.
"""

import argparse
import functools
import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from _common import (
    ALLOCATORS,
    allocator_env,
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
from _metrics import METRICS_EVERY, instrument, metrics_table
from _pp import PP_RANKS, pp_table, pp_worker
from _tp import TP_RANKS, tp_table, tp_worker

CONTENDERS = ("torchacc", "fsdp2", "ddp", "single")
LABELS = {"torchacc": "(a) torchacc", "fsdp2": "(b) FSDP2", "ddp": "(c) DDP", "single": "(d) 1 process"}
# The compile comparison (--compile): eager (a) and (b) against the same two with every GPT2Block compiled.
COMPILED = ("torchacc", "fsdp2", "torchacc+compile", "fsdp2+compile")
COMPILED_KEYS = {"torchacc": "a", "fsdp2": "b", "torchacc+compile": "a'", "fsdp2+compile": "b'"}
LABELS.update({"torchacc+compile": "(a') torchacc compiled", "fsdp2+compile": "(b') FSDP2 compiled"})
# name -> (n_layer, n_embd, n_head, timed steps); the vocabulary is --vocab, the context --seq.
FULL_SIZES = {
    "L2-E128": (2, 128, 4, 16),
    "L4-E256": (4, 256, 4, 6),
    "L6-E512": (6, 512, 8, 3),
}
QUICK_SIZES = {"L2-E128": (2, 128, 4, 1)}
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


def setup_torchacc(
    model: Any, dataset: Any, batch: int, device: Any, *, compiled: bool = False, metrics_dir: str | None = None
) -> tuple[Any, Any, Callable[[Any], Any]]:
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    import torchacc

    config = torchacc.Config()
    config.dist.fsdp.size = dist.get_world_size()
    config.dist.fsdp.wrap_layer_cls = {"GPT2Block"}
    config.compute.compile = compiled
    if metrics_dir is not None:  # --metrics: a record every METRICS_EVERY steps, to the JSONL file (rank 0)
        config.metrics.every, config.metrics.sinks, config.metrics.dir = METRICS_EVERY, {"jsonl"}, metrics_dir
    model, loader = torchacc.accelerate(model, DataLoader(dataset, batch_size=batch, drop_last=True), config)
    return model, loader, _keep  # torchacc's loader already yields batches on the device


def setup_fsdp2(
    model: Any, dataset: Any, batch: int, device: Any, *, compiled: bool = False
) -> tuple[Any, Any, Callable[[Any], Any]]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if compiled:
        # torchtitan's order: compile every block, then shard. Only ``forward`` is compiled, in place, as torchacc
        # does, so the compiled region is the same in (a') and (b') and FSDP's hooks on ``__call__`` stay eager.
        for block in model.transformer.h:
            block.forward = torch.compile(block.forward)
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


SETUPS = {
    "torchacc": setup_torchacc,
    "fsdp2": setup_fsdp2,
    "ddp": setup_ddp,
    "single": setup_single,
    "torchacc+compile": functools.partial(setup_torchacc, compiled=True),
    "fsdp2+compile": functools.partial(setup_fsdp2, compiled=True),
}


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


class Run:
    """One contender's model, optimizer and batches, ready to train (built on this rank)."""

    def __init__(
        self,
        contender: str,
        size: tuple[int, ...],
        args: argparse.Namespace,
        device: Any,
        num_steps: int,
        *,
        use_cache: bool = True,
    ):
        import torch
        import torch.distributed as dist

        n_layer, n_embd, n_head = size[:3]
        self.contender, self.device = contender, device
        world = dist.get_world_size()
        dataset = random_tokens(world * args.batch * num_steps, args.seq, args.vocab)
        model = gpt2_model(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab=args.vocab, seq=args.seq)
        model.config.use_cache = use_cache  # True (HF's default): every step also builds an unused KV cache
        self.params = num_params(model)
        self.model, loader, self.move = SETUPS[contender](model, dataset, args.batch, device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.batches = iter(loader)

    def train(self, num_steps: int) -> float:
        return run_steps(self.model, self.optimizer, self.batches, self.move, num_steps)

    def timed(self, num_steps: int, gloo: Any) -> tuple[float, float, float]:
        """(seconds, CPU seconds, last loss) of ``num_steps`` steps; the slowest rank's for distributed runs."""
        import torch
        import torch.distributed as dist

        _sync(self.device)
        if self.contender != "single":
            dist.barrier(group=gloo)
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = self.train(num_steps)
        _sync(self.device)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        if self.contender != "single":
            slowest = torch.tensor([elapsed, cpu], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=gloo)
            elapsed, cpu = slowest.tolist()
        return elapsed, cpu, loss


def global_hooks() -> int:
    """Hooks registered process-wide (on every optimizer or module). torchacc installing one would make (b), (c)
    and (d), which run in the same process after it, pay for it too; the count is reported with the results."""
    import torch.nn.modules.module as module
    import torch.optim.optimizer as optimizer

    names = [(optimizer, "_global_optimizer_pre_hooks"), (optimizer, "_global_optimizer_post_hooks")]
    names += [(module, f"_global_{kind}_hooks") for kind in ("forward_pre", "forward", "backward_pre", "backward")]
    return sum(len(getattr(where, name, {})) for where, name in names)


def _free(device: Any) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(contender: str, size: tuple[int, int, int, int], args: argparse.Namespace, device: Any, gloo: Any) -> dict:
    """Train ``contender`` for ``warmup + steps`` steps; the timed part's tokens/s (all ranks) and last loss."""
    import torch.distributed as dist

    steps = args.steps or size[3]
    world, rank = dist.get_world_size(), dist.get_rank()
    if contender == "single" and rank != 0:
        cpu = time.process_time()
        dist.barrier(group=gloo)  # rank 0 trains alone; this one sleeps until it is done
        return {"idle_cpu_s": time.process_time() - cpu}
    run = Run(contender, size, args, device, args.warmup + steps)
    run.train(args.warmup)
    elapsed, cpu, loss = run.timed(steps, gloo)
    if contender == "single":
        dist.barrier(group=gloo)  # release rank 1
    num_ranks = 1 if contender == "single" else world
    params = run.params
    del run
    _free(device)
    return {
        "tokens_per_s": num_ranks * args.batch * args.seq * steps / elapsed,
        "seconds": elapsed,
        "cpu_s_per_step": cpu / steps,  # this process's CPU time (all its threads), the busiest rank
        "steps": steps,
        "loss": loss,
        "params": params,
        "loadavg": os.getloadavg()[0],
        "global_hooks": global_hooks(),
    }


def measure_paired(size: tuple[int, int, int, int], args: argparse.Namespace, device: Any, gloo: Any) -> dict:
    """(a) and (b) built side by side in this process, timed in alternating blocks (ab, ba, ab, ...).

    Neighbouring blocks see nearly the same load from other processes, so the ratio of each pair is
    far less noisy than the ratio of two separate runs; the median over pairs is reported.
    """
    block = max(1, (args.steps or size[3]) // 2)
    runs = {c: Run(c, size, args, device, args.warmup + args.pairs * block) for c in ("torchacc", "fsdp2")}
    for run in runs.values():
        run.train(args.warmup)
    ratios, cpu_ratios, loss_gap = [], [], 0.0
    for pair in range(args.pairs):
        order = ("torchacc", "fsdp2") if pair % 2 == 0 else ("fsdp2", "torchacc")
        timing = {c: runs[c].timed(block, gloo) for c in order}
        ratios.append(timing["fsdp2"][0] / timing["torchacc"][0])  # tokens/s (a) over (b)
        cpu_ratios.append(timing["fsdp2"][1] / timing["torchacc"][1])
        loss_gap = max(loss_gap, abs(timing["torchacc"][2] - timing["fsdp2"][2]))
    del runs
    _free(device)
    return {"paired_ratios": ratios, "paired_cpu_ratios": cpu_ratios, "block": block, "loss_gap": loss_gap}


def measure_metrics(size: tuple[int, int, int, int], args: argparse.Namespace, device: Any, gloo: Any) -> dict:
    """(a) metrics off and (a*) metrics every 10 steps built side by side, timed in alternating blocks (ab, ba, ...)
    of ``args.metrics_block`` steps; per pair, the time of (a*) over (a), by wall and by CPU time."""
    import shutil
    import tempfile

    import torch
    import torch.distributed as dist

    box = [tempfile.mkdtemp(prefix="throughput-metrics-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, group=gloo)  # every rank must give accelerate() the same config
    metrics_dir = box[0]
    hooks = instrument()  # before the first model is watched, so that the hooks registered are the timed ones
    SETUPS["torchacc+metrics"] = functools.partial(setup_torchacc, metrics_dir=metrics_dir)
    block, pairs = args.metrics_block, args.metrics_pairs
    runs = {c: Run(c, size, args, device, args.warmup + pairs * block) for c in ("torchacc", "torchacc+metrics")}
    for run in runs.values():
        run.train(args.warmup)
    import torchacc

    wall, cpu, off_step_s, on_cpu_s = [], [], [], 0.0
    hooks["cpu_s"] = 0.0  # the timed blocks only
    for pair in range(pairs):
        order = ("torchacc", "torchacc+metrics") if pair % 2 == 0 else ("torchacc+metrics", "torchacc")
        timing = {c: runs[c].timed(block, gloo) for c in order}
        wall.append(timing["torchacc+metrics"][0] / timing["torchacc"][0])
        cpu.append(timing["torchacc+metrics"][1] / timing["torchacc"][1])
        off_step_s.append(timing["torchacc"][0] / block)
        on_cpu_s += timing["torchacc+metrics"][1]
    hook_cpu = torch.tensor([hooks["cpu_s"]], dtype=torch.float64)
    dist.all_reduce(hook_cpu, op=dist.ReduceOp.MAX, group=gloo)
    last_step = torchacc.last_metrics().get("step", 0)  # the model with metrics is the only one recording
    del runs
    torchacc.metrics.close_metrics()
    if dist.get_rank() == 0:
        shutil.rmtree(metrics_dir, ignore_errors=True)
    _free(device)
    return {
        "metrics_wall": wall,
        "metrics_cpu": cpu,
        "off_step_s": off_step_s,
        "block": block,
        "records": last_step // METRICS_EVERY,
        "hook_cpu_s": float(hook_cpu),  # the busiest rank's CPU seconds inside the metrics hooks, timed blocks
        "metrics_steps": pairs * block,
        "metrics_cpu_step_s": on_cpu_s / (pairs * block),  # (a*)'s CPU seconds per step, the busiest rank
    }


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def measure_compiled(size: tuple[int, int, int, int], args: argparse.Namespace, device: Any, gloo: Any) -> dict:
    """(a), (b), (a') and (b') built side by side: warm-up steps timed one by one (the first compiles), then
    ``--rounds`` rounds of one block of steps each, the order rotating every round.

    All four run with ``use_cache=False``: with HF's default the KV cache a block updates differs per layer,
    so each block compiles its own graph (and past ``recompile_limit`` blocks, 8, run eager).
    """
    import torch

    torch._dynamo.reset()  # no graphs, and no dynamic-shape decisions, carried over from another size
    steps = args.steps or size[3]
    warmup = max(2, args.warmup)  # step 1 compiles forward and backward; step 2 is the first plain one
    runs = {c: Run(c, size, args, device, warmup + args.rounds * steps, use_cache=False) for c in COMPILED}
    graphs = _graphs_compiled()
    warmups = {}
    for c in COMPILED:  # (a') compiles first, into a fresh cache; (b') then finds the same graphs cached
        warmups[c] = [runs[c].timed(1, gloo)[0] for _ in range(warmup)]
    graphs_warmup, graphs = _graphs_compiled() - graphs, _graphs_compiled()
    timings: dict[str, list[tuple[float, float, float]]] = {c: [] for c in COMPILED}
    orders = []
    for round_index in range(args.rounds):
        shift = round_index % len(COMPILED)
        order = COMPILED[shift:] + COMPILED[:shift]
        orders.append("".join(COMPILED_KEYS[c] for c in order))
        for c in order:
            timings[c].append(runs[c].timed(steps, gloo))
    graphs_timed = _graphs_compiled() - graphs
    params = runs["torchacc"].params
    del runs
    _free(device)
    torch._dynamo.reset()
    tokens = torch.distributed.get_world_size() * args.batch * args.seq * steps
    return {
        "compiled_tokens_per_s": {c: [tokens / t[0] for t in timings[c]] for c in COMPILED},
        "compiled_cpu_s_per_step": {c: [t[1] / steps for t in timings[c]] for c in COMPILED},
        "compiled_losses": {c: [t[2] for t in timings[c]] for c in COMPILED},
        "warmup_s": warmups,
        "orders": orders,
        "steps": steps,
        "params": params,
        "graphs_warmup": graphs_warmup,  # per rank: each distinct compiled graph of this size
        "graphs_timed": graphs_timed,  # 0 when the warm-up covered every compilation
    }


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    if args.tp:
        tp_worker(args, memory=False)
        return
    if args.pp:
        pp_worker(args, memory=False)
        return
    if args.metrics:
        args.compile, args.rounds, args.pairs = "off", 0, 0  # the metrics comparison alone
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(process_group_backend(device.type))
    gloo = dist.new_group(backend="gloo")  # barriers and timings on the CPU, also next to NCCL
    rank = dist.get_rank()
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    names = args.sizes or list(sizes)
    base = args.compile != "only"  # the eager comparison of (a)-(d) and the (a)/(b) pairs
    for round_index in range(args.rounds if base else 0):
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
    for name in names if base and args.pairs else []:
        result = measure_paired(sizes[name], args, device, gloo)
        result.update(size=name, rank=rank, loadavg=os.getloadavg()[0])
        if rank == 0:
            print(
                f"[paired] {name} (a)/(b): median {median(result['paired_ratios']):.3f} over {args.pairs} pairs of "
                f"{result['block']} steps",
                flush=True,
            )
            emit_result(result)
    for name in names if args.metrics else []:
        result = measure_metrics(sizes[name], args, device, gloo)
        result.update(size=name, rank=rank, loadavg=os.getloadavg()[0])
        if rank == 0:
            print(
                f"[metrics] {name}: (a*)/(a) step time median {median(result['metrics_wall']):.4f} (wall), "
                f"{median(result['metrics_cpu']):.4f} (CPU) over {args.metrics_pairs} pairs of {result['block']} steps",
                flush=True,
            )
            emit_result(result)
    for name in names if args.compile != "off" else []:
        result = measure_compiled(sizes[name], args, device, gloo)
        result.update(size=name, rank=rank, loadavg=os.getloadavg()[0])
        if rank == 0:
            tps = {c: median(v) for c, v in result["compiled_tokens_per_s"].items()}
            first = {c: v[0] for c, v in result["warmup_s"].items()}
            print(
                f"[compile] {name}: "
                + ", ".join(f"{LABELS[c]} {tps[c]:,.0f} tok/s" for c in COMPILED)
                + "; first step "
                + ", ".join(f"{COMPILED_KEYS[c]} {first[c]:.1f} s" for c in COMPILED),
                flush=True,
            )
            emit_result(result)
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# The driver: one torchrun job, then the tables
# ------------------------------------------------------------------------------------------------


def _ratio_cell(values: list[float]) -> str:
    if not values:
        return "-"
    spread = f" ({min(values):.3f}-{max(values):.3f})" if len(values) > 1 else ""
    return f"{median(values):.3f}{spread}"


def summarize(results: list[dict[str, Any]], args: argparse.Namespace) -> tuple[list[str], str, dict]:
    """The tables (throughput, torchacc against FSDP2, per round), a fairness line, and medians for the plot."""
    timed = [r for r in results if "tokens_per_s" in r]
    paired = {r["size"]: r for r in results if "paired_ratios" in r}
    sizes = list(dict.fromkeys(r["size"] for r in timed))

    def pick(size: str, contender: str, key: str) -> list[float]:
        return [r[key] for r in timed if r["size"] == size and r["contender"] == contender]

    med = {(s, c): median(pick(s, c, "tokens_per_s")) for s in sizes for c in CONTENDERS if pick(s, c, "tokens_per_s")}
    rows, ab_rows, round_rows, loss_gap = [], [], [], 0.0
    for s in sizes:
        ratios = []
        for round_index in sorted({r["round"] for r in timed if r["size"] == s}):
            this = {r["contender"]: r for r in timed if r["size"] == s and r["round"] == round_index}
            ratio = "-"
            if "torchacc" in this and "fsdp2" in this:
                ratios.append(this["torchacc"]["tokens_per_s"] / this["fsdp2"]["tokens_per_s"])
                loss_gap = max(loss_gap, abs(this["torchacc"]["loss"] - this["fsdp2"]["loss"]))
                ratio = f"{ratios[-1]:.3f}"
            first = next(iter(this.values()))
            cells = [f"{this[c]['tokens_per_s']:,.0f}" if c in this else "-" for c in CONTENDERS]
            load = median(r["loadavg"] for r in this.values())
            round_rows.append([s, round_index + 1, first["order"], *cells, ratio, f"{load:.1f}"])
        single = med[(s, "single")]
        params = pick(s, "torchacc", "params")[0]
        rows.append(
            [s, f"{params / 1e6:.2f}M", args.nproc * args.batch * args.seq]
            + [f"{med[(s, c)]:,.0f}" for c in CONTENDERS]
            + [f"{med[(s, c)] / single:.2f}x" for c in ("torchacc", "fsdp2", "ddp")]
        )
        cpu = {c: median(pick(s, c, "cpu_s_per_step")) for c in ("torchacc", "fsdp2")}
        pair = paired.get(s, {})
        loss_gap = max(loss_gap, pair.get("loss_gap", 0.0))
        ab_rows.append(
            [
                s,
                f"{med[(s, 'torchacc')] / med[(s, 'fsdp2')]:.3f}",
                _ratio_cell(ratios),
                f"{cpu['fsdp2'] / cpu['torchacc']:.3f}",
                f"{cpu['torchacc']:.3f} / {cpu['fsdp2']:.3f}",
                f"**{_ratio_cell(pair.get('paired_ratios', []))}**",
                _ratio_cell(pair.get("paired_cpu_ratios", [])),
            ]
        )
    headers = ["model", "params", "tokens/step", *(LABELS[c] + " tok/s" for c in CONTENDERS)]
    headers += ["speed-up (a)", "speed-up (b)", "speed-up (c)"]
    ab_headers = [
        "model",
        "ratio of medians",
        "per round (range)",
        "by CPU time",
        "CPU s/step (a) / (b)",
        f"paired blocks: median (range) of {args.pairs}",
        "paired, by CPU time",
    ]
    idle = [r["idle_cpu_s"] for r in results if "idle_cpu_s" in r]
    hooks = max((r["global_hooks"] for r in timed), default=0)
    loads = [r["loadavg"] for r in results if "loadavg" in r]
    notes = (
        f"max |loss (a) - loss (b)| at the same step: {loss_gap:.2e} (same data, same init); "
        f"CPU time of the idle rank during (d): max {max(idle, default=0.0):.3f} s; "
        f"1-min load average during the run: {min(loads):.1f}-{max(loads):.1f} (this job alone: 2.0); "
        f"process-wide optimizer/module hooks present: {hooks}"
        + (" (they also run in (b), (c) and (d), which share the process)" if hooks else "")
    )
    round_headers = ["model", "round", "order", *(LABELS[c] for c in CONTENDERS), "(a)/(b)", "load avg"]
    tables = [markdown_table(headers, rows), markdown_table(ab_headers, ab_rows)]
    return [*tables, markdown_table(round_headers, round_rows)], notes, med


def summarize_compiled(results: list[dict[str, Any]], args: argparse.Namespace) -> tuple[str, str, str]:
    """The compile tables (throughput and speed-ups; warm-up and compile time) and the loss check line."""
    a, b, a2, b2 = COMPILED
    rows, time_rows, gaps = [], [], {"(a') - (a)": 0.0, "(b') - (b)": 0.0, "(a) - (b)": 0.0, "(a') - (b')": 0.0}
    loss_scale = 0.0
    for r in (r for r in results if "compiled_tokens_per_s" in r):
        tps, cpu, losses = r["compiled_tokens_per_s"], r["compiled_cpu_s_per_step"], r["compiled_losses"]

        def per_round(x: str, y: str, values: dict[str, list[float]] = tps) -> list[float]:
            return [p / q for p, q in zip(values[x], values[y], strict=True)]

        rows.append(
            [r["size"], f"{r['params'] / 1e6:.2f}M"]
            + [f"{median(tps[c]):,.0f}" for c in COMPILED]
            + [f"**{_ratio_cell(per_round(a2, a))}**", _ratio_cell(per_round(b2, b))]
            + [f"**{_ratio_cell(per_round(a2, b2))}**", _ratio_cell(per_round(a, a2, cpu))]
        )
        for name, (x, y) in zip(gaps, ((a2, a), (b2, b), (a, b), (a2, b2)), strict=True):
            gaps[name] = max([gaps[name]] + [abs(p - q) for p, q in zip(losses[x], losses[y], strict=True)])
        loss_scale = max([loss_scale] + losses[a])
        warm = r["warmup_s"]
        step = {c: args.nproc * args.batch * args.seq / median(tps[c]) for c in (a, a2)}  # s/step
        compile_s = warm[a2][0] - warm[a][0]
        saved = step[a] - step[a2]
        time_rows.append(
            [r["size"]]
            + [f"{warm[c][0]:.1f}" for c in COMPILED]
            + [f"**{compile_s:.1f}**", f"{warm[b2][0] - warm[b][0]:.1f}"]
            + [f"{step[a]:.3f} / {step[a2]:.3f}", f"{compile_s / saved:.0f}" if saved > 0 else "never"]
            + [f"{r['graphs_warmup']} / {r['graphs_timed']}", " ".join(r["orders"])]
        )
    headers = ["model", "params", *(LABELS[c] + " tok/s" for c in COMPILED)]
    headers += ["(a')/(a)", "(b')/(b)", "(a')/(b')", "(a')/(a) by CPU time"]
    time_headers = ["model", *(f"1st step s {COMPILED_KEYS[c]}" for c in COMPILED)]
    time_headers += ["compile s (a') = 1st (a') - 1st (a)", "compile s (b')", "step s (a) / (a')"]
    time_headers += ["steps to repay (a')", "graphs compiled: warm-up / timed", "orders"]
    check = "; ".join(f"{name} {gap:.2e}" for name, gap in gaps.items())
    check = (
        f"loss check, max |difference| at the same step (same data, same init; loss about {loss_scale:.2f}): {check}"
    )
    return markdown_table(headers, rows), markdown_table(time_headers, time_rows), check


def loader_overhead(args: argparse.Namespace, repeats: int = 7, num_batches: int = 400) -> dict[str, float]:
    """Microseconds per batch to iterate rank 0's share of the data: torchacc against the hand-written loader.

    torchacc: ``shard_dataloader`` (what ``accelerate()`` builds, with the config's defaults), whose batches come
    already placed on the device; hand-written: ``DataLoader`` + ``DistributedSampler`` + ``.to(device)`` per
    tensor. On the CPU, in this (driver) process; the two alternate and the medians are returned.
    """
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    from torchacc.data import shard_dataloader

    torch.set_num_threads(1)
    device = torch.device("cpu")
    dataset = random_tokens(args.nproc * args.batch * num_batches, args.seq, args.vocab)

    def torchacc_loader() -> Any:
        plain = DataLoader(dataset, batch_size=args.batch, drop_last=True)
        kwargs = {"shuffle": None, "drop_last": None, "seed": 0, "prefetch": True, "shard": True}
        return shard_dataloader(plain, num_replicas=args.nproc, rank=0, device=device, **kwargs)

    def hand_loader() -> Any:
        sampler = DistributedSampler(dataset, args.nproc, 0, shuffle=False, drop_last=True)
        return DataLoader(dataset, batch_size=args.batch, sampler=sampler, drop_last=True)

    def per_batch(loader: Any, move: Callable[[Any], Any]) -> float:
        start, count = time.perf_counter(), 0
        for batch in loader:
            move(batch)
            count += 1
        return (time.perf_counter() - start) / count * 1e6

    times: dict[str, list[float]] = {"torchacc": [], "fsdp2": []}
    for _ in range(repeats):
        times["torchacc"].append(per_batch(torchacc_loader(), _keep))
        times["fsdp2"].append(per_batch(hand_loader(), lambda b: _move(b, device)))
    return {name: median(values) for name, values in times.items()}


def plot(med: dict, path: str, nproc: int) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    sizes = list(dict.fromkeys(s for s, _ in med))
    shown = ("torchacc", "fsdp2", "ddp")
    width = 0.8 / len(shown)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, c in enumerate(shown):
        xs = [j + (i - 1) * width for j in range(len(sizes))]
        ax.bar(xs, [med.get((s, c), 0) / med[(s, "single")] for s in sizes], width, label=LABELS[c])
    ax.axhline(1.0, color="gray", linewidth=1, label="(d) 1 process")
    ax.axhline(nproc, color="gray", linewidth=1, linestyle="--", label=f"ideal ({nproc} ranks)")
    ax.set_xticks(range(len(sizes)), sizes)
    ax.set_ylabel("tokens/s over one process (medians)")
    ax.set_title(f"GPT-2 training throughput, fp32 AdamW, {nproc} ranks")
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="smoke run: one tiny size, batch 2 x seq 32, 1 round, 1 timed step"
    )
    p.add_argument("--rounds", type=int, default=None, help="rounds of all contenders (default 4, quick 1)")
    p.add_argument("--steps", type=int, default=0, help="timed steps per measurement (default: per size)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2, quick 1)")
    p.add_argument("--batch", type=int, default=0, help="sequences per rank per step (default 8, quick 2)")
    p.add_argument("--seq", type=int, default=0, help="tokens per sequence (default 128, quick 32)")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary size (GPT-2's is 50257)")
    p.add_argument("--sizes", nargs="*", help=f"subset of {list(FULL_SIZES)}")
    p.add_argument("--pairs", type=int, default=None, help="(a)/(b) paired block count per size (default 6, quick 1)")
    p.add_argument("--allocator", choices=list(ALLOCATORS), default="glibc", help="malloc setting of the ranks")
    p.add_argument("--nproc", type=int, default=2, help="ranks")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--plot", default=os.path.join(OUT_DIR, "throughput.png"), help="PNG path; raw JSON beside it")
    p.add_argument(
        "--compile",
        choices=("off", "on", "only"),
        default=None,
        help="add the compute.compile comparison (a)/(b)/(a')/(b') after the others, or run only it (default off)",
    )
    p.add_argument("--tp", action="store_true", help="only the tensor-parallel comparison (4 ranks, Llama-style)")
    p.add_argument("--tp-batch", type=int, default=8, help="--tp: global batch (sequences per step, all layouts)")
    p.add_argument("--tp-steps", type=int, default=0, help="--tp: timed steps per round (default 3, quick 1)")
    p.add_argument("--tp-only", help=argparse.SUPPRESS)
    p.add_argument("--pp", action="store_true", help="only the pipeline-parallel comparison (4 ranks, Llama-style)")
    p.add_argument("--pp-batch", type=int, default=8, help="--pp: global batch (sequences per step, all layouts)")
    p.add_argument("--pp-steps", type=int, default=0, help="--pp: timed steps per round (default 3, quick 1)")
    p.add_argument("--pp-only", help=argparse.SUPPRESS)
    p.add_argument("--metrics", action="store_true", help="only the cost of metrics.every=10 against metrics off")
    p.add_argument(
        "--metrics-pairs", type=int, default=0, help="--metrics: paired blocks per size (default 12, quick 1)"
    )
    p.add_argument(
        "--metrics-block",
        type=int,
        default=0,
        help="--metrics: steps per block, a multiple of 10 (default 20, quick 10)",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.compile = args.compile or "off"
    tiny = args.quick and not (args.tp or args.pp)  # --tp/--pp --quick keep their own batch and seq 128
    args.batch = args.batch or (2 if tiny else 8)
    args.seq = args.seq or (32 if tiny else 128)
    args.rounds = args.rounds or (1 if args.quick else len(CONTENDERS))
    args.pairs = args.pairs if args.pairs is not None else (1 if args.quick else 6)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.tp_steps = args.tp_steps or (1 if args.quick else 3)
    args.pp_steps = args.pp_steps or (1 if args.quick else 3)
    args.metrics_pairs = args.metrics_pairs or (1 if args.quick else 12)
    args.metrics_block = args.metrics_block or (10 if args.quick else 20)
    if args.metrics and not args.sizes and not args.quick:
        args.sizes = ["L2-E128", "L4-E256"]  # the shortest steps, where a fixed cost per step weighs most
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
    if args.tp:
        results = run_torchrun(os.path.abspath(__file__), [*passed, "--worker"], nproc=TP_RANKS)
        info = machine_summary()
        print(
            f"\n## Tensor parallelism: Llama-style model, fp32 AdamW, {TP_RANKS} ranks on CPU/gloo (global batch "
            f"{args.tp_batch}, seq {args.seq}, vocab {args.vocab}, {args.rounds} rounds of {args.tp_steps} steps)\n"
        )
        print(
            f"{info['date']}; {info['cpu']}, {info['cores']} cores, {info['mem_gib']} GiB; torch {info['torch']}; "
            f"load {max(r['loadavg'] for r in results):.1f}; wall {time.monotonic() - started:.0f} s\n"
        )
        print(tp_table(results, memory=False))
        return
    if args.pp:
        results = run_torchrun(os.path.abspath(__file__), [*passed, "--worker"], nproc=PP_RANKS)
        info = machine_summary()
        print(
            f"\n## Pipeline parallelism: Llama-style model, fp32 AdamW, {PP_RANKS} ranks on CPU/gloo (global batch "
            f"{args.pp_batch}, seq {args.seq}, vocab {args.vocab}, {args.rounds} rounds of {args.pp_steps} steps)\n"
        )
        print(
            f"{info['date']}; {info['cpu']}, {info['cores']} cores, {info['mem_gib']} GiB; torch {info['torch']}; "
            f"load {max(r['loadavg'] for r in results):.1f}; wall {time.monotonic() - started:.0f} s\n"
        )
        print(pp_table(results, memory=False))
    if args.metrics:
        results = run_torchrun(
            os.path.abspath(__file__), [*passed, "--worker", "--device", args.device], nproc=args.nproc
        )
        info = machine_summary()
        print(
            f"\n## Metrics overhead: GPT-2, fp32 AdamW, {args.nproc} ranks on {args.device} (batch {args.batch}/rank, "
            f"seq {args.seq}, vocab {args.vocab}; metrics.every = {METRICS_EVERY}, JSONL sink)\n"
        )
        print(
            f"{info['date']}; {info['cpu']}, {info['cores']} cores, {info['mem_gib']} GiB; torch {info['torch']}; "
            f"wall {time.monotonic() - started:.0f} s\n"
        )
        print(metrics_table(results, args))
        return
    env = allocator_env(args.allocator)
    cmd = [*passed, "--worker", "--device", args.device]
    # A fresh inductor cache, so the compile time below is a cold compile (not what an earlier run left behind).
    with tempfile.TemporaryDirectory(prefix="throughput-inductor-") as cache:
        env = {**(env or {}), "TORCHINDUCTOR_CACHE_DIR": cache}
        results = run_torchrun(os.path.abspath(__file__), cmd, nproc=args.nproc, env=env)
    info = machine_summary()
    print(
        f"\n## Training throughput: GPT-2, fp32 AdamW, {args.nproc} ranks on {args.device} "
        f"(batch {args.batch}/rank, seq {args.seq}, vocab {args.vocab}, {args.rounds} rounds, "
        f"{args.warmup} warm-up steps, malloc {args.allocator})\n"
    )
    print(
        f"{info['date']}; {info['cpu']}, {info['cores']} cores, {info['mem_gib']} GiB; torch {info['torch']}; "
        f"wall {time.monotonic() - started:.0f} s\n"
    )
    med = print_base(results, args) if args.compile != "only" else {}
    if args.compile != "off":
        table, time_table, check = summarize_compiled(results, args)
        print(
            "\n### compute.compile: (a') torchacc with compute.compile = True, (b') hand-written FSDP2 compiling each "
            "block first\n\n"
            "(a), (b), (a'), (b') built side by side (use_cache=False for all four), warmed up, then timed in rotating "
            f"order, one block of steps each per round; tokens/s medians over {args.rounds} rounds; ratios: median "
            "(range) of the per-round ratios of tokens/s. 'By CPU time' = CPU s/step of (a) over (a').\n"
        )
        print(table)
        print(
            "\nWarm-up (not in tokens/s above): wall seconds of the first step, slowest rank. (a') compiles first, "
            "into an empty inductor cache; (b') then reuses what (a') compiled. Steps to repay = compile s / (step s "
            "(a) - step s (a')).\n"
        )
        print(time_table)
        print("\n" + check)
    raw = os.path.splitext(args.plot)[0] + ".json"  # the raw results, next to the plot
    os.makedirs(os.path.dirname(os.path.abspath(raw)), exist_ok=True)
    with open(raw, "w") as f:
        json.dump({"args": vars(args), "machine": info, "results": results}, f, indent=1)
    path = plot(med, args.plot, args.nproc) if med else None
    print(f"plot: {path}" if path else "plot: skipped (matplotlib is not installed, or --compile only)")


def print_base(results: list[dict[str, Any]], args: argparse.Namespace) -> dict:
    """Print the tables of (a)-(d) and the (a)/(b) pairs; return the medians for the plot."""
    (table, ab_table, per_round), notes, med = summarize(results, args)
    print("Tokens/s of all ranks, medians over rounds; speed-up = tokens/s over (d) one process.\n")
    print(table)
    print(
        "\n### (a) torchacc / (b) hand-written FSDP2 (goal >= 0.98)\n\n"
        "Ratios of tokens/s from the rounds above, and from paired blocks: (a) and (b) built side by side and "
        "timed in alternating blocks of steps. 'By CPU time' = CPU seconds per step of (b) over (a) (the busiest "
        "rank), which does not count time a rank is descheduled by other processes.\n"
    )
    print(ab_table)
    print("\nPer round (tokens/s):\n")
    print(per_round)
    print("\n" + notes)
    if args.device == "cpu":
        loader = loader_overhead(args, *((1, 20) if args.quick else (7, 400)))
        step_ms = min(args.nproc * args.batch * args.seq / med[(s, "fsdp2")] for s, _ in med) * 1e3
        extra = loader["torchacc"] - loader["fsdp2"]
        print(
            f"loader, per batch: torchacc {loader['torchacc']:.1f} us, hand-written {loader['fsdp2']:.1f} us; the "
            f"difference ({extra:+.1f} us) is {extra / 1e3 / step_ms:+.3%} of the shortest (b) step ({step_ms:.0f} ms)"
        )
    return med


if __name__ == "__main__":
    main()
