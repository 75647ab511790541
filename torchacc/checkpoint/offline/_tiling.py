"""Exact tiling: the pieces of a sharded tensor, n-dimensional blocks from every rank's shard metadata, must
cover its full shape with no overlap and no gap before anything is rebuilt from them.

Checked on the blocks alone, never on a mask of the tensor: see [Note: exact tiling].
"""

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .shard_set import TensorItem

__all__ = ["check_tiling"]


def check_tiling(item: "TensorItem", pieces: Iterable[tuple[str, Sequence[int], Sequence[int]]], where: str) -> None:
    """Raise ValueError unless ``pieces`` tile ``item``'s full shape exactly: no overlap, no gap.

    Args:
        item: the tensor.
        pieces: (file, offset, local shape) of every rank's block; equal blocks in several files are replicas
            (HSDP, or a tensor TP leaves whole) and count once, empty blocks count for nothing.
        where: the directory of the files, for a gap (which no file holds).

    See [Note: exact tiling] for how, at any world size, nothing of the tensor's size is built.
    """
    shape = tuple(item.shape)
    blocks: dict[tuple[tuple[int, ...], tuple[int, ...]], str] = {}
    for path, offset, local in pieces:
        lo = tuple(offset)
        hi = tuple(o + n for o, n in zip(lo, local, strict=True))
        if any(h > s for h, s in zip(hi, shape, strict=True)):
            raise ValueError(
                f"{item.name}: the piece in {path} (block {_region(lo, hi)}) reaches outside its full shape "
                f"{list(shape)}; {_RESAVE}"
            )
        if all(h > o for o, h in zip(lo, hi, strict=True)):
            blocks.setdefault((lo, hi), path)
    if not shape or math.prod(shape) == 0:
        return  # a 0-dim tensor is one piece; an empty one has nothing to cover
    flaw = _first_flaw([(lo, hi, path) for (lo, hi), path in blocks.items()], shape, 0)
    if flaw is None:
        return
    lo, hi, overlapping = flaw
    if not overlapping:
        raise ValueError(
            f"{item.name}: no piece in {where} covers {_region(lo, hi)} of its full shape {list(shape)}; {_RESAVE}"
        )
    (lo_a, hi_a, a), (lo_b, hi_b, b) = overlapping
    raise ValueError(
        f"{item.name}: the pieces in {a} (block {_region(lo_a, hi_a)}) and {b} (block {_region(lo_b, hi_b)}) "
        f"overlap on {_region(lo, hi)}; {_RESAVE}"
    )


_RESAVE = (
    "the shard metadata is corrupt or the files come from different layouts: re-save the shards with "
    "model.get_shard_metadata()"
)

# [Note: exact tiling] Blocks tile a box exactly when, cut into slabs along dim 0 at every block's start and
# end, the blocks spanning each slab tile the slab's remaining dims exactly; in one dim, sorted intervals must
# follow each other end to start. A slab visits only the blocks that span it, so an FSDP x TP grid of N
# blocks costs O(N log N) and a corrupt layout at most O(N^2) per dim, whatever the tensor's size.
_Block = tuple[tuple[int, ...], tuple[int, ...], str]


def _first_flaw(
    blocks: list[_Block], shape: tuple[int, ...], dim: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[_Block, _Block] | None] | None:
    """The first flaw of ``blocks`` (all spanning the current slab of dims < ``dim``) in tiling dims >= ``dim``:
    (lo, hi, None) for a gap or (lo, hi, (block, block)) for an overlap, on dims >= ``dim``; None if exact."""
    size, last = shape[dim], dim == len(shape) - 1
    if last:
        end, previous = 0, None
        for block in sorted(blocks, key=lambda b: (b[0][dim], b[1][dim])):
            start, stop = block[0][dim], block[1][dim]
            if start > end:
                return (end,), (start,), None
            if start < end and previous is not None:  # previous is set once end > 0
                return (start,), (min(end, stop),), (previous, block)
            end, previous = stop, block
        return ((end,), (size,), None) if end < size else None
    cuts = sorted({0, size, *(b[0][dim] for b in blocks), *(b[1][dim] for b in blocks)})
    starts = sorted(blocks, key=lambda b: b[0][dim])
    active: list[_Block] = []
    following = 0
    for start, stop in zip(cuts, cuts[1:], strict=False):
        active = [b for b in active if b[1][dim] > start]
        while following < len(starts) and starts[following][0][dim] <= start:
            active.append(starts[following])
            following += 1
        whole = len(active) == 1 and all(
            active[0][0][d] == 0 and active[0][1][d] == shape[d] for d in range(dim + 1, len(shape))
        )
        if whole:
            continue  # the common case of FSDP's dim-0 slabs: one block spanning every later dim
        if not active:
            rest = len(shape) - dim - 1
            return (start, *(0,) * rest), (stop, *shape[dim + 1 :]), None
        flaw = _first_flaw(active, shape, dim + 1)
        if flaw is not None:
            lo, hi, overlapping = flaw
            return (start, *lo), (stop, *hi), overlapping
    return None


def _region(lo: Sequence[int], hi: Sequence[int]) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in zip(lo, hi, strict=True)) + "]"
