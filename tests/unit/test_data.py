"""Unit tests for torchacc.data on CPU, without a process group."""

from collections import OrderedDict, defaultdict, namedtuple

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler, WeightedRandomSampler

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
