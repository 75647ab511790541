"""Context parallelism without processes: the sequence split, the rank layout, and every check that runs before
any collective (the training itself is compared with one process in tests/multiproc/test_cp.py)."""

import pytest
import torch
from _models import TinyNet, tiny_decoder, tiny_llama

import torchacc
from torchacc.data.context import split_sequences
from torchacc.distributed.mesh import context_parallel_rank, data_parallel_rank
from torchacc.parallel.context_plan import resolve_context_parallel
from torchacc.parallel.layout import Layout
from torchacc.parallel.plan import plan_model


def _cp_config(size: int = 2, **dist) -> torchacc.Config:
    config = torchacc.Config()
    config.dist.cp.size = size
    for name, value in dist.items():
        section, field = name.split("__")
        setattr(getattr(config.dist, section), field, value)
    return config


# ---- the loader's split ----


def test_labels_are_shifted_before_the_split_and_positions_are_the_whole_sequence():
    ids = torch.arange(8).view(1, 8) + 10
    batch = {"input_ids": ids, "labels": ids.clone(), "index": torch.tensor([3])}
    first, second = (split_sequences(batch, rank=r, size=2) for r in range(2))
    assert first["input_ids"].tolist() == [[10, 11, 12, 13]] and second["input_ids"].tolist() == [[14, 15, 16, 17]]
    assert first["shift_labels"].tolist() == [[11, 12, 13, 14]], "the chunk's last target is the next chunk's first"
    assert second["shift_labels"].tolist() == [[15, 16, 17, -100]]
    assert second["position_ids"].tolist() == [[4, 5, 6, 7]]
    assert second["labels"].tolist() == [[14, 15, 16, 17]] and second["index"].tolist() == [3]


def test_a_length_that_does_not_divide_is_padded_without_targets():
    batch = {
        "input_ids": torch.tensor([[1, 2, 3, 4, 5]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 0]]),
        "labels": torch.tensor([[1, 2, 3, 4, -100]]),
    }
    chunks = [split_sequences(batch, rank=r, size=2) for r in range(2)]
    assert [c["input_ids"].tolist() for c in chunks] == [[[1, 2, 3]], [[4, 5, 0]]]
    assert [c["attention_mask"].tolist() for c in chunks] == [[[1, 1, 1]], [[1, 0, 0]]]
    assert [c["shift_labels"].tolist() for c in chunks] == [[[2, 3, 4]], [[-100, -100, -100]]]
    assert [c["position_ids"].tolist() for c in chunks] == [[[0, 1, 2]], [[3, 4, 5]]]


def test_head_tail_chunks_follow_torchs_load_balanced_ring():
    batch = {"input_ids": torch.arange(8).view(1, 8)}
    assert [split_sequences(batch, rank=r, size=2, head_tail=True)["input_ids"].tolist() for r in range(2)] == [
        [[0, 1, 6, 7]],
        [[2, 3, 4, 5]],
    ]


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ((torch.zeros(1, 4),), "dist.cp splits every sequence of a batch, so batches must be dicts"),
        ({"pixel_values": torch.zeros(1, 4)}, "the batch has neither input_ids nor inputs_embeds"),
        (
            {"input_ids": torch.zeros(2, 4), "labels": torch.zeros(2, 3)},
            r"batch\['labels'\] has shape \(2, 3\), but the sequences of batch\['input_ids'\] are 4 long",
        ),
        (
            {"input_ids": torch.zeros(1, 4), "attention_mask": torch.ones(1, 1, 4, 4)},
            r"dist.cp needs a 2-D attention_mask \(batch, seq\)",
        ),
    ],
)
def test_batches_that_cannot_be_split_are_named(batch, message):
    with pytest.raises(ValueError, match=message):
        split_sequences(batch, rank=0, size=2)


# ---- the rank layout ----


@pytest.mark.parametrize("topology", [["dp", "fsdp"], ["fsdp", "dp"], ["dp", "tp", "fsdp"]])
def test_a_cp_group_shares_one_data_rank_and_takes_every_chunk(topology):
    sizes = {"dp_size": 2, "fsdp_size": 1, "tp_size": 2, "topology": topology}
    data = [data_parallel_rank(r, **sizes, cp_size=2) for r in range(8)]
    chunks = [context_parallel_rank(r, **sizes, cp_size=2) for r in range(8)]
    assert sorted(set(data)) == [0, 1]
    for d in (0, 1):  # two data ranks, each with 2 chunks x 2 TP ranks
        assert sorted(c for c, dr in zip(chunks, data, strict=True) if dr == d) == [0, 0, 1, 1]


def test_cp_sits_just_outside_tp_and_fsdp_shards_over_it():
    layout = Layout.from_config(_cp_config(fsdp__size=2, tp__size=2), world_size=8, device_type="cpu")
    dims = layout.dims
    assert (dims.dp, dims.fsdp, dims.cp, dims.tp, dims.num_data_ranks) == (1, 2, 2, 2, 2)
    assert dims.describe() == "fsdp=2 x cp=2 x tp=2" and dims.sharded
    assert [dims.context_parallel_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [dims.data_parallel_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    alone = Layout.from_config(_cp_config(), world_size=2, device_type="cpu").dims
    assert (alone.dp, alone.fsdp, alone.needs_mesh, alone.sharded) == (1, 1, True, True), "FSDP over the CP ranks"


def test_ring_is_refused_off_cuda_naming_ulysses():
    with pytest.raises(
        ValueError,
        match="dist.cp.method='ring' runs torch's ring attention, which needs CUDA, but "
        "this run computes on cpu; use dist.cp.method='ulysses'",
    ):
        Layout.from_config(_cp_config(cp__method="ring"), world_size=2, device_type="cpu")
    assert Layout.from_config(_cp_config(cp__method="ring"), world_size=2, device_type="cuda").cp_method == "ring"


# ---- the model checks ----


def _qwen2(**overrides):
    return tiny_llama(kind="qwen2", **overrides)


@pytest.mark.parametrize(
    ("build", "kwargs", "message"),
    [
        (
            TinyNet,
            {},
            "dist.cp.size=2 runs the attention of a Hugging Face transformers model over split sequences, "
            "but torchacc finds no such attention in TinyNet",
        ),
        (
            tiny_llama,
            {"size": 2, "tp_size": 2},
            r"dist.cp.size=2 \* dist.tp.size=2 = 4 does not divide "
            r"num_key_value_heads=2 of LlamaConfig: .* choose dist.cp.size in \[1\]",
        ),
        (
            tiny_llama,
            {"size": 3},
            r"dist.cp.size=3 does not divide num_attention_heads=4 of LlamaConfig: the ranks "
            r"of a CP group each attend with a share of the heads; choose dist.cp.size in \[1, 2, 4\]",
        ),
        (
            lambda: _qwen2(use_sliding_window=True, sliding_window=4, max_window_layers=0),
            {"method": "ring"},
            r"dist.cp.method='ring' runs plain causal attention, but Qwen2ForCausalLM has sliding-window layers "
            r"\(0, 1\); use dist.cp.method='ulysses'",
        ),
        (
            lambda: _with_layer_types(tiny_llama(), ["full_attention", "chunked_attention"]),
            {},
            r"dist.cp: LlamaForCausalLM has chunked_attention layers \(config.layer_types\), whose masks torchacc "
            r"does not build over split sequences \(it builds full and sliding-window causal masks\)",
        ),
        (
            lambda: _without_context_parallel(tiny_llama()),
            {},
            r"dist.cp: LlamaForCausalLM says it cannot run under context parallelism",
        ),
        (
            lambda: tiny_llama(attn_implementation="eager"),
            {"method": "ring"},
            "dist.cp.method='ring' runs the "
            "model's attention over whole sequences as sdpa, but LlamaForCausalLM uses attn_implementation='eager'",
        ),
        (
            lambda: tiny_llama(attn_implementation="flex_attention"),
            {},
            "as sdpa or eager, but LlamaForCausalLM uses "
            "attn_implementation='flex_attention'; load it with from_pretrained",
        ),
        (lambda: _bert(), {}, r"dist.cp splits causal \(decoder\) attention, but BertModel\..* attends both ways"),
    ],
)
def test_models_context_parallelism_cannot_split_are_refused(build, kwargs, message):
    with pytest.raises(ValueError, match=message):
        resolve_context_parallel(build(), **{"size": 2, "method": "ulysses", **kwargs})


def _with_layer_types(model, layer_types):
    model.config.layer_types = layer_types
    return model


def _without_context_parallel(model):
    model._supports_context_parallel = False  # attention sinks, for one (transformers' class flag)
    return model


def test_sliding_window_layers_are_split_with_their_own_masks():
    plan = resolve_context_parallel(
        _qwen2(use_sliding_window=True, sliding_window=4, max_window_layers=1), size=2, method="ulysses"
    )
    assert plan.sliding_layers == frozenset({1}), "Qwen2 slides from max_window_layers on"
    mistral = tiny_decoder("mistral", sliding_window=4)  # no layer_types: every layer slides
    assert resolve_context_parallel(mistral, size=2, method="ulysses").sliding_layers == frozenset({0, 1})
    assert resolve_context_parallel(tiny_llama(), size=2, method="ulysses").sliding_layers == frozenset()


def _bert():
    from transformers import BertConfig, BertModel

    return BertModel(
        BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    )


def test_eager_and_sdpa_models_pass_and_keep_their_attention_until_applied():
    for implementation in ("sdpa", "eager"):
        model = tiny_llama(attn_implementation=implementation)
        plan = resolve_context_parallel(model, size=2, method="ulysses")
        assert plan.attn_implementation == implementation
        assert model.config._attn_implementation == implementation


def test_the_model_check_runs_in_plan_model_before_any_collective():
    layout = Layout.from_config(_cp_config(), world_size=2, device_type="cpu")
    with pytest.raises(ValueError, match="torchacc finds no such attention in TinyNet"):
        plan_model(TinyNet(), layout)
    assert plan_model(tiny_llama(), layout).cp.size == 2


def test_a_cp_job_run_without_torchrun_says_how_to_launch_it():
    config = _cp_config(fsdp__size=2)
    with pytest.raises(
        ValueError,
        match=r"dist.fsdp.size=2 x dist.cp.size=2 asks for 4 processes, .* launch it with "
        r"`torchrun --nproc_per_node=4 .*`, or set dist.fsdp.size=1 and dist.cp.size=1 to train",
    ):
        torchacc.accelerate(tiny_llama(), config=config)


def test_a_model_error_under_cp_is_raised_by_accelerate_before_the_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="torchacc finds no such attention in TinyNet"):
        torchacc.accelerate(TinyNet(), config=_cp_config())
