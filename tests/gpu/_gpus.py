"""Skip markers for the GPU tests: each names the number of CUDA devices it needs and how many there are."""

import pytest
import torch

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(count: int) -> pytest.MarkDecorator:
    """Skip unless this machine has ``count`` CUDA devices (ranks take ``cuda:LOCAL_RANK``, one GPU each)."""
    noun = "CUDA device" if count == 1 else "CUDA devices"
    return pytest.mark.skipif(count > NUM_GPUS, reason=f"needs {count} {noun} (this machine has {NUM_GPUS})")
