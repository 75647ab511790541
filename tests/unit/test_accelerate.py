"""accelerate() in one process: the errors it raises before any collective, and what it returns."""

import dataclasses
import inspect

import pytest
import torch
import torch.nn as nn
from _models import Block, TinyNet, tiny_decoder, tiny_gpt2, token_dataset
from torch.utils.data import DataLoader, IterableDataset

import torchacc
from torchacc.parallel.activation_checkpoint import apply_activation_checkpointing


def fsdp_config(size: int = 1, classes=("Block",)) -> torchacc.Config:
    config = torchacc.Config()
    config.dist.fsdp.size = size
    config.dist.fsdp.wrap_layer_cls = set(classes)
    return config


def test_returns_model_alone_pair_or_triple():
    loader = DataLoader(token_dataset(4), batch_size=2)
    assert isinstance(torchacc.accelerate(TinyNet()), TinyNet)
    model, sharded = torchacc.accelerate(TinyNet(), loader)
    assert len(sharded) == 2 and model.device == torch.device("cpu")
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = torchacc.accelerate(model, config=fsdp_config(), optimizer=optimizer)
    assert out[0] is model and out[1] is None and out[2] is optimizer


def test_keeps_state_dict_keys_with_checkpointing():
    model = tiny_gpt2()
    keys = list(model.state_dict())
    config = fsdp_config(classes=("GPT2Block",))
    config.memory.gc = True
    model = torchacc.accelerate(model, config=config)
    assert list(model.state_dict()) == keys


def test_unknown_wrap_class_lists_the_model_classes():
    with pytest.raises(
        ValueError, match=r"dist\.fsdp\.wrap_layer_cls: no module of class 'GPT2Block'.*contains: .*Block"
    ):
        torchacc.accelerate(TinyNet(), config=fsdp_config(classes=("GPT2Block",)))


def test_unknown_gc_class_names_memory_gc_cls():
    config = fsdp_config()
    config.memory.gc = True
    config.memory.gc_cls = {"Nope"}
    with pytest.raises(ValueError, match=r"memory\.gc_cls: no module of class 'Nope'.*Linear"):
        torchacc.accelerate(TinyNet(), config=config)


def test_fsdp_size_must_divide_the_world(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"dist\.fsdp\.size=3 does not divide world size 4"):
        torchacc.accelerate(TinyNet(), config=fsdp_config(size=3))


def test_already_accelerated_model_is_refused():
    model = torchacc.accelerate(TinyNet())
    with pytest.raises(ValueError, match="already accelerated.*once per model"):
        torchacc.accelerate(model)


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))


def test_meta_model_without_materialization_is_refused():
    with torchacc.init_empty_weights():
        model = nn.Sequential(nn.Linear(4, 4), Scale())
    with pytest.raises(ValueError, match=r"no way to initialize them: module '1' has no reset_parameters\(\)"):
        torchacc.accelerate(model)
    with torch.device("meta"):
        model = nn.BatchNorm1d(4)
    with pytest.raises(ValueError, match="buffers on the meta device.*build the model under torchacc.init_empty"):
        torchacc.accelerate(model)


def test_meta_model_is_materialized_with_its_own_init_and_real_buffers():
    with torchacc.init_empty_weights():
        model = TinyNet()
        model.register_buffer("table", torch.arange(3.0), persistent=False)
    assert model.blocks[0].fc1.weight.is_meta and not model.table.is_meta
    model = torchacc.accelerate(model)
    weight = model.blocks[0].fc1.weight
    assert not weight.is_meta and torch.equal(model.table, torch.arange(3.0))
    bound = 1 / 16**0.5  # nn.Linear's kaiming-uniform bound for fan_in 16
    assert weight.abs().max() <= bound and weight.std() > bound / 3
    assert torch.isfinite(model(torch.randn(2, 16))).all()


def test_optimizer_of_another_model_is_refused():
    optimizer = torch.optim.SGD(TinyNet().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not parameters of TinyNet.*model.parameters"):
        torchacc.accelerate(TinyNet(), optimizer=optimizer)


def test_wrong_types_are_named():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        torchacc.accelerate("model")
    with pytest.raises(TypeError, match="config must be a torchacc.Config, got dict"):
        torchacc.accelerate(TinyNet(), config={"compute": {}})
    with pytest.raises(TypeError, match="list"):
        torchacc.accelerate(TinyNet(), [1, 2, 3])
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        torchacc.accelerate(TinyNet(), optimizer="adam")


def test_iterable_dataset_gets_a_clear_error():
    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(4)

    with pytest.raises(ValueError, match=r"cannot split an iterable dataset \(Stream\).*config.dataloader.shard=False"):
        torchacc.accelerate(TinyNet(), DataLoader(Stream(), batch_size=2))


def test_accelerated_loader_cannot_be_accelerated_again():
    _, loader = torchacc.accelerate(TinyNet(), DataLoader(token_dataset(4), batch_size=2))
    with pytest.raises(ValueError, match="already returned by torchacc.accelerate"):
        torchacc.accelerate(TinyNet(), loader)


@dataclasses.dataclass
class LossAndLogits:
    loss: torch.Tensor
    logits: torch.Tensor


class TinyNetWithLoss(TinyNet):
    def forward(self, x: torch.Tensor) -> LossAndLogits:  # a dataclass output, not a dict
        logits = super().forward(x)
        return LossAndLogits(loss=logits.square().mean(), logits=logits)


def test_bf16_autocasts_without_fsdp_and_returns_the_loss_in_float32(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torchacc._utils.logging, "_seen", set())
    config = torchacc.Config()
    config.compute.bf16 = True
    with pytest.warns(UserWarning, match="compute.bf16=True on a CPU without native bf16"):
        model = torchacc.accelerate(TinyNetWithLoss(), config=config)
    seen = {}

    def record(module, inputs, output):
        seen["dtype"], seen["autocast"] = output.dtype, torch.is_autocast_enabled("cpu")

    model.blocks[0].fc1.register_forward_hook(record)
    out = model(torch.randn(2, 16))
    assert seen == {"dtype": torch.bfloat16, "autocast": True}, "one process has no FSDP policy: autocast casts"
    assert isinstance(out, LossAndLogits)
    assert out.loss.dtype == torch.float32, "a scalar output (the loss) comes back in float32"
    assert out.logits.dtype == torch.bfloat16, "larger outputs stay in bf16 (a float32 copy doubles their memory)"
    assert next(model.parameters()).dtype == torch.float32


def count_saved_tensors(model: nn.Module) -> int:
    saved = []
    torch.manual_seed(1)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = model(torch.randn(4, 16)).sum()
    loss.backward()
    return len(saved)


@pytest.mark.parametrize("num_layers, recomputed", [(None, [2, 2, 2]), (1, [2, 1, 1])])
def test_activation_checkpointing_recomputes_and_saves_less(num_layers, recomputed):
    torch.manual_seed(0)
    plain, checkpointed = TinyNet(), TinyNet()
    checkpointed.load_state_dict(plain.state_dict())
    names = apply_activation_checkpointing(checkpointed, {Block}, num_layers=num_layers)
    assert names == ["blocks.0", "blocks.1", "blocks.2"][: num_layers or 3]
    assert count_saved_tensors(checkpointed) < count_saved_tensors(plain)
    assert [b.num_forward_calls for b in checkpointed.blocks] == recomputed
    assert [b.num_forward_calls for b in plain.blocks] == [1, 1, 1]
    for p, q in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_activation_checkpointing_of_a_model_with_a_kv_cache_matches_no_checkpointing(family, monkeypatch):
    monkeypatch.setattr(torchacc._utils.logging, "_seen", set())
    plain = tiny_decoder(family, sliding_window=8)
    config = torchacc.Config()
    config.memory.gc = True
    config.dist.fsdp.wrap_layer_cls = {type(plain.model.layers[0]).__name__}
    with pytest.warns(UserWarning, match=r"memory.gc=True: training forwards run with use_cache=False"):
        checkpointed = torchacc.accelerate(tiny_decoder(family, sliding_window=8), config=config)
    assert checkpointed.config.use_cache
    ids = torch.stack([sample["input_ids"] for sample in token_dataset(2)])
    for model in (plain, checkpointed):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    assert out.past_key_values is None, "a training forward with checkpointed layers builds no KV cache"
    for p, q in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    assert checkpointed.config.use_cache, "the model's setting is left for generate()"
    with torch.no_grad():
        assert checkpointed(input_ids=ids).past_key_values is not None, "without gradients the cache is built"
    prompt = ids[:, :4]
    torch.testing.assert_close(
        checkpointed.generate(prompt, max_new_tokens=3, do_sample=False),
        plain.generate(prompt, max_new_tokens=3, do_sample=False),
    )


def test_grad_scaler_skips_an_overflowing_step_in_one_process():
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torchacc.GradScaler(init_scale=8.0)
    scaler.scale(model(torch.randn(2, 16)).sum()).backward()
    model.head.weight.grad[0, 0] = float("inf")
    before = model.head.weight.detach().clone()
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(model.head.weight, before) and scaler.get_scale() == 4.0


def test_meta_gpt2_gets_the_hf_init_distribution():
    with torchacc.init_empty_weights():
        model = tiny_gpt2()
    model = torchacc.accelerate(model)
    weight = model.transformer.h[0].attn.c_attn.weight.detach()
    assert abs(weight.std().item() - model.config.initializer_range) < 0.002
    assert torch.all(model.transformer.h[0].ln_1.weight == 1)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_cpu_offload_is_ignored_with_a_warning_on_cpu(monkeypatch):
    monkeypatch.setattr(torchacc._utils.logging, "_seen", set())
    config = torchacc.Config()
    config.memory.offload_params = True
    with pytest.warns(UserWarning, match="memory.offload_params=True is ignored on a CPU run"):
        torchacc.accelerate(TinyNet(), config=config)


def test_compile_keeps_keys_and_hooks_and_needs_wrap_classes():
    config = torchacc.Config()
    config.compute.compile = True
    with pytest.raises(ValueError, match="compute.compile=True compiles each dist.fsdp.wrap_layer_cls block"):
        torchacc.accelerate(TinyNet(), config=config)
    config.dist.fsdp.wrap_layer_cls = {"Block"}
    model = TinyNet()
    keys = list(model.state_dict())
    model = torchacc.accelerate(model, config=config)
    assert list(model.state_dict()) == keys
    assert all("_orig_mod" not in k for k in model.state_dict())


def test_compile_trains_without_the_hf_kv_cache_with_a_note(monkeypatch):
    """With use_cache=True each compiled GPT-2 block recompiles, and past the recompile limit runs eager."""
    monkeypatch.setattr(torchacc._utils.logging, "_seen", set())
    monkeypatch.setattr(torch, "compile", lambda fn: fn)  # only the cache switch is under test
    config = torchacc.Config()
    config.compute.compile = True
    config.dist.fsdp.wrap_layer_cls = {"GPT2Block"}
    model = tiny_gpt2()
    assert model.config.use_cache
    with pytest.warns(UserWarning, match=r"compute.compile=True: training forwards run with use_cache=False"):
        model = torchacc.accelerate(model, config=config)
    assert model.config.use_cache, "left as it is, for generate()"
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    assert model(input_ids=ids).past_key_values is None
    position = list(inspect.signature(model.forward).parameters).index("use_cache")
    assert model(ids, *[None] * (position - 1), True).past_key_values is None, "a positional use_cache=True too"
    with torch.no_grad():
        assert model(input_ids=ids).past_key_values is not None
    model.eval()
    assert model(input_ids=ids).past_key_values is not None
