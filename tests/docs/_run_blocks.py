"""Run the code blocks of the docs, page by page, in this process (every rank of a launch).

    python _run_blocks.py PLAN.json WORK_DIR RESULTS_DIR

(or ``run_forked`` in a rank that tests/_launch.py forked, with torchrun's environment).

PLAN.json lists groups ``{"page", "blocks": [{"line", "code", "setup"}]}``. Each group gets a fresh
namespace and runs in ``WORK_DIR/<page>`` (shared by the ranks). After each group this rank writes
``RESULTS_DIR/rank<R>.json``: per group, whether it passed, each block's output and the traceback. A
failing block ends the process at once (``os._exit``), so the launcher stops the other ranks instead of
leaving them waiting in a collective.
"""

import contextlib
import io
import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _setups  # noqa: E402


class _Tee(io.TextIOBase):
    """Write to the real stdout and keep a copy."""

    def __init__(self, out):
        self.out, self.parts = out, []

    def write(self, text):
        self.parts.append(text)
        return self.out.write(text)

    def flush(self):
        self.out.flush()


def main() -> None:
    plan_path, work, results_dir = sys.argv[1:4]
    rank = int(os.environ.get("RANK", "0"))
    groups = json.loads(Path(plan_path).read_text())
    results = []
    out_file = Path(results_dir) / f"rank{rank}.json"
    for group in groups:
        page = group["page"]
        where = Path(work) / page.replace("/", "_").removesuffix(".md")
        where.mkdir(parents=True, exist_ok=True)
        os.chdir(where)
        namespace = {"__name__": "__main__"}
        record = {"page": page, "ok": True, "error": None, "blocks": []}
        results.append(record)
        for block in group["blocks"]:
            tee = _Tee(sys.stdout)
            try:
                with contextlib.redirect_stdout(tee):
                    if block["setup"]:
                        getattr(_setups, block["setup"])(namespace)
                    # Leading newlines make tracebacks name the markdown file's own line numbers.
                    code = "\n" * (block["line"] - 1) + block["code"]
                    exec(compile(code, str(Path(os.environ["DOCS_ROOT"]) / page), "exec"), namespace)
            except BaseException:
                record.update(ok=False, error=f"block at {page}:{block['line']} failed:\n{traceback.format_exc()}")
            record["blocks"].append({"line": block["line"], "output": "".join(tee.parts)})
            if not record["ok"]:
                break
        out_file.write_text(json.dumps(results, indent=1))
        if not record["ok"]:
            sys.stdout.flush()
            sys.stderr.write(record["error"])
            sys.stderr.flush()
            os._exit(1)


def run_forked(plan_path: str, work: str, results_dir: str, env: str) -> None:
    """A rank forked by test_docs.py (tests/_launch.py): ``main`` with these arguments and ``env`` (JSON) added."""
    os.environ.update(json.loads(env))
    sys.argv = [__file__, plan_path, work, results_dir]
    main()


if __name__ == "__main__":
    main()
