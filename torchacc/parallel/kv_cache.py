"""Training forwards of a Hugging Face model build no KV cache when its blocks are checkpointed or compiled.

[Note: no KV cache in a training forward] A Hugging Face causal LM builds a KV cache in every forward while
``config.use_cache`` is True (the default), training included. A cache is harmful to two of torchacc's mechanisms:

- activation checkpointing (``memory.gc``): the checkpointed layer's recomputation in backward appends its keys to
  the cache a second time; with a sliding window (Mistral, Gemma 2 and 3) attention then fails on mismatched
  sizes, and elsewhere the cache grows for nothing;
- ``compute.compile``: each block updates its own layer's cache entry and dynamo guards on it, so every block
  recompiles, and past ``torch._dynamo.config.recompile_limit`` the remaining blocks silently run eager.

So a forward pre-hook passes ``use_cache=False`` to every module that has a ``config.use_cache`` and takes a
``use_cache`` argument, in a training forward only (``module.training`` and gradients enabled: the condition
transformers itself uses for its own gradient checkpointing). ``model.config.use_cache`` is left as it is, so
``model.generate()`` (which runs under ``torch.no_grad()``) and evaluation under ``torch.no_grad()`` still use a
cache after training: without gradients nothing is recomputed, and a compiled block that recompiles there only
runs slower.
"""

import inspect
from typing import Any

import torch
import torch.nn as nn

__all__ = ["train_without_kv_cache"]


def _use_cache_index(module: nn.Module) -> int | None:
    """The position of ``use_cache`` among ``module.forward``'s arguments; None if it takes no such argument."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    names = [p.name for p in params]
    if "use_cache" not in names:
        return None
    index = names.index("use_cache")
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return index if all(p.kind in positional for p in params[: index + 1]) else -1  # -1: keyword only


def train_without_kv_cache(model: nn.Module) -> list[str]:
    """Pass ``use_cache=False`` to ``model``'s Hugging Face modules in every training forward.

    See [Note: no KV cache in a training forward]. A training forward is one with ``module.training`` set and
    gradients enabled; every other forward (``generate()``, evaluation under ``torch.no_grad()``) is unchanged.

    Args:
        model: the model, before sharding (the hooks stay on the modules through ``fully_shard``).

    Returns:
        The names of the modules whose training forwards now build no cache (empty for a model without a
        ``config.use_cache``).

    Example:
        >>> train_without_kv_cache(LlamaForCausalLM(config))
        ['', 'model']
    """
    names = []
    for name, module in model.named_modules():
        if not hasattr(getattr(module, "config", None), "use_cache"):
            continue
        index = _use_cache_index(module)
        if index is None:
            continue
        module.register_forward_pre_hook(_no_cache_hook(index), with_kwargs=True)
        names.append(name)
    return names


def _no_cache_hook(index: int):
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict]:
        if not (module.training and torch.is_grad_enabled()):
            return args, kwargs
        if 0 <= index < len(args):
            args = (*args[:index], False, *args[index + 1 :])
        else:
            kwargs = {**kwargs, "use_cache": False}
        return args, kwargs

    return hook
