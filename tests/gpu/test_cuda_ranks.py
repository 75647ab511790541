"""The CUDA/NCCL path on several GPUs: what a first GPU run must show. Each test names the GPUs it needs and is
skipped without them.

One launch per suite (tests/_launch.py gives rank r the device cuda:LOCAL_RANK); the references run here, in the
pytest process, on the CPU. A scenario that raised on the GPUs fails its own test with the rank's traceback.
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _gpus import needs_gpus
from _launch import launch
from _models import tiny_gpt2, tiny_llama, token_dataset
from _parity import assert_parity
from torch.distributed.tensor import Shard

TESTS = Path(__file__).resolve().parents[1]
SCENARIOS = str(Path(__file__).with_name("cuda_scenarios.py"))
ATOL, RTOL = 1e-5, 1e-4


def ok(results: list[dict], name: str) -> list:
    """Every rank's result of scenario ``name``; fails with the first rank's traceback if it raised there."""
    for rank, result in enumerate(results):
        entry = result[name]
        if isinstance(entry, dict) and set(entry) == {"error"}:
            pytest.fail(f"scenario {name!r} raised on rank {rank}:\n{entry['error']}")
    return [result[name] for result in results]


def assert_states_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


@pytest.fixture(scope="module")
def two_gpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_gpus")
    torch.save({"model": tiny_gpt2(seed=7).state_dict()}, out / "reference.pth")
    return launch(f"{SCENARIOS}:two_gpu_suite", 2, out / "logs", args=(out,), timeout=900)


# --- devices and backends ------------------------------------------------------------------------------------


@needs_gpus(2)
def test_each_rank_computes_on_its_own_gpu_with_nccl_and_gloo(two_gpus):
    for rank, result in enumerate(ok(two_gpus, "devices")):
        device = f"cuda:{rank}"
        assert result["rank"] == result["local_rank"] == result["current_device"] == rank
        assert result["device"] == result["model_device"] == result["param_local"] == device
        assert result["batch"] == result["loss"] == device and result["mesh_device_type"] == "cuda"
        for backend in (result["backend"], result["mesh_backend"]):
            assert "cpu:gloo" in backend and "cuda:nccl" in backend, backend
        assert result["reduce"] == 1.5 and result["broadcast"] == {"from": 1}


@needs_gpus(2)
def test_nccl_fsdp_matches_single_process(two_gpus):
    results = ok(two_gpus, "fsdp")
    assert all(r["param_devices"] == r["grad_devices"] == r["optimizer_devices"] == ["cuda"] for r in results)
    assert_parity(results)


# --- CPU offload -------------------------------------------------------------------------------------------


@needs_gpus(2)
def test_cpu_offload_keeps_shards_gradients_and_state_in_cpu_memory_and_matches_single_process(two_gpus):
    results = ok(two_gpus, "offload")
    assert all(r["param_devices"] == r["grad_devices"] == r["optimizer_devices"] == ["cpu"] for r in results)
    assert_parity(results)


@needs_gpus(2)
def test_clipping_under_cpu_offload_sees_the_same_global_norm(two_gpus):
    plain, offload = ok(two_gpus, "clip"), ok(two_gpus, "clip_offload")
    for rank in range(2):
        assert offload[rank]["grad_devices"] == ["cpu"], "the norm was taken over CPU gradients (gloo)"
        assert min(plain[rank]["norms"]) > 0.05, "the test must actually clip"
        torch.testing.assert_close(
            torch.tensor(offload[rank]["norms"]), torch.tensor(plain[rank]["norms"]), atol=ATOL, rtol=RTOL
        )
        for key, value in plain[rank]["state"].items():
            torch.testing.assert_close(offload[rank]["state"][key], value, atol=ATOL, rtol=RTOL, msg=key)


@needs_gpus(2)
def test_meta_init_on_gpus_is_the_same_at_fsdp_1_and_2_and_under_offload(two_gpus):
    fsdp1, fsdp2, offload = ok(two_gpus, "meta_fsdp1"), ok(two_gpus, "meta_fsdp2"), ok(two_gpus, "meta_offload")
    for rank in range(2):
        assert fsdp2[rank]["param_devices"] == ["cuda"] and offload[rank]["param_devices"] == ["cpu"]
        assert_states_equal(fsdp2[rank]["state"], fsdp1[0]["state"])
        assert_states_equal(offload[rank]["state"], fsdp1[0]["state"])
    assert_states_equal(fsdp1[1]["state"], fsdp1[0]["state"])


@needs_gpus(2)
def test_init_from_under_cpu_offload_loads_the_checkpoint(two_gpus):
    model = tiny_gpt2(seed=7)
    with torch.no_grad():
        logits = model(input_ids=torch.arange(16).unsqueeze(0)).logits
    expected = model.state_dict()
    for result in ok(two_gpus, "init_from_offload"):
        assert result["param_devices"] == ["cpu"]
        assert_states_equal(result["state"], expected)
        torch.testing.assert_close(result["logits"], logits, atol=1e-4, rtol=1e-4)


@needs_gpus(2)
def test_strategy_optimizer_offload_round_trip_under_fsdp(two_gpus):
    for result in ok(two_gpus, "strategy_offload"):
        plain, moved = result["plain"], result["round_trip"]
        # CPUOffloadPolicy: DTensors on the CUDA mesh whose shards, and optimizer state, live in CPU memory
        assert moved["before"] == moved["offloaded"] == moved["loaded"] == [("cpu", "cuda")]
        assert moved["same_objects"], "state already in place is not moved or rebuilt"
        assert moved["first"] + moved["second"] == plain["first"] + plain["second"]
        assert_states_equal(moved["state"], plain["state"])


# --- precision and tensor parallelism ----------------------------------------------------------------------


@needs_gpus(2)
def test_fp16_fsdp_trains_in_fp16_and_follows_the_fp32_run(two_gpus):
    from _parity import reference_run

    results = ok(two_gpus, "fp16")
    assert all(r["inside"] == {"dtype": "torch.float16"} for r in results), "the FSDP policy computes in fp16"
    assert all(scale == 1024.0 for r in results for scale in r["scales"]), "no step was skipped for an overflow"
    ref_losses, ref_state = reference_run([r["indices"] for r in results])
    losses = torch.tensor([r["losses"] for r in results]).mean(dim=0)
    torch.testing.assert_close(losses, torch.tensor(ref_losses), atol=2e-2, rtol=1e-2)
    # Adam's steps are about lr in size whatever the gradient, so compare the updates, not the weights.
    start = tiny_gpt2(seed=0).state_dict()
    keys = [k for k, v in start.items() if v.is_floating_point()]
    ref_update = torch.cat([(ref_state[k] - start[k]).flatten() for k in keys])
    for result in results:
        update = torch.cat([(result["state"][k] - start[k]).flatten() for k in keys])
        assert torch.nn.functional.cosine_similarity(update, ref_update, dim=0) > 0.99
        assert 0.9 < update.norm() / ref_update.norm() < 1.1


@needs_gpus(2)
def test_tensor_parallel_on_two_gpus_matches_single_process(two_gpus):
    results = ok(two_gpus, "tp")
    assert results[0]["q_proj"] == [str(Shard(0))], "q_proj is split over the GPUs"
    assert results[0]["indices"] == results[1]["indices"], "the ranks of a TP group take the same batches"
    data, model = token_dataset(32), tiny_llama(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, norms = [], []
    for step_indices in results[0]["indices"]:
        ids = torch.stack([data[i]["input_ids"] for i in step_indices])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    for result in results:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), atol=5e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(norms), atol=5e-5, rtol=1e-5)
        for key, value in model.state_dict().items():
            torch.testing.assert_close(result["state"][key], value, atol=5e-5, rtol=0, msg=key)


# --- memory ------------------------------------------------------------------------------------------------


@needs_gpus(2)
def test_peak_memory_is_about_one_shard_of_the_model(two_gpus):
    for result in ok(two_gpus, "memory"):
        model, shard = result["model_bytes"], result["model_bytes"] / result["world_size"]
        # meta init allocates this rank's shards, plus one whole parameter at a time while it draws its values
        assert result["after_setup"] <= 1.05 * shard, result
        assert result["peak_setup"] <= 1.05 * shard + 2 * result["largest_param_bytes"], result
        # after a step: the shards of the parameters, their gradients and AdamW's two moments
        assert result["after_step"] <= 1.1 * 4 * shard, result
        assert result["peak_step"] < 0.8 * 4 * model, f"the unsharded step would hold 4x the model: {result}"


# --- checkpoints written by CUDA ranks, read without a GPU ----------------------------------------------------


@pytest.fixture(scope="module")
def saved_on_gpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("saved_on_gpus")
    return out, launch(f"{SCENARIOS}:save_on_gpus", 2, out / "logs", args=(out,), timeout=600)


def _without_gpus(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@needs_gpus(2)
def test_shards_saved_on_gpus_consolidate_on_a_machine_without_gpus(saved_on_gpus, tmp_path, monkeypatch):
    out, results = saved_on_gpus
    for path in (out / "shards").glob("rank-*"):
        shutil.copy(path, tmp_path / path.name)
    _without_gpus(monkeypatch)
    proc = subprocess.run(
        [sys.executable, "-m", "torchacc", "consolidate", "--ckpt-dir", str(tmp_path), "--type", "all", "--quiet"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert_states_equal(torch.load(tmp_path / "consolidated.pth", weights_only=True)["model"], results[0]["gathered"])
    optim = torch.load(tmp_path / "consolidated_optim.pth", weights_only=True)["optimizer"]
    for name, values in results[0]["full_optim"]["state"].items():
        for key, value in values.items():
            assert torch.equal(optim["state"][name][key], value.cpu()), (name, key)


@needs_gpus(2)
def test_a_dcp_checkpoint_saved_on_gpus_loads_on_a_machine_without_gpus(saved_on_gpus, monkeypatch):
    out, results = saved_on_gpus
    _without_gpus(monkeypatch)
    (loaded,) = launch(f"{SCENARIOS}:load_without_gpu", 1, out / "logs-cpu", args=(out,))
    assert loaded["cuda"] is False and loaded["extra"] == {"step": 3}
    assert_states_equal(loaded["state"], results[0]["gathered"])
    for name, values in results[0]["full_optim"]["state"].items():
        for key, value in values.items():
            assert torch.equal(loaded["optim"]["state"][name][key].cpu(), value.cpu()), (name, key)


# --- process groups the script starts, and a rank that fails ---------------------------------------------------


@needs_gpus(2)
def test_a_script_group_with_gloo_beside_nccl_is_adopted_on_the_local_rank_gpu(tmp_path):
    results = launch(f"{SCENARIOS}:user_group", 2, tmp_path, args=("cpu:gloo,cuda:nccl",))
    for rank, result in enumerate(results):
        assert result["current_device"] == rank, "torchacc moved the rank to cuda:LOCAL_RANK"
        assert result["train"]["device"] == f"cuda:{rank}"
    assert_parity([r["train"] for r in results])


@needs_gpus(2)
def test_a_script_group_of_nccl_alone_is_refused_naming_the_fix(tmp_path):
    results = launch(f"{SCENARIOS}:user_group", 2, tmp_path, args=("nccl",))
    for rank, result in enumerate(results):
        assert result["backend"] == "cuda:nccl", "what init_process_group('nccl') starts"
        assert 'init_process_group("cpu:gloo,cuda:nccl")' in result["error"], result
        assert result["current_device"] == rank, "the device is set before the refusal"


def _injected_at(output: str) -> float:
    match = re.search(r"injected failure at step 3 \(t=([0-9.]+)\)", output)
    assert match, f"the fault was never injected:\n{output[-3000:]}"
    return float(match.group(1))


@needs_gpus(2)
def test_a_rank_raising_under_nccl_ends_the_job_within_a_minute(tmp_path):
    sys.path.insert(0, str(TESTS / "reliability"))
    from _faults import run_torchrun

    # a timeout far longer than the bound: the job must end because torchrun sees the rank fail, not by timing out
    env = {"FAULT": "raise", "FAULT_RANK": "1", "FAULT_STEP": "3", "TIMEOUT": "600", "OUT": str(tmp_path)}
    code, ended, output = run_torchrun(TESTS / "reliability" / "fault_train.py", env, timeout=300)
    assert code != 0, output[-3000:]
    waited = ended - _injected_at(output)
    assert waited < 60, f"the job took {waited:.1f} s to end after the failure:\n{output[-3000:]}"
    assert not (tmp_path / "final.pt").exists()


# --- four GPUs ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def four_gpus(tmp_path_factory):
    return launch(f"{SCENARIOS}:four_gpu_suite", 4, tmp_path_factory.mktemp("four_gpus"), timeout=600)


@needs_gpus(4)
def test_hsdp_on_four_gpus_matches_single_process(four_gpus):
    results = ok(four_gpus, "hsdp")
    assert all(r["param_devices"] == ["cuda"] for r in results)
    assert_parity(results)


@needs_gpus(4)
def test_meta_init_under_hsdp_equals_fsdp_1(four_gpus):
    hsdp, fsdp1 = ok(four_gpus, "meta_hsdp"), ok(four_gpus, "meta_fsdp1")
    for result in hsdp + fsdp1:
        assert_states_equal(result["state"], fsdp1[0]["state"])


CP_SCENARIOS = str(Path(__file__).parents[1] / "multiproc" / "cp_scenarios.py")


@needs_gpus(2)
@pytest.mark.parametrize("method", ["ulysses", "ring"])
def test_context_parallel_on_cuda_matches_one_gpu(tmp_path, method):
    """dist.cp.size=2 on 2 GPUs (ring: torch's ring attention, CUDA only) against the same steps on one GPU."""
    results = launch(f"{CP_SCENARIOS}:cuda_cp2", 2, tmp_path, args=(method,))
    for result in results:
        assert result["attn"] == f"torchacc_{method}"
        reference = result["reference"]
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), atol=1e-4, rtol=0)
        for name, value in reference["state"].items():
            torch.testing.assert_close(result["state"][name], value, atol=1e-4, rtol=0, msg=name)
