"""Scale features inside each rank (see tests/_launch.py): prefetch and reshard policies, reduce dtype,
compile, meta-device init from checkpoints; the assertions live in test_scale.py."""

import torch
from _models import PureBlock, TinyNet, tiny_gpt2
from scenarios import full_state, gpt2_config, train_gpt2
from torch._dynamo.utils import counters

import torchacc


def tinynet_train(**extra) -> dict:
    """TinyNet on 2-rank FSDP for a few SGD steps; eager and compiled runs are compared, and dynamo's counters
    say whether anything was compiled (a graph break inside a block would leave it eager)."""
    config = torchacc.Config()
    config.dist.fsdp.size = torchacc.dist.world_size()
    config.dist.fsdp.wrap_layer_cls = {"PureBlock"}
    for key, value in extra.items():
        section, name = key.split("__")
        setattr(getattr(config, section), name, value)
    counters.clear()
    torch.manual_seed(0)
    model = torchacc.accelerate(TinyNet(block_cls=PureBlock), config=config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(torchacc.dist.rank()))
    losses = []
    for _ in range(4):
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "state": full_state(model),
        "keys": sorted(model.state_dict()),
        "num_graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sorted(counters["graph_break"]),
    }


def fsdp_policies(**extra) -> dict:
    """What FSDP2 was told: each block's explicit prefetch targets and whether it reshards after forward."""
    model = torchacc.accelerate(tiny_gpt2(seed=0), config=gpt2_config(fsdp=2, **extra))
    blocks = list(model.transformer.h)
    position = {id(block._get_fsdp_state()): i for i, block in enumerate(blocks)}
    states = [block._get_fsdp_state() for block in blocks]
    return {
        "forward": [[position[id(s)] for s in state._states_to_forward_prefetch] for state in states],
        "backward": [[position[id(s)] for s in state._states_to_backward_prefetch] for state in states],
        "reshards": [state._fsdp_param_group.post_forward_mesh_info is not None for state in states],
    }


def post_forward_group_sizes(model: torch.nn.Module) -> list[int | None]:
    """Per FSDP unit (blocks, then the root): how many ranks hold its parameters between forward and backward."""
    units = [*model.transformer.h, model]
    infos = [unit._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info for unit in units]
    return [None if info is None else info.shard_mesh_size for info in infos]


def two_rank_suite() -> dict:
    return {
        "policy_default": fsdp_policies(),
        "policy_prefetch": fsdp_policies(dist__fsdp__forward_prefetch=1, dist__fsdp__backward_prefetch=2),
        "policy_keep_gathered": fsdp_policies(dist__fsdp__reshard_after_forward=False),
        "default": train_gpt2(gpt2_config(fsdp=2)),
        "prefetch": train_gpt2(gpt2_config(fsdp=2, dist__fsdp__forward_prefetch=1, dist__fsdp__backward_prefetch=2)),
        "keep_gathered": train_gpt2(gpt2_config(fsdp=2, dist__fsdp__reshard_after_forward=False)),
        "reduce_bf16": train_gpt2(gpt2_config(fsdp=2, dist__fsdp__reduce_dtype="bfloat16")),
        "selective_gc": train_gpt2(gpt2_config(fsdp=2, memory__gc=True, memory__gc_interval=2)),
        "eager": tinynet_train(memory__gc=True),
        "compiled": tinynet_train(memory__gc=True, compute__compile=True),
    }


def four_rank_suite() -> dict:
    config = gpt2_config(fsdp=4, dist__fsdp__reshard_after_forward=2)
    model = torchacc.accelerate(tiny_gpt2(seed=0), config=config)
    model(input_ids=torch.arange(16).unsqueeze(0))  # FSDP2 settles the root's policy at its first forward
    return {"reshard_to_2": train_gpt2(config), "post_forward_group_sizes": post_forward_group_sizes(model)}


def init_from(source: str, mode: str) -> dict:
    """Build tiny GPT-2 on the meta device and fill it from ``source``; report logits on fixed tokens."""
    with torchacc.init_empty_weights():
        model = tiny_gpt2(seed=123)
        model.register_buffer("table", torch.arange(4.0), persistent=False)
    config = gpt2_config(fsdp=2, dist__fsdp__init_from=source)
    model = torchacc.accelerate(model, config=config)
    ids = torch.arange(16).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    local = sum(p.to_local().numel() for p in model.parameters())
    return {"logits": logits, "table": model.table.clone(), "local_numel": local}
