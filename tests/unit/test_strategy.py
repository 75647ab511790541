"""FSDP2Strategy in one process: argument checks, set-up order, and the single-process step path."""

import pytest
import torch
from _models import TinyNet, tiny_gpt2, token_dataset
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import torchacc
from torchacc import FSDP2Strategy


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sharding_strategy": "ZERO3"}, "sharding_strategy='ZERO3' is not one of FULL_SHARD, SHARD_GRAD_OP"),
        ({"state_dict_type": "mixed"}, "state_dict_type='mixed' must be 'full' or 'sharded'"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an int >= 1, got 0"),
        ({"tensor_parallel_plan": "colwise"}, "tensor_parallel_plan='colwise' must be 'auto'"),
        ({"tensor_parallel_plan": ["q_proj"]}, "tensor_parallel_plan must be 'auto' or a mapping .*, got list"),
        ({"data_parallel_size": 0}, "data_parallel_size must be an int >= 1, got 0"),
        ({"mp_policy": "int8"}, "mp_policy='int8' must be a MixedPrecisionPolicy or 'bf16', 'fp16', 'fp32'"),
        ({"max_norm": -1.0}, r"max_norm=-1.0 must be >= 0 \(0 disables clipping\)"),
        ({"micro_train_batch_size": 0}, "micro_train_batch_size must be an int >= 1, got 0"),
        ({"train_batch_size": 2.5}, "train_batch_size must be an int >= 1, got 2.5"),
    ],
)
def test_constructor_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FSDP2Strategy(**kwargs)


def test_config_must_be_a_config():
    with pytest.raises(TypeError, match="config must be a torchacc.Config, got dict"):
        FSDP2Strategy({"dist": {}})


@pytest.mark.parametrize("prop", ["root_device", "world_size", "global_rank", "local_rank", "is_global_zero"])
def test_properties_before_setup_say_what_to_call(prop):
    with pytest.raises(RuntimeError, match=r"call strategy.setup_environment\(\) first"):
        getattr(FSDP2Strategy(), prop)


def test_setup_checks_batch_sizes_and_data_parallel_size(monkeypatch):
    with pytest.raises(ValueError, match="train_batch_size=3 is not a multiple of micro_train_batch_size=2"):
        FSDP2Strategy(micro_train_batch_size=2, train_batch_size=3).setup_environment()
    with pytest.raises(ValueError, match="data_parallel_size=2 must equal the world size 1"):
        FSDP2Strategy(data_parallel_size=2).setup_environment()


def test_steps_before_parallelize_say_what_to_call():
    strategy = FSDP2Strategy()
    strategy.setup_environment()
    with pytest.raises(RuntimeError, match=r"call strategy.parallelize\(model\) first"):
        strategy.training_step({"x": torch.zeros(1)}, 0)


def test_single_process_loop_with_accumulation_validation_and_predict():
    strategy = FSDP2Strategy(micro_train_batch_size=2, train_batch_size=4, max_norm=1.0)
    strategy.setup_environment()
    assert strategy.accumulation_steps == 2 and strategy.is_global_zero and strategy.device_mesh is None
    model = strategy.parallelize(tiny_gpt2())
    with pytest.warns(UserWarning, match="already parallelized"):
        assert strategy.parallelize(model) is model
    loader = strategy.process_dataloader(DataLoader(token_dataset(8), batch_size=2))
    optimizer = strategy.create_optimizer(model, lr=1e-2, weight_decay=0.1)
    norms = []
    for i, batch in enumerate(loader):
        batch = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
        strategy.backward(strategy.training_step(batch, i), model, optimizer)
        norms.append(strategy.optimizer_step(optimizer, model))
    assert norms[0] is None and isinstance(norms[1], float) and strategy.global_step == 2
    loss = strategy.validation_step(batch, 0)
    assert not loss.requires_grad
    assert strategy.predict_step({"input_ids": batch["input_ids"]}, 0).logits.shape[-1] == 128
    assert strategy.reduce(torch.tensor(2.0)).item() == 2.0 and strategy.broadcast("x") == "x"
    strategy.barrier("named")


def test_loss_fn_and_missing_loss():
    strategy = FSDP2Strategy()
    strategy.setup_environment()
    strategy.parallelize(TinyNet())
    with pytest.raises(ValueError, match=r"output has no .loss; give FSDP2Strategy a loss_fn=fn\(model, batch\)"):
        strategy.training_step(torch.zeros(2, 16), 0)
    strategy.loss_fn = lambda model, batch: model(batch).sum()
    assert strategy.training_step(torch.zeros(2, 16), 0).dim() == 0


def test_activation_checkpointing_policy_and_precision_reach_the_config():
    strategy = FSDP2Strategy(activation_checkpointing_policy={"Block"}, mp_policy="bf16")
    strategy.setup_environment()
    model = strategy.parallelize(TinyNet())
    assert strategy.config.memory.gc and strategy.config.memory.gc_cls == {"Block"}
    assert type(model.blocks[0].forward).__name__ == "_CheckpointedForward"
    assert model(torch.zeros(2, 16)).dtype == torch.bfloat16, "mp_policy='bf16' reaches the forward"


def test_clip_grad_norm_matches_torch_in_one_process():
    torch.manual_seed(0)
    a, b = TinyNet(), TinyNet()
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 16)
    a(x).sum().backward()
    b(x).sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.1).item()
    assert torchacc.clip_grad_norm_(b.parameters(), 0.1) == pytest.approx(expected, rel=1e-6)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_parallelize_fn_is_called_in_one_process_with_a_one_rank_mesh():
    seen = {}

    def parallelize_fn(model, mesh, mp_policy):
        seen.update(names=mesh.mesh_dim_names, shape=tuple(mesh.shape), policy=mp_policy)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)

    strategy = FSDP2Strategy(parallelize_fn=parallelize_fn, mp_policy="bf16")
    strategy.setup_environment()
    assert strategy.device_mesh.mesh_dim_names == ("fsdp",) and strategy.device_mesh.size() == 1
    torch.manual_seed(0)
    model = strategy.parallelize(TinyNet())
    assert seen["names"] == ("fsdp",) and seen["shape"] == (1,)
    assert seen["policy"].param_dtype == torch.bfloat16, "the policy the fn gets is the strategy's"
    assert isinstance(model.blocks[0], FSDPModule) and isinstance(model.head.weight, DTensor)
    strategy.loss_fn = lambda model, batch: model(batch).float().square().mean()
    optimizer = strategy.create_optimizer(model, lr=0.1)
    before = model.head.weight.full_tensor().clone()
    strategy.backward(strategy.training_step(torch.ones(2, 16), 0), model, optimizer)
    strategy.optimizer_step(optimizer, model)
    assert not torch.equal(before, model.head.weight.full_tensor()), "the fn's sharded model trains"
