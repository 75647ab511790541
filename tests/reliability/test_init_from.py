"""``dist.fsdp.init_from`` with checkpoints that do not fit the model, and with a read failing halfway.

A checkpoint of a bigger model must not load cut to its leading block, nor a smaller one fail with a size
error naming no key: every rank raises a ValueError naming the key, both shapes and dtypes and the file, before
any rank reads a tensor. A floating-point dtype may differ (converted). A read failing halfway on rank 0 (the one
that reads) is an error on every rank within seconds, not after ``dist.timeout``. One 2-rank launch runs every
case, where every rank sees the file and where only rank 0 does (see init_from_scenarios.py).
"""

from pathlib import Path

import pytest
import torch
from _launch import launch
from init_from_scenarios import MISFITS, TIMEOUT, write_checkpoints

import torchacc

SCENARIOS = str(Path(__file__).with_name("init_from_scenarios.py"))
QUICK = TIMEOUT / 2  # seconds; a rank left in a collective would wait the TIMEOUT (this machine may be busy)
MODES = ("shared", "rank0")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("init-from")
    return launch(f"{SCENARIOS}:suite", 2, out / "logs", args=(out,), timeout=240)


def expected_parts(name: str, index_files: dict[str, str]) -> list[str]:
    size, kind = name.split(".")
    vocab = {"bigger": 256, "smaller": 64}[size]
    file = {"pth": f"{size}.pth", "hf": f"{size}.hf/model.safetensors"}.get(kind, f"{size}.hf-index/")
    if kind == "hf-index":
        file += index_files[size]
    return [
        "transformer.wte.weight is ",
        f"[{vocab}, 64] float32 in ",
        file,
        "but [128, 64] float32 in the model",
        "1 more differ, next: lm_head.weight",
        "load a checkpoint of this model",
    ]


@pytest.mark.parametrize("kind", ["meta", "real"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", MISFITS)
def test_a_checkpoint_of_another_size_is_refused_on_every_rank_before_loading(ranks, name, mode, kind):
    results = [r[f"{mode}/{name}/{kind}"] for r in ranks]
    for result in results:
        assert result["type"] == "ValueError", result
        for part in expected_parts(name, ranks[0]["info"]["index_files"]):
            assert part in result["message"], (part, result["message"])
        assert result["reads"] == 0, "nothing is read before every shape was compared"
    assert results[0]["message"] == results[1]["message"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["bf16.pth", "bf16.hf"])
def test_a_bfloat16_checkpoint_loads_into_a_float32_model_converted(ranks, name, mode):
    expected = ranks[0]["info"]["bf16"]
    for result in (r[f"{mode}/{name}"] for r in ranks):
        assert result["type"] is None, result["message"]
        assert result["state"].keys() == expected.keys()
        for key, value in expected.items():
            assert result["state"][key].dtype == torch.float32 and torch.equal(result["state"][key], value), key


@pytest.mark.parametrize("mode", MODES)
def test_an_integer_tensor_for_a_float_one_is_refused(ranks, mode):
    for result in (r[f"{mode}/int.pth"] for r in ranks):
        assert result["type"] == "ValueError" and result["reads"] == 0
        assert "transformer.wpe.weight is [16, 64] int64 in " in result["message"]
        assert "int.pth but [16, 64] float32 in the model" in result["message"]


@pytest.mark.parametrize("mode", MODES)
def test_a_read_failing_halfway_raises_on_every_rank_quickly(ranks, mode):
    results = [r[f"{mode}/read-fails"] for r in ranks]
    reader = 0  # only rank 0 reads, in both modes
    for result in results:
        assert result["type"] == "ValueError", result
        assert f"rank {reader}: dist.fsdp.init_from=" in result["message"]
        assert "cannot be read" in result["message"] and "OSError: [Errno 5]" in result["message"]
        assert result["seconds"] < QUICK, f"a rank waited {result['seconds']:.1f} s for the one that failed"
    assert results[0]["message"] == results[1]["message"]
    assert results[reader]["reads"] == 4, "the fifth read failed"


def test_after_the_errors_the_job_goes_on(ranks):
    assert [r["all_reduce"] for r in ranks] == [2.0, 2.0], "no rank was left behind in a collective"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = tmp_path_factory.mktemp("init-from-one")
    return out, write_checkpoints(out)


@pytest.mark.parametrize("name", MISFITS)
def test_one_process_refuses_a_checkpoint_of_another_size(checkpoints, name):
    from _models import tiny_gpt2

    out, info = checkpoints
    config = torchacc.Config()
    config.dist.fsdp.init_from = str(out / name)
    model = tiny_gpt2(seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as raised:
        torchacc.accelerate(model, config=config)
    for part in expected_parts(name, info["index_files"]):
        assert part in str(raised.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "nothing was loaded"
