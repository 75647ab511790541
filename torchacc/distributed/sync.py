"""Making the ranks' copies of a model's weights agree before sharding (``sync_module_states``), reading each byte at
most once per rank and sending only the tensors that differ."""

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from ._digest import release_weights, tensor_digest
from .collectives import _active, broadcast_tensors

__all__ = ["sync_tensors"]


def sync_tensors(
    tensors: Iterable[torch.Tensor],
    *,
    src: int = 0,
    bucket_bytes: int = 64 << 20,
    shard_of_rank: Sequence[int] | None = None,
    whole: Iterable[torch.Tensor] = (),
) -> int:
    """Make ``tensors`` (and ``whole``) equal rank ``src``'s where it matters, sending only the tensors that differ.

    Every rank digests each tensor's bytes (see [Note: the tensor digest] in ``_digest.py``), the digests
    travel in one all-gather, and only the tensors whose digest differs from ``src``'s on some rank are
    broadcast, bucketed as in :func:`broadcast_tensors`. Ranks that already agree pay one read of the tensors
    and one message of 16 bytes per tensor.

    With ``shard_of_rank`` the ``tensors`` are about to be sharded as FSDP2 shards a parameter: dim 0 cut into
    ``max(shard_of_rank) + 1`` chunks (``torch.chunk``), rank ``q`` keeping chunk ``shard_of_rank[q]`` and
    dropping the rest. Only what each rank keeps must equal ``src``'s, so each rank digests only its own chunk
    and ``src`` the chunks that other ranks keep (at FSDP 2 every rank reads half of each tensor instead of all
    of it), and ``src``'s chunk digests travel in one broadcast. A tensor that differs in any kept chunk is
    broadcast whole; a difference only in chunks that a rank drops is left alone (sharding discards it).

    Args:
        tensors: the same shapes, dtypes and order on every rank, on the process group's device; updated in place.
        src: the rank whose values win.
        bucket_bytes: the size at which a bucket of differing tensors is sent.
        shard_of_rank: each global rank's chunk index, or None when every rank keeps the whole tensors.
        whole: more tensors, compared whole on every rank (the buffers beside sharded parameters), in the same
            collectives.

    Returns:
        How many tensors were broadcast (the same on every rank); 0 in a world of one.

    Example:
        >>> sync_tensors(model.parameters(), shard_of_rank=shard_of_rank(mesh), whole=model.buffers())
    """
    cut = [*((t, True) for t in tensors), *((t, False) for t in whole)]  # (tensor, cut into chunks)
    if not _active() or not cut:
        return 0
    try:
        return _sync(cut, src=src, bucket_bytes=bucket_bytes, shard_of_rank=shard_of_rank)
    finally:
        release_weights()  # else they stay on the device for the whole run


def _sync(
    cut: list[tuple[torch.Tensor, bool]], *, src: int, bucket_bytes: int, shard_of_rank: Sequence[int] | None
) -> int:
    device, world, rank = cut[0][0].device, dist.get_world_size(), dist.get_rank()
    shard_of_rank = list(shard_of_rank) if shard_of_rank is not None else [0] * world
    num_chunks = max(shard_of_rank) + 1
    # src digests every chunk that another rank keeps: its own only when a replica keeps it too (HSDP)
    wanted = {shard_of_rank[q] for q in range(world) if q != src}
    zero = torch.zeros(2, dtype=torch.int64, device=device)

    def digest(tensor: torch.Tensor, chunked: bool, chunk: int) -> torch.Tensor:
        return tensor_digest(_kept(tensor, num_chunks, chunk) if chunked else tensor).to(device)

    if rank == src:  # [tensor, chunk, 2]; zeros for the chunks no other rank keeps
        reference = torch.stack(
            [
                torch.stack([digest(t, chunked, c) if c in wanted else zero for c in range(num_chunks)])
                if chunked
                else digest(t, False, 0).expand(num_chunks, 2)
                for t, chunked in cut
            ]
        )
        digests = reference[:, 0].contiguous() if num_chunks == 1 else torch.zeros_like(reference[:, 0])
    else:
        digests = torch.stack([digest(t, chunked, shard_of_rank[rank]) for t, chunked in cut])
        reference = torch.empty(len(cut), num_chunks, 2, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(digests) for _ in range(world)]
    dist.all_gather(gathered, digests)  # with one chunk, src's digests travel here as everyone's
    if num_chunks == 1:
        reference = gathered[src][:, None]
    else:
        dist.broadcast(reference, src=src)
    table = torch.stack(gathered)  # [rank, tensor, 2]
    expected = reference[:, shard_of_rank].transpose(0, 1)  # [rank, tensor, 2]: src's digest of what each keeps
    others = torch.tensor([q != src for q in range(world)], device=device)
    differs = ((table != expected).any(dim=2) & others[:, None]).any(dim=0).tolist()
    stale = [t for (t, _), differ in zip(cut, differs, strict=True) if differ]
    broadcast_tensors(stale, src=src, bucket_bytes=bucket_bytes)
    return len(stale)


def _kept(tensor: torch.Tensor, num_chunks: int, chunk: int) -> torch.Tensor:
    """The part of ``tensor`` that FSDP2 keeps on the rank of shard ``chunk`` of ``num_chunks`` (dim-0 pieces by
    ``torch.chunk``, empty past the last); a 0-dim tensor is kept whole."""
    if num_chunks == 1 or tensor.dim() == 0:
        return tensor
    size = -(-tensor.shape[0] // num_chunks)  # torch.chunk's piece length, without building every piece
    start = min(chunk * size, tensor.shape[0])
    return tensor.detach().narrow(0, start, min(size, tensor.shape[0] - start))
