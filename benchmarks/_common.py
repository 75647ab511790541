"""Small helpers shared by the benchmark scripts: memory sampling, child runs, page cache, tables.

Memory is read from ``/proc/<pid>/status`` (Linux): ``VmHWM`` is the kernel's exact peak RSS;
``RssAnon`` (heap, tensors) has no kernel high-water mark, so it is polled. The poller runs in the
*parent*, on the child's pid: a thread inside the child would need the child's GIL, which long C
calls (pickling, zip writes, CRC loops) can hold for longer than the sampling interval.
"""

import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
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
    return run_child_results(cmd, env=env, interval=interval)[-1]


def run_child_results(
    cmd: Sequence[str], *, env: dict[str, str] | None = None, interval: float = 0.005
) -> list[dict[str, Any]]:
    """``run_child`` for a child that prints several results, one per measurement: every one, each with the
    sampled peaks of its own window.

    Raises:
        RuntimeError: the child failed or printed no result; the message holds its stderr.
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    with MemorySampler(proc.pid, interval) as sampler:
        stdout, stderr = proc.communicate()
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{stderr[-4000:]}")
    results = []
    for line in lines:
        result = json.loads(line[len(RESULT_PREFIX) :])
        window = (result["t_start"], result["t_end"])
        result["peak_anon"] = max(sampler.peak("RssAnon", *window), result.get("anon_end", 0))
        result["peak_file"] = sampler.peak("RssFile", *window)
        result["num_samples"] = sum(1 for t, _ in sampler.samples if window[0] <= t <= window[1])
        results.append(result)
    return results


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


def cpu_busy(window: float = 0.5) -> float:
    """The fraction of all CPUs busy (not idle) over the next ``window`` seconds, from ``/proc/stat``."""

    def snapshot() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return sum(ticks), ticks[3]  # total, idle (iowait counts as busy: someone else's I/O disturbs ours)

    total0, idle0 = snapshot()
    time.sleep(window)
    total1, idle1 = snapshot()
    return 1 - (idle1 - idle0) / max(1, total1 - total0)


def wait_for_idle(threshold: float = 0.1, timeout: float = 120.0) -> float:
    """Wait (at most ``timeout`` s) until other jobs on a shared machine leave the CPUs; return the busy fraction."""
    deadline = time.monotonic() + timeout
    while True:
        busy = cpu_busy()
        if busy <= threshold or time.monotonic() >= deadline:
            return busy


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
    # torch's version from its installed metadata: a driver that needs nothing else from torch skips its import
    # (seconds of CPU); a torch already imported (one on sys.path ahead of the installed one) wins.
    torch = sys.modules.get("torch")
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_gib": round(mem / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__ if torch else importlib.metadata.version("torch"),
    }


# ---------------------------------------------------------------------------------------------------
# Training benchmarks (throughput.py, memory.py): torchrun launches, a GPT-2 model, synthetic tokens.
# ---------------------------------------------------------------------------------------------------


def run_torchrun(
    script: str,
    args: Sequence[str],
    *,
    nproc: int,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    echo: bool = True,
) -> list[dict[str, Any]]:
    """Run ``script`` on ``nproc`` local ranks with ``torchrun --standalone``; return its ``RESULT`` lines.

    Every rank gets ``OMP_NUM_THREADS=1`` (one compute thread per rank) and ``env`` on top of this process's
    environment. Lines the ranks print that are not results are echoed to stderr as they come (progress),
    so stdout keeps only the caller's tables.

    Raises:
        RuntimeError: a rank failed or the run took over ``timeout`` seconds; the message holds the output tail.
    """

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env)
    timer = threading.Timer(timeout, proc.kill) if timeout else None
    if timer:
        timer.start()
    results: list[dict[str, Any]] = []
    tail: list[str] = []
    for line in proc.stdout or ():
        if line.startswith(RESULT_PREFIX):
            # two ranks writing at once can share a line: each record starts with the prefix
            results.extend(json.loads(part) for part in line.strip().split(RESULT_PREFIX) if part)
            continue
        tail = [*tail[-200:], line]
        if echo:
            sys.stderr.write(line)
    code = proc.wait()
    if timer:
        timer.cancel()
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {code}):\n{''.join(tail)[-6000:]}")
    return results


def gpt2_model(*, n_layer: int, n_embd: int, n_head: int, vocab: int, seq: int, seed: int = 0) -> Any:
    """A randomly initialized ``transformers.GPT2LMHeadModel`` (dropout off, float32), the same on every rank."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab,
        n_positions=seq,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


def num_params(model: Any) -> int:
    """Parameters counted once each (GPT-2's tied ``wte``/``lm_head`` once)."""
    return sum(p.numel() for p in model.parameters())


def random_tokens(num_samples: int, seq: int, vocab: int, seed: int = 0) -> Any:
    """A map-style dataset of ``{"input_ids", "labels"}`` rows of random token ids (a list of dicts)."""
    import torch

    ids = torch.randint(vocab, (num_samples, seq), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": row, "labels": row} for row in ids]


def process_group_backend(device_type: str) -> str:
    """The backend torchacc starts for ``device_type``: NCCL for CUDA tensors (gloo beside it), gloo on CPU."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def malloc_trim() -> bool:
    """Give freed heap memory back to the kernel (glibc ``malloc_trim(0)``); False where it is unavailable."""
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def reset_peak_rss() -> bool:
    """Reset this process's ``VmHWM`` to its current RSS (Linux ``/proc/self/clear_refs``, value 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def emit_result(result: dict[str, Any]) -> None:
    """``print_result`` for a rank sharing stdout with other ranks: the line goes out in one ``write`` (atomic on
    a pipe below 4 KiB), so lines of different ranks never interleave."""
    os.write(1, (RESULT_PREFIX + json.dumps(result) + "\n").encode())


# malloc settings a benchmark's ranks can run under: name -> environment. glibc's default raises its mmap
# threshold (up to 32 MiB) as large blocks are freed, so later blocks below it come from the heap, where freed
# space stays resident; a fixed threshold (which also turns that off) maps every block above it on its own.
# jemalloc and tcmalloc are preloaded from the system's libraries (Debian: libjemalloc2, libtcmalloc-minimal4).
ALLOCATORS: dict[str, dict[str, str]] = {
    "glibc": {},
    "mmap64k": {"MALLOC_MMAP_THRESHOLD_": "65536"},
    # mmap64k, plus transparent huge pages for the mapped blocks (glibc >= 2.35; THP "madvise" or "always"): the
    # same memory, about 4x fewer page faults.
    "mmap64k-thp": {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536:glibc.malloc.hugetlb=1"},
    "mmap4m": {"MALLOC_MMAP_THRESHOLD_": str(4 << 20)},
    "mmap16m": {"MALLOC_MMAP_THRESHOLD_": str(16 << 20)},
    "jemalloc": {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"},
    "tcmalloc": {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"},
}


def allocator_env(name: str) -> dict[str, str]:
    """The environment for malloc setting ``name`` (see ``ALLOCATORS``).

    Raises:
        ValueError: an unknown name, or a preloaded library that is not installed (the message says which package).
    """
    if name not in ALLOCATORS:
        raise ValueError(f"unknown allocator {name!r}; choose from {', '.join(ALLOCATORS)}")
    library = ALLOCATORS[name].get("LD_PRELOAD")
    if library and not os.path.exists(library):
        package = "libjemalloc2" if "jemalloc" in library else "libtcmalloc-minimal4"
        raise ValueError(f"--allocator {name} needs {library}: apt-get install {package}")
    return dict(ALLOCATORS[name])
