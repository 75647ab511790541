"""The parity matrix's families, layouts and runs (test_matrix.py holds what each cell must give).

``run_layouts`` runs inside each rank of one launch per world size (see tests/_launch.py) and trains every
family in every init variant on every layout of that size; ``reference`` trains one unsharded model in the
pytest process.

A family is a tiny Hugging Face decoder (2 layers, hidden 64, 4 heads / 2 key-value heads, vocabulary
128, dropout off), its FSDP unit and the TP plan the matrix uses. A layout is a world size and the config
fields it sets: adding one (pipeline, context parallelism) is one ``LAYOUTS`` entry plus its column of
``CELLS`` in test_matrix.py.

Every layout trains on the same global batches (``GLOBAL_BATCH`` samples per step, split over the
data-parallel ranks; the ranks of a TP group share theirs), so one reference per family and init variant
serves every layout.
"""

import contextlib
import importlib
import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from _models import DECODER_SIZES, SEQ, VOCAB, token_dataset
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import torchacc

NUM_STEPS = 3
GLOBAL_BATCH = 8  # 2 samples per data-parallel rank at HSDP 2x2, 8 under TP alone
LR = 1e-3
# AdamW's default eps (1e-8) turns the fp32 rounding noise of a gradient near 1e-8 (some elements of a tiny
# model have one) into differences of several 1e-5 after 3 steps: 1e-6 keeps them under 1e-6, while a wrong
# gradient still moves a parameter by about LR per step
EPS = 1e-6
SEED = 100  # rank r seeds SEED + r before it builds its model, as docs/checkpoints.md shows
# seeded: per-rank seeds, real weights (rank 0's win: sync_module_states); meta: per-rank seeds, meta init
VARIANTS = ("seeded", "meta")


def _hand_plan(qkv: Iterable[str], out: str, up: Iterable[str] = (), down: str | None = None) -> dict[str, str]:
    """The natural dict plan: embedding and head by vocabulary, q/k/v and up colwise, o and down rowwise."""
    plan = {"model.embed_tokens": "embedding_rowwise", "lm_head": "colwise_gather_output"}
    plan.update({f"model.layers.*.self_attn.{name}": "colwise" for name in qkv})
    plan[f"model.layers.*.self_attn.{out}"] = "rowwise"
    plan.update({f"model.layers.*.mlp.{name}": "colwise" for name in up})
    if down is not None:
        plan[f"model.layers.*.mlp.{down}"] = "rowwise"
    return plan


@dataclass(frozen=True)
class Family:
    """A decoder family: its transformers class, FSDP unit, TP plan and config fields beyond the tiny sizes."""

    title: str  # for the docs
    module: str  # transformers.models.<module>.modeling_<module>
    model_cls: str
    block: str  # dist.fsdp.wrap_layer_cls
    tp_plan: str | Mapping[str, str] = "auto"  # "auto": the model's own plan
    overrides: Mapping[str, Any] = field(default_factory=dict)


FAMILIES: dict[str, Family] = {
    "gpt2": Family(
        "GPT-2",
        "gpt2",
        "GPT2LMHeadModel",
        "GPT2Block",
        # no plan of its own: what a user would write (its layers are transformers Conv1D)
        tp_plan={
            "transformer.wte": "embedding_rowwise",
            "transformer.h.*.attn.c_attn": "colwise",
            "transformer.h.*.attn.c_proj": "rowwise",
            "transformer.h.*.mlp.c_fc": "colwise",
            "transformer.h.*.mlp.c_proj": "rowwise",
            "lm_head": "colwise_gather_output",
        },
    ),
    "llama": Family("Llama", "llama", "LlamaForCausalLM", "LlamaDecoderLayer"),
    "mistral": Family(
        "Mistral", "mistral", "MistralForCausalLM", "MistralDecoderLayer", overrides={"sliding_window": 8}
    ),
    "qwen2": Family("Qwen2", "qwen2", "Qwen2ForCausalLM", "Qwen2DecoderLayer"),
    "qwen3": Family("Qwen3", "qwen3", "Qwen3ForCausalLM", "Qwen3DecoderLayer", overrides={"head_dim": 16}),
    "gemma": Family("Gemma", "gemma", "GemmaForCausalLM", "GemmaDecoderLayer", overrides={"head_dim": 16}),
    "gemma2": Family(
        "Gemma 2", "gemma2", "Gemma2ForCausalLM", "Gemma2DecoderLayer", overrides={"head_dim": 16, "sliding_window": 8}
    ),
    "phi": Family("Phi", "phi", "PhiForCausalLM", "PhiDecoderLayer"),
    # Phi-3's own plan gathers the outputs of its packed qkv_proj and gate_up_proj (colwise_gather_output) and
    # splits the next layer's input (rowwise_split_input)
    "phi3": Family("Phi-3", "phi3", "Phi3ForCausalLM", "Phi3DecoderLayer"),
    # Mixtral's own plan splits its packed experts with styles torchacc does not have (test_matrix.py checks that
    # it is refused): the matrix uses what the refusal asks for, a hand-written plan
    "mixtral": Family(
        "Mixtral (MoE)",
        "mixtral",
        "MixtralForCausalLM",
        "MixtralDecoderLayer",
        tp_plan=_hand_plan(["q_proj", "k_proj", "v_proj"], "o_proj"),  # the router and experts stay whole
        overrides={"num_local_experts": 4, "num_experts_per_tok": 2},
    ),
}


@dataclass(frozen=True)
class Layout:
    """A parallel layout: the number of ranks, the config fields it sets (dotted paths) and what it must do."""

    title: str  # for the docs
    world_size: int
    settings: Mapping[str, Any]
    axes: frozenset[str]  # the mesh axes that the parameters must live on (split, sharded or replicated)
    sequence_split: int = 1  # the decoder layers must see 1/sequence_split of each sequence

    @property
    def num_stages(self) -> int:
        """Pipeline stages: each rank holds the parameters of one of them."""
        return self.settings.get("dist.pp.size", 1)

    @property
    def num_data_ranks(self) -> int:
        """Ranks that take batches of their own: the ranks of a TP group, a CP group or a pipeline share theirs."""
        shared = ("dist.tp.size", "dist.cp.size", "dist.pp.size")
        return self.world_size // math.prod(self.settings.get(key, 1) for key in shared)


LAYOUTS: dict[str, Layout] = {
    "fsdp2": Layout("FSDP 2", 2, {"dist.fsdp.size": 2}, frozenset({"fsdp"})),
    "hsdp2x2": Layout("HSDP 2x2", 4, {"dist.fsdp.size": 2, "dist.dp.size": 2}, frozenset({"dp", "fsdp"})),
    "tp2": Layout("TP 2", 2, {"dist.tp.size": 2}, frozenset({"tp"})),
    "tp2_sp": Layout(
        "TP 2 + SP", 2, {"dist.tp.size": 2, "dist.tp.sequence_parallel": True}, frozenset({"tp"}), sequence_split=2
    ),
    "fsdp2_tp2": Layout("FSDP 2 x TP 2", 4, {"dist.fsdp.size": 2, "dist.tp.size": 2}, frozenset({"fsdp", "tp"})),
    # a stage alone holds plain tensors: test_matrix.py checks the stages' parameters instead
    "pp2": Layout("PP 2", 2, {"dist.pp.size": 2}, frozenset()),
    "pp2_fsdp2": Layout("PP 2 x FSDP 2", 4, {"dist.pp.size": 2, "dist.fsdp.size": 2}, frozenset({"fsdp"})),
    # the ranks of a CP group hold the same parameters: FSDP shards them over fsdp x cp
    "cp2": Layout("CP 2", 2, {"dist.cp.size": 2}, frozenset({"fsdp_cp"}), sequence_split=2),
    "cp2_fsdp2": Layout(
        "CP 2 x FSDP 2", 4, {"dist.cp.size": 2, "dist.fsdp.size": 2}, frozenset({"fsdp_cp"}), sequence_split=2
    ),
}


def build_model(family: str, *, seed: int, meta: bool) -> torch.nn.Module:
    """The family's tiny model, built after ``torch.manual_seed(seed)`` (under ``init_empty_weights`` if ``meta``)."""
    spec = FAMILIES[family]
    model_cls = getattr(
        importlib.import_module(f"transformers.models.{spec.module}.modeling_{spec.module}"), spec.model_cls
    )
    if spec.module == "gpt2":
        sizes = dict(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4)
    else:
        sizes = {**DECODER_SIZES, "pad_token_id": None}
    hf_config = model_cls.config_class(**sizes, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, **spec.overrides)
    for name, value in hf_config.to_dict().items():
        if ("pdrop" in name or "dropout" in name) and isinstance(value, float):
            setattr(hf_config, name, 0.0)  # the matrix compares numbers, not random streams
    torch.manual_seed(seed)
    with torchacc.init_empty_weights() if meta else contextlib.nullcontext():
        model = model_cls(hf_config)
    model.loss_type = "ForCausalLM"  # transformers cannot tell it from every class name, and would warn
    return model


def matrix_config(family: str, layout: str) -> torchacc.Config:
    """The config of one cell: the layout's fields, the family's FSDP unit and, under TP, its plan."""
    config = torchacc.Config()
    config.dist.fsdp.wrap_layer_cls = {FAMILIES[family].block}
    config.dist.timeout = 120.0
    for dotted, value in LAYOUTS[layout].settings.items():
        *path, leaf = dotted.split(".")
        node = config
        for part in path:
            node = getattr(node, part)
        setattr(node, leaf, value)
    if config.dist.tp.size > 1:
        config.dist.tp.plan = FAMILIES[family].tp_plan
    return config


def global_batches() -> list[list[int]]:
    """The sample indices of each step's global batch: the same for every layout."""
    return [list(range(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)) for step in range(NUM_STEPS)]


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu().clone()
        for name, value in model.state_dict().items()
    }


def _axes(model: torch.nn.Module) -> frozenset[str]:
    """The mesh axes that the model's parameters live on."""
    return frozenset(
        axis for p in model.parameters() if isinstance(p, DTensor) for axis in p.device_mesh.mesh_dim_names or ()
    )


def _count_block_tokens(model: torch.nn.Module, block: str, seen: list[int]) -> None:
    """Record in ``seen`` how many tokens of each sequence the last decoder layer of this rank takes."""

    def record(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        seen.append((hidden.to_local() if isinstance(hidden, DTensor) else hidden).shape[1])

    # by class name: under a pipeline, the rank's blocks are no longer in an nn.ModuleList
    blocks = [m for m in model.modules() if block in {cls.__name__ for cls in type(m).__mro__}]
    blocks[-1].register_forward_pre_hook(record, with_kwargs=True)


def _train(model: torch.nn.Module, batches: Iterable[dict]) -> tuple[list[float], list[list[int]]]:
    """The loop every layout runs: the plain loop with ``torchacc.train_step`` as its forward and backward."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses, indices = [], []
    for batch in batches:
        indices.append(batch.pop("index").tolist())  # not the model's: the test checks which samples each rank saw
        loss = torchacc.train_step(model, batch)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, indices


def train_cell(family: str, layout: str, variant: str) -> dict:
    """One cell on this rank: ``{"losses", "indices", "state"}``; ``{"refused": message}`` when accelerate()
    raised a ValueError; ``{"crashed": message}`` when training raised (on every rank alike, or the launch hangs)."""
    model = build_model(family, seed=SEED + torchacc.dist.rank(), meta=variant == "meta")
    batch_size = GLOBAL_BATCH // LAYOUTS[layout].num_data_ranks
    loader = DataLoader(token_dataset(NUM_STEPS * GLOBAL_BATCH), batch_size=batch_size)
    try:
        model, loader = torchacc.accelerate(model, loader, matrix_config(family, layout))
    except ValueError as exc:
        return {"refused": str(exc)}
    block_tokens: list[int] = []
    _count_block_tokens(model, FAMILIES[family].block, block_tokens)
    try:
        losses, indices = _train(model, itertools.islice(loader, NUM_STEPS))
    except Exception as exc:  # noqa: BLE001 - the test reports it as the cell's failure
        return {"crashed": f"{type(exc).__name__}: {exc}"}
    return {
        "losses": losses,
        "indices": indices,
        "state": _full_state(model),
        "axes": _axes(model),
        "block_tokens": block_tokens[0],
    }


def own_plan_refusal(family: str) -> str | None:
    """accelerate()'s error for the family's own plan (``"auto"``) at TP 2, or None when it takes it."""
    config = matrix_config(family, "tp2")
    config.dist.tp.plan = "auto"
    try:
        torchacc.accelerate(build_model(family, seed=SEED, meta=False), config=config)
    except ValueError as exc:
        return str(exc)
    return None


def run_layouts(world_size: int | str) -> dict[str, dict]:
    """Every layout of ``world_size`` ranks, each with every family in every init variant, on this rank (one launch
    per world size: starting the ranks costs more than a layout's cells); at TP 2 also the own plans the matrix does
    not use. Returns layout -> ``{"cells": {(family, variant): cell}, "own_plans": {family: message}}``."""
    results = {}
    for layout in (name for name, spec in LAYOUTS.items() if spec.world_size == int(world_size)):  # argv: a str
        cells = {(family, variant): train_cell(family, layout, variant) for family in FAMILIES for variant in VARIANTS}
        own_plans = {}
        if layout == "tp2":
            own_plans = {name: own_plan_refusal(name) for name, spec in FAMILIES.items() if spec.tp_plan != "auto"}
        results[layout] = {"cells": cells, "own_plans": own_plans}
    return results


def reference(family: str, variant: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, one unsharded model (rank 0's seed; meta init materialized alone), the global batches."""
    model = build_model(family, seed=SEED, meta=variant == "meta")
    if variant == "meta":
        model = torchacc.accelerate(model)  # one process: materializes the model's own init, shards nothing
    data = token_dataset(NUM_STEPS * GLOBAL_BATCH)
    batches = [
        {key: torch.stack([data[i][key] for i in indices]) for key in ("input_ids", "labels", "index")}
        for indices in global_batches()
    ]
    losses, _ = _train(model, batches)
    return losses, _full_state(model)
