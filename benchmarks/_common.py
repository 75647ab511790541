"""Small helpers shared by the benchmark scripts: memory sampling, child runs, page cache, tables.

Memory is read from ``/proc/<pid>/status`` (Linux): ``VmHWM`` is the kernel's exact peak RSS;
``RssAnon`` (heap, tensors) has no kernel high-water mark, so it is polled. The poller runs in the
*parent*, on the child's pid: a thread inside the child would need the child's GIL, which long C
calls (pickling, zip writes, CRC loops) can hold for longer than the sampling interval.
"""

import json
import os
import platform
import statistics
import subprocess
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

GB = 1e9  # decimal gigabytes, for sizes and throughput alike
RESULT_PREFIX = "RESULT "
_STATUS_KEYS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def read_status(pid: int | str = "self") -> dict[str, int]:
    """``VmRSS``, ``VmHWM``, ``RssAnon`` and ``RssFile`` of ``pid`` in bytes (empty once it has exited)."""
    values = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in _STATUS_KEYS:
                    values[key] = int(rest.split()[0]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return values


class MemorySampler:
    """Poll ``/proc/<pid>/status`` every ``interval`` seconds in a daemon thread; samples are (t, status)."""

    def __init__(self, pid: int | str = "self", interval: float = 0.005) -> None:
        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            status = read_status(self.pid)
            if status:
                self.samples.append((time.monotonic(), status))
            self._stop.wait(self.interval)

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()

    def peak(self, key: str, start: float = float("-inf"), end: float = float("inf")) -> int:
        """The largest sampled ``key`` (e.g. ``"RssAnon"``) between monotonic times ``start`` and ``end``."""
        return max((s[key] for t, s in self.samples if start <= t <= end and key in s), default=0)


def run_child(cmd: Sequence[str], *, env: dict[str, str] | None = None, interval: float = 0.005) -> dict[str, Any]:
    """Run ``cmd`` while sampling its memory; return the JSON it printed after ``RESULT_PREFIX``.

    The child should print ``RESULT {"t_start": ..., "t_end": ...}`` (``time.monotonic()`` values, one
    clock for every process); ``peak_anon`` and ``peak_file`` (sampled maxima over that window) are added.

    Raises:
        RuntimeError: the child failed or printed no result; the message holds its stderr.
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    with MemorySampler(proc.pid, interval) as sampler:
        stdout, stderr = proc.communicate()
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{stderr[-4000:]}")
    result = json.loads(lines[-1][len(RESULT_PREFIX) :])
    window = (result["t_start"], result["t_end"])
    result["peak_anon"] = max(sampler.peak("RssAnon", *window), result.get("anon_end", 0))
    result["peak_file"] = sampler.peak("RssFile", *window)
    result["num_samples"] = sum(1 for t, _ in sampler.samples if window[0] <= t <= window[1])
    return result


def print_result(result: dict[str, Any]) -> None:
    """The child's side of ``run_child``."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def warm_page_cache(paths: Iterable[str], chunk: int = 16 << 20) -> int:
    """Read every file under ``paths`` once so it sits in the page cache; returns the bytes read."""
    total = 0
    for top in paths:
        files = [top] if os.path.isfile(top) else [os.path.join(d, f) for d, _, fs in os.walk(top) for f in fs]
        for path in files:
            with open(path, "rb", buffering=0) as f:
                while block := f.read(chunk):
                    total += len(block)
    return total


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def machine_summary() -> dict[str, Any]:
    """Date, CPU model, cores, memory, Python and torch versions, for the README next to the figures."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except OSError:
        mem = 0
    import torch

    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_gib": round(mem / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
