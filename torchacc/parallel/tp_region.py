"""The split region of a tensor-parallel plan: the layers that run on this rank's heads or features only.

[Note: the split region] Between a ``colwise`` layer and the ``rowwise`` layer that reads its output (q/k/v
then o, gate/up then down), each rank of a TP group holds only its own attention heads or MLP features. A
parameter that the plan leaves whole but that is used there (Qwen3's and Gemma3's ``q_norm``/``k_norm``,
Phi's ``q_layernorm``/``k_layernorm``: norms over ``head_dim``) gets on each rank only the gradient of that
rank's heads; the true gradient is their sum over the TP group (transformers' style
``replicated_with_grad_allreduce``). A parameter outside the region (``input_layernorm``, before the
``colwise`` layers) already gets the full gradient on every rank, because the backward of a ``colwise``
layer all-reduces the gradient of its input; summing it would multiply it by the TP size.

``add_region_styles`` finds the region's parameters from the module structure: the region is inside the
module that holds ``colwise`` layers (an attention or MLP module). There, a norm whose width is the width of
the module's input runs before the ``colwise`` layers (a pre-norm) and stays as it is; any other norm runs
on the split activations and gets ``replicated_with_grad_allreduce``. What the structure cannot settle is
refused, to be named in the plan: another module with parameters there (DeepSeek's MLA down-projections
feed the region without a ``colwise`` layer), a parameter of the holding module itself, a norm as wide as
both the input and a head. A block that holds ``colwise`` layers directly (an element of the model's layer
list, or the model) also holds the residual stream, so its other modules are taken as whole-gradient ones.

``check_packed_layers`` refuses ``colwise`` on a packed layer (several projections stacked in one weight,
such as Phi-3's ``gate_up_proj`` or a fused qkv): a contiguous block of its rows is one projection's rows,
not this rank's share of each, and the module's own split of the output would pair the wrong halves.
"""

import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["PACKED_NAMES", "add_region_styles", "check_packed_layers", "is_norm", "sum_replicated_grads"]

# Layer names that hold stacked projections ([q | k | v] or [gate | up]) in the models that use them:
# Phi-3, nanoGPT (an nn.Linear c_attn), MPT and ModernBERT (Wqkv), Baichuan (W_pack), timm's ViT (qkv).
# GPT-NeoX's and Falcon's query_key_value group q, k and v per head, so a contiguous split is right there.
PACKED_NAMES = frozenset({"gate_up_proj", "qkv_proj", "Wqkv", "W_pack", "c_attn", "qkv"})


def is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _is_block(model: nn.Module, name: str) -> bool:
    """Whether ``name`` is the model or one element of a list of blocks (it then carries the residual stream)."""
    return not name or isinstance(model.get_submodule(_parent(name)), (nn.ModuleList, nn.Sequential))


def _holders(styles: dict[str, str]) -> dict[str, list[str]]:
    """The modules that hold ``colwise`` layers -> those layers."""
    holders: dict[str, list[str]] = {}
    for name, style in styles.items():
        if style == "colwise":
            holders.setdefault(_parent(name), []).append(name)
    return holders


def _head_dim(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    head_dim = getattr(config, "head_dim", None)
    if isinstance(head_dim, int):
        return head_dim
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


def _trainable(module: nn.Module) -> list[str]:
    return [name for name, p in module.named_parameters(recurse=False) if p.requires_grad]


def _name_it(name: str, what: str, holder: str, layers: list[str]) -> ValueError:
    return ValueError(
        f"dist.tp.plan: {name} ({what}) sits inside {holder}, which holds the 'colwise' layer(s) "
        f"{', '.join(layers)}, and the plan leaves it whole; torchacc cannot tell from the module structure whether "
        "it runs on this rank's heads or features (its gradient then covers only those) or on the whole input. "
        f"Name it in dist.tp.plan: {name!r}: 'replicated_with_grad_allreduce' if it runs between the colwise and "
        "the rowwise layers (its gradient is then summed over the TP ranks), 'replicate' if it runs on the "
        "module's whole input, or split it like the layers beside it ('colwise', 'rowwise')"
    )


def add_region_styles(model: nn.Module, styles: dict[str, str]) -> dict[str, str]:
    """``styles`` plus ``replicated_with_grad_allreduce`` for the norms of [Note: the split region].

    Args:
        model: the plain model.
        styles: exact module names -> styles (already checked); names given any style are left alone.

    Raises:
        ValueError: a module or parameter inside a module holding ``colwise`` layers whose place (before
            or inside the split region) the structure does not settle; the message says how to name it.
    """
    head_dim = _head_dim(model)
    found: dict[str, str] = {}
    holders = _holders(styles)
    for holder, layers in holders.items():
        if _is_block(model, holder):
            continue
        module = model.get_submodule(holder)
        if direct := _trainable(module):
            raise ValueError(
                f"dist.tp.plan: {holder}.{direct[0]} is a parameter of {holder} itself, which holds the 'colwise' "
                f"layer(s) {', '.join(layers)}; torchacc cannot tell whether it is used on this rank's heads or "
                f"features only (its gradient then covers only those) or on the whole input. Leave {holder}'s "
                "layers out of dist.tp.plan, or keep the parameter in a submodule and name that module in the plan "
                "('replicated_with_grad_allreduce' or 'replicate')"
            )
        input_widths = {model.get_submodule(n).in_features for n in layers}
        planned = (*styles, *(h for h in holders if h.startswith(f"{holder}.")))  # a nested holder reads its own
        for sub_name, sub in module.named_modules(prefix=holder):
            if (
                sub_name == holder
                or not _trainable(sub)
                or any(sub_name == n or sub_name.startswith(f"{n}.") for n in planned)
            ):
                continue
            if not is_norm(sub):
                raise _name_it(sub_name, f"a {type(sub).__name__}", holder, layers)
            width = next(sub.parameters()).shape[-1]
            if width not in input_widths:
                found[sub_name] = "replicated_with_grad_allreduce"
            elif width == head_dim:
                raise _name_it(
                    sub_name,
                    f"a {type(sub).__name__} over {width} features, as many as the input and a head",
                    holder,
                    layers,
                )
    return {**styles, **found}


def check_packed_layers(model: nn.Module, styles: dict[str, str]) -> None:
    """Refuse ``colwise`` on a layer that stacks several projections in its weight.

    A layer is taken as packed when its name is one of ``PACKED_NAMES``, or when its ``out_features`` is
    twice the ``in_features`` of a ``rowwise`` layer beside it (a gate and an up projection in one weight).

    Raises:
        ValueError: naming the layer and the styles to use instead.
    """
    for name, style in styles.items():
        if style != "colwise":
            continue
        layer = model.get_submodule(name)
        partners = [n for n, s in styles.items() if s == "rowwise" and _parent(n) == _parent(name)]
        short = name.rpartition(".")[2]
        reason = f"its name {short!r} is that of a packed layer" if short in PACKED_NAMES else None
        for partner in partners:
            width = getattr(model.get_submodule(partner), "in_features", None)
            if reason is None and width is not None and layer.out_features == 2 * width:
                reason = f"out_features={layer.out_features} is twice the in_features of {partner}"
        if reason is not None:
            after = f"the layer that reads its output ({', '.join(partners)})" if partners else "the layer after it"
            raise ValueError(
                f"dist.tp.plan: {name} looks like a packed layer, several projections stacked in one weight "
                f"({reason}); 'colwise' would give each rank a contiguous block of its rows (one projection's rows, "
                "not this rank's share of each) and the model would compute the wrong thing. Use "
                f"'colwise_gather_output' for {name} and 'rowwise_split_input' for {after}, as Phi-3's own plan "
                "does (dist.tp.plan='auto'), or split the layer into one nn.Linear per projection"
            )


def _sum_partial_grad(grad: DTensor) -> DTensor:
    if any(placement.is_partial() for placement in grad.placements):
        return grad.redistribute(grad.device_mesh, [Replicate()] * grad.device_mesh.ndim)
    return grad


def sum_replicated_grads(model: nn.Module) -> None:
    """Sum the gradients of the parameters replicated over the TP ranks (norms under sequence parallelism,
    ``replicated_with_grad_allreduce``) in backward, once per backward.

    Each rank computes a partial gradient (its own tokens or heads). Left partial, the sum would happen at every
    read (each optimizer op, clipping) and ``grad.to_local()`` would be this rank's part only. Call it on the
    final parameters (after meta-device materialization); under FSDP, whose parameters are also split over its
    own axis, FSDP sums them before its reduce-scatter and nothing is registered.
    """
    for param in model.parameters():
        if isinstance(param, DTensor) and param.requires_grad and all(p.is_replicate() for p in param.placements):
            param.register_hook(_sum_partial_grad)
