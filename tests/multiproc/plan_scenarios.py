"""The estimate's oracle, inside the ranks of the ``two_ranks`` and ``four_ranks`` launches (scenarios.py).

Each rank trains every configuration for real (gloo, real tensors): one step to create the optimizer state, then
one step inside ``torchacc.track_memory()``, after which ``memory_report`` gives the held bytes and the measured
peak. Then, in the same processes and with their real process group alive, each rank computes
``torchacc.estimate_memory`` for its share of the configurations; an all-gather of the estimates over the real
group afterwards shows the estimate left it working. test_plan_oracle.py compares the two.
"""

import gc
import time

import torch
from _models import SEQ, tiny_gpt2, tiny_llama

import torchacc
from torchacc.data.context import split_sequences
from torchacc.parallel import memory_tracking

BATCH = 2
MEASURED_STEPS = 5  # see measure()
# name -> (model, {dotted config setting: value}); the world size is the launch's
TWO = {
    "gpt2_fsdp": ("gpt2", {"dist.fsdp.size": 2}),
    "llama_tp": ("llama", {"dist.tp.size": 2}),
    "llama_fsdp_ac_bf16": ("llama", {"dist.fsdp.size": 2, "memory.gc": True, "compute.bf16": True}),
    "llama_cp": ("llama", {"dist.cp.size": 2, "dist.fsdp.size": 1}),
    # last: after a pipelined model's measurement some of its memory is freed only later, during the next one
    "llama_pp": ("llama", {"dist.pp.size": 2, "dist.fsdp.size": 1}),
}
FOUR = {
    "gpt2_hsdp": ("gpt2", {"dist.fsdp.size": 2, "dist.dp.size": 2}),
    "llama_fsdp_tp_ac": ("llama", {"dist.fsdp.size": 2, "dist.tp.size": 2, "memory.gc": True}),
}


def build_config(settings: dict) -> torchacc.Config:
    config = torchacc.Config()
    config.dist.timeout = 120.0
    for dotted, value in settings.items():
        *path, leaf = dotted.split(".")
        node = config
        for part in path:
            node = getattr(node, part)
        setattr(node, leaf, value)
    return config


def build_model(kind: str, *, seed: int = 0) -> torch.nn.Module:
    return tiny_gpt2(seed=seed) if kind == "gpt2" else tiny_llama(seed=seed)


def wrap_classes(kind: str) -> set[str]:
    return {"GPT2Block"} if kind == "gpt2" else {"LlamaDecoderLayer"}


def measure(kind: str, settings: dict) -> dict:
    """Real steps after a first one: the held bytes and the measured peak of this rank (the least of
    ``MEASURED_STEPS`` steps: under CP the order in which gloo's asynchronous transfers finish can keep one more
    buffer alive through the peak, 144 KiB more on one step in four or in two, which no estimate can foresee; the
    least of 5 steps still fails an estimate off by more than 10%).

    ``track_memory`` counts every tensor alive in the process, like CUDA's allocator; the scenarios that ran
    before in this launch leave some alive (their results), so those bytes are subtracted.
    """
    gc.collect()
    with torchacc.track_memory() as before:
        leftover = before.baseline_bytes
    config = build_config(settings)
    config.dist.fsdp.wrap_layer_cls = wrap_classes(kind)
    model = torchacc.accelerate(build_model(kind), config=config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pp, cp = config.dist.pp.size, config.dist.cp.size
    # a pipeline's batch is BATCH sequences per microbatch, one microbatch per stage (the estimate's convention)
    ids = torch.randint(0, 128, (BATCH * pp, SEQ), generator=torch.Generator().manual_seed(torchacc.dist.rank()))
    batch = {"input_ids": ids, "labels": ids}
    if cp > 1:  # what the loader gives a CP rank: its chunk of every sequence
        batch = split_sequences(batch, rank=torchacc.dist.rank() % cp, size=cp)
    torchacc.train_step(model, batch)
    optimizer.step()
    optimizer.zero_grad()
    peaks = []
    for _ in range(MEASURED_STEPS):
        gc.collect()
        with torchacc.track_memory():
            torchacc.train_step(model, batch)
            optimizer.step()
        report = torchacc.memory_report(model, optimizer)
        peaks.append(report.peak_bytes)
        optimizer.zero_grad()
    return {
        "parameters": report.parameters.held_bytes,
        "gradients": report.gradients.held_bytes,
        "optimizer_state": report.optimizer_state.held_bytes,
        "peak": min(peaks) - leftover,
    }


def estimate(kind: str, settings: dict, world_size: int) -> dict:
    config = build_config(settings)
    config.dist.fsdp.wrap_layer_cls = wrap_classes(kind)
    with torchacc.init_empty_weights():
        model = build_model(kind)
    found = torchacc.estimate_memory(
        model, config, world_size=world_size, micro_batch_size=BATCH, seq_len=SEQ, device_type="cpu"
    )
    return {
        "parameters": found.parameters,
        "gradients": found.gradients,
        "optimizer_state": found.optimizer_state,
        "peak": found.peak,
        "rank": found.rank,
    }


def _oracle(configs: dict) -> dict:
    start = time.perf_counter()
    rank, world = torchacc.dist.rank(), torchacc.dist.world_size()
    measured = {name: measure(kind, settings) for name, (kind, settings) in configs.items()}
    mine = {name: estimate(kind, settings, world) for i, (name, (kind, settings)) in enumerate(configs.items())
            if i % world == rank}  # fmt: skip
    memory_tracking._last = None  # the scenarios after these expect no track_memory() block in the process
    estimates: dict = {}
    for part in torchacc.dist.collectives.all_gather_object(mine):  # the real group still works
        estimates.update(part)
    return {"measured": measured, "estimated": estimates, "seconds": time.perf_counter() - start}


def oracle_two() -> dict:
    return _oracle(TWO)


def oracle_four() -> dict:
    return _oracle(FOUR)


def _fsdp_tp_step() -> dict:
    """A fresh FSDP 2 x TP 2 llama, one forward and backward, its clipped norm (reduced over the mesh's groups)."""
    config = build_config({"dist.fsdp.size": 2, "dist.tp.size": 2})
    config.dist.fsdp.wrap_layer_cls = wrap_classes("llama")
    model = torchacc.accelerate(build_model("llama"), config=config)
    ids = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(torchacc.dist.rank() // 2))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return {"loss": loss.item(), "norm": torchacc.clip_grad_norm_(model.parameters(), max_norm=1e6)}


def estimate_between_trainings() -> dict:
    """Train, let rank 0 alone estimate (a script printing its plan), train a new model of the same layout.

    The second model's meshes equal the first's; DTensor's caches must not send some ranks to the first model's
    process groups and others to the second's (see [Note: fake world]): test_plan_oracle.py's launch times out.
    """
    first = _fsdp_tp_step()
    if torchacc.dist.rank() == 0:
        estimate("llama", {"dist.fsdp.size": 2, "dist.tp.size": 2}, torchacc.dist.world_size())
    return {"first": first, "second": _fsdp_tp_step()}
