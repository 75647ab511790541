"""Pipeline parallelism must match one process on the same global batches (the parity oracle), and its
checkpoints must travel: PP 2 x FSDP 2 -> PP 2 x FSDP 2 (resume), FSDP 4, one process, and offline consolidation.

Two launches (2 and 4 ranks) run every scenario of pp_scenarios.py; the reference trains one unsharded model here
on the batches of the distinct data-parallel ranks (the stages of one pipeline share theirs).
"""

from pathlib import Path

import pytest
import torch
from _launch import launch
from _models import tiny_llama, token_dataset

import torchacc

SCENARIOS = str(Path(__file__).with_name("pp_scenarios.py"))
TOL = 5e-5


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("pp")


@pytest.fixture(scope="module")
def two(out):
    return launch(f"{SCENARIOS}:two_rank_suite", 2, out / "logs2", args=(str(out / "two"),))


@pytest.fixture(scope="module")
def four(out):
    return launch(f"{SCENARIOS}:four_rank_suite", 4, out / "logs4", args=(str(out / "four"),))


def _reference(kind: str, batches: list[list[list[int]]], *, steps: int | None = None) -> dict:
    from pp_scenarios import LR, MAX_NORM, NUM_LAYERS

    data, model = token_dataset(32), tiny_llama(seed=0, kind=kind, num_hidden_layers=NUM_LAYERS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms, states = [], [], []
    for step in range(steps or len(batches[0])):
        ids = torch.stack([data[i]["input_ids"] for rank_batches in batches for i in rank_batches[step]])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return {"losses": losses, "norms": norms, "state": states[-1], "states": states, "model": model}


def _assert_parity(results: list[dict], kind: str = "llama", num_stages: int = 2) -> dict:
    """Union of the ranks' stages equals the reference; each rank's loss and norm equal the reference's."""
    streams: dict[str, list[dict]] = {}
    for result in results:
        streams.setdefault(str(result["indices"]), []).append(result)
    data_ranks = [group[0] for group in streams.values()]
    seen = [i for r in data_ranks for step in r["indices"] for i in step]
    assert len(seen) == len(set(seen)), "data-parallel ranks must see disjoint samples"
    ref = _reference(kind, [r["indices"] for r in data_ranks])
    mean_losses = torch.tensor([r["losses"] for r in data_ranks]).mean(dim=0)
    torch.testing.assert_close(mean_losses, torch.tensor(ref["losses"]), atol=TOL, rtol=0)
    union: dict[str, torch.Tensor] = {}
    for result in results:
        # one global norm, over every stage's gradients (and their FSDP / TP shards)
        torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(ref["norms"]), atol=TOL, rtol=1e-5)
        union.update(result["state"])
    assert union.keys() == ref["state"].keys(), "the stages' state_dict keys are the plain model's, all of them"
    worst = max((union[k] - v).abs().max().item() for k, v in ref["state"].items())
    assert worst < TOL, worst
    return ref


def _stage_keys(results: list[dict]) -> list[set[str]]:
    return [set(r["state"]) for r in results]


def _meta_reference() -> dict[str, torch.Tensor]:
    """One process's meta init of the model that pp_scenarios.meta_init builds (rank 0's seed)."""
    from pp_scenarios import NUM_LAYERS
    from scenarios import full_state

    with torchacc.init_empty_weights():
        model = tiny_llama(seed=7, num_hidden_layers=NUM_LAYERS)
    return full_state(torchacc.accelerate(model))


@pytest.mark.parametrize(
    ("suite", "layout"),
    [("two", "meta_pp2_rank_seeds"), ("two", "meta_pp2_interleaved_rank_seeds"), ("four", "meta_pp2_fsdp2_rank_seeds")],
)
def test_meta_init_under_a_pipeline_equals_one_process(request, suite, layout):
    """A stage built on the meta device gets one process's values (seeded like rank 0), also when each rank was
    seeded differently: the stages' draws come in the whole model's order, not from the start of each stage."""
    reference = _meta_reference()
    union: dict[str, torch.Tensor] = {}
    for result in request.getfixturevalue(suite):
        for key, value in result[layout].items():
            assert torch.equal(value, reference[key]), (layout, key)
            union[key] = value
    assert union.keys() == reference.keys()


def test_init_from_fills_every_pipeline_stage_from_rank_zeros_reads(two):
    """Rank 0 reads the file for every stage (its own and the others'): each rank gets its stages' tensors."""
    from pp_scenarios import model_of

    expected = model_of("llama", seed=11).state_dict()
    union: dict[str, torch.Tensor] = {}
    for result in two:
        for key, value in result["init_from_pp2"].items():
            assert torch.equal(value, expected[key]), key
            union[key] = value
    assert union.keys() == expected.keys() and len(two[0]["init_from_pp2"]) < len(expected)


def test_pp2_1f1b_matches_one_process_and_each_stage_holds_its_part(two):
    results = [r["pp2_llama_1f1b"] for r in two]
    _assert_parity(results)
    first, last = _stage_keys(results)
    assert "model.embed_tokens.weight" in first and "lm_head.weight" in last and "model.norm.weight" in last
    assert {k for k in first if ".layers." in k} == {
        k for k in first if k.startswith(("model.layers.0.", "model.layers.1."))
    }
    assert not first & last, "no tensor lives on two stages"
    assert results[0]["mesh"] == ("pp", "dp", "fsdp")


def test_evaluation_returns_the_loss_everywhere_and_logits_on_the_last_stage(two):
    results = [r["pp2_llama_1f1b"] for r in two]
    assert results[0]["eval"]["loss"] == results[1]["eval"]["loss"]
    assert results[0]["eval"]["logits"] is None and tuple(results[1]["eval"]["logits"]) == (4, 16, 128)
    ref = _reference("llama", [results[0]["indices"]])
    data = token_dataset(32)
    ids = torch.stack([data[i]["input_ids"] for i in results[0]["indices"][-1]])
    with torch.no_grad():
        expected = ref["model"].eval()(input_ids=ids, labels=ids).loss.item()
    assert abs(results[0]["eval"]["loss"] - expected) < TOL


def test_pp2_gpipe_on_qwen2_matches_one_process(two):
    _assert_parity([r["pp2_qwen2_gpipe"] for r in two], kind="qwen2")


def test_pp2_interleaved_1f1b_matches_one_process(two):
    results = [r["pp2_llama_interleaved"] for r in two]
    _assert_parity(results)
    first, last = _stage_keys(results)  # rank 0 holds stages 0 and 2: blocks 0 and 2
    assert {k.split(".")[2] for k in first if ".layers." in k} == {"0", "2"}
    assert {k.split(".")[2] for k in last if ".layers." in k} == {"1", "3"}


def test_the_strategy_loop_runs_unchanged_with_accumulation_and_clipping(two):
    from pp_scenarios import LR, MAX_NORM, NUM_LAYERS

    data, model = token_dataset(32), tiny_llama(seed=0, num_hidden_layers=NUM_LAYERS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(2):
        for micro in range(2):
            ids = torch.stack([data[8 * step + 4 * micro + j]["input_ids"] for j in range(4)])
            loss = model(input_ids=ids, labels=ids).loss
            (loss / 2).backward()
            losses.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
    union = {}
    for result in two:
        run = result["strategy"]
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(losses), atol=TOL, rtol=0)
        torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(norms), atol=TOL, rtol=1e-5)
        union.update(run["state"])
    assert max((union[k] - v).abs().max().item() for k, v in model.state_dict().items()) < TOL
    assert two[0]["strategy"]["validation"] == two[1]["strategy"]["validation"]
    assert "does not work under dist.pp.size > 1, where each rank holds only its pipeline stages" in run["full"]


def test_pipeline_refusals_name_the_fix_on_every_rank(two):
    for result in two:
        errors = result["refusals"]
        assert "batch of 3 samples does not divide into dist.pp.microbatches=2" in errors["microbatches"]
        assert "needs batch['labels']" in errors["no_labels"]
        assert errors["training_forward"].startswith("RuntimeError: a pipelined model (dist.pp.size > 1) cannot")
        assert "torchacc.train_step(model, batch)" in errors["training_forward"]
        assert "loss_fn= does not combine with config.dist.pp.size > 1" in errors["strategy_loss_fn"]
        assert "micro_train_batch_size=3 does not divide into config.dist.pp.microbatches=2" in errors["strategy_micro"]


def test_pp2_x_fsdp2_matches_one_process(four):
    results = [r["pp2_fsdp2_llama_1f1b"] for r in four]
    _assert_parity(results)
    assert results[0]["mesh"] == ("pp", "dp", "fsdp")


def test_pp2_x_fsdp2_interleaved_on_qwen2_matches_one_process(four):
    _assert_parity([r["pp2_fsdp2_qwen2_interleaved"] for r in four], kind="qwen2")


def test_pp2_x_tp2_matches_one_process(four):
    results = [r["pp2_tp2_llama"] for r in four]
    _assert_parity(results)
    assert results[0]["mesh"] == ("pp", "dp", "fsdp", "tp")


def test_replicas_of_each_stage_match_one_process(four):
    results = [r["pp2_dp2_llama_gpipe"] for r in four]
    _assert_parity(results)
    assert len({str(r["indices"]) for r in results}) == 2, "two data ranks, each with its own batches"


def _union(results: list[dict], key: str) -> dict[str, torch.Tensor]:
    union: dict[str, torch.Tensor] = {}
    for result in results:
        union.update(result[key])
    return union


def test_a_pipeline_checkpoint_resumes_exactly(four):
    trained = [r["pp2_fsdp2_llama_1f1b"] for r in four]
    resumed = [r["resume_pp2_fsdp2"] for r in four]
    for before, after in zip(trained, resumed, strict=True):
        assert after["index"] == before["indices"][-1], "the loader continues where the checkpoint left it"
        assert after["loss"] == before["losses"][-1]
        for name, value in before["state"].items():
            assert torch.equal(after["state"][name], value), name


def test_a_pipeline_checkpoint_loads_and_resumes_at_fsdp4_and_in_one_process(four, out):
    trained = [r["pp2_fsdp2_llama_1f1b"] for r in four]
    saved, saved_optim = _union(trained, "saved"), _union(trained, "saved_optim")
    assert len(saved_optim) == 3 * len(saved)  # step, exp_avg, exp_avg_sq of every parameter
    straight = _union(trained, "state")  # after the third step
    third = sorted({i for r in trained for i in r["indices"][-1]})  # its global batch
    for result in four:
        loaded = result["resume_fsdp4"]
        assert loaded["loaded"].keys() == saved.keys()
        assert all(torch.equal(loaded["loaded"][k], v) for k, v in saved.items())
        assert loaded["optim"].keys() == saved_optim.keys()
        assert all(torch.equal(loaded["optim"][k], v) for k, v in saved_optim.items())
    # FSDP 4 resumes the loader on the same global batch, and its third step is the pipeline's
    assert sorted(i for r in four for i in r["resume_fsdp4"]["index"]) == third
    worst = max((four[0]["resume_fsdp4"]["state"][k] - v).abs().max().item() for k, v in straight.items())
    assert worst < TOL, worst
    from pp_scenarios import LR, MAX_NORM, model_of

    model = model_of("llama", seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    torchacc.load_checkpoint(out / "four" / "dcp", model=model, optimizer=optimizer)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    state = torchacc.optim_state_dict(model, optimizer)["state"]
    assert all(torch.equal(state[k.rpartition("/")[0]][k.rpartition("/")[2]], v) for k, v in saved_optim.items())
    # one process resumes too: the third step on the same global batch
    data = token_dataset(32)
    ids = torch.stack([data[i]["input_ids"] for i in third])
    model(input_ids=ids, labels=ids).loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optimizer.step()
    worst = max((model.state_dict()[k] - v).abs().max().item() for k, v in straight.items())
    assert worst < TOL, worst


def test_the_seed_per_rank_files_of_a_pipeline_consolidate_offline(four, out):
    trained = [r["pp2_fsdp2_llama_1f1b"] for r in four]
    saved, saved_optim = _union(trained, "saved"), _union(trained, "saved_optim")
    shards = out / "four" / "shards"
    model = torchacc.consolidate(str(shards / "rank-*-of-4-model.pth"))["model"]
    assert list(model) == list(tiny_llama(num_hidden_layers=4).state_dict()), "the plain model's keys, in order"
    assert all(torch.equal(model[k], v) for k, v in saved.items())
    optim = torchacc.consolidate(str(shards / "rank-*-of-4-optim.pth"), section="optimizer")["optimizer"]
    assert all(
        torch.equal(optim["state"][k.rpartition("/")[0]][k.rpartition("/")[2]], v) for k, v in saved_optim.items()
    )
    assert optim["param_groups"][0]["params"] == list(model)
    # resharded FSDP-style for 2 ranks, the files hold every tensor again (the stage groups are gone)
    torchacc.reshard_checkpoint(shards, out / "four" / "resharded", num_shards=2)
    again = torchacc.consolidate(str(out / "four" / "resharded" / "rank-*-of-2-model.pth"))["model"]
    assert all(torch.equal(again[k], v) for k, v in saved.items())


def test_a_moe_router_aux_loss_is_refused_under_pp(two):
    # found by the red team: the last stage's loss is the cross-entropy of the logits, so the routers'
    # load-balancing loss was dropped silently (4.82 against one process's 6.83)
    for result in two:
        assert "dist.pp: MixtralForCausalLM adds its routers' load-balancing loss" in result["moe_aux_loss"]["error"]


@pytest.fixture(scope="module")
def uneven(out):
    return launch(f"{SCENARIOS}:uneven_last_batch", 2, out / "logs_uneven")


def test_a_smaller_last_batch_trains_equal_to_one_process(uneven):
    # it failed inside the schedule ('Expected input batch_size (32) to match target batch_size (16)', the first
    # stage left waiting): torch's stages keep the shapes of their first step, so each batch shape now gets a
    # schedule of its own
    assert [result["error"] for result in uneven] == [None, None]
    assert uneven[0]["indices"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert uneven[0]["losses"] == uneven[1]["losses"]
    ref = _reference("llama", [uneven[0]["indices"]])  # one process on the same batches
    torch.testing.assert_close(torch.tensor(uneven[0]["losses"]), torch.tensor(ref["losses"]), atol=TOL, rtol=0)


def test_pp_with_cp_is_refused_at_accelerate(four):
    for result in four:
        assert result["pp2_cp2"] is not None, "accelerate() accepted PP 2 x CP 2"
        assert "dist.cp" in result["pp2_cp2"] and "dist.pp" in result["pp2_cp2"]
