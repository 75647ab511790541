"""Every Python block of README.md and docs/ runs, and every command a shell block shows exists.

The blocks of all pages run in as few processes as possible (one plain process, and one launch per rank count
of ranks forked with torchrun's environment from tests/_launch.py's pre-imported server: torchrun's agent and
each rank's imports cost more CPU than the blocks), each page in its own namespace and directory; see
``_markdown.py`` for the markers.
"""

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _launch import spawn_ranks
from _markdown import ROOT, all_blocks, output_matches

HERE = Path(__file__).resolve().parent
BLOCKS = all_blocks()
PYTHON = [b for b in BLOCKS if b.lang == "python"]
RUN = [b for b in PYTHON if b.mode in ("python", "torchrun")]
PAGES = list(dict.fromkeys(b.page for b in RUN))
SHELL = [b for b in BLOCKS if b.lang in ("bash", "sh", "shell", "console")]
MAX_SKIPS = 8  # skips must stay rare: GPU-only code or other libraries' APIs


ENV = {
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "DOCS_ROOT": str(ROOT),
}


def _start(mode: str, nproc: int, tmp: Path) -> Any:
    """Start one process (or one launch of ``nproc`` forked ranks) that runs every page's blocks of this mode."""
    groups = []
    # A page that ends with teardown() runs last: creating a process group again after destroying it,
    # in the same torchrun process, is unreliable (gloo may connect to the old group's addresses).
    for page in sorted(PAGES, key=lambda p: any("teardown()" in b.code for b in RUN if b.page == p)):
        blocks = [b for b in RUN if b.page == page and (b.mode, b.nproc) == (mode, nproc)]
        if blocks:
            groups.append(
                {"page": page, "blocks": [{"line": b.line, "code": b.code, "setup": b.setup} for b in blocks]}
            )
    (tmp / "plan.json").write_text(json.dumps(groups))
    args = (str(tmp / "plan.json"), str(tmp / "work"), str(tmp))
    if mode == "python":
        cmd = [sys.executable, str(HERE / "_run_blocks.py"), *args]
        env = {**os.environ, **ENV}
        return subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    target = f"{HERE / '_run_blocks.py'}:run_forked"
    return spawn_ranks(target, nproc, tmp / "logs", args=(*args, json.dumps(ENV)))


def _wait_ranks(procs: list, tmp: Path, timeout: float) -> tuple[int | None, str]:
    """Wait for forked ranks as torchrun would: the first rank to fail (or the timeout) stops the others."""
    deadline = time.monotonic() + timeout
    codes = [proc.poll() for proc, _ in procs]
    while None in codes and not any(codes) and time.monotonic() < deadline:
        time.sleep(0.2)
        codes = [proc.poll() for proc, _ in procs]
    for proc, log in procs:
        proc.kill()
        proc.wait(timeout=30)
        log.close()
    output = "".join((tmp / "logs" / f"rank{r}.log").read_text() for r in range(len(procs)))
    if None in codes and not any(codes):
        return None, f"TIMED OUT after {timeout} s\n{output}"
    return next((code for code in codes if code), 0), output


def _finish(proc: Any, nproc: int, tmp: Path, timeout: float) -> dict:
    """Wait for a launch from ``_start``; return its exit code, output and every rank's per-page records."""
    if isinstance(proc, list):
        returncode, output = _wait_ranks(proc, tmp, timeout)
    else:
        try:
            output, _ = proc.communicate(timeout=timeout)
            returncode = proc.returncode
        except subprocess.TimeoutExpired:  # reported by every page of this launch, without re-running it
            proc.kill()
            output, _ = proc.communicate()
            returncode, output = None, f"TIMED OUT after {timeout} s\n{output}"
    ranks = []
    for rank in range(nproc):
        path = tmp / f"rank{rank}.json"
        ranks.append({r["page"]: r for r in json.loads(path.read_text())} if path.exists() else {})
    return {"returncode": returncode, "output": output, "ranks": ranks}


@pytest.fixture(scope="session")
def docs_run(tmp_path_factory):
    """``docs_run(mode, nproc)``: the results of running every page's blocks of that kind.

    The first call starts every launch at once (a plain process, and forked ranks per rank count):
    they overlap their start-up, which is most of their time. Each runs once per session.
    """
    cache: dict[tuple[str, int], dict] = {}

    def run(mode: str, nproc: int) -> dict:
        if not cache:
            kinds = list(dict.fromkeys((b.mode, b.nproc) for b in RUN))
            dirs = {kind: tmp_path_factory.mktemp(f"docs-{kind[0]}{kind[1]}") for kind in kinds}
            started = {kind: _start(*kind, dirs[kind]) for kind in kinds}
            for kind, proc in started.items():
                cache[kind] = _finish(proc, kind[1], dirs[kind], timeout=300)
        return cache[(mode, nproc)]

    return run


@pytest.mark.parametrize("page", PAGES)
def test_page_code_blocks_run(page, docs_run):
    blocks = [b for b in RUN if b.page == page]
    for mode, nproc in dict.fromkeys((b.mode, b.nproc) for b in blocks):
        result = docs_run(mode, nproc)
        for rank, records in enumerate(result["ranks"]):
            record = records.get(page)
            assert record is not None, (
                f"{page} ({mode} {nproc}) never ran on rank {rank}: an earlier page failed or the launch died:\n"
                f"{result['output'][-6000:]}"
            )
            assert record["ok"], f"rank {rank}: {record['error']}\n--- output ---\n{result['output'][-4000:]}"
        assert result["returncode"] == 0, (
            f"the {mode} {nproc} launch exited with {result['returncode']} (after this page's blocks passed):\n"
            f"{result['output'][-4000:]}"
        )
        outputs = {b["line"]: b["output"] for b in result["ranks"][0][page]["blocks"]}
        for block in blocks:
            if block.expected is not None and (block.mode, block.nproc) == (mode, nproc):
                assert output_matches(block.expected, outputs[block.line]), (
                    f"{block.where}: the output shown in the docs is not what the code prints.\n"
                    f"--- shown ---\n{block.expected}--- printed (rank 0) ---\n{outputs[block.line]}"
                )


def test_every_python_block_has_a_valid_marker():
    problems = [f"{b.where}: {p}" for b in BLOCKS for p in b.problems]
    problems += [f"{b.where}: python block without a <!-- run: ... --> marker" for b in PYTHON if b.mode is None]
    problems += [f"{b.where}: unknown setup {b.setup!r}" for b in PYTHON if b.setup and not _has_setup(b.setup)]
    assert not problems, "\n".join(problems)


def _has_setup(name: str) -> bool:
    import _setups

    return callable(getattr(_setups, name, None))


def test_skips_are_rare_and_say_why():
    skips = [b for b in PYTHON if b.mode == "skip"]
    assert all(len(b.reason.split()) >= 2 for b in skips), [b.where for b in skips if len(b.reason.split()) < 2]
    assert len(skips) <= MAX_SKIPS, f"{len(skips)} skipped blocks: {[b.where for b in skips]}"


# ---- shell blocks: the commands they show exist ---------------------------------------------------


def _commands(code: str) -> list[list[str]]:
    """The command lines of a shell block as token lists (continuations joined, comments and prompts dropped)."""
    joined = re.sub(r"\\\n", " ", code)
    commands = []
    for line in joined.splitlines():
        line = line.strip().removeprefix("$ ")
        if not line or line.startswith("#"):
            continue
        for part in re.split(r"&&|\|\||;|\|", line):
            tokens = shlex.split(part, comments=True)
            while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", tokens[0]):  # VAR=value prefixes
                tokens = tokens[1:]
            if tokens:
                commands.append(tokens)
    return commands


def _check_script(script: str, args: list[str]) -> list[str]:
    if script == "train.py":  # the docs' name for the reader's own script
        return []
    path = ROOT / script
    if not path.is_file():
        return [f"{script} does not exist"]
    source = path.read_text()
    problems = [f"{script} has no option {a.split('=')[0]}" for a in args if a.startswith("--")]
    problems = [p for p in problems if f'"{p.rsplit(" ", 1)[1]}"' not in source]
    overrides = [a for a in args if re.fullmatch(r"[a-z_]+(\.[a-z_]+)+=.*|config=.*", a)]
    if overrides:
        import torchacc

        resolved = [f"config={ROOT / a[7:]}" if a.startswith("config=") else a for a in overrides]
        try:
            torchacc.Config.from_cli(resolved)
        except (ValueError, FileNotFoundError) as exc:
            problems.append(f"{script} {' '.join(overrides)}: {exc}")
    return problems


def _check_command(tokens: list[str]) -> list[str]:
    head, rest = tokens[0], tokens[1:]
    if head in ("srun", "sbatch") and "torchrun" in rest:
        return _check_command(rest[rest.index("torchrun") :])
    if head.endswith("python") or head.endswith("python3"):
        if rest[:1] == ["-m"] and rest[1:2] == ["torchacc"]:
            return _check_command(["torchacc", *rest[2:]])
        if rest[:1] == ["-m"] and rest[1:2] == ["torch.distributed.run"]:
            return _check_command(["torchrun", *rest[2:]])
        if rest[:1] == ["-m"]:
            return []
        return _check_script(rest[0], rest[1:]) if rest else []
    if head.endswith("torchrun"):
        from torch.distributed.run import get_args_parser

        try:
            args = get_args_parser().parse_args(rest)
        except SystemExit:
            return [f"torchrun rejects: {' '.join(rest)}"]
        return [] if args.module else _check_script(args.training_script, args.training_script_args)
    if head.endswith("torchacc"):
        from torchacc.cli import _parser

        try:
            _parser().parse_args(rest)
        except SystemExit:
            return [f"the torchacc CLI rejects: {' '.join(rest)}"]
        return []
    if head == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.MULTILINE)
        return [f"make has no target {t}" for t in rest if not t.startswith("-") and "=" not in t and t not in targets]
    if head == "bash" and rest and rest[0].endswith(".sh"):
        return [] if (ROOT / rest[0]).is_file() else [f"{rest[0]} does not exist"]
    return []


@pytest.mark.parametrize("block", SHELL, ids=[b.where for b in SHELL])
def test_shell_block_commands_exist(block, capsys):
    problems = [p for tokens in _commands(block.code) for p in _check_command(tokens)]
    assert not problems, f"{block.where}:\n" + "\n".join(problems)
