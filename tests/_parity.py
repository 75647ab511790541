"""The parity oracle: a single-process reference run on the union of the ranks' batches."""

import torch
from _models import tiny_gpt2, token_dataset

ATOL, RTOL = 1e-5, 1e-4


def reference_run(indices_per_rank: list[list[list[int]]]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train one unsharded model (rank 0's initial weights) on the union of the ranks' batches."""
    data = token_dataset(32)
    model = tiny_gpt2(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(len(indices_per_rank[0])):
        batch = [data[i] for rank_indices in indices_per_rank for i in rank_indices[step]]
        ids = torch.stack([sample["input_ids"] for sample in batch])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_parity(results: list[dict]) -> None:
    ref_losses, ref_state = reference_run([r["indices"] for r in results])
    # Each rank's loss is the mean over its own equal-sized batch, so their mean is the global loss.
    mean_losses = torch.tensor([r["losses"] for r in results]).mean(dim=0)
    torch.testing.assert_close(mean_losses, torch.tensor(ref_losses), atol=ATOL, rtol=RTOL)
    assert results[0]["keys"] == sorted(ref_state), "accelerate() must keep the state_dict keys"
    for result in results:
        assert result["state"].keys() == ref_state.keys()
        for name, value in ref_state.items():
            torch.testing.assert_close(result["state"][name], value, atol=ATOL, rtol=RTOL, msg=name)
