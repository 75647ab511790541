"""The process group on CUDA paths, shown on CPU: a group the script started itself, and the exit teardown.

No GPU here: ``torch.cuda`` and the group's backend are monkeypatched where the CUDA path needs them; the
real NCCL runs are in tests/gpu/test_cuda_ranks.py.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _launch import free_port

from torchacc.distributed import env

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def user_group(tmp_path, monkeypatch):
    """A world-of-one group started by the "script" itself, and a fake node of 2 GPUs with this process on GPU 0."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: chosen[-1] if chosen else 0)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    yield chosen
    dist.destroy_process_group()


def test_a_group_the_script_started_still_gets_the_local_rank_device(user_group, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert env.init_distributed()
    assert user_group == [1], "the rank must compute on cuda:LOCAL_RANK, not on GPU 0"
    assert env.init_distributed() and user_group == [1], "set once, not again on every collective"


def test_a_local_rank_beyond_the_node_is_refused_with_a_user_group(user_group, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ValueError, match=r"LOCAL_RANK=2 but this node has 2 CUDA device\(s\)"):
        env.init_distributed()


@pytest.mark.parametrize("config", ["cuda:nccl"])
def test_a_group_without_a_cpu_backend_is_refused_naming_the_fix(user_group, monkeypatch, config):
    # what init_process_group("nccl") (or init_process_group() on a GPU machine) records in torch 2.13
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    with pytest.raises(ValueError, match=r"backend 'cuda:nccl'.*init_process_group\(\"cpu:gloo,cuda:nccl\"\)") as info:
        env.init_distributed()
    assert "no backend for CPU tensors" in str(info.value)
    assert user_group == [1], "the device is set before the refusal"


def test_a_real_group_without_a_cpu_backend_is_refused(tmp_path):
    # a group with a backend for CUDA tensors only, as NCCL alone starts it; gloo can stand in on this machine
    dist.init_process_group("cuda:gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    with pytest.raises(ValueError, match=r"backend 'cuda:gloo', which has no backend for CPU tensors"):
        env.init_distributed()


@pytest.mark.parametrize("config", ["cpu:gloo,cuda:nccl", "cpu:gloo,cuda:gloo", "cuda:nccl,cpu:gloo"])
def test_groups_with_a_cpu_backend_are_adopted(user_group, monkeypatch, config):
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    assert env.init_distributed()


_EXIT_SCRIPT = """
import sys
import torch.distributed as dist
from torchacc.distributed import env

real_destroy = dist.destroy_process_group


def spy(*args, **kwargs):
    print("destroy_process_group called", flush=True)
    real_destroy(*args, **kwargs)


dist.destroy_process_group = spy
assert env.init_distributed(timeout=60)
if sys.argv[1] == "raise":
    raise RuntimeError("this rank fails")
print("finished", flush=True)
"""


def test_the_exit_teardown_skips_a_rank_dying_of_an_exception(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_EXIT_SCRIPT)
    procs = {}
    for how in ("clean", "raise"):
        environ = {
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
        }
        procs[how] = subprocess.Popen(
            [sys.executable, str(script), how], env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    out = {how: (proc.communicate(timeout=120), proc.returncode) for how, proc in procs.items()}
    (clean_out, clean_err), clean_code = out["clean"]
    assert clean_code == 0 and "finished" in clean_out, clean_err
    assert "destroy_process_group called" in clean_out, "a clean exit destroys the group"
    (stdout, stderr), code = out["raise"]
    assert "RuntimeError: this rank fails" in stderr and code == 1, stderr
    assert "destroy_process_group called" not in stdout, "a dying rank must not wait in the teardown"
