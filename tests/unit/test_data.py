"""Unit tests for torchacc.data on CPU, without a process group."""

import json
from collections import OrderedDict, defaultdict, namedtuple

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    WeightedRandomSampler,
)

from torchacc.data import ShardedDataLoader, move_to_device, shard_dataloader

CPU = torch.device("cpu")
Pair = namedtuple("Pair", ["a", "b"])


def _indices(n: int) -> list[int]:
    return list(range(n))


def _collect(loader: ShardedDataLoader) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


def _ranks(loader: DataLoader, num_replicas: int, **kwargs) -> list[ShardedDataLoader]:
    return [
        shard_dataloader(loader, num_replicas=num_replicas, rank=rank, device=CPU, **kwargs)
        for rank in range(num_replicas)
    ]


@pytest.mark.parametrize("num_replicas", [2, 3])
@pytest.mark.parametrize("shuffle", [False, True])
def test_ranks_are_disjoint_and_cover_dataset(num_replicas: int, shuffle: bool) -> None:
    n = 24  # divisible by 2 and 3: nothing is padded or dropped
    for drop_last in (False, True):
        loader = DataLoader(_indices(n), batch_size=4, shuffle=shuffle, drop_last=drop_last)
        seen = [sample for rank in _ranks(loader, num_replicas) for batch in _collect(rank) for sample in batch]
        assert sorted(seen) == _indices(n)


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_uneven_dataset_pads_without_drop_last(num_replicas: int) -> None:
    n = 25
    loader = DataLoader(_indices(n), batch_size=4, shuffle=True)
    seen = [s for rank in _ranks(loader, num_replicas) for batch in _collect(rank) for s in batch]
    padded = -(-n // num_replicas) * num_replicas
    assert set(seen) == set(_indices(n))
    assert len(seen) == padded  # at most num_replicas - 1 samples repeated


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_uneven_dataset_drops_tail_with_drop_last(num_replicas: int) -> None:
    n, batch_size = 25, 4
    loader = DataLoader(_indices(n), batch_size=batch_size, shuffle=True, drop_last=True)
    seen = [s for rank in _ranks(loader, num_replicas) for batch in _collect(rank) for s in batch]
    assert len(seen) == len(set(seen))
    assert len(seen) == num_replicas * ((n // num_replicas) // batch_size) * batch_size


@pytest.mark.parametrize("num_replicas", [2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_len_matches_yield_count_and_ranks_agree(num_replicas: int, drop_last: bool) -> None:
    loader = DataLoader(_indices(23), batch_size=3, shuffle=True, drop_last=drop_last)
    counts = set()
    for rank in _ranks(loader, num_replicas):
        num_batches = len(_collect(rank))
        assert len(rank) == num_batches
        counts.add(num_batches)
    assert len(counts) == 1


def test_loader_attributes_preserved() -> None:
    def collate(samples):
        return torch.tensor(samples) * 10

    loader = DataLoader(_indices(12), batch_size=3, collate_fn=collate, num_workers=0, drop_last=True, timeout=0)
    sharded = shard_dataloader(loader, num_replicas=2, rank=1, device=CPU)
    assert sharded.batch_size == 3
    assert sharded.dataset is loader.dataset
    assert sharded.device == CPU
    assert sharded.loader is not loader
    assert sharded.loader.collate_fn is collate
    assert sharded.loader.num_workers == 0
    assert sharded.loader.drop_last is True
    assert sharded.sampler is sharded.loader.sampler
    assert sharded.sampler.num_replicas == 2 and sharded.sampler.rank == 1
    assert all(int(x) % 10 == 0 for batch in sharded for x in batch)


def test_worker_loader_is_rebuilt_with_its_settings() -> None:
    loader = DataLoader(_indices(8), batch_size=2, num_workers=1, prefetch_factor=3, persistent_workers=True)
    sharded = shard_dataloader(loader, num_replicas=2, rank=0, device=CPU)
    assert sharded.loader.num_workers == 1
    assert sharded.loader.prefetch_factor == 3
    assert sharded.loader.persistent_workers is True
    assert _collect(sharded) == [[0, 2], [4, 6]]


@pytest.mark.parametrize(
    ("loader_shuffle", "override", "expected"),
    [(True, None, True), (False, None, False), (False, True, True), (True, False, False)],
)
def test_shuffle_none_keeps_and_bool_overrides(loader_shuffle: bool, override: bool | None, expected: bool) -> None:
    loader = DataLoader(_indices(10), batch_size=2, shuffle=loader_shuffle)
    sharded = shard_dataloader(loader, num_replicas=2, rank=0, device=CPU, shuffle=override)
    assert sharded.sampler.shuffle is expected


def test_drop_last_none_keeps_and_bool_overrides() -> None:
    loader = DataLoader(_indices(10), batch_size=3, drop_last=True)
    kept = shard_dataloader(loader, num_replicas=2, rank=0, device=CPU)
    assert kept.loader.drop_last is True and kept.sampler.drop_last is True
    overridden = shard_dataloader(loader, num_replicas=2, rank=0, device=CPU, drop_last=False)
    assert overridden.loader.drop_last is False and overridden.sampler.drop_last is False


def test_batch_size_none_is_sharded_per_sample() -> None:
    loader = DataLoader(torch.arange(7), batch_size=None)
    ranks = _ranks(loader, 2, drop_last=True)
    seen = [[int(sample) for sample in rank] for rank in ranks]
    assert [len(rank) for rank in ranks] == [3, 3]
    assert seen == [[0, 2, 4], [1, 3, 5]]


def test_set_epoch_is_called_each_pass() -> None:
    loader = DataLoader(_indices(64), batch_size=8, shuffle=True)
    first = shard_dataloader(loader, num_replicas=2, rank=0, device=CPU, seed=3)
    second = shard_dataloader(loader, num_replicas=2, rank=0, device=CPU, seed=3)
    pass0, pass1 = _collect(first), _collect(first)
    assert first.epoch == 2
    assert pass0 != pass1
    other = shard_dataloader(loader, num_replicas=2, rank=1, device=CPU, seed=3)
    other.set_epoch(1)
    assert sorted(sum(pass1, []) + sum(_collect(other), [])) == _indices(64)  # ranks agree on the epoch-1 order
    assert _collect(second) == pass0  # same seed and epoch, fresh loader: same order
    first.set_epoch(0)
    assert _collect(first) == pass0  # an explicit epoch wins for the next pass


def test_move_to_device_keeps_nested_types() -> None:
    counts = defaultdict(int, {"n": torch.ones(1)})
    batch = {
        "items": [(torch.zeros(2), torch.ones(2)), ("label", 3)],
        "pair": Pair(a=torch.arange(3), b=None),
        "ordered": OrderedDict(x=torch.ones(1)),
        "counts": counts,
    }
    moved = move_to_device(batch, CPU)
    assert type(moved) is dict
    assert type(moved["items"]) is list and type(moved["items"][0]) is tuple
    assert torch.equal(moved["items"][0][1], torch.ones(2))
    assert moved["items"][1] == ("label", 3)
    assert type(moved["pair"]) is Pair and moved["pair"].b is None
    assert torch.equal(moved["pair"].a, torch.arange(3))
    assert type(moved["ordered"]) is OrderedDict
    assert type(moved["counts"]) is defaultdict and moved["counts"].default_factory is int
    assert moved["counts"] is not counts


def test_move_to_device_passes_non_tensors_through() -> None:
    marker = object()
    assert move_to_device(marker, CPU) is marker
    assert move_to_device("text", CPU) == "text"


def test_shard_false_passes_batches_through() -> None:
    loader = DataLoader(_indices(6), batch_size=2, sampler=SequentialSampler(_indices(6)))
    wrapped = shard_dataloader(loader, num_replicas=2, rank=1, device=CPU, shard=False)
    assert wrapped.loader is loader
    assert len(wrapped) == 3
    assert _collect(wrapped) == [[0, 1], [2, 3], [4, 5]]


def test_shard_false_warns_about_ignored_knobs() -> None:
    loader = DataLoader(_indices(4), batch_size=2)
    with pytest.warns(UserWarning, match="shuffle and drop_last are ignored"):
        shard_dataloader(loader, num_replicas=2, rank=0, device=CPU, shard=False, shuffle=True)


def test_custom_sampler_is_rejected() -> None:
    loader = DataLoader(_indices(6), batch_size=2, sampler=WeightedRandomSampler([1.0] * 6, num_samples=6))
    with pytest.raises(ValueError, match=r"custom sampler \(WeightedRandomSampler\).*shard=False"):
        shard_dataloader(loader, num_replicas=2, rank=0, device=CPU)


def test_custom_batch_sampler_is_rejected() -> None:
    class MyBatchSampler(BatchSampler):
        pass

    batch_sampler = MyBatchSampler(SequentialSampler(_indices(6)), batch_size=2, drop_last=False)
    loader = DataLoader(_indices(6), batch_sampler=batch_sampler)
    with pytest.raises(ValueError, match=r"custom batch_sampler \(MyBatchSampler\).*DistributedSampler"):
        shard_dataloader(loader, num_replicas=2, rank=0, device=CPU)


def test_batch_sampler_argument_is_rejected() -> None:
    # Exactly torch's BatchSampler, as DataLoader builds for batch_size=, but given by the user: the
    # loader's batch_size is then None, so a rebuilt loader would yield unbatched samples.
    batch_sampler = BatchSampler(RandomSampler(_indices(6)), batch_size=2, drop_last=False)
    loader = DataLoader(_indices(6), batch_sampler=batch_sampler)
    with pytest.raises(ValueError, match=r"custom batch_sampler \(BatchSampler\).*batch_size=.*shard=False"):
        shard_dataloader(loader, num_replicas=2, rank=0, device=CPU)
    built = DataLoader(_indices(6), batch_size=2, shuffle=True)  # DataLoader's own BatchSampler is fine
    assert [len(batch) for batch in shard_dataloader(built, num_replicas=2, rank=0, device=CPU)] == [2, 1]


def test_iterable_dataset_is_rejected() -> None:
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    loader = DataLoader(Stream(), batch_size=2)
    with pytest.raises(ValueError, match=r"cannot split an iterable dataset \(Stream\).*shard=False"):
        shard_dataloader(loader, num_replicas=2, rank=0, device=CPU)


def test_non_dataloader_is_rejected() -> None:
    with pytest.raises(TypeError, match=r"expects a torch.utils.data.DataLoader, got builtins.list"):
        shard_dataloader([1, 2, 3], num_replicas=2, rank=0, device=CPU)


@pytest.mark.parametrize(("num_replicas", "rank", "match"), [(0, 0, "num_replicas must be >= 1"), (2, 2, "rank must")])
def test_bad_rank_is_rejected(num_replicas: int, rank: int, match: str) -> None:
    loader = DataLoader(_indices(4), batch_size=2)
    with pytest.raises(ValueError, match=match):
        shard_dataloader(loader, num_replicas=num_replicas, rank=rank, device=CPU)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device for pinned, non-blocking copies")
def test_cuda_prefetch_places_pinned_batches() -> None:
    device = torch.device("cuda")
    data = [{"x": torch.full((4,), float(i)), "pair": Pair(a=torch.tensor(i), b="tag")} for i in range(16)]
    loader = DataLoader(data, batch_size=4, pin_memory=True)
    for prefetch in (True, False):
        sharded = shard_dataloader(loader, num_replicas=2, rank=0, device=device, prefetch=prefetch)
        assert sharded.loader.pin_memory is True
        batches = list(sharded)
        assert len(batches) == len(sharded) == 2
        for batch in batches:
            assert batch["x"].device.type == "cuda" and batch["pair"].a.device.type == "cuda"
            assert type(batch["pair"]) is Pair and batch["pair"].b == ["tag"] * 4
        torch.cuda.synchronize()
        assert sorted(batches[0]["pair"].a.tolist() + batches[1]["pair"].a.tolist()) == [0, 2, 4, 6, 8, 10, 12, 14]
    pinned = torch.ones(8).pin_memory()
    assert move_to_device(pinned, device, non_blocking=True).device.type == "cuda"


# --- Resuming: ShardedDataLoader.state_dict / load_state_dict ---------------------------------------


def _sharded(
    n: int, num_replicas: int, rank: int, *, batch_size: int | None = 3, shuffle: bool = True, seed: int = 7, **kwargs
) -> ShardedDataLoader:
    loader = DataLoader(torch.arange(n), batch_size=batch_size, shuffle=shuffle)
    return shard_dataloader(loader, num_replicas=num_replicas, rank=rank, device=CPU, seed=seed, **kwargs)


def _take(loader: ShardedDataLoader, num_batches: int) -> list:
    """Start a pass and consume ``num_batches`` of it without finishing it."""
    batches = iter(loader)
    return [next(batches).tolist() for _ in range(num_batches)]


def _global_order(n: int, epoch: int, *, shuffle: bool = True, seed: int = 7) -> list[int]:
    order = _sharded(n, 1, 0, batch_size=None, shuffle=shuffle, seed=seed)
    order.set_epoch(epoch)
    return _flat(_collect(order))


def _flat(batches: list) -> list[int]:
    return [sample for batch in batches for sample in (batch if isinstance(batch, list) else [batch])]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("stop", ["mid_epoch", "last_batch", "after_epoch"])
def test_same_world_resume_matches_uninterrupted_run(shuffle: bool, drop_last: bool, stop: str) -> None:
    n, num_replicas = 23, 3  # uneven: rank shares are padded or cut
    full = _sharded(n, num_replicas, 0, shuffle=shuffle, drop_last=drop_last)
    per_epoch = len(full)
    consumed = {"mid_epoch": 1, "last_batch": per_epoch, "after_epoch": 0}[stop]
    states = []
    for rank in range(num_replicas):
        uninterrupted = _sharded(n, num_replicas, rank, shuffle=shuffle, drop_last=drop_last)
        expected = [_collect(uninterrupted) for _ in range(3)]
        before = _sharded(n, num_replicas, rank, shuffle=shuffle, drop_last=drop_last)
        assert _collect(before) == expected[0]
        assert _take(before, consumed) == expected[1][:consumed]
        state = json.loads(json.dumps(before.state_dict()))
        states.append(state)
        after = _sharded(n, num_replicas, rank, shuffle=shuffle, drop_last=drop_last)
        after.load_state_dict(state)
        resumed_epoch = 2 if stop == "last_batch" else 1
        assert after.num_batches_remaining == len(expected[resumed_epoch]) - (consumed if stop == "mid_epoch" else 0)
        assert len(after) == per_epoch  # a full epoch's count, also while the resumed pass is shorter
        rest = _collect(after)
        if stop == "last_batch":  # a finished epoch is saved as the start of the next one
            assert state["epoch"] == 2 and state["batches_consumed"] == 0
            assert rest == expected[2]
        else:
            assert state["epoch"] == 1 and state["batches_consumed"] == consumed
            assert rest == expected[1][consumed:]
            assert len(after) == per_epoch  # the resumed pass is over: full epochs again
            assert _collect(after) == expected[2]
    assert all(state == states[0] for state in states)  # the rank does not matter


def test_state_dict_is_plain_json() -> None:
    loader = _sharded(10, 2, 1, batch_size=None, drop_last=True)
    _take(loader, 2)
    state = loader.state_dict()
    assert json.loads(json.dumps(state)) == state
    assert state == {
        "version": 1,
        "sharded": True,
        "epoch": 0,
        "batches_consumed": 2,
        "split_start": 0,
        "num_replicas": 2,
        "batch_size": None,
        "seed": 7,
        "shuffle": True,
        "drop_last": True,
        "dataset_len": 10,
    }


def test_state_counts_yielded_batches_not_prefetched_ones() -> None:
    loader = DataLoader(_indices(32), batch_size=2, num_workers=1, prefetch_factor=4)
    sharded = shard_dataloader(loader, num_replicas=2, rank=0, device=CPU)
    assert sharded.state_dict()["batches_consumed"] == 0
    batches = iter(sharded)
    first = [next(batches).tolist() for _ in range(3)]
    assert sharded.state_dict()["batches_consumed"] == 3
    resumed = shard_dataloader(loader, num_replicas=2, rank=0, device=CPU)
    resumed.load_state_dict(sharded.state_dict())
    assert first + _collect(resumed) == _collect(shard_dataloader(loader, num_replicas=2, rank=0, device=CPU))


def _change_world(n: int, old: int, new: int, consumed: int, **kwargs) -> tuple[list[int], list[list[list[int]]]]:
    """Consume ``consumed`` batches of epoch 1 on ``old`` ranks, resume on ``new`` ranks; return both parts."""
    taken, state = [], None
    for rank in range(old):
        loader = _sharded(n, old, rank, **kwargs)
        loader.set_epoch(1)
        taken += _flat(_take(loader, consumed))
        assert state in (None, loader.state_dict())
        state = loader.state_dict()
    resumed = []
    for rank in range(new):
        loader = _sharded(n, new, rank, **kwargs)
        loader.load_state_dict(state)
        num_batches = loader.num_batches_remaining
        fresh = _sharded(n, new, rank, **kwargs)
        fresh.set_epoch(2)
        assert len(loader) == len(fresh)  # a full epoch at this world size, not the rest of the resumed one
        resumed.append(_collect(loader))
        assert len(resumed[-1]) == num_batches
        assert len(loader) == len(fresh) == loader.num_batches_remaining
        assert _collect(loader) == _collect(fresh)  # the next pass is a full epoch 2
    return taken, resumed


@pytest.mark.parametrize(("old", "new"), [(2, 1), (2, 4), (4, 2)])
@pytest.mark.parametrize("n", [48, 50])  # even for every world size, and not
@pytest.mark.parametrize("drop_last", [False, True])
def test_world_size_change_resplits_the_rest_of_the_epoch(old: int, new: int, n: int, drop_last: bool) -> None:
    batch_size, consumed = 3, 2
    taken, resumed = _change_world(n, old, new, consumed, batch_size=batch_size, drop_last=drop_last)
    order = _global_order(n, 1)
    prefix = consumed * batch_size * old
    assert sorted(taken) == sorted(order[:prefix])  # the old ranks took a prefix of the epoch's global order
    remaining = order[prefix:]
    seen = [sample for rank in resumed for sample in _flat(rank)]
    assert len({len(rank) for rank in resumed}) == 1  # every new rank runs the same number of steps
    assert not set(seen) & set(taken)  # nothing consumed is replayed
    if not drop_last:
        assert set(seen) == set(remaining)  # nothing is skipped
        assert len(seen) == -(-len(remaining) // new) * new  # repeats only as padding, fewer than new
    else:
        assert len(seen) == len(set(seen))
        assert len(remaining) - len(seen) < new * batch_size  # only a tail that fills no batch is dropped
    if len(remaining) % new == 0 and not drop_last:
        assert sorted(seen) == sorted(remaining)  # exactly once


def test_world_size_change_then_save_again() -> None:
    n, batch_size = 50, 2
    kwargs = {"batch_size": batch_size}
    states = []
    for rank in range(2):
        loader = _sharded(n, 2, rank, **kwargs)
        _take(loader, 3)
        states.append(loader.state_dict())
    taken = 3 * batch_size * 2
    order = _global_order(n, 0)
    continued, stopped = [], []
    for rank in range(4):
        uninterrupted = _sharded(n, 4, rank, **kwargs)
        uninterrupted.load_state_dict(states[0])
        continued.append(_collect(uninterrupted))
        loader = _sharded(n, 4, rank, **kwargs)
        loader.load_state_dict(states[0])
        _take(loader, 2)
        stopped.append(loader.state_dict())
    assert stopped[0]["split_start"] == taken and stopped[0]["batches_consumed"] == 2
    for rank in range(4):  # the same world again: bitwise the batches of the run that did not stop
        loader = _sharded(n, 4, rank, **kwargs)
        loader.load_state_dict(stopped[0])
        assert _collect(loader) == continued[rank][2:]
    taken += 2 * batch_size * 4
    seen = []
    for rank in range(3):  # another world size: the rest, once each, plus padding
        loader = _sharded(n, 3, rank, **kwargs)
        loader.load_state_dict(stopped[0])
        seen += _flat(_collect(loader))
    assert set(seen) == set(order[taken:]) and len(seen) == -(-(n - taken) // 3) * 3


def test_world_size_change_per_sample_batches() -> None:
    taken, resumed = _change_world(9, 3, 2, 1, batch_size=None)
    order = _global_order(9, 1)
    assert sorted(taken) == sorted(order[:3])
    assert [len(rank) for rank in resumed] == [3, 3]
    assert sorted(sample for rank in resumed for sample in rank) == sorted(order[3:])


def test_set_epoch_after_load_keeps_or_discards_the_resume() -> None:
    loader = _sharded(12, 2, 0)
    expected = [_collect(loader) for _ in range(2)]
    loader.set_epoch(0)
    _take(loader, 1)
    state = loader.state_dict()
    kept = _sharded(12, 2, 0)
    kept.load_state_dict(state)
    kept.set_epoch(0)  # the loaded epoch: an explicit per-epoch set_epoch call does not lose the position
    assert _collect(kept) == expected[0][1:]
    discarded = _sharded(12, 2, 0)
    discarded.load_state_dict(state)
    discarded.set_epoch(1)
    assert len(discarded) == len(expected[1])
    assert _collect(discarded) == expected[1]
    assert discarded.state_dict()["epoch"] == 2


@pytest.mark.parametrize(
    ("field", "saved", "current"),
    [
        ("batch_size", {"batch_size": 3}, {"batch_size": 4}),
        ("seed", {"seed": 7}, {"seed": 8}),
        ("shuffle", {"shuffle": True}, {"shuffle": False}),
        ("drop_last", {"drop_last": False}, {"drop_last": True}),
        ("dataset_len", {"n": 20}, {"n": 21}),
    ],
)
def test_resume_mismatch_names_field_and_values(field: str, saved: dict, current: dict) -> None:
    old = _sharded(saved.pop("n", 20), 2, 0, **saved)
    _take(old, 1)
    new = _sharded(current.pop("n", 20), 2, 0, **current)
    state = old.state_dict()
    match = rf"does not match this loader in {field} \(saved {state[field]!r}, current {new.state_dict()[field]!r}\)"
    with pytest.raises(ValueError, match=match):
        new.load_state_dict(state)
    assert new.state_dict() == {**state, "batches_consumed": 0, field: new.state_dict()[field]}  # left unchanged


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"version": 2}, ValueError, r"version 2 \(this torchacc reads version 1\)"),
        ({"sharded": False}, ValueError, r"saved from an unsharded loader \(shard=False\) but this is a sharded"),
        ({"epoch": "1"}, ValueError, r"field 'epoch' must be int, got '1'"),
        ({"shuffle": 1}, ValueError, r"field 'shuffle' must be bool, got 1"),
        ({"num_replicas": True}, ValueError, r"field 'num_replicas' must be int, got True"),
        ({"batches_consumed": -1}, ValueError, r"'batches_consumed' must be >= 0, got -1"),
        ({"num_replicas": 0}, ValueError, r"'num_replicas' must be >= 1, got 0"),
        ({"split_start": 20}, ValueError, r"'split_start' must be less than the dataset length 20, got 20"),
        ({"batches_consumed": 4}, ValueError, r"4 batches of epoch 0 .* only 4 batches per rank .*set_epoch\(1\)"),
    ],
)
def test_malformed_state_is_rejected(change: dict, error: type, match: str) -> None:
    loader = _sharded(20, 2, 0)
    state = {**loader.state_dict(), **change}
    with pytest.raises(error, match=match):
        loader.load_state_dict(state)


def test_missing_fields_and_non_dict_are_rejected() -> None:
    loader = _sharded(20, 2, 0)
    state = loader.state_dict()
    del state["seed"], state["dataset_len"]
    with pytest.raises(ValueError, match=r"missing \['dataset_len', 'seed'\]"):
        loader.load_state_dict(state)
    with pytest.raises(TypeError, match="state must be a dict returned by ShardedDataLoader.state_dict"):
        loader.load_state_dict([("epoch", 0)])


def test_shard_false_resume_reads_past_consumed_batches() -> None:
    def make() -> ShardedDataLoader:
        return shard_dataloader(DataLoader(_indices(10), batch_size=2), num_replicas=1, rank=0, device=CPU, shard=False)

    loader = make()
    expected = _collect(loader)
    _take(loader, 2)
    state = json.loads(json.dumps(loader.state_dict()))
    assert state == {"version": 1, "sharded": False, "epoch": 1, "batches_consumed": 2}
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.num_batches_remaining == 3 and len(resumed) == 5
    assert _collect(resumed) == expected[2:]
    assert resumed.epoch == 2 and len(resumed) == 5
    with pytest.raises(ValueError, match=r"saved from a sharded loader \(shard=True\) but this is an unsharded"):
        resumed.load_state_dict(_sharded(10, 1, 0).state_dict())
    with pytest.raises(ValueError, match="7 batches of epoch 1 were consumed, but the loader has only 5 batches"):
        resumed.load_state_dict({**state, "batches_consumed": 7})


# --- The DistributedSampler idiom: loader.sampler.set_epoch(epoch) before each pass ---------------


def _reference(n: int, num_replicas: int, rank: int, epoch: int, seed: int = 7) -> list[int]:
    sampler = DistributedSampler(_indices(n), num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def test_sampler_set_epoch_idiom_matches_distributed_sampler() -> None:
    n, epochs = 23, [3, 4, 4, 1]  # a non-zero start, a repeated epoch, an earlier one
    for rank in range(2):
        loader = _sharded(n, 2, rank)
        for epoch in epochs:
            loader.sampler.set_epoch(epoch)
            assert loader.epoch == epoch
            assert _flat(_collect(loader)) == _reference(n, 2, rank, epoch)
        assert loader.epoch == epochs[-1] + 1  # without a call, the next pass is the following epoch
        assert _flat(_collect(loader)) == _reference(n, 2, rank, epochs[-1] + 1)


def test_sampler_set_epoch_is_reported_by_state_dict() -> None:
    loader = _sharded(23, 2, 0)
    loader.sampler.set_epoch(5)
    assert loader.state_dict()["epoch"] == 5
    _take(loader, 2)
    assert (loader.state_dict()["epoch"], loader.state_dict()["batches_consumed"]) == (5, 2)
    loader.sampler.set_epoch(6)  # mid-pass: as loader.set_epoch, it is the next pass's epoch
    assert (loader.state_dict()["epoch"], loader.state_dict()["batches_consumed"]) == (5, 2)
    _collect(loader)
    assert loader.state_dict()["epoch"] == 7
    ordered = _sharded(23, 2, 0)
    ordered.set_epoch(2)  # the later call wins, whichever object it was made on
    ordered.sampler.set_epoch(6)
    assert ordered.state_dict()["epoch"] == 6
    ordered.sampler.set_epoch(1)
    ordered.set_epoch(2)
    assert ordered.state_dict()["epoch"] == 2


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_resume_mid_epoch_then_sampler_set_epoch_idiom(num_replicas: int) -> None:
    n, start, stop_epoch, consumed = 41, 2, 3, 2
    for rank in range(num_replicas):
        uninterrupted = _sharded(n, num_replicas, rank)
        expected = {}
        for epoch in range(start, 5):
            uninterrupted.sampler.set_epoch(epoch)
            expected[epoch] = _collect(uninterrupted)
        before = _sharded(n, num_replicas, rank)
        for epoch in range(start, stop_epoch):
            before.sampler.set_epoch(epoch)
            assert _collect(before) == expected[epoch]
        before.sampler.set_epoch(stop_epoch)
        assert _take(before, consumed) == expected[stop_epoch][:consumed]
        state = json.loads(json.dumps(before.state_dict()))
        assert (state["epoch"], state["batches_consumed"]) == (stop_epoch, consumed)
        after = _sharded(n, num_replicas, rank)
        after.load_state_dict(state)
        after.sampler.set_epoch(state["epoch"])  # the saved epoch keeps the position, as loader.set_epoch does
        assert after.num_batches_remaining == len(expected[stop_epoch]) - consumed
        assert len(after) == len(expected[stop_epoch])
        batches = iter(after)
        first = next(batches).tolist()
        assert after.state_dict() == {**state, "batches_consumed": consumed + 1}
        assert after.num_batches_remaining == len(expected[stop_epoch]) - consumed - 1  # counts down in the pass
        assert [first] + [batch.tolist() for batch in batches] == expected[stop_epoch][consumed:]
        for epoch in range(stop_epoch + 1, 5):
            after.sampler.set_epoch(epoch)
            assert _collect(after) == expected[epoch]
        discarded = _sharded(n, num_replicas, rank)
        discarded.load_state_dict(state)
        discarded.sampler.set_epoch(stop_epoch + 1)  # another epoch: a full pass of it
        assert len(discarded) == len(expected[stop_epoch + 1])
        assert _collect(discarded) == expected[stop_epoch + 1]
        assert discarded.state_dict()["epoch"] == stop_epoch + 2


def test_shard_false_user_sampler_set_epoch_idiom() -> None:
    n, epochs = 23, [3, 4, 4, 1]

    def make(rank: int) -> ShardedDataLoader:
        sampler = DistributedSampler(_indices(n), num_replicas=2, rank=rank, shuffle=True, seed=7)
        loader = DataLoader(_indices(n), batch_size=3, sampler=sampler)
        return shard_dataloader(loader, num_replicas=2, rank=rank, device=CPU, shard=False)

    for rank in range(2):
        loader = make(rank)
        expected = {}
        for epoch in epochs:
            loader.sampler.set_epoch(epoch)
            assert loader.state_dict()["epoch"] == epoch
            expected[epoch] = _collect(loader)
            assert _flat(expected[epoch]) == _reference(n, 2, rank, epoch)
        assert loader.state_dict()["epoch"] == epochs[-1] + 1
        loader.sampler.set_epoch(4)
        _take(loader, 1)
        state = loader.state_dict()
        assert state == {"version": 1, "sharded": False, "epoch": 4, "batches_consumed": 1}
        resumed = make(rank)
        resumed.load_state_dict(state)
        resumed.sampler.set_epoch(state["epoch"])  # keeps the position: reads past the consumed batch
        assert _collect(resumed) == expected[4][1:]
        resumed.sampler.set_epoch(3)
        assert _collect(resumed) == expected[3]
