"""Metrics records on 2 ranks against a hand computation, and every sink read back with its own reader.

One launch runs every scenario of metrics_scenarios.py: FSDP with every sink, TP (the ranks of a TP group
count their shared batches once), FSDP2Strategy with gradient accumulation, and PP 2 and CP 2 through
``train_step`` and through the strategy. HSDP, FSDP 2 x TP 2 and PP 2 x FSDP 2 run in the shared 4-rank launch
(``four_ranks``, conftest.py). The gradient norms are checked against the norm of the gathered gradients.
"""

import json
import os
import struct
from pathlib import Path

import pytest
from _launch import launch
from _models import SEQ, tiny_gpt2

SCENARIOS = str(Path(__file__).with_name("metrics_scenarios.py"))
REL = 1e-9


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    pytest.importorskip("tensorboard", reason="the tensorboard sink needs pip install 'torchacc[tensorboard]'")
    pytest.importorskip("wandb", reason="the wandb sink needs pip install 'torchacc[wandb]'")
    out = tmp_path_factory.mktemp("metrics")
    results = launch(f"{SCENARIOS}:suite", 2, out / "logs", args=(out / "run",))
    return out, results


def _close(a: float, b: float, rel: float = REL) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


def test_fsdp_records_match_a_hand_computation(ranks):
    from metrics_scenarios import EVERY

    _, results = ranks
    seen = [r["fsdp"] for r in results]
    records = seen[0]["records"]
    assert [r["step"] for r in records] == [3, 6]
    num_params = sum(p.numel() for p in tiny_gpt2().parameters())  # GPT-2 ties lm_head to wte: counted once
    for index, record in enumerate(records):
        steps = range(index * EVERY, (index + 1) * EVERY)
        last = steps[-1]
        # loss: the logged step's, averaged over the data-parallel ranks
        assert _close(record["loss"], sum(s["losses"][last] for s in seen) / 2, 1e-6)
        # tokens: the attention masks' ones, of both ranks, since the previous record
        tokens = sum(s["tokens"][i] for s in seen for i in steps)
        seconds = record["step_seconds"] * EVERY
        assert _close(record["tokens_per_second"] * seconds, tokens)
        assert _close(record["tokens_per_second_per_device"], record["tokens_per_second"] / 2)
        # MFU: 6 N per token, plus 12 L d T per token for attention (L = 2 layers of width 64), over 2 x 1e12 FLOP/s
        flops = 6 * num_params * tokens + 12 * 2 * 64 * SEQ * tokens
        assert _close(record["mfu"], flops / (seconds * 2 * 1e12))
        # step 3: the clip's return; step 6: computed by the recorder, against the gathered gradients' norm
        assert _close(record["grad_norm"], seen[0]["norms"][last + 1], 1e-12)
        if last + 1 == 3:
            assert record["grad_norm"] == seen[0]["norms"][3]
        assert record["lr"] == seen[0]["lrs"][last] == 1e-3 * 0.5**last
        assert 0 <= record["data_wait_seconds"] < record["step_seconds"]
        assert 0 < record["memory_peak_bytes"] <= max(s["maxrss"] for s in seen)
        assert _close(record["memory_peak_fraction"], record["memory_peak_bytes"] / os.sysconf("SC_PHYS_PAGES") / 4096)
        assert record["rank_value"] == 0.0
    for key in ("step", "loss", "grad_norm", "lr", "memory_peak_bytes"):  # the same on every rank (not the clocks)
        assert [r[key] for r in seen[1]["records"]] == [r[key] for r in records]
    assert seen[1]["records"][0]["rank_value"] == 1.0  # each rank's own log_metrics values


def test_the_records_keys_are_the_documented_ones(ranks):
    from torchacc.metrics import KEYS

    _, results = ranks
    assert list(results[0]["fsdp"]["records"][0]) == [*KEYS, "rank_value"]


def test_jsonl_and_console(ranks):
    out, results = ranks
    lines = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    records = results[0]["fsdp"]["records"]
    assert lines[:2] == [{"run_name": "fsdp-test", **r} for r in records]
    assert lines[2] == {"run_name": "fsdp-test", "step": 6, "eval_loss": 1.25}
    rank0, rank1 = ((out / "logs" / f"rank{r}.log").read_text() for r in (0, 1))
    assert rank0.count("step 3 | loss ") == 1 and rank0.count("step 6 | loss ") == 1
    assert "step 6 | eval_loss 1.25" in rank0
    assert "| loss " not in rank1, "only rank 0 writes"


def test_tensorboard_event_file_read_back_by_tensorboard(ranks):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, results = ranks
    events = EventAccumulator(str(out / "run" / "tensorboard" / "fsdp-test"))
    events.Reload()
    records = results[0]["fsdp"]["records"]
    assert sorted(events.Tags()["scalars"]) == sorted({k for r in records for k in r if k != "step"} | {"eval_loss"})
    for key in records[0]:
        if key != "step":
            scalars = [(e.step, e.value) for e in events.Scalars(key)]
            assert [s for s, _ in scalars] == [3, 6]
            assert all(_close(v, r[key], 1e-6) for (_, v), r in zip(scalars, records, strict=True))  # float32


def _wandb_history(run_dir: Path) -> list[dict]:
    """The history rows of an offline W&B run: its .wandb file is a LevelDB-style log of protobuf records
    (wandb's own schema, wandb.proto.wandb_internal_pb2.Record) after a 7-byte header."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, chunks, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:  # full
            chunks.append(chunk)
        elif kind in (2, 3):  # first, middle
            pending = (pending if kind == 3 else b"") + chunk
        elif kind == 4:  # last
            chunks.append(pending + chunk)
    rows = []
    for chunk in chunks:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows


def test_wandb_offline_run_read_back(ranks):
    out, results = ranks
    (run_dir,) = (out / "run" / "wandb").glob("offline-run-*")
    rows = _wandb_history(run_dir)
    records = results[0]["fsdp"]["records"]
    assert [row["_step"] for row in rows] == [3, 6]  # eval_loss shares step 6 with the second record
    for row, record in zip(rows, records, strict=True):
        assert {k: row[k] for k in record if k != "step"} == {k: v for k, v in record.items() if k != "step"}
    assert rows[1]["eval_loss"] == 1.25


def test_tp_group_counts_its_batch_once(ranks):
    _, results = ranks
    seen = [r["tp"] for r in results]
    record = seen[0]["record"]
    assert record["step"] == 2
    # one data-parallel rank: 2 steps of one batch of 2 x SEQ tokens, not twice that
    assert _close(record["tokens_per_second"] * record["step_seconds"] * 2, 2 * 2 * SEQ)
    assert _close(record["tokens_per_second_per_device"], record["tokens_per_second"] / 2)
    assert seen[0]["losses"] == seen[1]["losses"]
    assert _close(record["loss"], seen[0]["losses"][-1], 1e-6)
    assert _close(record["grad_norm"], seen[0]["norms"][-1], 1e-12)
    assert "mfu" not in record  # no peak FLOP/s known for a CPU


def test_strategy_records_follow_its_steps_and_clip(ranks):
    _, results = ranks
    seen = [r["strategy"] for r in results]
    accumulation = seen[0]["accumulation_steps"]
    assert accumulation == 2 and seen[0]["steps"] == [1, 2, 3, 4]
    records = seen[0]["records"]
    assert [r["step"] for r in records] == [2, 4]
    for index, record in enumerate(records):
        step = 2 * (index + 1)
        assert record["grad_norm"] == seen[0]["norms"][step - 1]  # the norm optimizer_step clipped with
        micro = [s["losses"][i] for s in seen for i in range((step - 1) * accumulation, step * accumulation)]
        assert _close(record["loss"], sum(micro) / len(micro), 1e-6)  # mean over micro-batches and ranks
        # 2 ranks x 2 micro-batches x 2 samples x SEQ tokens per step, 2 steps per record
        assert _close(record["tokens_per_second"] * record["step_seconds"] * 2, 2 * 2 * 2 * 2 * SEQ)


def test_hsdp_norm_sums_shards_not_replicas(four_ranks):
    seen = [r["metrics"] for r in four_ranks]
    record = seen[0]["record"]
    assert record["step"] == 2
    assert _close(record["grad_norm"], seen[0]["norms"][-1], 1e-12)
    assert _close(record["loss"], sum(s["losses"][-1] for s in seen) / 4, 1e-6)
    assert _close(record["tokens_per_second"] * record["step_seconds"] * 2, 4 * 2 * 2 * SEQ)  # 4 data ranks


# Under PP, CP, FSDP x TP and PP x FSDP each value is a test of its own (VALUES), checked against a hand
# computation from what each rank saw; "rest" holds the keys, step, lr, memory, data wait and the agreement of
# the ranks.
VALUES = ("loss", "tokens_per_second", "mfu", "grad_norm", "rest")


def _check_value(
    value: str, record: dict, seen: list[dict], batches: range, *, step: int, loss, grad_norm: float, lr: float
) -> None:
    """One value of ``record`` (optimizer step ``step``, over the batches ``batches`` since the previous record,
    2 optimizer steps) against the hand computation: ``loss(seen_of_a_rank)``, the logged step's loss, averaged
    over the data-parallel ranks; the tokens and the attention's token positions of each data-parallel rank's
    whole sequences, counted once; 6 x the whole model's parameters per token; ``grad_norm``, the norm of the
    gathered gradients of all stages (or the clip's own return)."""
    from torchacc.metrics import KEYS

    data_ranks = list({s["data_rank"]: s for s in seen}.values())  # one rank per data-parallel rank
    assert len(data_ranks) == seen[0]["num_data_ranks"]
    tokens = sum(s["tokens"][i] for s in data_ranks for i in batches)
    positions = sum(s["positions"][i] for s in data_ranks for i in batches)
    seconds = record["step_seconds"] * 2  # every record here is of 2 optimizer steps
    if value == "loss":
        assert "loss" in record, record
        assert _close(record["loss"], sum(loss(s) for s in data_ranks) / len(data_ranks), 1e-6)
    elif value == "tokens_per_second":
        assert _close(record["tokens_per_second"] * seconds, tokens)
        assert _close(record["tokens_per_second_per_device"], record["tokens_per_second"] / len(seen))
    elif value == "mfu":
        layers, width = seen[0]["shape"]
        flops = 6 * seen[0]["num_params"] * tokens + 12 * layers * width * positions
        assert _close(record["mfu"], flops / (seconds * len(seen) * 1e12))
    elif value == "grad_norm":
        assert _close(record["grad_norm"], grad_norm, 1e-12)
    else:
        assert list(record) == list(KEYS), f"missing: {set(KEYS) - set(record)}"
        assert record["step"] == step and record["lr"] == lr
        assert 0 <= record["data_wait_seconds"] < record["step_seconds"]
        assert record["memory_peak_bytes"] > 0
        fraction = record["memory_peak_bytes"] / os.sysconf("SC_PHYS_PAGES") / os.sysconf("SC_PAGE_SIZE")
        assert _close(record["memory_peak_fraction"], fraction)


def _check_layout(value: str, seen: list[dict]) -> None:
    """The two records of ``metrics_scenarios._layout_run``: step 2 clipped, step 4 not."""
    for index, record in enumerate(seen[0]["records"]):
        step = 2 * (index + 1)
        _check_value(
            value,
            record,
            seen,
            range(step - 2, step),
            step=step,
            loss=lambda s, step=step: s["losses"][step - 1],
            grad_norm=seen[0]["norms"][step],
            lr=1e-3,
        )
    if value == "loss":  # the evaluation forward before step 4 (gradients enabled) had another loss
        assert not _close(seen[0]["eval_loss"], seen[0]["losses"][3], 1e-3)
    if value == "grad_norm":
        assert seen[0]["records"][0]["grad_norm"] == seen[0]["norms"][2]  # the clip's own return, not recomputed
    if value == "rest":
        for key in ("step", "loss", "grad_norm", "lr", "memory_peak_bytes"):  # the same on every rank
            assert all([r[key] for r in s["records"]] == [r[key] for r in seen[0]["records"]] for s in seen)


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("layout", ["pp", "cp"])
def test_pp_and_cp_records(ranks, layout, value):
    """PP 2 (1F1B, 2 microbatches): the loss is train_step's (an evaluation forward is none), MFU counts both
    stages' parameters, the batch the stages share counts once, the norm covers both stages. CP 2: each rank holds
    a chunk of every (odd-length, so padded) sequence; its tokens count once, without the padding, and the
    attention term of MFU is that of the whole sequence."""
    _, results = ranks
    _check_layout(value, [r[layout] for r in results])


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("layout", ["metrics_fsdp_tp", "metrics_pp_fsdp"])
def test_four_rank_layout_records(four_ranks, layout, value):
    """FSDP 2 x TP 2 and PP 2 x FSDP 2 at 4 ranks: 2 data-parallel ranks, whose losses are averaged; the grad norm
    equals clip_grad_norm_'s and the gathered gradients' (over both stages)."""
    _check_layout(value, [r[layout] for r in four_ranks])


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("kind", ["pp", "cp"])
def test_strategy_records_under_pp_and_cp(ranks, kind, value):
    """FSDP2Strategy: under PP 2 with 2 accumulation steps the loss is the mean of the micro-batches' and the norm
    optimizer_step's; under CP 2 (sequences of odd length without an attention mask: the input ids count, not
    the padding) the norm is the recorder's (no clipping)."""
    _, results = ranks
    seen = [r[f"strategy_{kind}"] for r in results]
    accumulation = seen[0]["accumulation_steps"]
    assert accumulation == (2 if kind == "pp" else 1)
    _check_value(
        value,
        seen[0]["record"],
        seen,
        range(2 * accumulation),
        step=2,
        loss=lambda s: sum(s["losses"][accumulation:]) / accumulation,  # step 2's micro-batches
        grad_norm=seen[0]["norms"][-1],
        lr=seen[0]["lr"],
    )
