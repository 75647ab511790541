"""The ``torchacc consolidate`` CLI in every mode, and the Hugging Face export, on real 2-rank shards."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _models import tiny_gpt2

import torchacc
from torchacc.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchacc", *args], capture_output=True, text=True, timeout=120)


def test_cli_model_torch_via_python_m(saved, tmp_path):
    out, results = saved
    target = tmp_path / "model.pth"
    proc = run_cli("consolidate", "--ckpt-dir", str(out / "shards"), "--out", str(target), "--quiet")
    assert proc.returncode == 0, proc.stderr
    state = torch.load(target, weights_only=True)["model"]
    assert all(torch.equal(state[k], v) for k, v in results[0]["gathered"].items())


def test_cli_all_types_in_process(saved, tmp_path, capsys):
    out, results = saved
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for path in (out / "shards").glob("rank-*"):
        (ckpt / path.name).write_bytes(path.read_bytes())
    assert main(["consolidate", "--ckpt-dir", str(ckpt), "--type", "all", "--quiet"]) == 0
    assert (ckpt / "consolidated.pth").exists() and (ckpt / "consolidated_optim.pth").exists()
    optim = torch.load(ckpt / "consolidated_optim.pth", weights_only=True)["optimizer"]
    assert optim["param_groups"] == results[0]["full_optim"]["param_groups"]


def test_cli_optimizer_and_safetensors_and_reshard(saved, tmp_path):
    out, results = saved
    shards = str(out / "shards")
    assert main(["consolidate", "--ckpt-dir", shards, "--type", "optimizer", "--out", str(tmp_path / "o.pth")]) == 0
    assert main(["consolidate", "--ckpt-dir", shards, "--format", "safetensors", "--out", str(tmp_path / "m.st")]) == 0
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "m.st")["lm_head.weight"], results[0]["gathered"]["lm_head.weight"])
    assert main(["consolidate", "--ckpt-dir", shards, "--reshard", "3", "--out", str(tmp_path / "r3")]) == 0
    names = sorted(p.name for p in (tmp_path / "r3").iterdir())
    assert names == sorted(f"rank-{r}-of-3-{kind}.pth" for kind in ("model", "optim") for r in range(3))
    again = torchacc.consolidate(f"{tmp_path}/r3/rank-*-of-*-model.pth", return_state=True)["model"]
    assert all(torch.equal(again[k], v) for k, v in results[0]["gathered"].items())


def test_cli_hf_export_loads_with_transformers(saved, tmp_path):
    out, results = saved
    cfg = tiny_gpt2().config
    cfg.save_pretrained(tmp_path / "cfg")
    target = tmp_path / "hf"
    shards = str(out / "shards")
    assert (
        main(
            [
                "consolidate",
                "--ckpt-dir",
                shards,
                "--format",
                "hf",
                "--hf-config",
                str(tmp_path / "cfg"),
                "--out",
                str(target),
                "--quiet",
            ]
        )
        == 0
    )
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(target)
    reference = tiny_gpt2()
    reference.load_state_dict({k: v for k, v in results[0]["gathered"].items() if k != "transformer.marker"})
    ids = torch.arange(8).unsqueeze(0)
    torch.testing.assert_close(loaded(ids).logits, reference(ids).logits, rtol=0, atol=0)


def test_export_hf_splits_into_indexed_shards(saved, tmp_path):
    out, results = saved
    state = {k: v for k, v in results[0]["gathered"].items() if k != "transformer.marker"}
    target = torchacc.export_hf(state, tmp_path / "hf", tiny_gpt2(), max_shard_size="20KB")
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 2
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(target)
    assert torch.equal(loaded.lm_head.weight, state["lm_head.weight"])


def test_export_hf_from_the_native_checkpoint(saved, tmp_path):
    out, results = saved
    target = torchacc.export_hf(out / "dcp" / "checkpoint-1", tmp_path / "hf", tiny_gpt2())
    from safetensors.torch import load_file

    weights = load_file(f"{target}/model.safetensors")
    assert torch.equal(
        weights["transformer.h.0.attn.c_attn.weight"], results[0]["gathered"]["transformer.h.0.attn.c_attn.weight"]
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["consolidate", "--ckpt-dir", "/nonexistent"], "--ckpt-dir '/nonexistent' is not a directory"),
        (["consolidate", "--ckpt-dir", ".", "--type", "optimizer", "--format", "hf"], "holds model weights only"),
        (["consolidate", "--ckpt-dir", ".", "--reshard", "2", "--format", "hf"], "--reshard writes torch rank files"),
        (["consolidate", "--ckpt-dir", ".", "--type", "all", "--out", "x"], "--type all uses the default patterns"),
        (["consolidate"], "the following arguments are required: --ckpt-dir"),
        (["consolidate", "--ckpt-dir", ".", "--type", "weights"], "invalid choice: 'weights'"),
    ],
)
def test_cli_errors_are_one_line_and_exit_1(args, message, capsys):
    try:
        code = main(args)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    stderr = capsys.readouterr().err
    assert code == 1
    assert stderr.count("\n") == 1 and stderr.startswith("torchacc: error: ") and message in stderr


def test_console_script_reports_a_broken_shard_set_in_one_line(tmp_path):
    script = Path(sys.executable).with_name("torchacc")
    proc = subprocess.run([str(script), "consolidate", "--ckpt-dir", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 1 and "no checkpoint files match" in proc.stderr and proc.stderr.count("\n") == 1


# ---- --format hf without what it needs: one line that says how to fix it --------------------------------


def one_line_error(capsys) -> str:
    stderr = capsys.readouterr().err
    assert stderr.count("\n") == 1 and stderr.startswith("torchacc: error: "), stderr
    return stderr


def test_cli_hf_without_a_config_names_hf_config_and_save_pretrained(saved, tmp_path, capsys):
    out, _ = saved
    shards = out / "shards"  # the model's shards, without a config.json beside them
    assert not (shards / "config.json").exists()
    args = ["consolidate", "--ckpt-dir", str(shards), "--format", "hf", "--out", str(tmp_path / "hf"), "--quiet"]
    assert main(args) == 1
    stderr = one_line_error(capsys)
    assert f"no config.json in --ckpt-dir {str(shards)!r}" in stderr
    assert "--hf-config" in stderr and "model.config.save_pretrained(" in stderr and "--save_dir" in stderr
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("given", ["missing", "empty-dir"])
def test_cli_hf_config_that_holds_no_config_is_named(saved, tmp_path, capsys, given):
    out, _ = saved
    config = tmp_path / given
    if given == "empty-dir":
        config.mkdir()
    args = ["consolidate", "--ckpt-dir", str(out / "shards"), "--format", "hf", "--hf-config", str(config)]
    assert main([*args, "--out", str(tmp_path / "hf"), "--quiet"]) == 1
    stderr = one_line_error(capsys)
    assert repr(str(config)) in stderr and "config.json" in stderr and "save_pretrained" in stderr
    assert not (tmp_path / "hf").exists()


def test_cli_hf_without_transformers_says_what_to_install(saved, tmp_path, capsys, monkeypatch):
    out, _ = saved
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails
    args = ["consolidate", "--ckpt-dir", str(out / "shards"), "--format", "hf", "--out", str(tmp_path / "hf")]
    assert main(args) == 1
    stderr = one_line_error(capsys)
    assert "--format hf needs transformers" in stderr and "pip install 'torchacc[hf]'" in stderr
    assert not (tmp_path / "hf").exists()


def test_export_hf_without_a_config_or_transformers_raises_with_the_fix(saved, tmp_path, monkeypatch):
    out, _ = saved
    shards = out / "shards"
    with pytest.raises(ValueError, match=r"no config\.json in .*model\.config\.save_pretrained\("):
        torchacc.export_hf(shards, tmp_path / "hf", shards)
    with pytest.raises(ValueError, match=r"config_or_model='[^']*missing' does not exist"):
        torchacc.export_hf(shards, tmp_path / "hf", tmp_path / "missing")
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"export_hf needs transformers.*pip install 'torchacc\[hf\]'"):
        torchacc.export_hf(shards, tmp_path / "hf", shards)
    assert not (tmp_path / "hf").exists()


# ---- a save_checkpoint folder, in every format (issue 24 item 5) ----------------------------------------------


@pytest.mark.parametrize("fmt", ["torch", "safetensors", "hf"])
def test_cli_reads_a_save_checkpoint_root_in_every_format(saved, tmp_path, fmt):
    out, results = saved
    gathered = results[0]["gathered"]
    target = tmp_path / "out"
    args = ["consolidate", "--ckpt-dir", str(out / "dcp"), "--format", fmt, "--out", str(target), "--quiet"]
    if fmt == "hf":
        tiny_gpt2().config.save_pretrained(tmp_path / "cfg")
        args += ["--hf-config", str(tmp_path / "cfg")]
    assert main(args) == 0
    if fmt == "torch":
        state = torch.load(target, weights_only=True)["model"]
    elif fmt == "safetensors":
        from safetensors.torch import load_file

        state = load_file(target)
    else:
        from transformers import AutoModelForCausalLM

        state = {
            **AutoModelForCausalLM.from_pretrained(target).state_dict(),
            "transformer.marker": gathered["transformer.marker"],
        }
    assert state.keys() == gathered.keys()
    assert all(torch.equal(state[k], v) for k, v in gathered.items())


def test_cli_consolidates_the_optimizer_of_a_save_checkpoint(saved, tmp_path):
    out, results = saved
    target = tmp_path / "optim.pth"
    checkpoint = out / "dcp" / "checkpoint-1"
    assert main(["consolidate", "--ckpt-dir", str(checkpoint), "--type", "optimizer", "--out", str(target)]) == 0
    optim, expected = torch.load(target, weights_only=True)["optimizer"], results[0]["full_optim"]
    assert optim["param_groups"] == expected["param_groups"]
    for name, values in expected["state"].items():
        assert all(torch.equal(optim["state"][name][k], v) for k, v in values.items()), name


def test_cli_names_what_a_folder_of_neither_kind_holds(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert main(["consolidate", "--ckpt-dir", str(tmp_path), "--format", "safetensors"]) == 1
    stderr = one_line_error(capsys)
    assert "is no save_checkpoint checkpoint either" in stderr and "it holds notes.txt" in stderr
