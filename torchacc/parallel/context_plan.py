"""Context parallelism: which models it can split, checked before any collective (``resolve_context_parallel``).

The result, a ``CPPlan``, is what ``apply_context_parallel`` (context.py) applies: see [Note: context
parallelism on a transformers model] there. Every check here raises the same ``ValueError`` on every rank.
"""

from dataclasses import dataclass

import torch.nn as nn

__all__ = ["CPPlan", "resolve_context_parallel"]

SUPPORTED_ATTENTION = {"ulysses": ("sdpa", "eager"), "ring": ("sdpa",)}


@dataclass(frozen=True)
class CPPlan:
    """A checked context-parallel plan for one model."""

    size: int
    method: str
    attn_implementation: str
    """The model's own attention implementation, which runs on the whole sequences."""
    sliding_layers: frozenset[int] = frozenset()
    """The ``layer_idx`` of the attention layers with a sliding window: they attend with the whole sequences'
    sliding-window mask (``config.sliding_window``), the others with the causal one."""


def _attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, m)
        for name, m in model.named_modules()
        if type(m).__name__.endswith("Attention") and hasattr(m, "is_causal") and hasattr(m, "config")
    ]


def resolve_context_parallel(model: nn.Module, *, size: int, method: str, tp_size: int = 1) -> CPPlan:
    """Check that ``model``'s attention can run over sequences split into ``size`` chunks; no communication.

    Args:
        model: the plain model: a transformers model whose attention goes through ``AttentionInterface``.
        size: ``dist.cp.size``.
        method: ``dist.cp.method``, "ulysses" or "ring".
        tp_size: ``dist.tp.size``: with TP each rank holds ``1 / tp_size`` of the heads, which CP then shares.

    Returns:
        The plan ``apply_context_parallel`` carries out.

    Raises:
        ValueError: a model without such attention (no Hugging Face config, or attention modules that do not
            go through the interface), non-causal or chunked attention (sliding windows: with "ring"), a model
            that declares it cannot run under context parallelism, an attention implementation other than sdpa or
            eager (sdpa for "ring"), or heads that ``tp_size * size`` does not divide.
    """
    hf_config = getattr(model, "config", None)
    implementation = getattr(hf_config, "_attn_implementation", None)
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    attention = _attention_modules(model)
    if implementation is None or not attention or (callable(can_set) and not can_set()):
        raise ValueError(
            f"dist.cp.size={size} runs the attention of a Hugging Face transformers model over split sequences, but "
            f"torchacc finds no such attention in {type(model).__name__}: it needs a transformers model (a "
            "model.config with _attn_implementation) whose attention layers call transformers' AttentionInterface "
            "(Llama, Qwen2, Mistral and most decoders do); train this model without context parallelism "
            "(dist.cp.size=1)"
        )
    name = type(model).__name__
    bidirectional = [n for n, m in attention if not m.is_causal]
    if bidirectional:
        raise ValueError(
            f"dist.cp splits causal (decoder) attention, but {name}.{bidirectional[0]} attends both ways "
            "(is_causal=False); train this model without context parallelism (dist.cp.size=1)"
        )
    _refuse_chunk_dependent_config(model)
    sliding = _sliding_layers(model, attention)
    if sliding and method == "ring":
        raise ValueError(
            f"dist.cp.method='ring' runs plain causal attention, but {name} has sliding-window layers "
            f"({', '.join(map(str, sorted(sliding)))}); use dist.cp.method='ulysses', which builds the model's own "
            "masks"
        )
    supported = SUPPORTED_ATTENTION[method]
    if implementation not in supported:
        raise ValueError(
            f"dist.cp.method={method!r} runs the model's attention over whole sequences as "
            f"{' or '.join(supported)}, but {name} uses attn_implementation={implementation!r}; load it with "
            f"from_pretrained(..., attn_implementation='sdpa') or call model.set_attn_implementation('sdpa')"
        )
    split = size * tp_size
    for field_name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(hf_config, field_name, None)
        if isinstance(heads, int) and heads % split:
            what = f"dist.cp.size={size}" + (f" * dist.tp.size={tp_size} = {split}" if tp_size > 1 else "")
            choices = [n for n in range(1, heads + 1) if heads % (n * tp_size) == 0]
            raise ValueError(
                f"{what} does not divide {field_name}={heads} of {type(hf_config).__name__}: the ranks of a CP group "
                f"each attend with a share of the heads; choose dist.cp.size in {choices}"
            )
    return CPPlan(size=size, method=method, attn_implementation=implementation, sliding_layers=sliding)


def _refuse_chunk_dependent_config(model: nn.Module) -> None:
    """Refuse what a rank would compute from its chunk alone where one process uses the whole sequence."""
    name = type(model).__name__
    config = model.config
    config = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    if getattr(config, "output_router_logits", False):
        raise ValueError(
            f"dist.cp: {name} adds its routers' load-balancing loss to the loss (config.output_router_logits=True); "
            "under context parallelism each rank would compute it on its chunk and the loss would count it "
            "wrongly; build the model with output_router_logits=False or train it with dist.cp.size=1"
        )
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "dynamic":
        raise ValueError(
            f"dist.cp: {name} uses dynamic NTK rope scaling (rope_type='dynamic'), which scales the rotary "
            "frequencies by the longest position it sees: each chunk would scale by its own positions; use "
            "another rope_type or train it with dist.cp.size=1"
        )


def _sliding_layers(model: nn.Module, attention: list[tuple[str, nn.Module]]) -> frozenset[int]:
    """The ``layer_idx`` of the sliding-window attention layers, decided as the model's decoder decides which mask
    each layer gets: by ``config.layer_types``, or (models predating it, such as Mistral) every layer when
    ``config.sliding_window`` is set. Raises for layer types whose masks torchacc does not build."""
    name = type(model).__name__
    if not getattr(model, "_supports_context_parallel", True):  # transformers' flag: attention sinks, for one
        raise ValueError(
            f"dist.cp: {name} says it cannot run under context parallelism (transformers' "
            "_supports_context_parallel=False: its attention needs more than the mask and the heads, such as "
            "attention sinks); train it with dist.cp.size=1"
        )
    config = model.config
    config = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        other = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if other:
            raise ValueError(
                f"dist.cp: {name} has {', '.join(other)} layers (config.layer_types), whose masks torchacc does not "
                "build over split sequences (it builds full and sliding-window causal masks); use a config without "
                "them or dist.cp.size=1"
            )
    if layer_types is None and getattr(config, "sliding_window", None) is None:
        return frozenset()
    if layer_types is not None and "sliding_attention" not in layer_types:
        return frozenset()
    indices = [getattr(module, "layer_idx", None) for _, module in attention]
    if not all(isinstance(i, int) and (layer_types is None or 0 <= i < len(layer_types)) for i in indices):
        raise ValueError(
            f"dist.cp: {name} has sliding-window layers, but its attention modules do not say which layer they are "
            "(an int layer_idx), so torchacc cannot give each its mask; train it with dist.cp.size=1"
        )
    return frozenset(i for i in indices if layer_types is None or layer_types[i] == "sliding_attention")
