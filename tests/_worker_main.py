"""Entry point of one rank started by tests/_launch.py: run FILE:FUNCTION, save its return value."""

import importlib.util
import os
import sys
from pathlib import Path

import torch

if __name__ == "__main__":
    target, out_path, *args = sys.argv[1:]
    path, func_name = target.rsplit(":", 1)
    sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(path).resolve().parent)]
    spec = importlib.util.spec_from_file_location("_scenario", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = getattr(module, func_name)(*args)
    torch.save(result, out_path)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # The result is on disk. Skip the interpreter's finalization: gloo's C++ worker threads can abort it
    # ("terminate called without an active exception", pytorch/pytorch#179291), failing a finished rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
