"""Code that runs inside each rank of a multi-process test (see tests/_launch.py).

Every function here returns plain data; the assertions live in the test modules, which compare
the ranks' results with a single-process reference computed in the pytest process.
"""

import itertools

import metrics_scenarios
import plan_scenarios
import report_scenarios
import torch
import torch.distributed as dist
from _models import TinyNet, tiny_gpt2, tiny_llama, token_dataset
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import torchacc
import torchacc.parallel.engine
from torchacc.distributed.sync import sync_tensors

NUM_STEPS = 5
LR = 1e-3
PAD_ROW = 70  # a padding token in the second half of the vocabulary: another rank's shard at 2 and 4 ranks


def gpt2_config(*, fsdp: int, dp: int | None = None, **extra) -> torchacc.Config:
    config = torchacc.Config()
    config.dist.fsdp.size = fsdp
    config.dist.dp.size = dp
    config.dist.fsdp.wrap_layer_cls = {"GPT2Block"}
    config.dist.timeout = 120.0
    for dotted, value in extra.items():
        *path, leaf = dotted.split("__")
        node = config
        for part in path:
            node = getattr(node, part)
        setattr(node, leaf, value)
    return config


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = {}
    for name, value in model.state_dict().items():
        value = value.full_tensor() if isinstance(value, DTensor) else value
        state[name] = value.detach().cpu().clone()
    return state


def train_gpt2(config: torchacc.Config, *, optimizer_first: bool = False, num_steps: int = NUM_STEPS) -> dict:
    """Train tiny GPT-2 for a few AdamW steps; each rank starts from different weights on purpose."""
    model = tiny_gpt2(seed=torchacc.dist.rank())
    loader = DataLoader(token_dataset(32), batch_size=2)
    if optimizer_first:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        model, loader, optimizer = torchacc.accelerate(model, loader, config, optimizer=optimizer)
    else:
        model, loader = torchacc.accelerate(model, loader, config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, indices = [], []
    for batch in itertools.islice(loader, num_steps):
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        indices.append(batch["index"].tolist())
    placements = {
        name: (tuple(str(p) for p in param.placements), tuple(param.to_local().shape), tuple(param.shape))
        for name, param in model.named_parameters()
        if isinstance(param, DTensor)
    }
    return {
        "losses": losses,
        "indices": indices,
        "state": full_state(model),
        "placements": placements,
        "num_params": sum(1 for _ in model.parameters()),
        "device": str(model.device),
        "keys": sorted(model.state_dict()),
        "mesh": (
            torchacc.accelerated_state(model).mesh.mesh.tolist()
            if torchacc.accelerated_state(model).mesh is not None
            else None
        ),
    }


def loader_indices(num_samples: str = "12") -> dict:
    loader = DataLoader(token_dataset(int(num_samples)), batch_size=3, shuffle=True)
    _, loader = torchacc.accelerate(torch.nn.Linear(2, 2), loader, torchacc.Config())
    epochs = [[i for batch in loader for i in batch["index"].tolist()] for _ in range(2)]
    return {"epochs": epochs, "len": len(loader)}


def meta_init_state(
    fsdp: int = 0, dp: int | None = None, *, tp: int = 1, rank_seeds: bool = False
) -> dict[str, dict[str, torch.Tensor]]:
    """Tiny GPT-2 (HF init), TinyNet (reset_parameters) and a Llama with a padding token built on the meta device,
    then accelerated.

    ``rank_seeds``: each rank seeds 7 + its rank before building (docs/checkpoints.md's per-rank seeding); the
    replicas must still start from rank 0's draw. ``tp``: TinyNet's blocks and the Llama's embedding split by a dict
    plan (TinyNet's head, outside the plan, stays replicated over the TP ranks); GPT-2 is left out (its Conv1D has
    no TP style). The Llama's init zeroes the padding row in place through an index of the (sharded) weight.
    """
    result = {}
    models = (
        ("gpt2", lambda: tiny_gpt2(seed=7), "GPT2Block"),
        ("tinynet", TinyNet, "Block"),
        ("llama_pad", lambda: tiny_llama(seed=7, pad_token_id=PAD_ROW), "LlamaDecoderLayer"),
    )
    plans = {
        "tinynet": {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"},
        "llama_pad": {"model.embed_tokens": "embedding_rowwise", "lm_head": "colwise_gather_output"},
    }
    for name, build, wrap in models[1:] if tp > 1 else models:
        torch.manual_seed(7 + (torchacc.dist.rank() if rank_seeds else 0))
        with torchacc.init_empty_weights():
            model = build()
        config = torchacc.Config()
        config.dist.fsdp.size = fsdp or torchacc.dist.world_size()
        config.dist.dp.size = dp
        config.dist.fsdp.wrap_layer_cls = {wrap}
        if tp > 1:
            config.dist.tp.size = tp
            config.dist.tp.plan = plans[name]
        model = torchacc.accelerate(model, config=config)
        result[name] = full_state(model)
        first = next(model.parameters())
        result[f"{name}_local"] = {
            "first": (first.to_local() if hasattr(first, "to_local") else first).detach().clone()
        }
    return result


def low_precision(dtype_name: str) -> dict:
    """A short TinyNet run at 2-rank FSDP in "bf16", "fp16" or "fp32"; fp16 injects an overflow on rank 1 only."""
    config = torchacc.Config()
    config.dist.fsdp.size = 2
    config.dist.fsdp.wrap_layer_cls = {"Block"}
    if dtype_name != "fp32":
        setattr(config.compute, dtype_name, True)
    torch.manual_seed(0)
    model = torchacc.accelerate(TinyNet(), config=config)
    inside = {}

    def record(module, inputs, output):
        inside.update(
            weight=str(module.weight.dtype), output=str(output.dtype), autocast=torch.is_autocast_enabled("cpu")
        )

    model.blocks[0].fc1.register_forward_hook(record)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torchacc.GradScaler(init_scale=1024.0) if dtype_name == "fp16" else None
    gen = torch.Generator().manual_seed(10 + torchacc.dist.rank())
    x = torch.randn(16, 16, generator=gen)
    y = x.sum(dim=1, keepdim=True)
    losses, out_dtype, overflow = [], None, {}
    for step in range(12):
        out = model(x)
        out_dtype = str(out.dtype)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            if step == 6:
                if torchacc.dist.rank() == 1:
                    next(iter(model.parameters())).grad.to_local().view(-1)[0] = float("inf")
                finite_here = all(bool(torch.isfinite(p.grad.to_local()).all()) for p in model.parameters())
                before = full_state(model)
                scale_before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            if step == 6:
                after = full_state(model)
                overflow = {
                    "finite_here": finite_here,
                    "unchanged": all(torch.equal(before[k], after[k]) for k in before),
                    "scale_before": scale_before,
                    "scale_after": scaler.get_scale(),
                }
        optimizer.zero_grad()
        losses.append(torchacc.dist.reduce(loss.detach()).item())
    return {"losses": losses, "out_dtype": out_dtype, "overflow": overflow, "inside": inside}


def gpt2_bf16_at_both_sizes() -> dict:
    """The same bf16 config at dist.fsdp.size 1 (DP: autocast) and 2 (FSDP: the policy casts), and fp32."""
    runs = {}
    for name, fsdp, bf16 in (("fsdp_bf16", 2, True), ("dp_bf16", 1, True), ("fsdp_fp32", 2, False)):
        runs[name] = train_gpt2(gpt2_config(fsdp=fsdp, compute__bf16=bf16), num_steps=3)["losses"]
    return runs


def no_whole_model_moves() -> list[str]:
    """Which modules accelerate() moves as a whole (Module.to) while it shards: none may be."""
    moved: list[str] = []
    real_to = torch.nn.Module.to

    def spy(self, *args, **kwargs):
        moved.append(type(self).__name__)
        return real_to(self, *args, **kwargs)

    torch.nn.Module.to = spy
    try:
        torchacc.accelerate(tiny_gpt2(seed=0), config=gpt2_config(fsdp=2))
    finally:
        torch.nn.Module.to = real_to
    return moved


def unsharded_parameters_left_alive() -> dict:
    """While accelerate() shards a model, each unit's unsharded parameters must be freed as it is sharded (holding
    them all kept the whole model alive, and the shards then took fresh memory: a set-up cost growing with the
    model). Count the originals still alive afterwards, with none held by the caller."""
    import gc
    import weakref

    import torchacc.parallel.fsdp as fsdp_module

    model = tiny_gpt2(seed=0)
    blocks = {id(p) for p in model.transformer.h.parameters()}
    refs = [weakref.ref(p) for p in model.parameters() if id(p) in blocks]
    alive_at_root = []
    real_fully_shard = fsdp_module.fully_shard

    def spy(module, **kwargs):
        if module is model:  # the root comes last: every block is sharded by now
            gc.collect()
            alive_at_root.append(sum(ref() is not None for ref in refs))
        return real_fully_shard(module, **kwargs)

    fsdp_module.fully_shard = spy
    try:
        torchacc.accelerate(model, config=gpt2_config(fsdp=2))
    finally:
        fsdp_module.fully_shard = real_fully_shard
    return {"alive": alive_at_root, "num_params": len(refs)}


def collectives() -> dict:
    rank = torchacc.dist.rank()
    result = {
        "broadcast_obj": torchacc.dist.broadcast({"from": rank}, src=1),
        "broadcast_tensor": torchacc.dist.broadcast(torch.tensor([float(rank)]), src=0).tolist(),
        "reduce_mean": torchacc.dist.reduce(float(rank + 1)),
        "all_reduce_sum": torchacc.dist.all_reduce(torch.tensor([rank + 1]), op="sum").tolist(),
        "master": torchacc.dist.is_master_ordinal(local=False),
    }
    torchacc.dist.rendezvous("same-tag")
    torchacc.dist.mark_step()
    try:
        torchacc.dist.rendezvous(f"tag-of-rank-{rank}")
        result["mismatch"] = None
    except RuntimeError as exc:
        result["mismatch"] = str(exc)
    dist.barrier()
    return result


class _Output:
    """A plain object as a model's output (not a tuple, dict or dataclass): FSDP2 finds no tensor in it."""

    def __init__(self, loss: torch.Tensor) -> None:
        self.loss = loss


class _PlainOutputNet(TinyNet):
    def forward(self, x: torch.Tensor) -> _Output:
        return _Output(super().forward(x).square().mean())


def plain_output_object() -> dict:
    """FSDP2 over a model whose output is a plain object: its gradients must equal one process's."""
    torch.manual_seed(0)
    model = torchacc.accelerate(_PlainOutputNet(), config=gpt2_config(fsdp=2, dist__fsdp__wrap_layer_cls={"Block"}))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(x)
    sharded_after_eval = isinstance(model.head.weight, DTensor)  # no backward follows: the root frees its gather
    try:
        out = model(x)
        gathered_for_backward = not isinstance(model.head.weight, DTensor)  # the root unit: head
        out.loss.backward()
    except RuntimeError as exc:
        return {"error": str(exc)}
    return {
        "error": None,
        "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()},
        "sharded_after_eval": sharded_after_eval,
        "gathered_for_backward": gathered_for_backward,
        "sharded_after_backward": isinstance(model.head.weight, DTensor),
    }


def fsdp_suite() -> dict:
    """Everything checked at 2 ranks, in one launch."""
    return {
        "fsdp": train_gpt2(gpt2_config(fsdp=2)),
        "fsdp_gc": train_gpt2(gpt2_config(fsdp=2, memory__gc=True)),
        "fsdp_opt_first": train_gpt2(gpt2_config(fsdp=2), optimizer_first=True),
        "dp": train_gpt2(gpt2_config(fsdp=1)),
        "loader": loader_indices(),
        "bf16": low_precision("bf16"),
        "fp16": low_precision("fp16"),
        "fp32": low_precision("fp32"),
        "bf16_sizes": gpt2_bf16_at_both_sizes(),
        "moves": no_whole_model_moves(),
        "originals": unsharded_parameters_left_alive(),
        "collectives": collectives(),
        "stale_optimizer": stale_optimizer(),
        "sync": sync_states(),
        "kept_chunk_sync": kept_chunk_sync(fsdp=2),
        "memory_report": report_scenarios.fsdp_reports(),
        "plain_output": plain_output_object(),
        "plan_oracle": plan_scenarios.oracle_two(),
    }


def hsdp_suite() -> dict:
    """Everything checked at 4 ranks, in one launch."""
    return {
        "hsdp": train_gpt2(gpt2_config(fsdp=2, dp=2)),
        "hsdp_strided": train_gpt2(gpt2_config(fsdp=2, dp=2, dist__topology=["fsdp", "dp"]), num_steps=2),
        "kept_chunk_sync": kept_chunk_sync(fsdp=2, dp=2),
        "kept_chunk_sync_strided": kept_chunk_sync(fsdp=2, dp=2, strided=True),
        "meta_fsdp4": meta_init_state(fsdp=4),
        "meta_hsdp": meta_init_state(fsdp=2, dp=2),
        "meta_hsdp_rank_seeds": meta_init_state(fsdp=2, dp=2, rank_seeds=True),
        "meta_fsdp2_tp2_rank_seeds": meta_init_state(fsdp=2, tp=2, rank_seeds=True),
        "memory_report": report_scenarios.hsdp_reports(),
        "metrics": metrics_scenarios.hsdp_metrics(),
        "metrics_fsdp_tp": metrics_scenarios.fsdp_tp_records(),
        "plan_oracle": plan_scenarios.oracle_four(),
        # After the oracle: a PP x FSDP run leaves about 190 KB per rank alive that a later run frees, which the
        # oracle's measured peak (net of what was alive before it) would lose.
        "metrics_pp_fsdp": metrics_scenarios.pp_fsdp_records(),
    }


def train_gpt2_fsdp() -> dict:
    return train_gpt2(gpt2_config(fsdp=2))


def stale_optimizer() -> dict:
    """An optimizer built before accelerate() and not passed in must fail loudly at its first step."""
    model = tiny_gpt2(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model = torchacc.accelerate(model, config=gpt2_config(fsdp=2))
    ids = token_dataset(2)[0]["input_ids"].unsqueeze(0)
    model(input_ids=ids, labels=ids).loss.backward()
    try:
        optimizer.step()
        return {"error": None}
    except RuntimeError as exc:
        return {"error": str(exc)}


def _sync_tensors() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(64, 48, generator=gen),
        torch.randn(40, generator=gen).to(torch.bfloat16),
        torch.randint(-9, 9, (5, 3), generator=gen),
        torch.rand(7, generator=gen) > 0.5,
        torch.randn(6, 4, generator=gen).to(torch.float16).t(),
        torch.randperm(70_000, generator=gen),  # a large tensor: digested by rows of 1021 words
    ]


def kept_chunk_sync(*, fsdp: int, dp: int | None = None, strided: bool = False) -> dict:
    """accelerate()'s sync under plain FSDP/HSDP compares only the chunk of each parameter that a rank keeps.

    Cases (rank 0 builds seed 0 unchanged in each): ``same``, every rank builds seed 0; ``kept``, every other rank
    adds 1 to the first element of the chunk it keeps, in every parameter; ``dropped``, the same in a chunk it
    drops (the next one). ``strided``: the topology ``["fsdp", "dp"]`` (rank r keeps chunk r // dp). Per case: the
    tensors sent, the elements each rank digested, and whether every rank's sharded model, gathered, equals seed
    0's (the oracle: what a rank keeps is rank 0's).
    """
    import torchacc.distributed.sync as sync

    rank = torchacc.dist.rank()
    shard = rank // (dp or 1) if strided else rank % fsdp  # the default topology has "fsdp" innermost
    extra = {"dist__topology": ["fsdp", "dp"]} if strided else {}
    reference = {n: p.detach().clone() for n, p in tiny_gpt2(seed=0).named_parameters()}
    real_digest, real_sync = sync.tensor_digest, torchacc.parallel.engine.sync_tensors
    read, sent = [0], [0]

    def counting_digest(tensor):
        read[0] += tensor.numel()
        return real_digest(tensor)

    def counting_sync(tensors, **kwargs):
        num_sent = real_sync(tensors, **kwargs)
        sent[0] += num_sent
        return num_sent

    result = {"num_elements": sum(t.numel() for t in reference.values())}
    sync.tensor_digest, torchacc.parallel.engine.sync_tensors = counting_digest, counting_sync
    try:
        for case in ("same", "kept", "dropped"):
            model = tiny_gpt2(seed=0)
            if rank != 0 and case != "same":
                chunk = shard if case == "kept" else (shard + 1) % fsdp
                with torch.no_grad():
                    for param in model.parameters():
                        piece = torch.chunk(param, fsdp, dim=0)[chunk]
                        piece.view(-1)[0] += 1.0
            read[0] = sent[0] = 0
            model = torchacc.accelerate(model, config=gpt2_config(fsdp=fsdp, dp=dp, **extra))
            gathered = {n: p.full_tensor() for n, p in model.named_parameters()}
            result[case] = {
                "sent": sent[0],
                "read": read[0],
                "equal": all(torch.equal(gathered[n], reference[n]) for n in reference),
            }
    finally:
        sync.tensor_digest, torchacc.parallel.engine.sync_tensors = real_digest, real_sync
    return result


def sync_states() -> dict:
    """sync_tensors sends only what differs from rank 0, and accelerate() goes through it."""
    rank = torchacc.dist.rank()
    agreeing = _sync_tensors()
    num_agreeing = sync_tensors(agreeing)
    mixed = _sync_tensors()
    if rank == 1:
        mixed[0][3, [5, 9]] = mixed[0][3, [9, 5]].clone()  # a swap: the same values, in another order
        mixed[5] = torch.randperm(70_000, generator=torch.Generator().manual_seed(1))  # a per-rank permutation
    sent: list[int] = []
    real_broadcast = dist.broadcast

    def spy(tensor, *args, **kwargs):
        sent.append(tensor.numel())
        return real_broadcast(tensor, *args, **kwargs)

    dist.broadcast = spy
    try:
        num_mixed = sync_tensors(mixed)
    finally:
        dist.broadcast = real_broadcast
    counts: list[tuple[int, int]] = []  # (tensors sent, tensors compared) per accelerate() call
    real_sync = torchacc.parallel.engine.sync_tensors

    def counting_sync(tensors, *, whole=(), **kwargs):
        tensors, whole = list(tensors), list(whole)
        counts.append((real_sync(tensors, whole=whole, **kwargs), len(tensors) + len(whole)))
        return counts[-1][0]

    torchacc.parallel.engine.sync_tensors = counting_sync
    try:
        for seed in (0, rank):
            torchacc.accelerate(tiny_gpt2(seed=seed), config=gpt2_config(fsdp=2))
    finally:
        torchacc.parallel.engine.sync_tensors = real_sync
    return {
        "num_agreeing": num_agreeing,
        "num_mixed": num_mixed,
        "sent": sent,
        "mixed": mixed,
        "expected": _sync_tensors(),
        "engine_counts": counts,
    }
