"""The one walker over nested containers of tensors: map every tensor, keep every container's type.

Batches, model outputs, state dicts and optimizer states nest tensors in dicts (``defaultdict``,
``OrderedDict``, Hugging Face ``ModelOutput``, ``BatchEncoding``), lists, tuples, namedtuples and
dataclasses. :func:`map_tensors` rebuilds each container with its own type where it can and falls
back to a plain ``dict`` / ``list`` / ``tuple`` where the type cannot be rebuilt, so a walk never
fails on an unusual container (a walk inside a collective must not raise on one rank only).
"""

import copy
import dataclasses
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import torch

__all__ = ["iter_tensors", "map_tensors"]


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any, *, defaultdict_as_dict: bool = False) -> Any:
    """Return ``obj`` with every tensor ``t`` in it replaced by ``fn(t)``; other leaves are kept as they are.

    Args:
        fn: applied to each tensor (DTensors included), in depth-first order.
        obj: a tensor, or a nest of mappings, lists, tuples, namedtuples and dataclasses.
        defaultdict_as_dict: rebuild ``defaultdict``s as plain dicts (for files loaded with ``weights_only``).

    Returns:
        A new structure of the same shape and, where possible, the same container types.

    Example:
        >>> on_cpu = map_tensors(lambda t: t.cpu(), batch)
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        values = {k: map_tensors(fn, v, defaultdict_as_dict=defaultdict_as_dict) for k, v in obj.items()}
        return values if defaultdict_as_dict and isinstance(obj, defaultdict) else _rebuild_mapping(obj, values)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        values = [map_tensors(fn, v, defaultdict_as_dict=defaultdict_as_dict) for v in obj]
        try:
            return type(obj)(*values)
        except TypeError:
            return tuple(values)
    if isinstance(obj, (list, tuple)):
        values = [map_tensors(fn, v, defaultdict_as_dict=defaultdict_as_dict) for v in obj]
        try:
            return type(obj)(values)
        except TypeError:
            return tuple(values) if isinstance(obj, tuple) else values
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _rebuild_dataclass(obj, lambda o: map_tensors(fn, o, defaultdict_as_dict=defaultdict_as_dict))
    return obj


def iter_tensors(obj: Any, *, kind: type = torch.Tensor) -> Iterator[Any]:
    """Every tensor (or every leaf of type ``kind``) in ``obj``, in :func:`map_tensors`'s order, building nothing."""
    if isinstance(obj, kind):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from iter_tensors(value, kind=kind)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from iter_tensors(value, kind=kind)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name, None), kind=kind)


def _rebuild_mapping(original: Mapping, values: dict[Any, Any]) -> Any:
    if isinstance(original, MutableMapping):
        # A shallow copy keeps what the constructor would lose (defaultdict's factory, BatchEncoding's
        # encodings, ModelOutput's attributes); item assignment, because ModelOutput refuses update().
        try:
            clone = copy.copy(original)
            for key, value in values.items():
                clone[key] = value
            return clone
        except Exception:
            pass
    try:
        return type(original)(values)
    except Exception:
        return values


def _rebuild_dataclass(obj: Any, walk: Callable[[Any], Any]) -> Any:
    values = {f.name: walk(getattr(obj, f.name)) for f in dataclasses.fields(obj) if hasattr(obj, f.name)}
    try:
        clone = copy.copy(obj)
        for name, value in values.items():
            object.__setattr__(clone, name, value)  # frozen dataclasses too
        return clone
    except Exception:
        return values
