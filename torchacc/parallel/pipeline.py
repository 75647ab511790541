"""Pipeline parallelism, the split: which blocks each stage holds, and the model cut down to this rank's stages.

[Note: pipeline stages] ``plan_pipeline`` runs before any collective: it finds a Hugging Face decoder's parts
(the embedding, the list of blocks, the final norm, the head) and divides the blocks into stages, raising the
same ``ValueError`` on every rank for a model it cannot split. ``split_model`` then cuts the user's model down,
in place, to the stages this rank holds: the other stages' blocks leave the block list (which keeps the blocks'
original names, ``model.layers.6`` stays ``model.layers.6``), the embedding stays only with the first stage and
the norm and the head only with the last. So ``model.state_dict()`` on each rank holds its stages' tensors under
the plain model's names, and checkpoints stay portable between layouts.

Each stage also gets a ``StageModule`` (pipeline_stages.py): a module holding (not copying) that stage's parts,
which is what ``torch.distributed.pipelining`` runs and what FSDP shards as a root. Its forward calls the
decoder's own forward (so masks and rotary embeddings are built as the model builds them) with only the stage's
blocks active: the first stage from ``input_ids``, the others from ``inputs_embeds`` (the hidden states
received), whose first active block takes the received hidden states in place of what the decoder computed from
``inputs_embeds`` (a decoder that scales its embeddings, as Granite's, scales them once). The last stage runs
the model's own forward, so that what follows the head (Gemma 2's soft-capping) happens too: its output is the
logits; the others return hidden states.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch.nn as nn

from .._utils.tied import tied_names
from .tp import TPPlan

__all__ = ["StagePlan", "plan_pipeline", "restrict_tp_plan"]

_FIX_BLOCKS = (
    "set dist.fsdp.wrap_layer_cls to the class of the model's blocks (e.g. {'LlamaDecoderLayer'}), or name the "
    "first block of each later stage in dist.pp.split (e.g. ['model.layers.8'])"
)


@dataclass(frozen=True)
class StagePlan:
    """The split of one model into pipeline stages (see [Note: pipeline stages])."""

    decoder: str
    """The decoder's module name (``"model"``): it holds ``embed_tokens``, ``layers`` and the final norm."""
    norm: str
    """The final norm's attribute of the decoder (``"norm"``; Phi's ``"final_layernorm"``)."""
    head: str
    """The output layer's module name (``"lm_head"``)."""
    num_blocks: int
    """Blocks of the whole model."""
    stages: tuple[tuple[int, ...], ...]
    """The block indices of each stage, in order."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)


def _block_list(
    model: nn.Module, wrap_classes: frozenset[type[nn.Module]], split: Sequence[str]
) -> tuple[str, nn.ModuleList]:
    """The module list holding the blocks: the parent of the ``split`` names, or the list of wrap-class blocks."""
    modules = dict(model.named_modules())
    if split:
        parents = {name.rpartition(".")[0] for name in split}
        unknown = [name for name in split if name not in modules]
        parent = next(iter(parents))
        if unknown or len(parents) > 1 or not isinstance(modules.get(parent), nn.ModuleList):
            lists = [n for n, m in modules.items() if isinstance(m, nn.ModuleList) and len(m)]
            example = f"{lists[0]}.{len(modules[lists[0]]) // 2}" if lists else "model.layers.8"
            raise ValueError(
                f"dist.pp.split={list(split)!r} must name blocks of one list of blocks of {type(model).__name__} "
                f"(e.g. {example!r}); {'unknown: ' + repr(unknown) if unknown else 'they are not in one nn.ModuleList'}"
            )
        return parent, modules[parent]
    if not wrap_classes:
        raise ValueError(f"dist.pp.size > 1 divides the model's blocks into stages, but none are known: {_FIX_BLOCKS}")
    classes = tuple(wrap_classes)
    lists = [
        (name, module)
        for name, module in modules.items()
        if isinstance(module, nn.ModuleList) and len(module) and all(isinstance(m, classes) for m in module)
    ]
    if len(lists) != 1:
        found = ", ".join(name for name, _ in lists)
        what = f"{len(lists)} module lists ({found}) hold" if lists else "no nn.ModuleList holds"
        names = sorted(c.__name__ for c in wrap_classes)
        raise ValueError(
            f"dist.pp.size > 1 needs the model's blocks in one list to split, but {what} the dist.fsdp.wrap_layer_cls "
            f"blocks ({', '.join(names)}) of {type(model).__name__}; name the first block of each later stage in "
            "dist.pp.split instead"
        )
    return lists[0]


def _decoder_parts(model: nn.Module, list_name: str) -> tuple[str, str, str]:
    """(decoder, final norm attribute, head) names of a Hugging Face decoder-only model whose blocks are ``list_name``.

    The final norm is the decoder's ``norm``, or else its one child with parameters besides ``embed_tokens`` and the
    blocks (Phi's ``final_layernorm``). What the decoder does to ``inputs_embeds`` before its blocks (Granite's scaling,
    Phi's dropout) and what the model does after its head (Gemma 2's soft-capping) need no check: see
    [Note: pipeline stages].
    """
    decoder_name, _, attr = list_name.rpartition(".")
    modules = dict(model.named_modules())
    decoder = modules.get(decoder_name)
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    head_name = next((n for n, m in modules.items() if m is head and head is not None), None)
    embedding = getattr(decoder, "embed_tokens", None)
    norms = [
        name
        for name, child in (decoder.named_children() if decoder is not None else ())
        if name not in ("embed_tokens", attr) and any(True for _ in child.parameters())
    ]
    norms = ["norm"] if "norm" in norms else norms  # others: refused below as parameters no stage holds
    missing = [
        what
        for what, found in (
            ("its blocks in a list named 'layers'", attr == "layers"),
            ("an output layer (get_output_embeddings())", head_name is not None),
            ("an embed_tokens embedding", isinstance(embedding, nn.Module)),
            (
                f"a final norm as its one other part with parameters (it has {', '.join(norms) or 'none'})",
                len(norms) == 1,
            ),
        )
        if not found
    ]
    if missing:
        raise ValueError(
            f"dist.pp.size > 1 splits Hugging Face decoder-only models (a *ForCausalLM whose decoder holds "
            f"embed_tokens, layers and a final norm, with an output layer such as lm_head: Llama, Mistral, Qwen2, "
            f"Qwen3, Phi, ...); {type(model).__name__} (blocks in {list_name!r}) lacks {', '.join(missing)}: train "
            "it without a pipeline (dist.pp.size=1)"
        )
    return decoder_name, norms[0], head_name


def _stages_of(num_blocks: int, num_stages: int, starts: list[int]) -> tuple[tuple[int, ...], ...]:
    if not starts:
        base, extra = divmod(num_blocks, num_stages)
        sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
        starts = [sum(sizes[:s]) for s in range(1, num_stages)]
    bounds = [0, *starts, num_blocks]
    return tuple(tuple(range(bounds[s], bounds[s + 1])) for s in range(num_stages))


def plan_pipeline(
    model: nn.Module, *, num_stages: int, split: Sequence[str], wrap_classes: frozenset[type[nn.Module]]
) -> StagePlan:
    """Find the decoder's parts and divide its blocks into ``num_stages`` stages; no communication.

    Args:
        model: the plain model (on any device, meta included).
        num_stages: all stages of the pipeline (``dist.pp.size * dist.pp.stages_per_rank``).
        split: the first block of each stage after the first (``dist.pp.split``); empty: divide evenly.
        wrap_classes: the block classes (``dist.fsdp.wrap_layer_cls``), used when ``split`` is empty.

    Returns:
        The ``StagePlan``.

    Raises:
        ValueError: no list of blocks (naming dist.fsdp.wrap_layer_cls and dist.pp.split), fewer blocks than
            stages, split names out of order, a model that is not a decoder-only Hugging Face model, a parameter
            outside the embedding, blocks, norm and head, or a head tied to the embedding.

    Example:
        >>> plan_pipeline(llama, num_stages=2, split=[], wrap_classes=frozenset({LlamaDecoderLayer})).stages
        ((0, 1), (2, 3))
    """
    list_name, blocks = _block_list(model, wrap_classes, split)
    num_blocks = len(blocks)
    if num_blocks < num_stages:
        raise ValueError(
            f"dist.pp: {type(model).__name__} has {num_blocks} block(s) in {list_name} but the pipeline has "
            f"{num_stages} stages (dist.pp.size * dist.pp.stages_per_rank), and every stage needs a block; use at "
            f"most {num_blocks} stages"
        )
    starts = [int(name.rpartition(".")[2]) for name in split]
    if starts and (starts != sorted(starts) or starts[0] == 0):
        raise ValueError(
            f"dist.pp.split={list(split)!r} must name blocks in increasing order, none of them the first block "
            f"({list_name}.0, which starts stage 0): each name starts the next stage"
        )
    decoder_name, norm_name, head_name = _decoder_parts(model, list_name)
    placed = (f"{decoder_name}.embed_tokens.", f"{list_name}.", f"{decoder_name}.{norm_name}.", f"{head_name}.")
    for name, _ in model.named_parameters():
        if not name.startswith(placed):
            raise ValueError(
                f"dist.pp: {name} is neither in the embedding, a block, the final norm nor the head of "
                f"{type(model).__name__}, so no stage can hold it; train this model with dist.pp.size=1"
            )
    if getattr(getattr(model, "config", None), "output_router_logits", False):
        raise ValueError(
            f"dist.pp: {type(model).__name__} adds its routers' load-balancing loss to the loss "
            "(config.output_router_logits=True), but the pipeline's last stage computes the causal-LM loss of the "
            "logits only; build the model with output_router_logits=False or train it with dist.pp.size=1"
        )
    for alias, owner in tied_names(model.named_parameters(remove_duplicate=False)).items():
        if alias.startswith(f"{head_name}.") != owner.startswith(f"{head_name}."):
            raise ValueError(
                f"dist.pp: {alias} is tied to {owner}, but the head lives on the last stage and the embedding on the "
                "first; untie them (build the model with tie_word_embeddings=False) or train with dist.pp.size=1"
            )
    return StagePlan(decoder_name, norm_name, head_name, num_blocks, _stages_of(num_blocks, num_stages, starts))


def restrict_tp_plan(plan: TPPlan | None, model: nn.Module) -> TPPlan | None:
    """``plan`` without the modules that other stages hold (after ``split_model``)."""
    if plan is None:
        return None
    names = {name for name, _ in model.named_modules()}
    return TPPlan({n: s for n, s in plan.styles.items() if n in names}, plan.sequence_parallel)
