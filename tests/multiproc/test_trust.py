"""Regression tests of the trust review on 2 ranks emulating 2 nodes (see trust_scenarios.py).

Meta-device init must not depend on the world size; torchacc.save must be safe with several writers
of one path and refuse one path given to every rank; defaultdicts save; init_from read by rank 0
alone, or into a model that is not on the meta device; per-rank extra in save_checkpoint.
"""

from pathlib import Path

import pytest
import torch
from _launch import launch
from _models import tiny_gpt2

SCENARIOS = str(Path(__file__).with_name("trust_scenarios.py"))


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    out = tmp_path_factory.mktemp("trust")
    return launch(f"{SCENARIOS}:two_node_suite", 2, out / "logs", args=(out,), local_world_size=1)


@pytest.fixture(scope="module")
def one_process_meta_init():
    import scenarios

    return scenarios.meta_init_state()


def assert_states_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


@pytest.mark.parametrize("model", ["gpt2", "tinynet", "llama_pad"])
def test_meta_init_does_not_depend_on_the_world_size(two_nodes, one_process_meta_init, model):
    if model == "llama_pad":  # what the sharded init must also do: its padding row is zeroed
        import scenarios

        assert not one_process_meta_init[model]["model.embed_tokens.weight"][scenarios.PAD_ROW].any()
    for result in two_nodes:
        assert_states_equal(result["meta_init"][model], one_process_meta_init[model])
    # and the shards are not copies of each other (DTensor on CPU would give every shard the same numbers)
    first = [r["meta_init"][f"{model}_local"]["first"] for r in two_nodes]
    assert first[0].numel() and not torch.equal(first[0], first[1])


def test_concurrent_writers_of_one_path_on_two_nodes_all_succeed(two_nodes):
    for result in two_nodes:
        saves = result["concurrent_saves"]
        assert saves["errors"] == [None] * 5
        assert saves["final_step"] == 4
        # a dead process's temporary of this host is removed; another host's (in flight) is never touched
        assert saves["leftovers"] == ["shared.pth.tmp-1@node9-0badc0de"]


def test_one_path_for_every_rank_is_refused_on_every_rank_before_writing(two_nodes):
    for result in two_nodes:
        same = result["same_path"]
        assert "ranks 0 and 1 would both write" in same["error"] and "give each rank its own file" in same["error"]
        assert not same["written"] and same["seconds"] < 5


def test_defaultdicts_and_optimizer_state_save_and_load(two_nodes):
    for result in two_nodes:
        saved = result["save_defaultdicts"]
        assert saved["saved"]["error"] is None
        assert torch.equal(saved["nested"]["b"]["c"]["d"], torch.zeros(1))
        assert saved["num_optim_states"] == 14  # TinyNet: 3 blocks of 4 parameters, and the head


def test_init_from_on_rank_zero_only_and_into_a_real_model(two_nodes):
    expected = tiny_gpt2(seed=11).state_dict()
    for result in two_nodes:
        for case in ("meta", "real"):
            loaded = result["init_from_rank0_only"][case]
            assert loaded["error"] is None, loaded["error"]
            assert_states_equal(loaded["value"], {k: v for k, v in expected.items() if k in loaded["value"]})


def test_each_rank_gets_its_own_extra_back(two_nodes):
    for rank, result in enumerate(two_nodes):
        extra = result["per_rank_extra"]
        assert extra["loaded"]["rank"] == rank and extra["loaded"]["note"] == f"from rank {rank}"
        assert torch.equal(extra["loaded"]["rng"], extra["saved"]["rng"])
    assert not torch.equal(
        two_nodes[0]["per_rank_extra"]["saved"]["rng"], two_nodes[1]["per_rank_extra"]["saved"]["rng"]
    )
