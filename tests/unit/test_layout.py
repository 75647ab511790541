"""The package layout: the public surface stays where it was, modules stay small, and layers import downward.

Layers, lowest first; a module imports only from its own layer or below (``torchacc/__init__.py`` and
the public face ``torchacc.dist`` sit on top and may import anything): ``_utils`` < ``distributed`` <
``config`` < ``data``, ``parallel``, ``checkpoint``, ``metrics`` < ``strategy``, ``planning`` < ``cli``.
"""

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "torchacc"
LAYERS = {
    "_utils": 0,
    "distributed": 1,
    "config": 2,
    "data": 3,
    "parallel": 3,
    "checkpoint": 3,
    "metrics": 3,
    "strategy": 4,
    "planning": 4,
    "cli": 5,
    "__main__": 5,
}
TOP = 9  # torchacc/__init__.py and torchacc/dist/ (the public faces)

# Every public name importable before the package layout (issue 16), from the same place.
PUBLIC = {
    "torchacc": [
        "Config", "ComputeConfig", "MemoryConfig", "DistConfig", "DPConfig", "FSDPConfig", "DataLoaderConfig",
        "accelerate", "init_empty_weights", "GradScaler", "clip_grad_norm_", "FSDP2Strategy", "save", "load",
        "optim_state_dict", "load_optim_state_dict", "save_checkpoint", "load_checkpoint", "latest_checkpoint",
        "resume_latest", "consolidate", "reshard_checkpoint", "export_hf", "dist", "memory_report", "MemoryReport",
        "MetricsConfig", "log_metrics", "last_metrics", "track_memory", "estimate_memory", "MemoryEstimate",
    ],
    "torchacc.dist": [
        "init_distributed", "rank", "world_size", "local_rank", "local_world_size", "is_master_ordinal", "device",
        "rendezvous", "mark_step", "barrier", "broadcast", "all_reduce", "reduce", "teardown", "fsdp", "env",
        "collectives", "mesh",
    ],
    "torchacc.dist.fsdp": [
        "resolve_module_classes", "wrap_fsdp", "wrap_ddp",
        "consolidate_sharded_model_checkpoints", "consolidate_sharded_optimizer_checkpoints",
    ],
    "torchacc.config": [
        "Config", "ComputeConfig", "MemoryConfig", "DistConfig", "DPConfig", "FSDPConfig", "DataLoaderConfig",
        "MetricsConfig", "field_docs",
    ],
    "torchacc.data": ["shard_dataloader", "ShardedDataLoader", "move_to_device"],
    "torchacc.strategy": ["FSDP2Strategy"],
    "torchacc.cli": ["main", "COMMANDS"],
    "torchacc.metrics": [
        "install_metrics", "watch_loader", "note_grad_norm", "log_metrics", "last_metrics", "close_metrics",
        "plot_metrics", "Recorder", "KEYS",
    ],
    "torchacc.planning": [
        "estimate_memory", "MemoryEstimate", "plan_layouts", "Plan", "PlannedLayout", "Cluster", "Hardware", "AXES",
        "Candidate", "Choice",
    ],
}  # fmt: skip


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_every_public_name_imports_from_where_it_did(module):
    imported = importlib.import_module(module)
    missing = [name for name in PUBLIC[module] if not hasattr(imported, name)]
    assert not missing, f"{module} lost {missing}"


def test_the_seed_consolidation_helper_is_a_lazy_re_export():
    from torchacc.checkpoint.offline import consolidate
    from torchacc.dist.fsdp import consolidate_sharded_model_checkpoints

    assert consolidate_sharded_model_checkpoints is consolidate.consolidate_sharded_model_checkpoints
    for path in (PACKAGE / "dist" / "fsdp.py", PACKAGE / "dist" / "__init__.py"):
        top_level = [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ImportFrom)]
        assert not [n.module for n in top_level if "checkpoint" in (n.module or "")], "imported at import time"


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _layer(path: Path) -> int:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts == ("__init__",) or parts[0] == "dist":
        return TOP
    return LAYERS[parts[0]]


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every torchacc import in ``path``, lazy ones inside functions included."""
    package = ".".join(("torchacc", *path.relative_to(PACKAGE).parent.parts))
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            else:
                names = [node.module or ""]
            found += [(node.lineno, n) for n in names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return [(line, name) for line, name in found if name == "torchacc" or name.startswith("torchacc.")]


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for path in _modules():
        mine = _layer(path)
        for line, name in _imported_modules(path):
            parts = name.split(".")[1:]
            if not parts:
                continue  # `import torchacc` alone never happens inside the package; `from . import x` resolves
            theirs = TOP if parts[0] == "dist" else LAYERS.get(parts[0], TOP)
            if theirs > mine:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
    assert not upward, "\n".join(upward)


def test_no_module_is_over_300_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in _modules() if (n := len(p.read_text().splitlines())) > 300}
    assert not long, long


def test_the_test_files_started_first_exist():
    tests_dir = Path(__file__).resolve().parents[1]
    # tests/conftest.py by its path: `import conftest` may find another directory's conftest first
    tree = ast.parse((tests_dir / "conftest.py").read_text())
    (names,) = [ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                and [t.id for t in n.targets if isinstance(t, ast.Name)] == ["SLOWEST_FIRST"]]  # fmt: skip
    assert len(names) > 10 and [name for name in names if not (tests_dir / name).is_file()] == []
