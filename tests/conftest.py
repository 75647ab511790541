"""Test hygiene: every test starts and ends with no process group and the environment it found."""

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

_DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _clean_distributed_state():
    leaked = [name for name in _DIST_VARS if name in os.environ]
    if leaked:
        pytest.fail(f"torchrun variables leaked into the test environment: {leaked}")
    torch.set_num_threads(1)
    saved = dict(os.environ)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


requires_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA devices for the NCCL path",
)


# The files that take longest, longest first (CPU seconds on a quiet 2-core machine, 2026-11-25, each file alone).
# `make test` runs two pytest workers that take a file at a time in collection order (--no-loadscope-reorder: xdist
# would otherwise start the files with the most tests first and leave the longest, one-test files for the end, on
# one worker).
SLOWEST_FIRST = (
    "multiproc/test_matrix.py",
    "e2e/test_examples.py",
    "bench_smoke/test_benchmarks.py",
    "bench_smoke/test_benchmarks_capacity.py",
    "e2e/test_multinode.py",
    "docs/test_docs.py",
    "unit/test_planning.py",
    "reliability/test_rank_failures.py",
    "multiproc/test_memory_report.py",
    "reliability/test_elastic_restart.py",
    "bench_smoke/test_benchmarks_training.py",
    "multiproc/test_cli_export.py",
    "multiproc/test_tp.py",
    "multiproc/test_pp.py",
    "multiproc/test_scale.py",
    "multiproc/test_strategy_tp.py",
    "multiproc/test_cp.py",
    "multiproc/test_tp_dcp.py",
    "multiproc/test_checkpoint.py",
    "multiproc/test_seed_checkpoint.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    tests_dir = Path(__file__).parent

    def file_rank(item: pytest.Item) -> int:
        relative = Path(item.path).relative_to(tests_dir).as_posix() if tests_dir in Path(item.path).parents else ""
        return rank.get(relative, len(SLOWEST_FIRST))

    items.sort(key=file_rank)  # stable: the order inside a file, and of the other files, is kept
