"""Consolidating a 2-rank checkpoint: torchacc against load-everything, DCP and a plain file copy.

Run (from the repository root; about 10 minutes on 2 cores for the default 2.15 GB checkpoint and 5 rounds)::

    .venv/bin/python benchmarks/consolidate.py            # full: a 2.15 GB GPT-2-like checkpoint, 5 rounds
    .venv/bin/python benchmarks/consolidate.py --quick    # smoke run: a 2 MB checkpoint, every variant in one child

It writes a synthetic GPT-2-like checkpoint (nanoGPT parameter names; every parameter sharded on dim 0
with ``torch.chunk`` sizes and ``model.get_shard_metadata()``-format metadata, as FSDP2 does) as two
``rank-{r}-of-2-model.pth`` files plus a DCP copy of the same weights, then times each variant in a
fresh subprocess so its peak memory is its own (``--quick``, a smoke run, runs them all in one subprocess):

* ``torchacc return``:    ``torchacc.consolidate(pattern)`` -- the full state dict returned, nothing written
* ``torchacc streaming``: ``torchacc.consolidate(pattern, out=..., return_state=False)`` -- what the CLI does
* ``torchacc streaming no-verify``: the same with ``verify=False`` (``--no-verify``): no CRC-32 pass over the shards
* ``torchacc streaming no-sync``: the same with ``sync_files=False`` (``--no-sync``): no fsync, like ``copy``
* ``torchacc return+save``: ``torchacc.dist.fsdp.consolidate_sharded_model_checkpoints(prefix)``
* ``load-everything``:    ``torch.load`` every shard (no mmap), ``torch.cat`` the pieces, ``torch.save`` (TorchAcc)
* ``dcp_to_torch_save``:  ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` on the DCP copy
* ``copy``:               ``shutil.copyfile`` of the shard files -- the I/O ceiling
* ``copy+fsync``:         the same, then ``fsync`` -- the ceiling for a durable write (torchacc fsyncs its output)

Inputs are read once before every run, so every variant starts with its files warm in the page cache,
and ``os.sync()`` runs between runs so one run's dirty pages are not written back during the next.
Variants are interleaved (the order rotates every round); the table shows medians over rounds.
Memory: peak RSS is the kernel's ``VmHWM``; peak anonymous memory is ``RssAnon`` polled every 5 ms
(see ``_common.py``); "above start" subtracts the child's ``RssAnon`` after its imports.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from typing import Any

from _common import (
    GB,
    cpu_busy,
    machine_summary,
    markdown_table,
    median,
    print_result,
    read_status,
    run_child_results,
    wait_for_idle,
    warm_page_cache,
)

WORLD_SIZE = 2
PATTERN = "rank-*-of-*-model.pth"
VARIANTS = (
    "torchacc return",
    "torchacc streaming",
    "torchacc streaming no-verify",
    "torchacc streaming no-sync",
    "torchacc return+save",
    "load-everything",
    "dcp_to_torch_save",
    "copy",
    "copy+fsync",
)
# GPT-2-like sizes: (vocab, width, layers, context). Full: GPT-2 large width, 24 layers, 537.8M params.
FULL_SIZE = (50257, 1280, 24, 1024)
QUICK_SIZE = (2048, 64, 2, 64)
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def gpt2_spec(vocab: int, dim: int, num_layers: int, context: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of a nanoGPT-style GPT-2 (``nn.Linear`` layout, no tied head)."""
    spec: list[tuple[str, tuple[int, ...]]] = [("transformer.wte.weight", (vocab, dim))]
    spec.append(("transformer.wpe.weight", (context, dim)))
    for i in range(num_layers):
        p = f"transformer.h.{i}."
        spec += [(p + "ln_1.weight", (dim,)), (p + "ln_1.bias", (dim,))]
        spec += [(p + "attn.c_attn.weight", (3 * dim, dim)), (p + "attn.c_attn.bias", (3 * dim,))]
        spec += [(p + "attn.c_proj.weight", (dim, dim)), (p + "attn.c_proj.bias", (dim,))]
        spec += [(p + "ln_2.weight", (dim,)), (p + "ln_2.bias", (dim,))]
        spec += [(p + "mlp.c_fc.weight", (4 * dim, dim)), (p + "mlp.c_fc.bias", (4 * dim,))]
        spec += [(p + "mlp.c_proj.weight", (dim, 4 * dim)), (p + "mlp.c_proj.bias", (dim,))]
    return spec + [("transformer.ln_f.weight", (dim,)), ("transformer.ln_f.bias", (dim,))]


def _paths(root: str) -> dict[str, Any]:
    shards = os.path.join(root, "shards")
    return {
        "shard_dir": shards,
        "shards": [os.path.join(shards, f"rank-{r}-of-{WORLD_SIZE}-model.pth") for r in range(WORLD_SIZE)],
        "dcp": os.path.join(root, "dcp"),
        "out": os.path.join(root, "out"),
    }


def write_checkpoint(root: str, size: tuple[int, int, int, int]) -> dict[str, Any]:
    """Write the shard files and the DCP copy under ``root``; return sizes for the report."""
    import torch
    import torch.distributed.checkpoint as dcp

    from torchacc.checkpoint.state import FORMAT, local_slice

    paths = _paths(root)
    os.makedirs(paths["shard_dir"])
    os.makedirs(paths["out"])
    gen = torch.Generator().manual_seed(0)
    full = {name: torch.randn(shape, generator=gen) * 0.02 for name, shape in gpt2_spec(*size)}
    for rank in range(WORLD_SIZE):
        mesh = {"shape": [WORLD_SIZE], "dim_names": ["fsdp"], "coordinate": [rank]}
        local, tensors = {}, {}
        for name, value in full.items():
            placements = ["shard:0"]  # FSDP2 shards every parameter on dim 0, 1-D ones included
            offset, local_shape = local_slice(tuple(value.shape), placements, mesh["shape"], mesh["coordinate"])
            tensors[name] = {
                "kind": "param",
                "dtype": str(value.dtype),
                "shape": list(value.shape),
                "placements": placements,
                "offset": offset,
                "local_shape": local_shape,
            }
            # clone: torch.save writes a view's whole storage
            local[name] = value.narrow(0, offset[0], local_shape[0]).clone()
        meta = {"format": FORMAT, "world_size": WORLD_SIZE, "rank": rank, "mesh": mesh, "tensors": tensors}
        torch.save({"model": local, "shard_metadata": meta}, paths["shards"][rank])
        del local
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(full, checkpoint_id=paths["dcp"], no_dist=True)
    sizes = [v.numel() * v.element_size() for v in full.values()]
    return {
        "ckpt_bytes": sum(sizes),
        "largest_tensor_bytes": max(sizes),
        "num_tensors": len(sizes),
        "num_params": sum(v.numel() for v in full.values()),
        "shard_file_bytes": sum(os.path.getsize(p) for p in paths["shards"]),
    }


def _load_everything(shard_paths: list[str], out: str) -> None:
    """What the original TorchAcc did: every shard whole in RAM, concatenate, save."""
    import torch

    shards = [torch.load(p, map_location="cpu", weights_only=True) for p in shard_paths]
    full = {}
    for key, entry in shards[0]["shard_metadata"]["tensors"].items():
        placement = entry["placements"][0]
        if placement.startswith("shard:"):
            full[key] = torch.cat([s["model"][key] for s in shards], dim=int(placement.split(":")[1]))
        else:
            full[key] = shards[0]["model"][key]
    torch.save({"model": full}, out)


def _copy(shard_paths: list[str], out_dir: str, fsync: bool) -> None:
    for path in shard_paths:
        dst = shutil.copyfile(path, os.path.join(out_dir, os.path.basename(path)))
        if fsync:
            with open(dst, "rb") as f:
                os.fsync(f.fileno())


def child(variants: list[str], root: str) -> None:
    """Run ``variants`` one after the other in this (fresh) process; print the timings of each for the parent.

    The parent prepares the first (see ``run_all``); this process prepares the others the same way.
    """
    for index, variant in enumerate(variants):
        if index:
            _prepare(variant, root)
        _run_variant(variant, root)


def _run_variant(variant: str, root: str) -> None:
    paths = _paths(root)
    out = os.path.join(paths["out"], "consolidated.pth")
    pattern = os.path.join(paths["shard_dir"], PATTERN)
    # import outside the timed window, and only what the variant needs
    if variant.startswith("torchacc"):
        import torchacc
        import torchacc.parallel.fsdp
    elif variant == "dcp_to_torch_save":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    elif variant == "load-everything":
        import torch  # noqa: F401
    start_status = read_status()
    t_start = time.monotonic()
    if variant == "torchacc return":
        result = torchacc.consolidate(pattern, return_state=True, progress=False)
    elif variant == "torchacc streaming":
        torchacc.consolidate(pattern, out=out, return_state=False, progress=False)
    elif variant == "torchacc streaming no-verify":
        torchacc.consolidate(pattern, out=out, return_state=False, verify=False, progress=False)
    elif variant == "torchacc streaming no-sync":
        torchacc.consolidate(pattern, out=out, return_state=False, sync_files=False, progress=False)
    elif variant == "torchacc return+save":
        result = torchacc.dist.fsdp.consolidate_sharded_model_checkpoints(paths["shard_dir"] + "/", save_path=out)
    elif variant == "load-everything":
        _load_everything(paths["shards"], out)
    elif variant == "dcp_to_torch_save":
        dcp_to_torch_save(paths["dcp"], out)
    elif variant in ("copy", "copy+fsync"):
        _copy(paths["shards"], paths["out"], fsync=variant == "copy+fsync")
    else:
        raise SystemExit(f"unknown variant {variant!r}; choose from {list(VARIANTS)}")
    t_end = time.monotonic()
    end_status = read_status()
    if variant.startswith("torchacc return"):
        assert len(result["model"]) > 0, "empty result"
    print_result(
        {
            "variant": variant,
            "t_start": t_start,
            "t_end": t_end,
            "seconds": t_end - t_start,
            "anon_start": start_status["RssAnon"],
            "anon_end": end_status["RssAnon"],
            "file_start": start_status["RssFile"],
            "peak_rss": end_status["VmHWM"],
        }
    )


def _prepare(variant: str, root: str) -> None:
    """An empty output directory, the previous run's writes flushed, ``variant``'s inputs in the page cache."""
    paths = _paths(root)
    shutil.rmtree(paths["out"])
    os.makedirs(paths["out"])
    os.sync()  # flush the previous run's output so its write-back does not slow this run
    warm_page_cache([paths["dcp"]] if variant == "dcp_to_torch_save" else paths["shards"])


def run_all(variants: list[str], root: str, wait_idle: float) -> list[dict[str, Any]]:
    """``variants`` one after the other in one fresh subprocess (one variant: its peak memory is its own)."""
    busy = wait_for_idle(timeout=wait_idle) if wait_idle > 0 else cpu_busy(0.1)
    _prepare(variants[0], root)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", *variants, "--workdir", root]
    return [{**result, "cpu_busy_before": busy} for result in run_child_results(cmd, env=dict(os.environ))]


def summarize(runs: list[dict[str, Any]], info: dict[str, Any]) -> list[dict[str, Any]]:
    """Median figures per variant, with ratios to the copy time and to the checkpoint size."""
    ckpt = info["ckpt_bytes"]
    rows = []
    for variant in VARIANTS:
        mine = [r for r in runs if r["variant"] == variant]
        rows.append(
            {
                "variant": variant,
                "runs": len(mine),
                "seconds": median(r["seconds"] for r in mine),
                "seconds_min": min(r["seconds"] for r in mine),
                "seconds_max": max(r["seconds"] for r in mine),
                "peak_rss": median(r["peak_rss"] for r in mine),
                "peak_anon": median(r["peak_anon"] for r in mine),
                "anon_above_start": median(r["peak_anon"] - r["anon_start"] for r in mine),
                "file_above_start": median(r["peak_file"] - r["file_start"] for r in mine),
            }
        )
    copy = next(r["seconds"] for r in rows if r["variant"] == "copy")
    for row in rows:
        row["gb_per_s"] = ckpt / GB / row["seconds"]
        row["copy_fraction"] = copy / row["seconds"]
        row["anon_over_ckpt"] = row["anon_above_start"] / ckpt
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    headers = [
        "variant",
        "time s",
        "min-max s",
        "GB/s",
        "copy speed x",
        "peak RSS GB",
        "peak anon GB",
        "anon above start GB",
        "anon above start / ckpt",
    ]
    return markdown_table(
        headers,
        [
            [
                f"`{r['variant']}`",
                f"{r['seconds']:.2f}",
                f"{r['seconds_min']:.2f}-{r['seconds_max']:.2f}",
                f"{r['gb_per_s']:.2f}",
                f"{r['copy_fraction']:.2f}",
                f"{r['peak_rss'] / GB:.2f}",
                f"{r['peak_anon'] / GB:.2f}",
                f"{r['anon_above_start'] / GB:.2f}",
                f"{r['anon_over_ckpt']:.2f}",
            ]
            for r in rows
        ],
    )


def check_claims(rows: list[dict[str, Any]], info: dict[str, Any]) -> list[str]:
    """The issue's claims, each with PASS or FAIL and the numbers behind it."""
    by = {r["variant"]: r for r in rows}
    ret, stream, load = by["torchacc return"], by["torchacc streaming"], by["load-everything"]
    no_sync = by["torchacc streaming no-sync"]
    largest = info["largest_tensor_bytes"]
    durable = by["copy+fsync"]["seconds"] / stream["seconds"]

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    lines = [
        f"{verdict(ret['anon_over_ckpt'] <= 1.3)} torchacc return mode peak anonymous memory <= 1.3x checkpoint: "
        f"{ret['anon_over_ckpt']:.2f}x ({ret['anon_above_start'] / GB:.2f} GB above start, "
        f"{ret['peak_anon'] / GB:.2f} GB in all)",
        f"{verdict(stream['anon_above_start'] <= 1.5 * largest)} torchacc streaming peak anonymous memory ~ one "
        f"tensor (<= 1.5x the largest, {largest / GB:.3f} GB): {stream['anon_above_start'] / GB:.3f} GB above start "
        f"= {stream['anon_above_start'] / largest:.2f}x the largest tensor",
        f"{verdict(load['anon_over_ckpt'] > 2.0)} load-everything peak anonymous memory > 2x checkpoint: "
        f"{load['anon_over_ckpt']:.2f}x",
        f"{verdict(no_sync['copy_fraction'] >= 0.7)} torchacc streaming with sync_files=False (no fsync, as copy) "
        f">= 70% of copy speed: {no_sync['copy_fraction']:.0%} ({no_sync['seconds']:.2f} s vs "
        f"{by['copy']['seconds']:.2f} s; CRC-32 check of the shards included)",
        f"{verdict(durable >= 0.7)} torchacc streaming (default sync_files=True) >= 70% of copy+fsync speed (the "
        f"ceiling for a durable write): {durable:.0%} ({stream['seconds']:.2f} s vs "
        f"{by['copy+fsync']['seconds']:.2f} s; against plain copy {stream['copy_fraction']:.0%}, with "
        f"verify=False {by['torchacc streaming no-verify']['copy_fraction']:.0%})",
    ]
    for row in (stream, ret):
        ratio = row["peak_rss"] / load["peak_rss"]
        lines.append(
            f"{verdict(ratio < 0.5)} {row['variant']} peak RSS < half of load-everything's: {ratio:.2f}x "
            f"({row['peak_rss'] / GB:.2f} GB vs {load['peak_rss'] / GB:.2f} GB; up to "
            f"{row['file_above_start'] / GB:.2f} GB of it file-backed pages mapped after start, i.e. shard pages)"
        )
    return lines


def plot(rows: list[dict[str, Any]], info: dict[str, Any], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = [r["variant"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    medians = [r["seconds"] for r in rows]
    spread = [
        [m - r["seconds_min"] for m, r in zip(medians, rows, strict=True)],
        [r["seconds_max"] - m for m, r in zip(medians, rows, strict=True)],
    ]
    left.barh(names, medians, xerr=spread, color="tab:blue", ecolor="gray", capsize=3)
    left.set_xlabel("seconds (median; whiskers: min and max)")
    left.set_title(f"time to consolidate {info['ckpt_bytes'] / GB:.2f} GB (2 ranks)")
    left.invert_yaxis()
    ys = range(len(rows))
    right.barh([y - 0.2 for y in ys], [r["peak_rss"] / GB for r in rows], height=0.4, label="peak RSS (VmHWM)")
    right.barh([y + 0.2 for y in ys], [r["peak_anon"] / GB for r in rows], height=0.4, label="peak anonymous (RssAnon)")
    right.axvline(info["ckpt_bytes"] / GB, color="k", linestyle="--", label="checkpoint size")
    right.set_yticks(list(ys), names)
    right.invert_yaxis()
    right.set_xlabel("GB")
    right.set_title("peak memory (median)")
    right.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: a ~2 MB checkpoint, 1 round, every variant in one subprocess"
    )
    parser.add_argument("--rounds", type=int, help="rounds of all variants (default 5, or 1 with --quick)")
    parser.add_argument("--workdir", help="where the temporary checkpoint goes (default: a new dir under /tmp)")
    parser.add_argument("--out", default=OUT_DIR, help="where the PNG and the raw JSON go (default benchmarks/out)")
    parser.add_argument(
        "--wait-idle",
        type=float,
        help="before each run, wait up to this many seconds for other jobs to leave the CPUs (default 120; 0: --quick)",
    )
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.workdir)
        return
    rounds = args.rounds or (1 if args.quick else 5)
    wait_idle = args.wait_idle if args.wait_idle is not None else (0 if args.quick else 120)
    name = "consolidate-quick" if args.quick else "consolidate"
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="torchacc-bench-consolidate-", dir=args.workdir)
    try:
        t0 = time.monotonic()
        info = write_checkpoint(root, QUICK_SIZE if args.quick else FULL_SIZE)
        print(
            f"checkpoint: {info['num_params'] / 1e6:.1f}M fp32 params, {info['num_tensors']} tensors, "
            f"{info['ckpt_bytes'] / GB:.3f} GB ({info['shard_file_bytes'] / GB:.3f} GB in {WORLD_SIZE} shard "
            f"files), largest tensor {info['largest_tensor_bytes'] / GB:.3f} GB; written in "
            f"{time.monotonic() - t0:.1f} s under {root}",
            flush=True,
        )
        runs = []
        for round_index in range(rounds):
            shift = round_index % len(VARIANTS)
            order = VARIANTS[shift:] + VARIANTS[:shift]
            # one subprocess per variant, so that each peak is its own; --quick: one for the round (one start-up)
            for group in [list(order)] if args.quick else [[variant] for variant in order]:
                new = run_all(group, root, wait_idle)
                runs += new
                for run in new:
                    print(
                        f"  round {round_index + 1}/{rounds} {run['variant']:<28} {run['seconds']:7.2f} s "
                        f"(CPUs {run['cpu_busy_before']:.0%} busy before)",
                        flush=True,
                    )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = summarize(runs, info)
    machine = machine_summary()
    print()
    print(
        f"{machine['date']}; {machine['cpu']}, {machine['cores']} cores, {machine['mem_gib']} GiB; "
        f"torch {machine['torch']}, Python {machine['python']}; medians of {rounds} round(s); GB = 1e9 bytes"
    )
    print(format_table(rows))
    print()
    if args.quick:
        print(
            "--quick is a smoke run: every variant shares one process and the checkpoint is tiny; the verdicts "
            "below say nothing"
        )
    for line in check_claims(rows, info):
        print(line)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump({"machine": machine, "checkpoint": info, "rounds": rounds, "runs": runs, "rows": rows}, f, indent=1)
    png = plot(rows, info, os.path.join(args.out, name + ".png"))
    print(f"\nplot: {png}" if png else "\nplot: skipped (matplotlib is not installed)")


if __name__ == "__main__":
    main()
