"""Pipeline parallelism, the cut: the model reduced to this rank's stages, and a ``StageModule`` per stage.

See [Note: pipeline stages] in pipeline.py, which plans the split (``plan_pipeline``) that ``split_model``
applies here.
"""

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn as nn

from .pipeline import StagePlan

__all__ = ["StageBlocks", "StageModule", "split_model", "whole_model_scope"]


def _skip(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return hidden_states


def _enter(block: nn.Module, received: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """Call ``block`` on ``received`` in place of the hidden states the decoder computed before its blocks."""
    if args:
        return block(received, *args[1:], **kwargs)
    return block(**{**kwargs, "hidden_states": received})


class StageBlocks(nn.Module):
    """The decoder's block list on one rank: its stages' blocks under their original indices.

    Iterating (and slicing, as Hugging Face's ``self.layers[: num_hidden_layers]``) yields every index of the
    whole model: the active stage's blocks, and for the others a step that passes the hidden states through, so
    that per-layer settings indexed by position (``config.layer_types[i]``) still find their layer. With
    ``entry`` set (a later stage), the first active block takes ``entry`` as its hidden states.
    """

    def __init__(self, blocks: dict[int, nn.Module], num_blocks: int) -> None:
        super().__init__()
        for index, block in blocks.items():
            self.add_module(str(index), block)
        self.num_blocks = num_blocks
        self.active: frozenset[str] = frozenset(self._modules)
        self.entry: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.num_blocks

    def __getitem__(self, index: int | slice) -> Any:
        steps: list[Any] = [self._modules[str(i)] if str(i) in self.active else _skip for i in range(self.num_blocks)]
        if self.entry is not None:
            first = min(map(int, self.active))
            steps[first] = functools.partial(_enter, steps[first], self.entry)
        return steps[index]

    def __iter__(self) -> Any:
        return iter(self[:])


class StageModule(nn.Module):
    """One pipeline stage of a split model: its parts (shared with the model, not copied) and its forward.

    Args:
        model: the model ``split_model`` cut down.
        plan: the ``StagePlan``.
        index: the stage's index in the pipeline.
    """

    def __init__(self, model: nn.Module, plan: StagePlan, index: int) -> None:
        super().__init__()
        self.index, self.is_first, self.is_last = index, index == 0, index == plan.num_stages - 1
        decoder = model.get_submodule(plan.decoder)
        if self.is_first:
            self.embed_tokens = decoder.embed_tokens
        self.blocks = nn.ModuleDict({str(i): decoder.layers[i] for i in plan.stages[index]})
        if self.is_last:
            self.norm = getattr(decoder, plan.norm)
            self.head = model.get_submodule(plan.head)
        # not submodules: the decoder holds the other stages' parts too
        self._decoder, self._model, self._norm = [decoder], weakref.ref(model), plan.norm

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """``input_ids`` (first stage) or hidden states in; hidden states or (last stage) logits out."""
        decoder = self._decoder[0]
        layers, norm = decoder.layers, decoder._modules[self._norm]
        layers.active = frozenset(self.blocks.keys())
        if not self.is_first:
            layers.entry = x  # see [Note: pipeline stages]
        if not self.is_last:
            decoder._modules[self._norm] = nn.Identity()  # the norm (if this rank has it) belongs to the last stage
        inputs = {"input_ids": x} if self.is_first else {"inputs_embeds": x}
        try:
            if not self.is_last:
                return decoder(**inputs, use_cache=False, **kwargs)[0]
            model = self._model()
            if model is None:
                raise RuntimeError("the pipelined model no longer exists")
            # the model's own forward (not self.head): what it does after the head happens too
            return type(model).forward(model, **inputs, use_cache=False, **kwargs).logits
        finally:
            layers.active = frozenset(layers._modules)
            layers.entry = None
            decoder._modules[self._norm] = norm


def split_model(model: nn.Module, plan: StagePlan, *, stages: Sequence[int]) -> list[StageModule]:
    """Cut ``model`` down, in place, to the parts of ``stages``; return their ``StageModule``s.

    See [Note: pipeline stages]. Names do not change: the model's ``state_dict`` keeps the keys of the kept parts.
    """
    decoder = model.get_submodule(plan.decoder)
    keep = sorted(i for s in stages for i in plan.stages[s])
    decoder.layers = StageBlocks({i: decoder.layers[i] for i in keep}, plan.num_blocks)
    if 0 not in stages:
        decoder.embed_tokens = None
    if plan.num_stages - 1 not in stages:
        setattr(decoder, plan.norm, nn.Identity())
        parent, _, name = plan.head.rpartition(".")
        setattr(model.get_submodule(parent), name, None)
    return [StageModule(model, plan, s) for s in stages]


def whole_model_scope(model: nn.Module, plan: StagePlan) -> Callable[[], AbstractContextManager[None]]:
    """Call before ``split_model``: a context that puts the parts ``split_model`` removes back, for a while.

    Inside ``with whole_model_scope(model, plan)():`` after the split, ``model`` holds the whole model's modules
    again, in their places and order: this rank's (materialized, sharded) and the other stages' as they were
    when this was called (on the meta device: holding them costs no memory). See [Note: meta init under a
    pipeline] in meta_init.py. Only for a model on the meta device: otherwise it would keep the whole model alive.
    """
    decoder = model.get_submodule(plan.decoder)
    parent, _, head = plan.head.rpartition(".")
    places = [(decoder, "layers"), (decoder, "embed_tokens"), (decoder, plan.norm), (model.get_submodule(parent), head)]
    whole = [(owner, name, owner._modules[name]) for owner, name in places]

    @contextlib.contextmanager
    def scope() -> Iterator[None]:
        cut = [(owner, name, owner._modules[name]) for owner, name, _ in whole]
        for owner, name, module in whole:
            owner._modules[name] = module
        try:
            yield
        finally:
            for owner, name, module in cut:
                owner._modules[name] = module

    return scope
