"""The tensor-parallel comparison of ``throughput.py --tp`` and ``memory.py --tp``: FSDP 4 against TP 2 (x DP 2)
and FSDP 2 x TP 2, on 4 ranks, training a Llama-style model (GPT-2's ``Conv1D`` has no TP plan).

Every contender trains the same global batch (``--tp-batch`` sequences per step, split over its data-parallel
ranks: 4 for FSDP 4, 2 for the TP layouts), so tokens/s compare the same work. One extra step runs under
``CommBytes``, which counts the payload of every collective the step issues, split into the weights that FSDP
moves (``c10d`` all-gathers and reduce-scatters, HSDP's all-reduce) and the activations that TP moves (DTensor's
functional collectives).
"""

import argparse
import os
import time
from typing import Any

from _common import emit_result, malloc_trim, median, num_params, random_tokens, read_status, reset_peak_rss

# name -> (dist.fsdp.size, dist.tp.size); dist.dp.size is inferred (4 ranks)
TP_CONTENDERS = {"FSDP4": (4, 1), "TP2 (x DP2)": (1, 2), "FSDP2 x TP2": (2, 2)}
TP_RANKS = 4
# (layers, hidden, intermediate, heads, kv heads)
TP_SIZES = {"L4-H512": (4, 512, 1408, 8, 4)}
TP_QUICK = {"L2-H128": (2, 128, 256, 4, 2)}


def llama_model(*, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int, seq: int) -> Any:
    """A randomly initialized ``transformers.LlamaForCausalLM`` (float32, untied head), the same on every rank."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq,
        use_cache=False,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.loss_type = "ForCausalLM"
    return model


class CommBytes:
    """A dispatch mode that sums the payload bytes of collectives: the full (gathered / unreduced) buffer of
    each, per rank. ``sent`` estimates what a ring sends per rank: (n-1)/n of the payload for an all-gather or a
    reduce-scatter, 2(n-1)/n for an all-reduce, n the size of the group; a point-to-point send (a pipeline's
    activations and their gradients at the stage boundaries) sends its payload."""

    def __new__(cls, sizes: dict[str, int]):
        from torch.utils._python_dispatch import TorchDispatchMode

        class Mode(TorchDispatchMode):
            def __init__(self) -> None:
                super().__init__()
                self.payload = {"weights (FSDP)": 0, "activations (TP)": 0, "activations (PP)": 0}
                self.sent = dict.fromkeys(self.payload, 0.0)

            def _add(self, kind: str, nbytes: int, group: int, factor: float) -> None:
                self.payload[kind] += nbytes
                self.sent[kind] += nbytes * factor * (group - 1) / group if group > 1 else 0.0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                kwargs = kwargs or {}
                name, ns = func.__name__.split(".")[0], func.namespace

                def size(t: Any) -> int:
                    return t.numel() * t.element_size()

                if ns == "c10d" and name == "_allgather_base_":
                    self._add("weights (FSDP)", size(args[0]), sizes["fsdp"], 1.0)
                elif ns == "c10d" and name == "_reduce_scatter_base_":
                    self._add("weights (FSDP)", size(args[1]), sizes["fsdp"], 1.0)
                elif ns == "c10d" and name == "allreduce_":
                    self._add("weights (FSDP)", sum(size(t) for t in args[0]), sizes["dp"], 2.0)
                elif ns == "_c10d_functional" and name == "all_reduce":
                    self._add("activations (TP)", size(args[0]), sizes["tp"], 2.0)
                elif ns == "_c10d_functional" and name == "all_gather_into_tensor":
                    self._add("activations (TP)", size(args[0]) * sizes["tp"], sizes["tp"], 1.0)
                elif ns == "_c10d_functional" and name == "reduce_scatter_tensor":
                    self._add("activations (TP)", size(args[0]), sizes["tp"], 1.0)
                elif ns == "c10d" and name == "send":
                    self._add("activations (PP)", sum(size(t) for t in args[0]), 2, 2.0)  # sent = payload
                return func(*args, **kwargs)

        return Mode()


def _build(name: str, shape: tuple[int, ...], args: argparse.Namespace) -> tuple[Any, Any, Any, int]:
    import torch
    from torch.utils.data import DataLoader

    import torchacc

    fsdp, tp = TP_CONTENDERS[name]
    data_ranks = TP_RANKS // tp
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
    steps = args.warmup + args.rounds * args.tp_steps + 1
    dataset = random_tokens(args.tp_batch * steps, args.seq, args.vocab)
    config = torchacc.Config()
    config.dist.fsdp.size, config.dist.tp.size = fsdp, tp
    config.dist.fsdp.wrap_layer_cls = {"LlamaDecoderLayer"}
    loader = DataLoader(dataset, batch_size=args.tp_batch // data_ranks, drop_last=True)
    model, loader = torchacc.accelerate(model, loader, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer, iter(loader), params


def _steps(model: Any, optimizer: Any, batches: Any, num: int) -> float:
    loss = None
    for _ in range(num):
        loss = model(**next(batches)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return float("nan") if loss is None else loss.item()


def _state_bytes(model: Any, optimizer: Any) -> int:
    """Bytes this rank stores for parameters, and (2x, AdamW) for its optimizer state, plus gradients (4x)."""
    from torch.distributed.tensor import DTensor

    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * 4 for p in model.parameters())
    return 4 * local  # params, grads, exp_avg, exp_avg_sq


def tp_worker(args: argparse.Namespace, *, memory: bool) -> None:
    """Every contender of ``TP_CONTENDERS`` (``--tp-only`` for one), built side by side (throughput) or alone
    (memory: one contender per launch, so each rank's peak RSS is its own)."""
    import torch
    import torch.distributed as dist

    import torchacc

    torchacc.dist.init_distributed()
    rank = dist.get_rank()
    sizes = TP_QUICK if args.quick else TP_SIZES
    for size_name, shape in sizes.items():
        names = [args.tp_only] if args.tp_only else list(TP_CONTENDERS)
        if memory:
            malloc_trim()
            reset_peak_rss()
            base = read_status()["VmHWM"]
        runs = {}
        for name in names:
            runs[name] = _build(name, shape, args)
            _steps(*runs[name][:3], args.warmup)
        if memory:
            malloc_trim()
            reset_peak_rss()
            before = read_status()["VmRSS"]
        timings: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
        for round_index in range(args.rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                model, optimizer, batches, _ = runs[name]
                dist.barrier()
                start, cpu = time.perf_counter(), time.process_time()
                _steps(model, optimizer, batches, args.tp_steps)
                slowest = torch.tensor([time.perf_counter() - start, time.process_time() - cpu], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                timings[name].append(tuple(slowest.tolist()))
        for name in names:
            model, optimizer, batches, params = runs[name]
            fsdp, tp = TP_CONTENDERS[name]
            with CommBytes({"fsdp": fsdp, "tp": tp, "dp": TP_RANKS // (fsdp * tp)}) as counter:
                loss = _steps(model, optimizer, batches, 1)
            tokens = args.tp_batch * args.seq * args.tp_steps
            result = {
                "tp_size": size_name,
                "contender": name,
                "rank": rank,
                "params": params,
                "tokens_per_s": [tokens / t for t, _ in timings[name]],
                "cpu_s_per_step": [c / args.tp_steps for _, c in timings[name]],
                "payload": counter.payload,
                "sent": counter.sent,
                "state_bytes": _state_bytes(model, optimizer),
                "loss": loss,
                "loadavg": os.getloadavg()[0],
            }
            if memory:
                result["peak_gb"] = (read_status()["VmHWM"] - base) / 1e9  # read_status gives bytes
                result["train_peak_gb"] = (read_status()["VmHWM"] - before) / 1e9
            if rank == 0:
                print(f"[tp] {size_name} {name}: {median(result['tokens_per_s']):,.0f} tok/s", flush=True)
            emit_result(result)
        del runs
    dist.destroy_process_group()


def tp_table(results: list[dict[str, Any]], *, memory: bool) -> str:
    """The markdown table of the TP comparison (the largest rank's memory; rank 0's bytes and times)."""
    from _common import markdown_table

    rows = []
    for size in dict.fromkeys(r["tp_size"] for r in results):
        mine = [r for r in results if r["tp_size"] == size]
        ref = None
        for name in TP_CONTENDERS:
            ranks = [r for r in mine if r["contender"] == name]
            if not ranks:
                continue
            r0 = min(ranks, key=lambda r: r["rank"])
            tps = median(r0["tokens_per_s"])
            ref = ref or tps
            w, a = r0["payload"]["weights (FSDP)"] / 1e6, r0["payload"]["activations (TP)"] / 1e6
            sw, sa = r0["sent"]["weights (FSDP)"] / 1e6, r0["sent"]["activations (TP)"] / 1e6
            row = [size, f"{r0['params'] / 1e6:.1f}M", name, f"{tps:,.0f}", f"{tps / ref:.2f}x"]
            row += [f"{median(r0['cpu_s_per_step']):.2f}", f"{w:.1f} / {a:.1f}", f"{sw:.1f} / {sa:.1f}"]
            if memory:
                row += [f"{r0['state_bytes'] / 1e9:.3f}", f"{max(r.get('peak_gb', 0) for r in ranks):.3f}"]
            rows.append(row)
    headers = ["model", "params", "layout", "tok/s (median)", "vs first", "CPU s/step"]
    headers += ["payload MB/step weights / activations", "sent MB/step (ring) weights / activations"]
    if memory:
        headers += ["state GB/rank (16 B x local params)", "peak GB/rank (largest rank)"]
    return markdown_table(headers, rows)
