"""The ``torchacc`` command: offline tools (consolidate, reshard, export), the plot of a run's metrics, the planner.

Examples::

    torchacc consolidate --ckpt-dir ckpt                                  # model shards -> ckpt/consolidated.pth
    torchacc consolidate --ckpt-dir ckpt --type all                       # model and optimizer
    torchacc consolidate --ckpt-dir ckpt --format safetensors --out model.safetensors
    torchacc consolidate --ckpt-dir ckpt --format hf --hf-config cfg.json --out gpt2-hf
    torchacc consolidate --ckpt-dir ckpt --reshard 4 --out ckpt-4
    torchacc consolidate --ckpt-dir run --format safetensors          # a save_checkpoint root (its latest)
    torchacc plot runs                                                    # runs/metrics.jsonl -> runs/metrics.png
    torchacc plan --model gpt2-dir --gpus 64 --seq-len 4096 --micro-batch 1 --bf16   # layouts that fit, fastest first
    torchacc --version

Outputs are streamed (memory for about one tensor). Errors are one line on stderr and exit code 1; a bare
``torchacc`` prints the usage. A command is one entry of ``COMMANDS``: a function that adds its arguments to
its sub-parser, and one that runs it and returns the paths it wrote.
"""

import argparse
import glob
import os
import sys
from collections.abc import Callable, Sequence

from ._utils.version import VERSION
from .checkpoint.directory import require_latest
from .checkpoint.offline.consolidate import MODEL_PATTERN, OPTIM_PATTERN, consolidate, consolidate_dcp
from .checkpoint.offline.reshard import reshard_checkpoint
from .planning.command import PLAN_HELP, add_plan_arguments, run_plan

__all__ = ["main", "COMMANDS"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 1, like every other torchacc CLI error
        sys.stderr.write(f"torchacc: error: {message}\n")
        sys.exit(1)


def _add_consolidate(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ckpt-dir", required=True, help="rank-*-of-*-{model,optim}.pth files, or a save_checkpoint root or checkpoint"
    )
    p.add_argument("--pattern", help=f"shard file glob for --type model or optimizer (default {MODEL_PATTERN!r})")
    p.add_argument("--type", choices=["model", "optimizer", "all"], default="model")
    p.add_argument("--reshard", type=int, metavar="N", help="write N rank files instead of one consolidated file")
    p.add_argument("--format", choices=["torch", "safetensors", "hf"], default="torch")
    p.add_argument("--out", help="output file or directory (default: inside --ckpt-dir)")
    p.add_argument("--hf-config", help="config.json or model directory for --format hf (default: --ckpt-dir)")
    p.add_argument("--no-verify", action="store_true", help="skip the CRC-32 check of the shard files")
    p.add_argument(
        "--no-sync",
        action="store_true",
        help="do not fsync the output files (faster; after a power cut, re-run); not with --format hf",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _add_plot(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="a run's metrics.dir: the directory holding metrics.jsonl")
    p.add_argument("--out", help="the PNG to write (default: DIR/metrics.png)")


def _plot(args: argparse.Namespace) -> list[str]:
    from .metrics.plot import plot_metrics  # matplotlib, an optional extra, is imported only here

    return [plot_metrics(args.dir, out=args.out)]


def _consolidate(args: argparse.Namespace) -> list[str]:
    ckpt, verify, progress = args.ckpt_dir, not args.no_verify, False if args.quiet else None
    sync_files = not args.no_sync
    if not os.path.isdir(ckpt):
        raise ValueError(f"--ckpt-dir {ckpt!r} is not a directory")
    rank_files = args.pattern or glob.glob(os.path.join(ckpt, MODEL_PATTERN))
    native = None if rank_files else _native_checkpoint(ckpt)
    if args.reshard is not None:
        if native is not None:
            raise ValueError(
                f"--ckpt-dir {ckpt!r} holds a save_checkpoint checkpoint, which loads at any world size as it is "
                "(torchacc.load_checkpoint reshards); --reshard is for rank-*-of-*-model.pth files"
            )
        if args.format != "torch":
            raise ValueError("--reshard writes torch rank files; drop --format or use --format torch")
        out = args.out or os.path.join(ckpt, f"resharded-{args.reshard}")
        return reshard_checkpoint(ckpt, out, num_shards=args.reshard, verify=verify, sync_files=sync_files)
    if args.no_sync and args.format == "hf":
        raise ValueError("--format hf never fsyncs (like save_pretrained), so --no-sync changes nothing; drop it")
    if args.type == "all" and (args.pattern or args.out):
        raise ValueError("--type all uses the default patterns and output names; drop --pattern and --out")
    if args.type != "model" and args.format != "torch":
        raise ValueError(f"--format {args.format} holds model weights only; use --format torch for optimizer state")
    if not rank_files and native is None:
        raise ValueError(_neither(ckpt))
    sections = ["model", "optimizer"] if args.type == "all" else [args.type]
    written = []
    for section in sections:
        pattern = os.path.join(ckpt, args.pattern or (MODEL_PATTERN if section == "model" else OPTIM_PATTERN))
        if native is not None and args.format != "hf":
            default = {"model": "consolidated.pth", "optimizer": "consolidated_optim.pth"}[section]
            out = args.out or os.path.join(ckpt, "model.safetensors" if args.format == "safetensors" else default)
            consolidate_dcp(native, section=section, out=out, fmt=args.format, sync_files=sync_files)
        elif args.format == "hf":
            out = args.out or os.path.join(ckpt, "hf")
            _export_hf(args, ckpt, out, native, pattern=os.path.basename(pattern), verify=verify)
        else:
            default = {"model": "consolidated.pth", "optimizer": "consolidated_optim.pth"}[section]
            if args.format == "safetensors":
                default = "model.safetensors"
            out = args.out or os.path.join(ckpt, default)
            consolidate(
                pattern,
                section=section,
                out=out,
                fmt=args.format,
                return_state=False,
                verify=verify,
                progress=progress,
                sync_files=sync_files,
            )
        written.append(out)
    return written


def _native_checkpoint(ckpt: str) -> str | None:
    """The ``save_checkpoint`` checkpoint ``ckpt`` is (or whose ``latest`` it holds), or None."""
    return ckpt if os.path.isfile(os.path.join(ckpt, ".metadata")) else require_latest(ckpt)


def _neither(ckpt: str) -> str:
    names = sorted(os.listdir(ckpt))
    found = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "") if names else "nothing"
    return (
        f"no checkpoint files match {os.path.join(ckpt, MODEL_PATTERN)!r}, and --ckpt-dir {ckpt!r} is no "
        f"save_checkpoint checkpoint either (no .metadata, no 'latest'); it holds {found}. Pass the directory of the "
        "rank files (or --pattern GLOB), or a save_checkpoint root or one of its checkpoint-N directories"
    )


def _export_hf(
    args: argparse.Namespace, ckpt: str, out: str, native: str | None, *, pattern: str, verify: bool
) -> None:
    """``--format hf``: check for transformers and the model config first, naming the flags that fix them."""
    from .checkpoint.hf import SAVE_CONFIG_HINT, config_problem, export_hf, require_transformers

    require_transformers("--format hf")
    if args.hf_config is None:
        problem = config_problem(ckpt, f"--ckpt-dir {ckpt!r} and no --hf-config was given")
    else:
        problem = config_problem(args.hf_config, f"--hf-config {args.hf_config!r}")
    if problem:
        raise ValueError(
            f"--format hf needs the model's config.json: {problem}; pass --hf-config PATH (a config.json or a "
            f"directory holding one), {SAVE_CONFIG_HINT}"
        )
    export_hf(native or ckpt, out, args.hf_config or ckpt, pattern=pattern, verify=verify)


# name -> (help, add its arguments, run it and return the paths written)
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], list[str]]]]
COMMANDS = {
    "consolidate": ("merge per-rank shard files offline (no GPU, no process group)", _add_consolidate, _consolidate),
    "plot": ("draw a run's metrics.jsonl as metrics.png (loss, tokens/s, MFU, memory)", _add_plot, _plot),
    "plan": (PLAN_HELP, add_plan_arguments, run_plan),
}


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="torchacc", description="torchacc command-line tools")
    parser.add_argument("--version", action="version", version=f"torchacc {VERSION}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (help_text, add_arguments, _) in COMMANDS.items():
        add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0, or 1 after a one-line error on stderr); no command prints the usage."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        for path in COMMANDS[args.command][2](args):
            print(path)
    except (ValueError, OSError, ImportError) as exc:  # ImportError: an optional dependency (transformers, ...)
        sys.stderr.write(f"torchacc: error: {' '.join(str(exc).split())}\n")
        return 1
    return 0
