"""Smoke tests for the training benchmarks: each script's ``--quick`` mode runs and prints its table (through
``run_benchmark``: see [Note: benchmarks in the suite] in conftest.py)."""

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _run_quick(run_benchmark, script: str, tmp_path: Path, *extra: str) -> str:
    return run_benchmark(script, "--quick", "--plot", str(tmp_path / "plot.png"), *extra)


def _table_rows(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("|---")), None)
    assert start is not None, f"no markdown table in the output:\n{stdout}"
    return [line for line in lines[start + 1 :] if line.startswith("| ")]


def test_throughput_quick(tmp_path: Path, run_benchmark) -> None:
    out = _run_quick(run_benchmark, "throughput.py", tmp_path)
    assert "(a)/(b)" in out and "paired blocks: median (range) of 1" in out, out
    assert "max |loss (a) - loss (b)|" in out and "loader, per batch:" in out, out
    rows = _table_rows(out)
    assert rows and rows[0].startswith("| L2-E128 |"), out
    assert "| L2-E128 | 1 | abcd |" in out, "one round of the four contenders"


def test_throughput_metrics_quick(tmp_path: Path, run_benchmark) -> None:
    out = _run_quick(run_benchmark, "throughput.py", tmp_path, "--metrics")
    rows = _table_rows(out)
    assert len(rows) == 1 and rows[0].startswith("| L2-E128 | ") and "| 1 x 10 |" in rows[0], out
    assert rows[0].split(" | ")[-2] == "1", "one record in a block of 10 steps"


def test_memory_quick(tmp_path: Path, run_benchmark) -> None:
    out = _run_quick(run_benchmark, "memory.py", tmp_path)
    assert "vs theory" in out
    rows = _table_rows(out)
    assert any("torchacc FSDP | 2 |" in row for row in rows), out
    assert "Activation checkpointing (memory.gc)" in out, out
    gc_rows = [line for line in out.splitlines() if line.startswith("| glibc | ") and "/4 |" in line]
    assert [row.split(" | ")[1] for row in gc_rows] == ["off", "every block", "1 block in 2"], out
