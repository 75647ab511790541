"""Entry point of one rank started by tests/_launch.py with TORCHACC_TEST_SPAWN=exec: run FILE:FUNCTION, save its
return value."""

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _launch import run_target

    target, out_path, *args = sys.argv[1:]
    run_target(target, out_path, tuple(args))
    # The result is on disk. Skip the interpreter's finalization: gloo's C++ worker threads can abort it
    # ("terminate called without an active exception", pytorch/pytorch#179291), failing a finished rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
