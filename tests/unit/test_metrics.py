"""Metrics in one process: the config rules, what is counted, the record's arithmetic, the sinks, metrics off,
log_metrics/last_metrics and the CLI (``torchacc plot``, ``--version``). The 2-rank records and the TensorBoard
and W&B read-backs are in tests/multiproc/test_metrics_ranks.py."""

import functools
import gc
import json
import sys

import pytest
import torch
from _models import SEQ, TinyNet, tiny_gpt2, token_dataset
from torch.optim import optimizer as torch_optimizer
from torch.utils.data import DataLoader

import torchacc
from torchacc.cli import main
from torchacc.metrics import close_metrics
from torchacc.metrics.counting import count_tokens, peak_flops_of
from torchacc.metrics.record import make_record
from torchacc.metrics.sinks import Sinks, format_line
from torchacc.parallel.clip_grad import grad_norm


@pytest.fixture(autouse=True)
def _no_watched_models():
    close_metrics()
    yield
    close_metrics()


def _config(**metrics) -> torchacc.Config:
    config = torchacc.Config()
    for key, value in metrics.items():
        setattr(config.metrics, key, value)
    return config


def _lm_loader(num_samples: int = 8) -> DataLoader:
    data = [{"input_ids": s["input_ids"], "labels": s["labels"]} for s in token_dataset(num_samples)]
    return DataLoader(data, batch_size=2)


def _global_hooks() -> int:
    return len(torch_optimizer._global_optimizer_pre_hooks) + len(torch_optimizer._global_optimizer_post_hooks)


# ---- config ----


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("every", -1, r"metrics.every must be >= 0, got -1; use 0 to turn metrics off"),
        ("sinks", {"tb", "console"}, r"metrics.sinks=\{'console', 'tb'\} holds unknown sink\(s\) 'tb'; use any of "),
        ("peak_flops", 0.0, r"metrics.peak_flops must be None or a positive number of FLOP/s per device, got 0.0"),
        ("peak_flops", float("inf"), r"metrics.peak_flops must be None or a positive number"),
        ("dir", "", r"metrics.dir must name a directory"),
        ("run_name", "a/b", r"metrics.run_name='a/b' must be a non-empty name without path separators"),
        ("run_name", "", r"metrics.run_name='' must be a non-empty name"),
    ],
)
def test_metrics_config_errors_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        _config(**{"every": 1, field: value}).validate(1)


@pytest.mark.parametrize("sink", ["tensorboard", "wandb"])
def test_a_missing_sink_package_fails_at_accelerate_naming_the_extra(monkeypatch, sink):
    monkeypatch.setitem(sys.modules, sink, None)  # as if it were not installed
    message = (
        rf"metrics.sinks includes '{sink}', but the {sink} package is not installed; install it with "
        rf"pip install 'torchacc\[{sink}\]', or remove '{sink}' from metrics.sinks"
    )
    with pytest.raises(ValueError, match=message):
        torchacc.accelerate(TinyNet(), config=_config(every=10, sinks={"console", sink}))
    _config(every=0, sinks={sink}).validate(1)  # metrics off: nothing is opened, so nothing is needed


# ---- counting and the record's arithmetic ----


@pytest.mark.parametrize(
    "batch, expected",
    [
        ({"input_ids": torch.zeros(4, 16, dtype=torch.long)}, (64, 64 * 16)),
        (
            {
                "input_ids": torch.zeros(2, 8, dtype=torch.long),
                "attention_mask": torch.tensor([[1] * 8, [1] * 2 + [0] * 6]),
            },
            (10, 10 * 8),
        ),
        ((torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long)), (10, 50)),  # token ids first
        ([torch.randn(8, 3, 4, 4), torch.zeros(8, dtype=torch.long)], (8, 0)),  # images: samples
        ({"label": "no tensors"}, (0, 0)),
    ],
)
def test_count_tokens(batch, expected):
    assert count_tokens(batch) == expected


def test_peak_flops_by_device_name(monkeypatch):
    cuda = torch.device("cuda", 0)
    for name, flops in [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA B200", 2250e12),
        ("Tesla T4", None),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert peak_flops_of(cuda) == flops, name
    assert peak_flops_of(torch.device("cpu")) is None


def test_make_record_by_hand():
    # two ranks: the step's loss (rank 1 had none), tokens, tokens x seq, wait s, memory and capacity bytes
    rows = [[2.0, 1.0, 300.0, 300.0 * 10, 0.5, 100.0, 1000.0], [9.0, 0.0, 100.0, 100.0 * 10, 1.5, 400.0, 800.0]]
    record = make_record(
        rows,
        step=4,
        num_steps=2,
        seconds=4.0,
        num_ranks_per_batch=1,
        flops_per_token=60.0,
        attention_flops=12.0,
        peak_flops=1e3,
    )
    assert record == {
        "step": 4,
        "loss": 2.0,
        "tokens_per_second": 400 / 4.0,
        "tokens_per_second_per_device": 400 / 4.0 / 2,
        "step_seconds": 2.0,
        "data_wait_seconds": 1.5 / 2,  # the rank that waited most, per step
        "mfu": (60.0 * 400 + 12.0 * 4000) / (4.0 * 2 * 1e3),
        "memory_peak_bytes": 400,
        "memory_peak_fraction": 0.5,
    }
    tp = make_record(
        rows,
        step=4,
        num_steps=2,
        seconds=4.0,
        num_ranks_per_batch=2,
        flops_per_token=6.0,
        attention_flops=0.0,
        peak_flops=None,
    )
    assert tp["tokens_per_second"] == 200 / 4.0 and "mfu" not in tp  # a TP pair saw each batch twice


def test_console_line():
    record = {
        "step": 20, "loss": 2.34567, "tokens_per_second": 12345.6, "tokens_per_second_per_device": 6172.8,
        "step_seconds": 0.1234, "data_wait_seconds": 0.002, "mfu": 0.3123, "memory_peak_bytes": 3 * 2**30,
        "memory_peak_fraction": 0.04, "grad_norm": 1.23456, "lr": 3e-4, "val_loss": 2.5,
    }  # fmt: skip
    assert format_line(record) == (
        "step 20 | loss 2.3457 | 12,346 tok/s (6,173/device) | 0.123 s/step | data 0.002 s | mfu 31.2% | "
        "mem 3.00 GiB (4%) | grad_norm 1.235 | lr 0.0003 | val_loss 2.5"
    )


# ---- metrics off, and the hooks' lifetime ----


def test_metrics_off_installs_nothing():
    before = _global_hooks()
    model, loader = torchacc.accelerate(tiny_gpt2(), _lm_loader(), torchacc.Config())
    assert _global_hooks() == before
    hooks = [*model._forward_hooks.values(), *model._forward_pre_hooks.values()]
    assert not [h for h in hooks if getattr(h, "__module__", "").startswith("torchacc.metrics")]
    assert loader._observer is None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in loader:
        model(**batch).loss.backward()
        optimizer.step()
    assert torchacc.last_metrics() == {}


def test_hooks_live_as_long_as_a_watched_model():
    before = _global_hooks()
    model, loader = torchacc.accelerate(tiny_gpt2(), _lm_loader(), _config(every=1, sinks=set()))
    assert _global_hooks() == before + 2 and loader._observer is not None
    other = torchacc.accelerate(TinyNet(), config=torchacc.Config())  # metrics off: the first one keeps its hooks
    assert _global_hooks() == before + 2
    del model, loader, other
    gc.collect()
    assert _global_hooks() == before, "a freed model must take its hooks with it"


# ---- one process end to end: console, JSONL, log_metrics, last_metrics ----


def test_one_process_records_console_jsonl_and_user_values(tmp_path, capsys):
    config = _config(every=2, sinks={"console", "jsonl"}, dir=str(tmp_path), run_name="one")
    model, loader = torchacc.accelerate(tiny_gpt2(), _lm_loader(8), config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = []
    for step, batch in enumerate(loader, start=1):
        loss = model(**batch).loss
        loss.backward()
        norms.append(grad_norm(model.parameters()))
        if step == 3:
            torchacc.log_metrics({"val_loss": torch.tensor(2.5)})  # joins the next record
        optimizer.step()
        optimizer.zero_grad()
    torchacc.log_metrics({"eval_accuracy": 0.75}, step=10)  # a record of its own, now
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [2, 4, 10]
    assert "val_loss" not in lines[0] and lines[1]["val_loss"] == 2.5
    assert lines[2] == {"run_name": "one", "step": 10, "eval_accuracy": 0.75}
    last = torchacc.last_metrics()
    assert last == {k: v for k, v in lines[1].items() if k != "run_name"}
    assert last["grad_norm"] == norms[3] and last["lr"] == 0.1
    assert last["tokens_per_second"] * last["step_seconds"] * 2 == pytest.approx(2 * 2 * SEQ, rel=1e-9)
    assert "mfu" not in last  # no peak FLOP/s on a CPU unless metrics.peak_flops is given
    out = capsys.readouterr().out
    assert out.count("step 2 | loss ") == out.count("step 4 | loss ") == 1 and "step 10 | eval_accuracy 0.75" in out


def test_the_loss_is_the_one_backward_ran_through():
    """An evaluation in eval mode with gradients enabled (no backward) and one under no_grad give no training loss;
    with 2 accumulation steps the record's loss is the mean of the micro-batches' whose backward ran."""
    model, loader = torchacc.accelerate(tiny_gpt2(), _lm_loader(8), _config(every=1, sinks=set()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = list(loader)
    model.eval()
    model(**batches[3])  # evaluation, gradients enabled
    with torch.no_grad():
        model(**batches[2])
    model.train()
    losses = []
    for batch in batches[:2]:
        loss = model(**batch).loss
        (loss / 2).backward()
        losses.append(loss.item())
    optimizer.step()
    assert torchacc.last_metrics()["loss"] == pytest.approx(sum(losses) / 2, rel=1e-6)


def test_tokens_are_counted_before_the_loaders_transform():
    """Context parallelism's transform cuts each sequence to one chunk (padding odd lengths); the observer counts
    the whole sequences: their tokens (not the padding) and, for the attention FLOPs, their whole length."""
    from torchacc.data import shard_dataloader
    from torchacc.data.context import split_sequences

    mask = torch.ones(2, 15, dtype=torch.long)
    mask[1, 12:] = 0
    data = [{"input_ids": torch.arange(15), "attention_mask": m, "labels": torch.arange(15)} for m in mask]
    loader = shard_dataloader(
        DataLoader(data, batch_size=2),
        num_replicas=1,
        rank=0,
        device=torch.device("cpu"),
        transform=functools.partial(split_sequences, rank=1, size=2),
    )
    notes = []

    class Observer:
        def read(self, batch):
            return count_tokens(batch)

        def delivered(self, note, wait_seconds):
            notes.append(note)

    loader.observe(Observer())
    (batch,) = list(loader)
    assert batch["input_ids"].shape == (2, 8)  # this rank's chunk of the padded sequences
    assert notes == [(27, 27 * 15)]


@pytest.mark.parametrize("load", ["optimizer.load_state_dict", "torchacc.load_optim_state_dict"])
def test_a_resumed_optimizer_goes_on_counting_steps(load):
    def train(optimizer_state=None):
        model, loader = torchacc.accelerate(tiny_gpt2(), _lm_loader(4), _config(every=1, sinks=set()))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if optimizer_state is not None and load == "optimizer.load_state_dict":
            optimizer.load_state_dict(optimizer_state)
        elif optimizer_state is not None:  # torch's set_optimizer_state_dict: a zero-gradient step creates the state
            torchacc.load_optim_state_dict(model, optimizer, optimizer_state)
        for batch in loader:
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if load == "optimizer.load_state_dict":
            return optimizer.state_dict()
        return torchacc.optim_state_dict(model, optimizer)

    state = train()
    assert torchacc.last_metrics()["step"] == 2
    train(state)  # AdamW's restored step count is 2: the records go on at 3 and 4
    assert torchacc.last_metrics()["step"] == 4


def test_log_metrics_errors_and_metrics_off():
    torchacc.accelerate(TinyNet(), config=_config(every=1, sinks=set()))
    with pytest.raises(ValueError, match="log_metrics: 'loss' is a value torchacc records itself"):
        torchacc.log_metrics({"loss": 1.0})
    with pytest.raises(ValueError, match=r"log_metrics: x='a' is not a number"):
        torchacc.log_metrics({"x": "a"})
    with pytest.raises(ValueError, match=r"log_metrics: step must be None or an int >= 0, got -1"):
        torchacc.log_metrics({"x": 1}, step=-1)
    with pytest.raises(TypeError, match="log_metrics takes a dict"):
        torchacc.log_metrics([1.0])
    close_metrics()
    with pytest.warns(UserWarning, match=r"metrics are off \(metrics.every=0\), so the values are dropped"):
        torchacc.log_metrics({"x": 1.0})


def test_an_unwritable_metrics_dir_fails_at_accelerate(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(RuntimeError, match=r"opening the metrics sinks failed: .*check metrics.dir="):
        torchacc.accelerate(TinyNet(), config=_config(every=1, sinks={"jsonl"}, dir=str(tmp_path / "file" / "sub")))


def test_a_failing_sink_is_dropped_with_one_warning(tmp_path):
    sinks = Sinks({"jsonl"}, dir=str(tmp_path), run_name="r")
    sinks._open["jsonl"].close()  # every write fails from now on
    with pytest.warns(UserWarning, match="the jsonl sink failed .* and is dropped; training goes on"):
        sinks.write({"step": 1, "loss": 1.0})
    sinks.write({"step": 2, "loss": 1.0})
    assert sinks._open == {}


# ---- the CLI ----


def test_bare_torchacc_prints_the_usage_and_version(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: torchacc") and "consolidate" in out and "plot" in out
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out == f"torchacc {torchacc.__version__}\n"


def test_plot_writes_a_png_with_a_line_per_run(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="torchacc plot needs pip install 'torchacc[plot]'")
    records = [
        {
            "run_name": run,
            "step": step,
            "loss": 3.0 / step,
            "tokens_per_second": 100.0 * step,
            "memory_peak_bytes": 2**30,
        }
        for run in ("a", "b")
        for step in (1, 2, 3)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["plot", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'metrics.png'}\n"
    assert (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_errors_say_what_to_do(tmp_path, capsys, monkeypatch):
    assert main(["plot", str(tmp_path)]) == 1
    assert "metrics.jsonl does not exist: plot reads the JSONL sink; train with metrics.every > 0 and 'jsonl'" in (
        capsys.readouterr().err
    )
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "lo\n')
    assert main(["plot", str(tmp_path)]) == 1
    assert "metrics.jsonl:2 is not JSON" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    assert main(["plot", str(tmp_path)]) == 1
    assert "torchacc plot needs matplotlib: pip install 'torchacc[plot]'" in capsys.readouterr().err
