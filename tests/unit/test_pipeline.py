"""Pipeline parallelism in one process: every dist.pp error, the layout and mesh arithmetic, the split of a
Hugging Face decoder into stages (whose forwards chained equal the whole model's), and train_step without a
pipeline. The multi-process parity runs are in tests/multiproc/test_pp.py."""

import copy
import re

import pytest
import torch
import torch.nn as nn
from _models import TinyNet, tiny_decoder, tiny_llama

import torchacc
from torchacc.config import Config
from torchacc.parallel.layout import Layout, ParallelDims
from torchacc.parallel.pipeline import plan_pipeline
from torchacc.parallel.pipeline_stages import split_model


def _config(**pp) -> Config:
    config = Config()
    for key, value in pp.items():
        setattr(config.dist.pp, key, value)
    return config


@pytest.mark.parametrize(
    ("pp", "world", "other", "message"),
    [
        ({"size": 0}, 4, {}, "dist.pp.size must be >= 1, got 0; use 1 to disable pipeline parallelism"),
        ({"size": 3}, 4, {}, "dist.pp.size=3 * dist.fsdp.size=1 = 3 does not divide world size 4; choose a divisor"),
        ({"size": 2}, 4, {"fsdp": 4}, "dist.pp.size=2 * dist.fsdp.size=4 = 8 exceeds world size 4"),
        (
            {"size": 2},
            8,
            {"dp": 2, "fsdp": 1},
            "dist.dp.size * dist.pp.size * dist.fsdp.size must equal world size 8, got dist.dp.size=2 * "
            "dist.pp.size=2 * dist.fsdp.size=1 = 4; set dist.dp.size=4",
        ),
        (
            {"size": 2, "schedule": "ZeroBubble"},
            2,
            {},
            "dist.pp.schedule='ZeroBubble' is not supported; use one of 1F1B",
        ),
        (
            {"size": 2, "schedule": "Interleaved1F1B"},
            2,
            {},
            "dist.pp.schedule='Interleaved1F1B' needs dist.pp.stages_per_rank >= 2, got 1",
        ),
        (
            {"size": 2, "stages_per_rank": 2},
            2,
            {},
            "dist.pp.stages_per_rank=2 needs dist.pp.schedule='Interleaved1F1B'",
        ),
        ({"size": 2, "microbatches": 0}, 2, {}, "dist.pp.microbatches must be None or >= 1, got 0"),
        (
            {"size": 4, "microbatches": 2},
            4,
            {},
            "dist.pp.schedule='1F1B' needs at least one microbatch per stage: dist.pp.microbatches=2 is fewer than "
            "the 4 stages",
        ),
        (
            {"size": 2, "schedule": "Interleaved1F1B", "stages_per_rank": 2, "microbatches": 5},
            2,
            {},
            "dist.pp.microbatches=5 is not a multiple of its 2 rounds; use a multiple of 2",
        ),
        (
            {"size": 2, "split": ["model.layers.2", "model.layers.3"]},
            2,
            {},
            "dist.pp.split names 2 block(s) but 2 stages need 1",
        ),
        (
            {"size": 3, "split": ["model.layers.2", "model.layers.2"]},
            3,
            {},
            "dist.pp.split=['model.layers.2', 'model.layers.2'] names a block twice",
        ),
        ({"microbatches": 4}, 2, {}, "dist.pp.microbatches=4 is set but dist.pp.size is 1 (no pipeline)"),
        ({"split": ["model.layers.2"]}, 2, {}, "dist.pp.split=['model.layers.2'] is set but dist.pp.size is 1"),
        (
            {"size": 2},
            4,
            {"tp": 2, "sequence_parallel": True},
            "dist.tp.sequence_parallel=True does not combine with dist.pp.size > 1",
        ),
        ({"size": 2}, 4, {"cp": 2}, "dist.pp.size=2 with dist.cp.size=2: pipeline and context parallelism do not"),
    ],
)
def test_every_pp_config_error(pp, world, other, message):
    config = _config(**pp)
    config.dist.fsdp.size = other.get("fsdp", 1)
    config.dist.dp.size = other.get("dp")
    config.dist.tp.size = other.get("tp", 1)
    config.dist.tp.sequence_parallel = other.get("sequence_parallel", False)
    config.dist.cp.size = other.get("cp", 1)
    with pytest.raises(ValueError, match=re.escape(message)):
        config.validate(world)


def test_the_layout_resolves_the_pipeline_and_keeps_stages_gathered():
    config = _config(size=2, schedule="Interleaved1F1B", stages_per_rank=2)
    config.dist.fsdp.size = 2
    layout = Layout.from_config(config, world_size=8, device_type="cpu")
    assert (layout.dims.pp, layout.dims.dp, layout.dims.fsdp) == (2, 2, 2)
    assert layout.dims.describe() == "pp=2 x dp=2 x fsdp=2"
    assert layout.pipeline.num_stages == 4 and layout.pipeline.microbatches == 4  # default: one per stage
    assert layout.reshard_after_forward is False
    assert config.resolved_dp_size(8) == 2
    assert Layout.from_config(Config(), world_size=1, device_type="cpu").pipeline is None


def test_the_stages_of_one_pipeline_share_their_data_rank():
    dims = ParallelDims(world_size=8, dp=1, fsdp=2, tp=2, pp=2)
    assert dims.num_data_ranks == 2 and dims.needs_mesh and not ParallelDims(world_size=2, dp=2, fsdp=1).needs_mesh
    # stage 0 is ranks 0-3, stage 1 ranks 4-7; inside a stage the TP pairs are contiguous
    assert [dims.data_parallel_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert ParallelDims(world_size=4, dp=2, fsdp=1, pp=2).sharded, "replicas of a stage sync through fully_shard"


def test_the_mesh_puts_the_pipeline_outermost():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.distributed.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        from torchacc.distributed.mesh import fsdp_submesh, pp_submesh, tp_submesh

        mesh = ParallelDims(world_size=8, dp=1, fsdp=2, tp=2, pp=2).build_mesh("cpu")
        assert mesh.mesh_dim_names == ("pp", "dp", "fsdp", "tp")
        assert mesh.mesh.tolist() == [[[[0, 1], [2, 3]]], [[[4, 5], [6, 7]]]]
        assert pp_submesh(mesh).mesh.tolist() == [1, 5] and tp_submesh(mesh).mesh.tolist() == [4, 5]
        assert fsdp_submesh(mesh).mesh.tolist() == [5, 7]
        plain = ParallelDims(world_size=8, dp=2, fsdp=2, pp=2).build_mesh("cpu")
        assert plain.mesh_dim_names == ("pp", "dp", "fsdp") and fsdp_submesh(plain).mesh_dim_names == ("dp", "fsdp")
        assert pp_submesh(ParallelDims(world_size=8, dp=1, fsdp=8).build_mesh("cpu")) is None
    finally:
        torch.distributed.destroy_process_group()


def _plan(model, stages=2, split=(), wrap=("LlamaDecoderLayer",)):
    classes = frozenset(type(m) for m in model.modules() if type(m).__name__ in wrap)
    return plan_pipeline(model, num_stages=stages, split=list(split), wrap_classes=classes)


def test_blocks_are_divided_evenly_or_where_split_says():
    model = tiny_llama(num_hidden_layers=5)
    assert _plan(model).stages == ((0, 1, 2), (3, 4))  # earlier stages take one more
    assert _plan(model, 3).stages == ((0, 1), (2, 3), (4,))
    assert _plan(model, split=["model.layers.1"], wrap=()).stages == ((0,), (1, 2, 3, 4))


@pytest.mark.parametrize(
    ("build", "kwargs", "message"),
    [
        (lambda: tiny_llama(), {"wrap": ()}, "but none are known: set dist.fsdp.wrap_layer_cls"),
        (lambda: tiny_llama(), {"stages": 3}, "has 2 block(s) in model.layers but the pipeline has 3 stages"),
        (lambda: tiny_llama(num_hidden_layers=4), {"split": ["model.layers.9"]}, "unknown: ['model.layers.9']"),
        (
            lambda: tiny_llama(num_hidden_layers=4),
            {"stages": 3, "split": ["model.layers.3", "model.layers.2"]},
            "must name blocks in increasing order",
        ),
        (lambda: tiny_llama(num_hidden_layers=4), {"split": ["model.layers.0"]}, "none of them the first block"),
        (lambda: TinyNet(), {"wrap": ("Block",)}, "splits Hugging Face decoder-only models"),
        (lambda: tiny_llama(), {"wrap": ("LlamaMLP",)}, "no nn.ModuleList holds the dist.fsdp.wrap_layer_cls blocks"),
        (
            lambda: tiny_llama(tie_word_embeddings=True),
            {},
            "lm_head.weight is tied to model.embed_tokens.weight, but the head lives on the last stage",
        ),
    ],
)
def test_every_split_error_names_the_fix(build, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _plan(build(), **kwargs)


def test_a_parameter_outside_the_parts_is_refused():
    model = tiny_llama()
    model.model.extra = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=re.escape("dist.pp: model.extra.weight is neither in the embedding")):
        _plan(model)


# phi: its final norm is final_layernorm, and its decoder runs embed_dropout on inputs_embeds; gemma: its embedding
# scales what it returns (untied: tied weights are refused); gemma2: it soft-caps the logits after the head;
# granite: it scales inputs_embeds in the decoder and the logits after the head
@pytest.mark.parametrize(
    ("kind", "overrides"),
    [
        ("llama", {}),
        ("qwen2", {}),
        ("phi", {}),
        ("gemma", {"tie_word_embeddings": False}),
        ("gemma2", {"final_logit_softcapping": 1.0, "tie_word_embeddings": False}),
        ("granite", {}),
    ],
)
def test_the_stages_chained_equal_the_whole_model_and_keep_its_names(kind, overrides):
    model = tiny_decoder(kind, seed=3, num_hidden_layers=4, **overrides)
    plan = _plan(model, stages=3, wrap=(type(model.model.layers[0]).__name__,))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    parts = [copy.deepcopy(model) for _ in range(3)]
    stages = [split_model(part, plan, stages=[s])[0] for s, part in enumerate(parts)]
    hidden = ids
    with torch.no_grad():
        for stage in stages:
            hidden = stage(hidden)
        expected = model(input_ids=ids).logits
    torch.testing.assert_close(hidden, expected, rtol=0, atol=1e-6)
    keys = [set(part.state_dict()) for part in parts]
    assert set().union(*keys) == set(model.state_dict()) and sum(map(len, keys)) == len(model.state_dict())
    assert any(key.startswith("model.layers.3.") for key in keys[2]) and "lm_head.weight" in keys[2]
    assert not any(key.startswith(("model.layers.3.", "lm_head.")) for key in keys[0] | keys[1])
    assert parts[1].model.embed_tokens is None and parts[1].lm_head is None


def test_train_step_without_a_pipeline_is_forward_and_backward():
    model, reference = tiny_llama(seed=1), tiny_llama(seed=1)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = torchacc.train_step(model, {"input_ids": ids, "labels": ids}, scale=0.5)
    expected = reference(input_ids=ids, labels=ids).loss
    (expected * 0.5).backward()
    assert loss.item() == expected.item() and not loss.requires_grad
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    with pytest.raises(ValueError, match=re.escape("torchacc.train_step: the output of TinyNet has no .loss")):
        torchacc.train_step(TinyNet(), torch.randn(2, 16))


def test_train_step_frees_the_output_before_the_backward():
    # the logits (batch x seq x vocab) are the largest tensor of an LLM's step: kept alive through the backward
    # they were one more of them at the peak than `loss = model(**batch).loss; loss.backward()` holds
    model = tiny_llama(seed=1, vocab_size=4096)
    ids = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    model(**batch).loss.backward()
    assert all(p.grad is not None for p in model.parameters())  # the gradients exist, and Python sees them
    peaks = []
    for step in (lambda: model(**batch).loss.backward(), lambda: torchacc.train_step(model, batch)):
        with torchacc.track_memory() as tracked:
            step()
        peaks.append(tracked.peak_bytes - tracked.baseline_bytes)
    assert peaks[1] == peaks[0], f"train_step held {peaks[1] - peaks[0]} bytes more"
