"""One rank of the two-"node" torchrun test: HSDP with the replicate axis across nodes."""

import os
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "multiproc")]
from scenarios import gpt2_config, train_gpt2  # noqa: E402

import torchacc  # noqa: E402

if __name__ == "__main__":
    out = Path(sys.argv[1])
    config = gpt2_config(fsdp=torchacc.dist.local_world_size())
    result = train_gpt2(config, num_steps=3)
    result.update(
        rank=torchacc.dist.rank(),
        local_rank=torchacc.dist.local_rank(),
        node=int(os.environ["GROUP_RANK"]),
        local_master=torchacc.dist.is_master_ordinal(local=True),
        global_master=torchacc.dist.is_master_ordinal(local=False),
    )
    torch.save(result, out / f"rank{torchacc.dist.rank()}.pt")
