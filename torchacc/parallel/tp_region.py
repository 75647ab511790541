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
both the input and a head. So is what no style can split: a norm with one weight per head (Cohere's
``q_norm`` of shape (heads, head_dim)), and a norm over a ``colwise`` layer's whole output (OLMo2's
``k_norm``: the layer must gather its output first). A block that holds ``colwise`` layers directly (an
element of the model's layer list, or the model) also holds the residual stream: its norms as wide as its
input and its other modules are taken as whole-gradient ones, but a norm of another width runs on the split
features, and a parameter of one number (a gate, PReLU's weight) may be applied to either, so it is refused.

``check_packed_layers`` refuses ``colwise`` on a packed layer (several projections stacked in one weight,
such as Phi-3's ``gate_up_proj`` or a fused qkv): a contiguous block of its rows is one projection's rows,
not this rank's share of each, and the module's own split of the output would pair the wrong halves. A
layer whose output is wider than the input of the ``rowwise`` layer beside it is taken as packed, unless its
name is one of ``PER_HEAD_NAMES`` (GPT-NeoX's ``query_key_value`` stacks q, k and v head by head, so a
contiguous block of rows is whole heads).

``check_pairs`` refuses the pairings that fail inside DTensor or compute the wrong thing: a ``colwise``
layer needs a ``rowwise`` layer beside it to read its split output (an ``lm_head`` left ``colwise`` would
give the loss this rank's share of the vocabulary), a ``rowwise`` layer needs a ``colwise`` one to feed
it, and ``rowwise_split_input`` expects a whole input, not a ``colwise`` layer's share.
"""

import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

__all__ = [
    "PACKED_NAMES",
    "PER_HEAD_NAMES",
    "add_region_styles",
    "check_packed_layers",
    "check_pairs",
    "is_norm",
    "sum_replicated_grads",
]

# Layer names that hold stacked projections ([q | k | v] or [gate | up]) in the models that use them:
# Phi-3, nanoGPT (an nn.Linear c_attn), MPT and ModernBERT (Wqkv), Baichuan (W_pack), timm's ViT (qkv),
# lucidrains' models (to_qkv).
PACKED_NAMES = frozenset({"gate_up_proj", "qkv_proj", "Wqkv", "W_pack", "c_attn", "qkv", "to_qkv"})
# Layers wider than the rowwise layer's input whose rows are grouped per head, so that a contiguous block of
# them is whole heads: GPT-NeoX's, Bloom's and Falcon's query_key_value; DeepSeek's (MLA) q and kv up-projections
# (a head's query or key is longer than its value); a q_proj is one projection whatever its width.
PER_HEAD_NAMES = frozenset({"query_key_value", "q_proj", "q_b_proj", "kv_b_proj"})


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


def _inside(name: str, outer: str) -> bool:
    """Whether module ``name`` is ``outer`` or inside it (every module is inside the model, named "")."""
    return not outer or name == outer or name.startswith(f"{outer}.")


def _scalar_params(module: nn.Module) -> list[str]:
    return [name for name, p in module.named_parameters(recurse=False) if p.requires_grad and p.numel() == 1]


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
            or inside the split region) the structure does not settle, or that no style can split there;
            the message says how to name it or what to split instead.
    """
    head_dim = _head_dim(model)
    found: dict[str, str] = {}
    holders = _holders(styles)
    for holder, layers in holders.items():
        module = model.get_submodule(holder)
        block = _is_block(model, holder)
        where = f"{holder or type(model).__name__}"
        if direct := (_scalar_params(module) if block else _trainable(module)):
            what = " (one number)" if block else ""
            raise ValueError(
                f"dist.tp.plan: {_join(holder, direct[0])}{what} is a parameter of {where} itself, which holds the "
                f"'colwise' layer(s) {', '.join(layers)}; torchacc cannot tell whether it is applied to this rank's "
                "features only (its gradient then covers only those) or to the whole input. Leave the layers of "
                f"{where} out of dist.tp.plan, or keep the parameter in a submodule and name that module in the plan "
                "('replicated_with_grad_allreduce' or 'replicate')"
            )
        input_widths = {model.get_submodule(n).in_features for n in layers}
        output_widths: dict[int, str] = {}
        for name in layers:
            output_widths.setdefault(model.get_submodule(name).out_features, name)
        planned = (*styles, *(h for h in holders if h != holder and _inside(h, holder)))  # nested holders: their own
        for sub_name, sub in module.named_modules(prefix=holder):
            if sub_name == holder or not _trainable(sub) or any(_inside(sub_name, n) for n in planned):
                continue
            if not is_norm(sub):
                if not block:
                    raise _name_it(sub_name, f"a {type(sub).__name__}", holder, layers)
                if _scalar_params(sub):  # the block's other modules: whole, unless it may scale the split features
                    raise _name_it(sub_name, f"a {type(sub).__name__} of one number", holder, layers)
                continue
            weight = next(sub.parameters())
            if weight.dim() > 1:
                raise ValueError(
                    f"dist.tp.plan: {sub_name} (a {type(sub).__name__}) holds one weight per attention head (weight of "
                    f"shape {tuple(weight.shape)}) inside {holder}, whose 'colwise' layer(s) {', '.join(layers)} give "
                    "each rank only its own heads; no style splits such a norm with them. Leave the layers of "
                    f"{holder} out of dist.tp.plan (it then runs whole on every rank; split the MLP only), or use FSDP "
                    "for this model"
                )
            width = weight.shape[-1]
            if width in input_widths:
                if width == head_dim and not block:
                    raise _name_it(
                        sub_name,
                        f"a {type(sub).__name__} over {width} features, as many as the input and a head",
                        holder,
                        layers,
                    )
                continue  # a pre-norm (or, in a block, the residual stream's)
            if width in output_widths and width != head_dim:
                layer = output_widths[width]
                raise ValueError(
                    f"dist.tp.plan: {sub_name} (a {type(sub).__name__} over {width} features) normalizes the whole "
                    f"output of {layer}, which 'colwise' splits: each rank would hold only its share of those "
                    f"features. Use 'colwise_gather_output' for the layers of {holder} that it follows and "
                    "'rowwise_split_input' for the layer that reads their output, as OLMo2's own plan does "
                    "(dist.tp.plan='auto'), or leave them out of the plan"
                )
            found[sub_name] = "replicated_with_grad_allreduce"
    return {**styles, **found}


def _join(holder: str, name: str) -> str:
    return f"{holder}.{name}" if holder else name


def check_packed_layers(model: nn.Module, styles: dict[str, str]) -> None:
    """Refuse ``colwise`` on a layer that stacks several projections in its weight.

    A layer is taken as packed when its name is one of ``PACKED_NAMES``, or when its ``out_features`` exceeds
    the ``in_features`` of a ``rowwise`` layer beside it (two or three projections in one weight) and its name
    is not one of ``PER_HEAD_NAMES``.

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
            if reason is not None or width is None or short in PER_HEAD_NAMES:
                continue
            if layer.out_features == 2 * width:
                reason = f"out_features={layer.out_features} is twice the in_features of {partner}"
            elif layer.out_features > width:
                reason = (
                    f"out_features={layer.out_features} is more than the in_features={width} of {partner}, which "
                    "reads its output"
                )
        if reason is not None:
            after = f"the layer that reads its output ({', '.join(partners)})" if partners else "the layer after it"
            raise ValueError(
                f"dist.tp.plan: {name} looks like a packed layer, several projections stacked in one weight "
                f"({reason}); 'colwise' would give each rank a contiguous block of its rows (one projection's rows, "
                "not this rank's share of each) and the model would compute the wrong thing. Use "
                f"'colwise_gather_output' for {name} and 'rowwise_split_input' for {after}, as Phi-3's own plan "
                "does (dist.tp.plan='auto'), or split the layer into one nn.Linear per projection"
            )


def check_pairs(model: nn.Module, styles: dict[str, str]) -> None:
    """Refuse a split layer without the partner beside it (same parent module) that its style needs.

    Raises:
        ValueError: a ``colwise`` layer that no ``rowwise`` layer reads, a ``rowwise`` layer (not an embedding)
            that no ``colwise`` layer feeds, a ``rowwise_split_input`` layer fed by ``colwise`` ones; the
            message names the style to use.
    """
    siblings: dict[str, dict[str, list[str]]] = {}
    for name, style in styles.items():
        siblings.setdefault(_parent(name), {}).setdefault(style, []).append(name)
    for name, style in styles.items():
        beside = siblings[_parent(name)]
        if style == "colwise" and not beside.get("rowwise") and not beside.get("rowwise_split_input"):
            raise ValueError(
                f"dist.tp.plan: {name} is 'colwise', but no 'rowwise' layer beside it reads its output: each rank "
                f"would keep only its share of {name}'s output features. Use 'colwise_gather_output' for {name} "
                "(every rank then gets the whole output), or split the layer that reads its output 'rowwise'"
            )
        if style == "rowwise" and not isinstance(model.get_submodule(name), nn.Embedding) and not beside.get("colwise"):
            gathered = beside.get("colwise_gather_output")
            feeding = f" ({', '.join(gathered)} gather their whole output)" if gathered else ""
            raise ValueError(
                f"dist.tp.plan: {name} is 'rowwise', which takes this rank's share of its input features from a "
                f"'colwise' layer beside it, but there is none{feeding}: use 'rowwise_split_input' for a layer whose "
                "input is whole (it splits the input itself), or split the layers that feed it 'colwise'"
            )
        if style == "rowwise_split_input" and beside.get("colwise") and not beside.get("colwise_gather_output"):
            raise ValueError(
                f"dist.tp.plan: {name} is 'rowwise_split_input', which splits a whole input itself, but the "
                f"'colwise' layer(s) {', '.join(beside['colwise'])} beside it give it only this rank's share: use "
                f"'rowwise' for {name}, or 'colwise_gather_output' for the layers that feed it"
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
