"""End-to-end: the examples run on 2 ranks (gloo) and as a plain process, without noise.

The main example runs under the real ``torchrun`` inside consolidate.sh, then the offline tools as the user's
shell runs them (test_multinode.py and tests/reliability run torchrun's agent too). The other examples run on
ranks forked from tests/_launch.py's pre-imported server with torchrun's environment, each running the script as
``__main__`` (see [Note: forked ranks]): what torchrun would add is its agent and each rank's imports, seconds of
CPU that the suite pays once.

Every run's output (stdout and stderr, every rank's) is checked for the warnings a wrong model config causes and
for progress bars drawn by more than one rank (see ``assert_quiet``).
"""

import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import _launch
from _launch import launch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_gpt2.py"
# Every example runs offline, one thread per rank (forked ranks keep the server's HF_HUB_OFFLINE, which
# huggingface_hub reads once, at import; these examples never call the Hub).
ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

# transformers' warnings for a model config that does not fit the model or the data: GPT2Config's default
# bos/eos (50256) outside a small vocabulary, a model whose loss transformers cannot tell from its class name,
# and a pad_token_id that occurs in unpadded input.
CONFIG_WARNINGS = (
    "must be `None` or an integer within the vocabulary",
    "loss_type=None",
    "recommend passing in an `attention_mask`",
)
# The first draw of a tqdm bar: "desc:   0%|   | 0/N [00:00<?, ?it/s]", or "desc: 0 examples [00:00, ? examples/s]"
# for a bar without a total. Each bar draws it once when it starts; a disabled bar draws nothing.
BAR_START = re.compile(
    r"(?:^|[\r\n])([^\r\n|:]+): +(?:0%\|[^|\r\n]*\| 0/\d+ \[00:00<\?, \?[\w ]*/s\]|0 [\w ]+ \[00:00, \?[\w ]*/s\])"
)


def assert_quiet(output: str) -> None:
    """No config warnings, and every progress bar started at most once: rank 0's, not one per rank."""
    warnings = [line for line in output.splitlines() if any(w in line for w in CONFIG_WARNINGS)]
    assert not warnings, "\n".join(warnings)
    repeated = {desc: n for desc, n in collections.Counter(BAR_START.findall(output)).items() if n > 1}
    assert not repeated, f"progress bars started more than once (one per rank?): {repeated}\n{output[-3000:]}"


def run(cmd: list[str], timeout: float = 300, **env_vars: str) -> str:
    """Run ``cmd`` from the repository root, offline; check it succeeds quietly (``assert_quiet``); return stdout."""
    env = {**os.environ, **ENV, **env_vars}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    assert_quiet(proc.stdout + proc.stderr)
    return proc.stdout


def run_ranks(script: Path, args: list[str], out: Path, *, nproc: int = 2) -> str:
    """Run ``script`` with ``args`` on ``nproc`` forked ranks, as ``torchrun --nproc_per_node=nproc`` would; check
    they succeed quietly (``assert_quiet`` over every rank's output) and that only rank 0 prints (the examples
    print on the global master alone); return rank 0's output."""
    launch(f"{_launch.__file__}:run_script", nproc, out, args=(str(script), json.dumps(args), json.dumps(ENV)))
    logs = [(out / f"rank{rank}.log").read_text() for rank in range(nproc)]
    assert_quiet("\n".join(logs))
    for rank, log in enumerate(logs[1:], start=1):
        printed = [line for line in log.splitlines() if re.match(r"(step |done at |loss |resumed |starting )", line)]
        assert not printed, f"rank {rank} printed what only rank 0 should:\n{printed}"
    return logs[0]


def final_losses(stdout: str) -> tuple[float, float, int]:
    match = re.search(r"loss ([\d.]+) -> ([\d.]+) after \d+ steps on (\d+) rank", stdout)
    assert match, f"no loss summary in:\n{stdout[-2000:]}"
    return float(match.group(1)), float(match.group(2)), int(match.group(3))


def test_gpt2_example_runs_as_one_process_without_torchrun(tmp_path):
    out = run([sys.executable, str(EXAMPLE), "--steps", "8", "--metrics_dir", str(tmp_path)])
    first, last, ranks = final_losses(out)
    assert ranks == 1
    assert last < first


def test_strategy_loop_trains_rotates_resumes_and_exports(tmp_path):
    script, args = ROOT / "examples" / "strategy_loop.py", ["--out", str(tmp_path), "--steps", "3"]
    first = run_ranks(script, args, tmp_path / "first")
    assert "starting from scratch" in first and "done at step 3" in first
    assert [line.split()[1] for line in first.splitlines() if line.startswith("step ")] == ["1", "2", "3"]
    assert "checkpoints: ['global_step2', 'global_step3', 'latest']" in first
    second = run_ranks(script, args, tmp_path / "second")
    assert "resumed from global_step3" in second and "done at step 6" in second
    # the metrics of both runs, the resumed one counting on from the optimizer's restored step
    assert f"metrics: {tmp_path / 'metrics' / 'metrics.jsonl'} (plot: torchacc plot {tmp_path / 'metrics'})" in second
    records = [json.loads(line) for line in (tmp_path / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in records if "val_loss" in r] == [1, 2, 3, 4, 5, 6]
    assert len({r["run_name"] for r in records}) == 2
    losses = [float(line.split()[3]) for line in (first + second).splitlines() if line.startswith("step ")]
    assert len(losses) == 6 and losses[-1] < losses[0]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf").config.n_layer == 2


# ---- the examples added for the docs: quick modes --------------------------------------------------


def test_yaml_config_is_the_default_run_of_train_gpt2():
    import torchacc

    default = torchacc.Config()  # what train_gpt2.py builds from its flags on 2 ranks
    default.dist.fsdp.size = 2
    default.dist.fsdp.wrap_layer_cls = {"GPT2Block"}
    default.metrics.every = 5
    default.metrics.sinks = {"console", "jsonl"}
    assert torchacc.Config.from_yaml(ROOT / "examples" / "train_gpt2.yaml") == default


def test_consolidate_sh_trains_from_yaml_consolidates_exports_and_generates(tmp_path):
    """The main example under torchrun (2 ranks, a cold datasets cache so that both ranks run map()), from its
    YAML with overrides, then the offline tools on its shards."""
    venv_bin = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        **ENV,
        "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
        "STEPS": "10",
        "OVERRIDES": "memory.gc=true dataloader.seed=3",
        "HF_DATASETS_CACHE": str(tmp_path / "datasets-cache"),
    }
    cmd = ["bash", str(ROOT / "examples" / "consolidate.sh"), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, f"exited {proc.returncode}:\n{out[-3000:]}\n{proc.stderr[-6000:]}"
    assert_quiet(out + proc.stderr)
    assert "gc: true" in out and "seed: 3" in out and "- GPT2Block" in out  # the YAML, then the overrides
    first, last, ranks = final_losses(out)
    assert ranks == 2 and last < first
    assert out.count(" after 10 steps on ") == 1  # the summary line: rank 0's only
    # a metrics line every 5 steps (the YAML's metrics.every), rank 0's only; where the records and their plot are
    assert [line.split(" | ")[0] for line in out.splitlines() if " | loss " in line] == ["step 5", "step 10"]
    metrics = tmp_path / "metrics"
    assert f"metrics: {metrics / 'metrics.jsonl'}" in out and f"plot: {metrics / 'metrics.png'}" in out
    assert len((metrics / "metrics.jsonl").read_text().splitlines()) == 2 and (metrics / "metrics.png").is_file()
    shards = tmp_path / "shards"
    assert {p.name for p in shards.glob("rank-*")} == {
        f"rank-{r}-of-2-{k}.pth" for r in (0, 1) for k in ("model", "optim")
    }
    assert (shards / "consolidated.pth").is_file() and (shards / "consolidated_optim.pth").is_file()
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert "generated: 'the" in out and f"logits match {shards / 'consolidated.pth'}" in out


def test_cnn_example_trains_with_fsdp_over_conv_blocks(tmp_path):
    out = run_ranks(ROOT / "examples" / "train_cnn.py", ["--steps", "8"], tmp_path)
    match = re.search(r"loss ([\d.]+) -> ([\d.]+), held-out accuracy (\d+)% after 8 steps on 2 rank", out)
    assert match, out[-2000:]
    first, last, accuracy = float(match.group(1)), float(match.group(2)), int(match.group(3))
    assert last < 0.7 * first and accuracy > 40
