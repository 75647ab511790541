"""Named set-ups for doc snippets that show an insertion into an existing script (``setup=NAME``).

Each function fills a block's namespace with what the surrounding script would have defined.
"""

from typing import Any


def gpt2(namespace: dict[str, Any]) -> None:
    """``torch``, a tiny GPT-2 ``model`` and a ``loader`` of 16 random token sequences (batches of 4)."""
    import torch
    from torch.utils.data import DataLoader
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    # bos/eos: GPT-2's default 50256 lies outside this vocabulary, and transformers warns at every build.
    config = GPT2Config(
        vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=127, eos_token_id=127
    )
    model = GPT2LMHeadModel(config)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (16, 32))]
    namespace.update(torch=torch, model=model, loader=DataLoader(data, batch_size=4, shuffle=True))
