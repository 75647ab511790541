"""The model to plan for, on the meta device: from a module, a factory, a Hugging Face config or a directory.

Nothing here allocates a weight: factories and configs are built under ``torch.device("meta")``; a module is
copied with its parameters replaced by meta ones (the caller's module is never changed, since sharding changes
the module it is given). Buffers are made real, empty CPU tensors: they are small, no estimate reads their values,
and ``accelerate()`` keeps them real too (see [Note: meta init] in parallel/meta_init.py).
"""

import copy
import importlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

__all__ = ["ModelSource", "build_meta_model", "resolve_factory", "with_num_blocks", "find_blocks"]

ModelSource = nn.Module | Callable[[], nn.Module] | str | os.PathLike | Any
"""An ``nn.Module`` (any device), a factory returning one, a ``transformers.PretrainedConfig``, or the path of a
local Hugging Face model directory or ``config.json``."""

_BUILD_HINT = (
    "a model is built on the meta device without memory, so its constructor must not read weight values "
    "(.item(), .tolist(), numpy(), printing a weight): move that work out of __init__, or build the model under "
    "torchacc.init_empty_weights() yourself and pass the module"
)


def build_meta_model(source: ModelSource) -> nn.Module:
    """A model with every parameter on the meta device and real (empty) buffers, built from ``source``.

    Raises:
        ValueError: the source is none of the accepted kinds, a path holds no ``config.json``, or building on
            the meta device failed (naming the module whose constructor failed, and how to fix it).
    """
    if isinstance(source, nn.Module):
        return _meta_copy(source)
    if isinstance(source, (str, os.PathLike)):
        source = _hf_config(os.fspath(source))
    if _is_hf_config(source):
        from transformers import AutoModelForCausalLM

        config = source
        return _build(
            lambda: AutoModelForCausalLM.from_config(config), f"AutoModelForCausalLM({type(config).__name__})"
        )
    if callable(source):
        return _build(source, getattr(source, "__qualname__", repr(source)))
    raise ValueError(
        f"model must be an nn.Module, a factory returning one, a transformers config, or a model directory or "
        f"config.json path, got {type(source).__name__}"
    )


def resolve_factory(spec: str) -> Callable[[], nn.Module]:
    """``"package.module:function"`` -> the function (imported from the current directory too).

    Raises:
        ValueError: malformed, not importable, or no such attribute.
    """
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"--model {spec!r}: write a factory as module:function, e.g. my_models:build_llama")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--model {spec!r}: cannot import {module_name!r} ({exc}); run from its directory") from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ValueError(f"--model {spec!r}: {module_name} has no callable {attribute!r}")
    return factory


def _is_hf_config(obj: Any) -> bool:
    if "transformers" not in sys.modules:  # a config object exists only once transformers was imported
        return False
    from transformers import PretrainedConfig

    return isinstance(obj, PretrainedConfig)


def _hf_config(path: str) -> Any:
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(
            f"model path {path!r} holds no config.json; pass a Hugging Face model directory, its config.json, or "
            "a module:factory"
        )
    from transformers import AutoConfig

    with open(file) as handle:
        data = json.load(handle)
    if "model_type" not in data:
        raise ValueError(f"{file} has no 'model_type', so transformers cannot tell which model it describes")
    return AutoConfig.for_model(**data)


def _build(factory: Callable[[], Any], what: str) -> nn.Module:
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as exc:
        raise ValueError(
            f"could not build {_failing_module(exc) or what} on the meta device ({exc}); {_BUILD_HINT}"
        ) from exc
    if not isinstance(model, nn.Module):
        raise ValueError(f"{what} returned {type(model).__name__}, not an nn.Module")
    _real_buffers(model)
    return model


def _failing_module(exc: BaseException) -> str | None:
    """The class of the innermost module whose code raised ``exc`` (its constructor, usually)."""
    found, tb = None, exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module):
            found = f"{type(owner).__name__} (in {tb.tb_frame.f_code.co_name})"
        tb = tb.tb_next
    return found


def _meta_copy(model: nn.Module) -> nn.Module:
    memo: dict[int, Any] = {}
    for param in model.parameters():
        memo[id(param)] = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
    copied = copy.deepcopy(model, memo)
    _real_buffers(copied)
    return copied


def _real_buffers(model: nn.Module) -> None:
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.zeros(buffer.shape, dtype=buffer.dtype, device="cpu")


def find_blocks(model: nn.Module, classes: tuple[type[nn.Module], ...]) -> tuple[nn.Module, str] | None:
    """The ``nn.ModuleList`` holding the most modules of ``classes`` (the repeated blocks), as (parent, name)."""
    best, most = None, 0
    for module in model.modules():
        for name, child in module.named_children():
            if isinstance(child, nn.ModuleList):
                count = sum(isinstance(block, classes) for block in child)
                if count > most:
                    best, most = (module, name), count
    return best


def with_num_blocks(model: nn.Module, classes: tuple[type[nn.Module], ...], num_blocks: int) -> nn.Module:
    """A copy of meta ``model`` with only the first ``num_blocks`` of its repeated blocks (see ``find_blocks``).

    Raises:
        ValueError: the model has no list of such blocks, or fewer than ``num_blocks`` of them.
    """
    found = find_blocks(model, classes)
    if found is None:
        names = ", ".join(sorted(c.__name__ for c in classes)) or "none"
        raise ValueError(f"{type(model).__name__} holds no nn.ModuleList of its blocks (classes: {names})")
    parent, name = found
    blocks = getattr(parent, name)
    if len(blocks) < num_blocks:
        raise ValueError(f"{type(model).__name__}.{name} has {len(blocks)} blocks, fewer than {num_blocks}")
    memo: dict[int, Any] = {}
    kept = copy.deepcopy(list(blocks)[:num_blocks], memo)  # one memo: weights tied across the cut stay tied
    memo[id(blocks)] = nn.ModuleList(kept)
    return copy.deepcopy(model, memo)
