"""Tensor-parallel plans, the config fields and the rank layout: every check runs before any collective."""

import re
import warnings

import pytest
import torch.nn as nn
from _models import TinyNet, tiny_gpt2, tiny_llama

import torchacc
from torchacc.distributed.mesh import data_parallel_rank
from torchacc.parallel.tp import resolve_tp_plan


def test_auto_plan_takes_the_hugging_face_plan_in_module_order():
    plan = resolve_tp_plan(tiny_llama(), "auto", size=2)
    assert plan.styles["model.layers.1.self_attn.q_proj"] == "colwise"
    assert plan.styles["model.layers.1.mlp.down_proj"] == "rowwise"
    assert plan.styles["lm_head"] == "colwise_gather_output"
    assert list(plan.styles)[0] == "model.embed_tokens" and list(plan.styles)[-1] == "lm_head"


def test_sequence_parallel_adds_the_norms_and_the_split():
    styles = resolve_tp_plan(tiny_llama(), "auto", size=2, sequence_parallel=True).styles
    assert styles["model.layers.0"] == "split_sequence"
    assert styles["model.layers.0.self_attn"] == styles["model.layers.0.mlp"] == "gather_sequence"
    assert styles["model.layers.1.post_attention_layernorm"] == styles["model.norm"] == "sequence_parallel"
    assert "model.embed_tokens" in styles and styles["model.layers.0.self_attn.q_proj"] == "colwise"


@pytest.mark.parametrize(
    ("build", "plan", "size", "message"),
    [
        (
            TinyNet,
            "auto",
            2,
            "dist.tp.plan='auto' takes a Hugging Face model's own plan (config.base_model_tp_plan), "
            "but TinyNet has none; pass a mapping",
        ),
        (
            TinyNet,
            {"blocks.*.fc1": "diagonal"},
            2,
            "dist.tp.plan['blocks.*.fc1']='diagonal' is not a supported style; use one of colwise, rowwise",
        ),
        (
            TinyNet,
            {"layers.*.fc1": "colwise"},
            2,
            "dist.tp.plan: pattern 'layers.*.fc1' matches no module of TinyNet; "
            "module names are relative to the model passed to accelerate(), e.g. blocks.0.fc1",
        ),
        (TinyNet, {"blocks.*": "colwise"}, 2, "dist.tp.plan: blocks.0 is a Block; style 'colwise' splits nn.Linear"),
        (
            TinyNet,
            {"blocks.*.fc1": "colwise"},
            3,
            "dist.tp.plan: blocks.0.fc1 (colwise) has out_features=64, not divisible by dist.tp.size=3",
        ),
        (TinyNet, {"blocks.*.fc1": "embedding_rowwise"}, 2, "blocks.0.fc1 is a Linear, but 'embedding_rowwise' splits"),
        (
            lambda: tiny_gpt2(),
            {"transformer.h.*.attn.c_attn": "colwise"},
            2,
            "dist.tp.plan: transformer.h.0.attn.c_attn "
            "is a transformers Conv1D (GPT-2 style, weight stored transposed), which has no tensor-parallel style",
        ),
        (
            tiny_llama,
            "auto",
            4,
            "dist.tp.size=4 does not divide num_key_value_heads=2 of LlamaConfig: each TP rank must "
            "hold whole attention heads; choose dist.tp.size in [1, 2]",
        ),
        (
            lambda: tiny_llama(vocab_size=127),
            {"model.embed_tokens": "embedding_rowwise"},
            2,
            "model.embed_tokens has 127 embeddings, not divisible by dist.tp.size=2; pad the vocabulary",
        ),
        (
            lambda: tiny_llama(tie_word_embeddings=True),
            {"lm_head": "colwise_gather_output"},
            2,
            "dist.tp.plan splits model.embed_tokens and lm_head differently, but they share one weight",
        ),
    ],
)
def test_plan_errors_name_the_module_and_the_fix(build, plan, size, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve_tp_plan(build(), plan, size=size)


def test_sequence_parallel_needs_blocks():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    with pytest.raises(ValueError, match=r"dist.tp.sequence_parallel=True needs the TP layers inside a list of blocks"):
        resolve_tp_plan(model, {"0": "colwise", "1": "rowwise"}, size=2, sequence_parallel=True)


def test_sequence_parallel_needs_an_output_layer_that_gathers():
    plan = {"model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"}
    with pytest.raises(ValueError, match=r"the output layer must gather them: add it to dist.tp.plan as "):
        resolve_tp_plan(tiny_llama(), plan, size=2, sequence_parallel=True)


def test_a_shared_weight_may_be_split_alike():
    model = tiny_llama(tie_word_embeddings=True)
    plan = {"model.embed_tokens": "embedding_rowwise", "lm_head": "colwise_gather_output"}  # both split dim 0
    assert resolve_tp_plan(model, plan, size=2).styles["lm_head"] == "colwise_gather_output"


def test_auto_plan_keeps_a_shared_weight_whole_when_its_plan_splits_it_two_ways():
    model = nn.Module()
    model.a, model.b = nn.Linear(8, 8), nn.Linear(8, 8)
    model.b.weight = model.a.weight
    model.tp_plan = {"a": "colwise", "b": "rowwise"}
    with pytest.warns(UserWarning, match=r"a and b share one weight \(a.weight\) but the model's plan splits them"):
        assert resolve_tp_plan(model, "auto", size=2).styles == {}


@pytest.mark.parametrize(
    ("settings", "world", "message"),
    [
        ({"tp.size": 0}, 2, "dist.tp.size must be >= 1, got 0; use 1 to disable tensor parallelism"),
        ({"tp.size": 3}, 4, "dist.fsdp.size=1 * dist.tp.size=3 = 3 does not divide world size 4; choose a divisor"),
        ({"tp.size": 2, "fsdp.size": 4}, 4, "dist.fsdp.size=4 * dist.tp.size=2 = 8 exceeds world size 4"),
        (
            {"tp.size": 2, "dp.size": 1},
            4,
            "dist.dp.size * dist.fsdp.size * dist.tp.size must equal world size 4, got "
            "dist.dp.size=1 * dist.fsdp.size=1 * dist.tp.size=2 = 2; set dist.dp.size=2",
        ),
        ({"tp.plan": "colwise"}, 1, "dist.tp.plan='colwise' is not supported; use 'auto'"),
        ({"tp.sequence_parallel": True}, 1, "dist.tp.sequence_parallel=True needs dist.tp.size > 1"),
        ({"topology": ["tp", "dp"]}, 1, "dist.topology must be a permutation of ['dp', 'fsdp'] or of"),
    ],
)
def test_config_errors(settings, world, message):
    config = torchacc.Config()
    for dotted, value in settings.items():
        node = config.dist
        *path, leaf = dotted.split(".")
        for part in path:
            node = getattr(node, part)
        setattr(node, leaf, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        config.validate(world)


def test_a_dict_plan_comes_from_the_command_line_and_yaml(tmp_path):
    config = torchacc.Config.from_cli(["dist.tp.size=2", "dist.tp.plan={'layers.*.up': colwise}"])
    assert config.dist.tp.plan == {"layers.*.up": "colwise"}
    path = tmp_path / "run.yaml"
    path.write_text(config.to_yaml())
    assert torchacc.Config.from_yaml(path).dist.tp.plan == {"layers.*.up": "colwise"}
    with pytest.raises(ValueError, match=r"dist.tp.plan: expected str or dict of str to str, got \['colwise'\]"):
        torchacc.Config.from_cli(["dist.tp.plan=[colwise]"])


@pytest.mark.parametrize(
    ("topology", "expected"),
    [(["dp", "fsdp"], [0, 0, 1, 1, 2, 2, 3, 3]), (["tp", "dp", "fsdp"], [0, 1, 2, 3, 0, 1, 2, 3])],
)
def test_the_ranks_of_one_tp_group_share_a_data_rank(topology, expected):
    ranks = [data_parallel_rank(r, dp_size=2, fsdp_size=2, tp_size=2, topology=topology) for r in range(8)]
    assert ranks == expected


def test_plain_python_with_tp_says_how_to_launch(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = torchacc.Config()
    config.dist.tp.size = 2
    with (
        warnings.catch_warnings(),
        pytest.raises(
            ValueError, match=r"dist.fsdp.size=1 x dist.tp.size=2 asks for 2 processes.*torchrun --nproc_per_node=2"
        ),
    ):
        torchacc.accelerate(tiny_llama(), config=config)
