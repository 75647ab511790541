"""Tensor-parallel plans, the config fields and the rank layout: every check runs before any collective."""

import re
import warnings

import pytest
import torch
import torch.nn as nn
from _models import TinyNet, tiny_decoder, tiny_gpt2, tiny_llama

import torchacc
from torchacc.distributed.mesh import data_parallel_rank
from torchacc.parallel.layout import Layout
from torchacc.parallel.plan import plan_model
from torchacc.parallel.tp import resolve_tp_plan
from torchacc.parallel.tp_rng import check_rng_states
from torchacc.parallel.tp_sequence import check_sequence_length

DECODER_PLAN = {
    **{f"model.layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"},
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}


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
    plan = {"model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise"}
    plan["model.layers.*.mlp.down_proj"] = "rowwise"
    with pytest.raises(ValueError, match=r"the output layer must gather them: add it to dist.tp.plan as "):
        resolve_tp_plan(tiny_llama(), plan, size=2, sequence_parallel=True)


def test_sequence_parallel_refuses_a_module_that_would_see_this_ranks_tokens_only():
    """An attention-only plan (the MLP, or an MoE, left to FSDP) is exact without sequence parallelism; with it, the
    MLP runs on 1/tp of the tokens and each rank would keep only their share of its gradient."""
    plan = {f"model.layers.*.self_attn.{n}_proj": "colwise" for n in "qkv"}
    plan.update({"model.layers.*.self_attn.o_proj": "rowwise", "lm_head": "colwise_gather_output"})
    resolve_tp_plan(tiny_llama(), plan, size=2)  # exact without sequence parallelism
    message = "model.layers.0.mlp.gate_proj (a Linear with parameters) sits inside the blocks but outside dist.tp.plan"
    with pytest.raises(ValueError, match=re.escape(message) + ".*or set dist.tp.sequence_parallel=False"):
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


def _region(styles: dict[str, str]) -> list[str]:
    return [name for name, style in styles.items() if style == "replicated_with_grad_allreduce"]


@pytest.mark.parametrize(
    ("family", "plan", "expected"),
    [
        ("llama", DECODER_PLAN, []),
        ("qwen2", "auto", []),
        ("mistral", "auto", []),
        ("gemma", "auto", []),
        ("gemma2", "auto", []),
        ("qwen3", DECODER_PLAN, ["self_attn.q_norm", "self_attn.k_norm"]),  # found without being named
        ("qwen3", "auto", ["self_attn.q_norm", "self_attn.k_norm"]),  # named by the model's own plan
        ("gemma3", DECODER_PLAN, ["self_attn.q_norm", "self_attn.k_norm"]),
        ("phi", "auto", ["self_attn.q_layernorm", "self_attn.k_layernorm"]),
        ("phi3", "auto", []),  # its packed layers gather their output: nothing runs split
        ("gpt_neox", "auto", []),  # query_key_value groups q, k, v per head: colwise is right, not refused
        ("olmo2", "auto", []),  # q/k/v gather their output, so q_norm and k_norm see every head
        ("cohere", "auto", []),
    ],
)
def test_norms_inside_the_split_region_sum_their_gradients_and_no_others(family, plan, expected):
    styles = resolve_tp_plan(tiny_decoder(family), plan, size=2).styles
    assert _region(styles) == [f"model.layers.{i}.{name}" for i in range(2) for name in expected]
    assert not [n for n in styles if n.endswith("input_layernorm")], (
        "a norm before the colwise layers keeps its gradient"
    )


class _Attention(nn.Module):
    """A module holding colwise layers, with a norm of its input width before them (a pre-norm)."""

    def __init__(self, dim: int = 16, head_dim: int = 4, down: bool = False, scale: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.head_norm = nn.RMSNorm(head_dim)
        self.o = nn.Linear(dim, dim)
        if down:  # DeepSeek's MLA: a low-rank projection feeding the region
            self.q_a_proj = nn.Linear(dim, dim)
        if scale:
            self.scale = nn.Parameter(torch.ones(head_dim))


class _Block(nn.Module):
    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.attn = _Attention(**kwargs)
        self.norm = nn.LayerNorm(16)  # a block's own norm: the residual stream
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 16)


def _blocks(**kwargs) -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleList(_Block(**kwargs) for _ in range(2))
    return model


def _glu() -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Module() for _ in range(2))
    for layer in model.layers:
        layer.mlp = nn.Module()
        layer.mlp.w13, layer.mlp.w2 = nn.Linear(16, 128), nn.Linear(64, 16)
    return model


_BLOCK_PLAN = {
    "layers.*.attn.q": "colwise",
    "layers.*.attn.o": "rowwise",
    "layers.*.fc1": "colwise",
    "layers.*.fc2": "rowwise",
}


def test_the_region_is_read_from_the_module_structure():
    styles = resolve_tp_plan(_blocks(), _BLOCK_PLAN, size=2).styles
    assert _region(styles) == ["layers.0.attn.head_norm", "layers.1.attn.head_norm"]
    assert "layers.0.attn.norm" not in styles, "a norm as wide as the module's input runs before the colwise layers"
    assert "layers.0.norm" not in styles, "a block holding colwise layers itself holds the residual stream"


def test_a_plan_may_name_the_region_itself():
    plan = {**_BLOCK_PLAN, "layers.*.attn.q_a_proj": "replicate", "layers.*.norm": "replicated_with_grad_allreduce"}
    styles = resolve_tp_plan(_blocks(down=True), plan, size=2).styles
    assert styles["layers.1.attn.q_a_proj"] == "replicate"
    assert _region(styles) == [f"layers.{i}.{n}" for i in range(2) for n in ("attn.head_norm", "norm")]


@pytest.mark.parametrize(
    ("build", "plan", "message"),
    [
        (
            lambda: _blocks(down=True),
            _BLOCK_PLAN,
            "dist.tp.plan: layers.0.attn.q_a_proj (a Linear) sits inside layers.0.attn, which holds the 'colwise' "
            "layer(s) layers.0.attn.q, and the plan leaves it whole; torchacc cannot tell",
        ),
        (
            lambda: _blocks(scale=True),
            _BLOCK_PLAN,
            "dist.tp.plan: layers.0.attn.scale is a parameter of layers.0.attn itself, which holds the 'colwise' layer",
        ),
        (
            lambda: tiny_decoder("qwen3", head_dim=64),  # q_norm as wide as the hidden size: before q_proj, or not?
            DECODER_PLAN,
            "dist.tp.plan: model.layers.0.self_attn.q_norm (a Qwen3RMSNorm over 64 features, as many as the input "
            "and a head) sits inside model.layers.0.self_attn",
        ),
        (
            tiny_llama,
            {**DECODER_PLAN, "model.layers.*.mlp.act_fn": "replicated_with_grad_allreduce"},
            "dist.tp.plan: model.layers.0.mlp.act_fn is a SiLUActivation with no parameters of its own; "
            "'replicated_with_grad_allreduce' keeps the parameters of one module whole",
        ),
        (
            lambda: tiny_decoder("phi3"),
            {"model.layers.*.mlp.gate_up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"},
            "dist.tp.plan: model.layers.0.mlp.gate_up_proj looks like a packed layer, several projections stacked in "
            "one weight (its name 'gate_up_proj' is that of a packed layer); 'colwise' would give each rank a "
            "contiguous block of its rows",
        ),
        (
            lambda: tiny_decoder("phi3"),
            {"model.layers.*.self_attn.qkv_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"},
            "Use 'colwise_gather_output' for model.layers.0.self_attn.qkv_proj and 'rowwise_split_input' for the "
            "layer that reads its output (model.layers.0.self_attn.o_proj)",
        ),
        (
            _glu,  # a gate and an up projection in one Linear, by its shape
            {"layers.*.mlp.w13": "colwise", "layers.*.mlp.w2": "rowwise"},
            "dist.tp.plan: layers.0.mlp.w13 looks like a packed layer, several projections stacked in one weight "
            "(out_features=128 is twice the in_features of layers.0.mlp.w2)",
        ),
        (
            lambda: tiny_decoder("phi3"),
            {"model.layers.*.mlp.gate_up_proj": "packed_colwise"},
            "dist.tp.plan['model.layers.*.mlp.gate_up_proj']='packed_colwise' (a layer holding several projections) "
            "is not supported; use 'colwise_gather_output' for the packed layer and 'rowwise_split_input'",
        ),
    ],
)
def test_what_the_structure_cannot_settle_is_refused_with_the_style_to_name(build, plan, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve_tp_plan(build(), plan, size=2)


class _FlatBlock(nn.Module):
    """A block holding its colwise and rowwise layers itself (TinyNet's Block), with ``extra`` beside them."""

    def __init__(self, extra: str = "") -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)  # a pre-norm: as wide as the block's input
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 16)
        if extra == "gate":  # x + fc2(gate * act(fc1(x))): one number applied to the split features
            self.gate = nn.Parameter(torch.tensor(0.5))
        if extra == "prelu":  # x + fc2(prelu(fc1(x))): PReLU's one weight, in a module of its own
            self.act = nn.PReLU()
        if extra == "layer_scale":  # ConvNeXt's gamma: x + gamma * fc2(...), as wide as the residual stream
            self.gamma = nn.Parameter(torch.ones(16))
        if extra == "head_norm":  # a norm over a head of the split features, in the block itself
            self.head_norm = nn.RMSNorm(4)


def _flat(extra: str = "") -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleList(_FlatBlock(extra) for _ in range(2))
    return model


_FLAT_PLAN = {"layers.*.fc1": "colwise", "layers.*.fc2": "rowwise"}


def _linears(*shapes: tuple[int, int], names: tuple[str, ...] = ("a", "b")) -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Module() for _ in range(2))
    for layer in model.layers:
        layer.attn = nn.Module()
        for name, (fan_in, fan_out) in zip(names, shapes, strict=True):
            setattr(layer.attn, name, nn.Linear(fan_in, fan_out))
    return model


def test_a_block_holding_the_split_layers_itself_keeps_what_is_as_wide_as_its_input_whole():
    assert resolve_tp_plan(_flat("layer_scale"), _FLAT_PLAN, size=2).styles.keys() == {
        f"layers.{i}.{n}" for i in range(2) for n in ("fc1", "fc2")
    }
    styles = resolve_tp_plan(_flat("head_norm"), _FLAT_PLAN, size=2).styles
    assert _region(styles) == ["layers.0.head_norm", "layers.1.head_norm"]


@pytest.mark.parametrize(
    ("build", "plan", "message"),
    [
        (
            lambda: _flat("gate"),
            _FLAT_PLAN,
            "dist.tp.plan: layers.0.gate (one number) is a parameter of layers.0 itself, which holds the 'colwise' "
            "layer(s) layers.0.fc1; torchacc cannot tell whether it is applied to this rank's features only",
        ),
        (
            lambda: _flat("prelu"),
            _FLAT_PLAN,
            "dist.tp.plan: layers.0.act (a PReLU of one number) sits inside layers.0, which holds the 'colwise' "
            "layer(s) layers.0.fc1, and the plan leaves it whole; torchacc cannot tell",
        ),
        (
            # lucidrains' attention: q, k and v in one Linear, chunked in three
            lambda: _linears((16, 48), (16, 16), names=("to_qkv", "to_out")),
            {"layers.*.attn.to_qkv": "colwise", "layers.*.attn.to_out": "rowwise"},
            "dist.tp.plan: layers.0.attn.to_qkv looks like a packed layer, several projections stacked in one weight "
            "(its name 'to_qkv' is that of a packed layer)",
        ),
        (
            lambda: _linears((16, 48), (16, 16)),  # the same by its width, whatever its name
            {"layers.*.attn.a": "colwise", "layers.*.attn.b": "rowwise"},
            "dist.tp.plan: layers.0.attn.a looks like a packed layer, several projections stacked in one weight "
            "(out_features=48 is more than the in_features=16 of layers.0.attn.b, which reads its output)",
        ),
        (
            lambda: _linears((16, 24), (16, 16)),  # 8 query heads and 2 key/value heads of 2 features, packed
            {"layers.*.attn.a": "colwise", "layers.*.attn.b": "rowwise"},
            "(out_features=24 is more than the in_features=16 of layers.0.attn.b, which reads its output)",
        ),
        (
            tiny_llama,
            {**DECODER_PLAN, "lm_head": "colwise"},
            "dist.tp.plan: lm_head is 'colwise', but no 'rowwise' layer beside it reads its output: each rank would "
            "keep only its share of lm_head's output features. Use 'colwise_gather_output' for lm_head",
        ),
        (
            tiny_llama,
            {"model.layers.*.mlp.down_proj": "rowwise"},
            "dist.tp.plan: model.layers.0.mlp.down_proj is 'rowwise', which takes this rank's share of its input "
            "features from a 'colwise' layer beside it, but there is none: use 'rowwise_split_input'",
        ),
        (
            tiny_llama,  # a whole output read as if it were this rank's share
            {f"model.layers.*.self_attn.{p}_proj": "colwise_gather_output" for p in "qkv"}
            | {"model.layers.*.self_attn.o_proj": "rowwise"},
            "dist.tp.plan: model.layers.0.self_attn.o_proj is 'rowwise', which takes this rank's share of its input "
            "features from a 'colwise' layer beside it, but there is none",
        ),
        (
            tiny_llama,
            {f"model.layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"}
            | {"model.layers.*.self_attn.o_proj": "rowwise_split_input"},
            "dist.tp.plan: model.layers.0.self_attn.o_proj is 'rowwise_split_input', which splits a whole input "
            "itself, but the 'colwise' layer(s) model.layers.0.self_attn.q_proj, model.layers.0.self_attn.k_proj, "
            "model.layers.0.self_attn.v_proj beside it give it only this rank's share: use 'rowwise'",
        ),
        (
            lambda: tiny_decoder("cohere", use_qk_norm=True),
            "auto",
            "dist.tp.plan: model.layers.0.self_attn.q_norm (a CohereLayerNorm) holds one weight per attention head "
            "(weight of shape (4, 16))",
        ),
        (
            lambda: tiny_decoder("olmo2"),
            DECODER_PLAN,
            "dist.tp.plan: model.layers.0.self_attn.k_norm (a Olmo2RMSNorm over 32 features) normalizes the whole "
            "output of model.layers.0.self_attn.k_proj, which 'colwise' splits",
        ),
    ],
)
def test_a_plan_that_would_compute_the_wrong_thing_or_fail_inside_dtensor_is_refused(build, plan, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve_tp_plan(build(), plan, size=2)


class _Lookup(nn.Embedding):
    """TorchTitan-style: the lookup on the weight's local tensor."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to_local() if hasattr(self.weight, "to_local") else self.weight
        return nn.functional.embedding(ids, weight)


class _Scaled(nn.Embedding):
    """Gemma-style: post-processes nn.Embedding's own lookup."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * 2.0


def _with_embedding(cls: type[nn.Embedding]) -> nn.Module:
    model = TinyNet()
    model.embed = cls(32, 16)
    return model


@pytest.mark.parametrize("style", ["embedding_rowwise", "rowwise"])
def test_an_embedding_with_its_own_lookup_is_refused(style):
    message = (
        "dist.tp.plan: embed is a _Lookup, an nn.Embedding subclass whose forward (_Lookup.forward) works on a local "
        f"tensor (to_local); '{style}' splits the vocabulary"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve_tp_plan(_with_embedding(_Lookup), {"embed": style}, size=2)


def test_an_embedding_that_scales_its_own_lookup_is_split():
    assert resolve_tp_plan(_with_embedding(_Scaled), {"embed": "embedding_rowwise"}, size=2).styles == {
        "embed": "embedding_rowwise"
    }
    assert resolve_tp_plan(tiny_decoder("gemma"), "auto", size=2).styles["model.embed_tokens"] == "embedding_rowwise"


def test_a_sequence_the_tp_ranks_cannot_split_evenly_is_refused():
    check_sequence_length(16, size=2)
    message = (
        "dist.tp.sequence_parallel=True splits each sequence over the dist.tp.size=2 ranks of a TP group, but this "
        "batch has sequence length 15, not a multiple of 2; pad the batches to a multiple of 2"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        check_sequence_length(15, size=2)


def test_tp_ranks_with_different_random_states_are_refused():
    check_rng_states([((0, 1), 7, 100), ((0, 1), 7, 101), ((2, 3), 8, 102), ((2, 3), 8, 103)])  # same states
    with pytest.raises(
        ValueError,
        match=re.escape(
            "dist.tp: the ranks [2, 3] of one TP group reach their first training forward with different random "
            "generator states (different seeds; torch.initial_seed() per rank: rank 2: 102, rank 3: 103)"
        ),
    ):
        check_rng_states([((0, 1), 7, 100), ((0, 1), 7, 100), ((2, 3), 8, 102), ((2, 3), 9, 103)])
    with pytest.raises(ValueError, match=r"\(the same seed, but some ranks drew more random numbers since;"):
        check_rng_states([((0, 1), 7, 100), ((0, 1), 8, 100)])


def test_sequence_parallel_gathers_the_tokens_for_a_module_of_packed_layers():
    styles = resolve_tp_plan(tiny_decoder("phi3"), "auto", size=2, sequence_parallel=True).styles
    assert styles["model.layers.0.self_attn"] == styles["model.layers.1.mlp"] == "gather_sequence"
    assert styles["model.layers.0.self_attn.qkv_proj"] == "colwise_gather_output"
    assert styles["model.layers.0.mlp.down_proj"] == "rowwise_split_input"


def test_compile_refuses_a_tp_plan_that_also_splits_a_layer_outside_the_blocks():
    """Llama's own plan (the blocks' layers and lm_head) fails in the first backward with compiled blocks
    (tests/multiproc/test_tp.py, TORCHACC_TEST_COMPILE_TP=1); a plan inside the blocks only is accepted."""
    config = torchacc.Config()
    config.dist.tp.size = 2
    config.dist.fsdp.wrap_layer_cls = {"LlamaDecoderLayer"}
    config.compute.compile = True
    message = "compute.compile=True with dist.tp.size=2: dist.tp.plan splits model.embed_tokens, lm_head outside"
    with pytest.raises(ValueError, match=re.escape(message) + ".*or set compute.compile=False"):
        plan_model(tiny_llama(), Layout.from_config(config, world_size=2, device_type="cpu"))
    config.dist.tp.plan = DECODER_PLAN
    assert plan_model(tiny_llama(), Layout.from_config(config, world_size=2, device_type="cpu")).tp is not None
