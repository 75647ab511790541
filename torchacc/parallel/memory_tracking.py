"""Live tensor bytes over time: ``track_memory()`` for real steps, ``LiveBytes`` for the planner's fake ones.

[Note: live bytes] CUDA keeps its own books (``torch.cuda.max_memory_allocated``). On the CPU nothing does, so
``LiveBytes`` keeps them: a ``TorchDispatchMode`` that sees every tensor an operation returns, counts each storage
once (views share it) while it lives (a weak reference tells when it dies), and follows ``UntypedStorage.resize_``,
which FSDP2 uses to free and re-allocate unsharded parameters outside the dispatcher. Tensor subclasses
(DTensor) are let through to their local tensors, which are the memory. The same books serve the planner's fake
step (``torchacc.estimate_memory``): fake tensors have storages of the right size and no data, so the trace of a
fake step is the trace of the real one. ``record=True`` also keeps the event log (which storage grew or shrank by
how much, and in which phase of the step) from which the planner reads each phase's peak and its make-up.

[Note: shape propagation] To know the shape of an operation's output, DTensor runs the operation on fake tensors
of the global shapes: under a fake mode of its own in a real run, under the active one in a fake step. Those are
no memory of the step and are not counted (``_quiet``). A tracker that counts them (torch's ``FSDPMemTracker``
does, in a fake step) sees a foreach AdamW step, which derives the shapes of all parameters at once, hold several
times the global optimizer state; measured here, a foreach step holds one temporary as large as the rank's
parameter shards, in a fake step and a real one alike.
"""

import contextlib
import gc
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytes", "MemoryTracking", "track_memory", "tracked_peak_bytes"]

_CUDA_BLOCK = 512  # the CUDA caching allocator rounds every allocation up to a multiple of 512 bytes


class LiveBytes(TorchDispatchMode):
    """Count the bytes of live tensor storages while the mode is on: see [Note: live bytes].

    Args:
        record: keep the event log (``events``, ``phases``) as well as the running total and peak.
        block_bytes: round every storage up to a multiple of this (512 mimics the CUDA caching allocator).
    """

    def __init__(self, *, record: bool = False, block_bytes: int = 1) -> None:
        super().__init__()
        self.record = record
        self.block_bytes = block_bytes
        self.current = 0
        self.peak = 0
        self.events: list[tuple[int, int]] = []  # (storage key, change in bytes), with record=True
        self.phases: list[tuple[int, str]] = [(0, "")]  # (index of the first event, phase name)
        self._sizes: dict[int, int] = {}  # storage key -> bytes counted now
        self._keys: dict[int, tuple[int, weakref.ref]] = {}  # id(storage) -> (key, weak reference)
        self._next_key = 0
        self._fake_on_entry: Any = None
        self._resize: Any = None
        self._propagate: Any = None
        self._quiet = 0  # > 0 while DTensor derives output shapes (no memory of the step)

    def _rounded(self, nbytes: int) -> int:
        return -(-nbytes // self.block_bytes) * self.block_bytes

    def _change(self, key: int, nbytes: int) -> None:
        delta = nbytes - self._sizes.get(key, 0)
        if delta:
            self._sizes[key] = nbytes
            self.current += delta
            self.peak = max(self.peak, self.current)
            if self.record:
                self.events.append((key, delta))

    def _forget(self, ident: int, key: int) -> None:
        self._change(key, 0)
        self._sizes.pop(key, None)
        if self._keys.get(ident, (None,))[0] == key:
            del self._keys[ident]

    def key_of(self, storage: torch.UntypedStorage) -> int:
        """The key of ``storage``, counting it (at its current size) from now on."""
        ident = id(storage)
        known = self._keys.get(ident)
        if known is None or known[1]() is not storage:
            self._next_key += 1
            key = self._next_key
            ref = weakref.ref(storage, lambda _, ident=ident, key=key: self._forget(ident, key))
            self._keys[ident] = (key, ref)
        else:
            key = known[0]
        self._change(key, self._rounded(storage.nbytes()))
        return key

    def keys(self, *tensors: Any) -> set[int]:
        """The keys of the storages of ``tensors`` already counted (nothing new is counted)."""
        found = set()
        for leaf in tree_flatten(tensors)[0]:
            if isinstance(leaf, torch.Tensor):
                for tensor in _plain_tensors(leaf):
                    known = self._keys.get(id(tensor.untyped_storage()))
                    if known is not None:
                        found.add(known[0])
        return found

    def track(self, *tensors: Any) -> set[int]:
        """Count the storages of ``tensors`` (nested lists, dicts and subclasses too); returns their keys."""
        keys = set()
        for leaf in tree_flatten(tensors)[0]:
            if isinstance(leaf, torch.Tensor):
                for tensor in _plain_tensors(leaf):
                    if isinstance(tensor, FakeTensor) or tensor.device.type != "meta":
                        keys.add(self.key_of(tensor.untyped_storage()))
        return keys

    def mark(self, phase: str) -> None:
        """Start a new phase ("forward", "backward", "optimizer", ...) of the event log."""
        self.phases.append((len(self.events), phase))

    def __enter__(self) -> "LiveBytes":
        self._fake_on_entry = active_fake_mode()
        self._resize = torch.UntypedStorage.resize_
        original = self._resize

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            result = original(storage, size)
            self.key_of(storage)
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        self._propagate = ShardingPropagator._propagate_tensor_meta_non_cached
        propagate_original = self._propagate

        def propagate(propagator: ShardingPropagator, *args: Any, **kwargs: Any) -> Any:
            self._quiet += 1
            try:
                return propagate_original(propagator, *args, **kwargs)
            finally:
                self._quiet -= 1

        ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        ShardingPropagator._propagate_tensor_meta_non_cached = self._propagate  # type: ignore[method-assign]
        super().__exit__(*args)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor run its local ops, which come back here
        if func is torch.ops._c10d_functional.wait_tensor.default and active_fake_mode() is not None:
            result = args[0]  # its fake kernel returns a new tensor; the real one returns its input
        else:
            result = func(*args, **(kwargs or {}))
        # see [Note: shape propagation]
        if not self._quiet and active_fake_mode() is self._fake_on_entry:
            self.track(result)
        return result


_last: "MemoryTracking | None" = None


@dataclass
class MemoryTracking:
    """What one ``track_memory()`` block measured (``peak_bytes`` grows while the block runs)."""

    device: torch.device
    baseline_bytes: int = 0
    """Bytes of the tensors alive when the block began (CPU), counted in the peak."""
    _live: LiveBytes | None = field(default=None, repr=False)
    _cuda_peak: int | None = None

    @property
    def peak_bytes(self) -> int:
        """The most tensor bytes alive at once inside the block, on ``device``."""
        if self.device.type == "cuda":
            if self._cuda_peak is not None:
                return self._cuda_peak
            return torch.cuda.max_memory_allocated(self.device)
        return 0 if self._live is None else self._live.peak


@contextlib.contextmanager
def track_memory(device: torch.device | str | None = None) -> Iterator[MemoryTracking]:
    """Measure the peak of live tensor memory of the steps run inside the block.

    On CUDA this is ``torch.cuda.max_memory_allocated`` (its peak is reset at the start of the block). On the CPU
    every operation's outputs are counted while they live, and the tensors alive at the start (the model, the
    optimizer state, anything else) count too, so the figure is comparable to CUDA's: see [Note: live bytes].
    The CPU books slow each operation a little. ``torchacc.memory_report(...).peak_bytes`` reads the most recent
    block's peak (also while it runs).

    Args:
        device: where to measure; defaults to this process's device (``torchacc.dist.device()``).

    Yields:
        A ``MemoryTracking`` whose ``peak_bytes`` is the peak so far.

    Example:
        >>> with torchacc.track_memory() as tracked:
        ...     model(**batch).loss.backward(); optimizer.step(); optimizer.zero_grad()
        >>> tracked.peak_bytes
        120586240
    """
    global _last
    from ..distributed import env

    where = torch.device(device) if device is not None else env.device()
    if where.type == "cuda":
        torch.cuda.synchronize(where)
        torch.cuda.reset_peak_memory_stats(where)
        tracking = MemoryTracking(where)
        _last = tracking
        yield tracking
        torch.cuda.synchronize(where)
        tracking._cuda_peak = torch.cuda.max_memory_allocated(where)
        return
    live = LiveBytes()
    live.track(_live_cpu_tensors())
    tracking = MemoryTracking(where, baseline_bytes=live.current, _live=live)
    _last = tracking
    with live:
        yield tracking


def _plain_tensors(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """``tensor`` itself, or the plain tensors inside a wrapper subclass (a DTensor's local tensor)."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            inner = getattr(tensor, name)
            if isinstance(inner, torch.Tensor):
                yield from _plain_tensors(inner)
    else:
        yield tensor


def _live_cpu_tensors() -> list[torch.Tensor]:
    """Every real CPU tensor alive in this process (the garbage collector knows them all), subclasses unwrapped."""
    found = []
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: that reads __class__, which some proxies compute
        if issubclass(kind, torch.Tensor) and not issubclass(kind, FakeTensor):
            with contextlib.suppress(Exception):  # a tensor without storage (a functional wrapper) is no memory
                found += [t for t in _plain_tensors(obj) if not isinstance(t, FakeTensor) and t.device.type == "cpu"]
    return found


def tracked_peak_bytes(device: torch.device) -> int | None:
    """``max_memory_allocated`` on CUDA; on the CPU the peak of the latest ``track_memory()`` block, or None."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    if _last is None or _last.device.type != device.type:
        return None
    return _last.peak_bytes
