"""Random numbers under tensor parallelism: the ranks of a TP group draw the same ones.

[Note: one random stream per TP group] The ranks of a TP group compute one copy of the model on the same
batch. Dropout outside the split layers (on the residual stream, after a ``rowwise`` layer) runs on each
rank on the same replicated activations; if the ranks' generators differ, each draws its own mask, the
ranks compute different losses, and the weights they keep whole drift apart, with no error. Users seed
each rank differently for good reasons (data augmentation, ``torch.manual_seed(100 + rank)`` as
docs/checkpoints.md shows), so ``sync_rng`` gives every rank of a TP group the generator states of the
group's first rank when the model is accelerated (data-parallel ranks keep their own), and
``check_rng_at_first_forward`` compares the states once more at the first forward in training mode
(one all-gather, never again): a script that re-seeds per rank after ``accelerate()`` gets a
``ValueError`` on every rank instead of a silent drift.

Inside the split region each rank draws masks for its own heads or features from the same stream, so the
ranks' masks repeat one pattern (Megatron forks a per-rank generator around its attention dropout, which
it can locate in its own layers; a Hugging Face attention module may also hold a dropout on its replicated
output, so torchacc does not fork). The masks are still independent draws along the sequence and batch.
Only torch's generators (CPU and CUDA) are kept in step; Python's and NumPy's stay per rank.
"""

import zlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..distributed.collectives import all_gather_object

__all__ = ["sync_rng", "check_rng_states", "check_rng_at_first_forward"]


def _states(device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def sync_rng(mesh: DeviceMesh, *, device: torch.device) -> None:
    """Give every rank of the 1-D TP ``mesh`` the torch generator states (CPU, and ``device``'s) of its first rank.

    Every rank of the job calls it (one broadcast per generator within each TP group).
    """
    states = _states(device)
    for state in states:
        dist.broadcast(state, group=mesh.get_group(), group_src=0)
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)


def check_rng_states(entries: list[tuple[tuple[int, ...], int, int]]) -> None:
    """Raise if the ranks of one TP group hold different generator states.

    Args:
        entries: for each rank, in rank order: (the global ranks of its TP group, a fingerprint of its
            generator states, ``torch.initial_seed()``).

    Raises:
        ValueError: naming the first such group and each of its ranks' seeds, and how to seed them.
    """
    for group in dict.fromkeys(entry[0] for entry in entries):
        members = [(rank, entries[rank]) for rank in group]
        if len({fingerprint for _, (_, fingerprint, _) in members}) == 1:
            continue
        seeds = ", ".join(f"rank {rank}: {seed}" for rank, (_, _, seed) in members)
        same = len({seed for _, (_, _, seed) in members}) == 1
        cause = "the same seed, but some ranks drew more random numbers since" if same else "different seeds"
        raise ValueError(
            f"dist.tp: the ranks {list(group)} of one TP group reach their first training forward with different "
            f"random generator states ({cause}; torch.initial_seed() per rank: {seeds}). They compute one copy of "
            "the model on the same batch, so dropout must draw the same masks on all of them, or the weights they "
            "keep whole drift apart. Seed the ranks of a TP group alike after accelerate() (with the default "
            "dist.topology: torch.manual_seed(seed + rank // dist.tp.size)), or seed before accelerate(), which "
            "gives each TP group the state of its first rank"
        )


def _fingerprint(device: torch.device) -> int:
    crc = 0
    for state in _states(device):
        crc = zlib.crc32(state.numpy().tobytes(), crc)
    return crc


def check_rng_at_first_forward(model: nn.Module, mesh: DeviceMesh, *, device: torch.device) -> None:
    """At ``model``'s first forward in training mode, compare the generator states of each TP group once.

    Register it after the model is wrapped: the hook goes in front of the others. Every rank of the job
    must run that forward (one all-gather over the job, then the hook removes itself).
    """
    group = tuple(int(rank) for rank in mesh.mesh.flatten().tolist())

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not module.training:
            return
        handle.remove()
        check_rng_states(all_gather_object((group, _fingerprint(device), torch.initial_seed())))

    handle = model.register_forward_pre_hook(hook, prepend=True, with_kwargs=True)
