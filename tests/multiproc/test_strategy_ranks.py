"""FSDP2Strategy on 2 and 4 ranks: parity for every sharding strategy, accumulation, clipping,
deferred optimizer restore, rotation, HF export and meta-device memory."""

from pathlib import Path

import pytest
import torch
from _launch import launch
from _models import tiny_gpt2, token_dataset

SCENARIOS = str(Path(__file__).with_name("strategy_scenarios.py"))
ATOL, RTOL = 1e-5, 1e-4


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("strategy")
    return launch(f"{SCENARIOS}:two_rank_suite", 2, out / "logs", args=(out,)), out


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("strategy4")
    return launch(f"{SCENARIOS}:hybrid_suite", 4, out, local_world_size=2)


def reference(results: list[dict], accumulation_steps: int, max_norm: float) -> tuple[list[float], list[float], dict]:
    """One unsharded model; each optimizer step on the union of every rank's micro-batches of that step."""
    data = token_dataset(64)
    model = tiny_gpt2(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, norms = [], []
    num_steps = len(results[0]["indices"]) // accumulation_steps
    for step in range(num_steps):
        micro = range(step * accumulation_steps, (step + 1) * accumulation_steps)
        ids = torch.stack([data[i]["input_ids"] for r in results for m in micro for i in r["indices"][m]])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms, model.state_dict()


def assert_strategy_parity(results: list[dict]) -> None:
    accumulation = results[0]["accumulation_steps"]
    ref_losses, ref_norms, ref_state = reference(results, accumulation, 0.05)
    micro_losses = torch.tensor([r["losses"] for r in results]).mean(dim=0)
    step_losses = micro_losses.view(-1, accumulation).mean(dim=1)
    torch.testing.assert_close(step_losses, torch.tensor(ref_losses), atol=ATOL, rtol=RTOL)
    for result in results:
        torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(ref_norms), atol=ATOL, rtol=RTOL)
        assert min(result["norms"]) > 0.05, "the test must actually clip"
        for name, value in ref_state.items():
            torch.testing.assert_close(result["state"][name], value, atol=ATOL, rtol=RTOL, msg=name)


@pytest.mark.parametrize("sharding", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_sharding_strategies_match_single_process_with_accumulation_and_clipping(two_ranks, sharding):
    results, _ = two_ranks
    assert results[0][sharding]["accumulation_steps"] == 2
    assert_strategy_parity([r[sharding] for r in results])


def test_no_shard_calls_parallelize_fn_with_a_replicating_mesh(two_ranks):
    results, _ = two_ranks
    for result in results:
        assert result["NO_SHARD_fn"]["fn_mesh"] == {"names": ("dp", "fsdp"), "shape": (2, 1)}
    assert_strategy_parity([r["NO_SHARD_fn"] for r in results])


@pytest.mark.parametrize("variant", ["HYBRID_SHARD", "HYBRID_DEFER"])
def test_hybrid_shard_on_two_emulated_nodes(four_ranks, variant):
    assert "(dp=2, fsdp=2)" in four_ranks[0][variant]["mesh"].replace(" ", "").replace(",", ", ")
    assert_strategy_parity([r[variant] for r in four_ranks])


def test_deferred_optimizer_restore_resumes_bitwise(two_ranks):
    results, _ = two_ranks
    for result in results:
        assert result["deferred"] == {"losses_equal": True, "state_equal": True}


def test_save_ckpt_rotates_and_load_ckpt_resumes(two_ranks):
    results, _ = two_ranks
    rotation = results[0]["rotation"]
    assert rotation["kept"] == ["global_step3", "global_step4", "latest", "my-export"], "only its own are rotated"
    assert rotation["loaded"] == "global_step4" and rotation["global_step"] == 4
    assert rotation["client_state"] == {"note": 4}
    assert rotation["resumed_equal"] and rotation["same_next_batch"]
    assert rotation["groups"] == [(10, 0.1), (18, 0.0)], "matrices decay; biases and norm weights do not"


def test_save_model_writes_a_transformers_directory(two_ranks):
    _, out = two_ranks
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "hf")
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    assert (out / "hf" / "train.log").read_text() == "step 1\n" and (out / "hf" / "run-1").is_dir()


def test_fp16_strategy_scales_unscales_before_clipping_and_skips_overflows_everywhere(two_ranks):
    results, _ = two_ranks
    for rank, result in enumerate(r["fp16"] for r in results):
        assert result["initial_scale"] == 2.0**16
        first, overflow, last = result["steps"]
        # backward scaled the loss; the norm that clipping saw (and returned) is the unscaled one
        assert first["scaled_norm"] / first["norm"] == pytest.approx(first["scale"], rel=1e-3)
        assert first["changed"] and first["scheduler_stepped"] and first["scale_after"] == first["scale"]
        assert not overflow["changed"] and not overflow["scheduler_stepped"], f"rank {rank} stepped on an inf"
        assert overflow["scale_after"] == overflow["scale"] / 2
        assert last["changed"] and last["scale"] == overflow["scale_after"]


def test_meta_init_allocates_about_one_shard_per_rank(two_ranks):
    results, _ = two_ranks
    for result in results:
        memory = result["meta_memory"]
        assert memory["local_bytes"] == memory["model_bytes"] // 2
        assert memory["growth"] < 0.75 * memory["model_bytes"], memory
        bound = 1 / 2048**0.5  # kaiming-uniform of nn.Linear: U(-bound, bound), std = bound / sqrt(3)
        assert abs(memory["std"] - bound / 3**0.5) < 0.05 * bound
    # The default flow (same seed on every rank, init_model_context) gives the weights of one process ...
    from strategy_scenarios import build_meta_model

    import torchacc

    strategy = torchacc.FSDP2Strategy(sharding_strategy="FULL_SHARD", seed=0)
    strategy.setup_environment()
    with strategy.init_model_context():
        model = build_meta_model()
    model = strategy.parallelize(model)
    for result in results:
        first, last = result["meta_memory"]["first_and_last"]
        assert torch.equal(first, model[0].weight) and torch.equal(last, model[15].weight)
    # ... so the shards are not copies of each other (DTensor on CPU draws the same numbers on every rank)
    assert not torch.equal(results[0]["meta_memory"]["local_rows"], results[1]["meta_memory"]["local_rows"])
