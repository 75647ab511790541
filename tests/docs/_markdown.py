"""Find the fenced code blocks of README.md and docs/*.md, with the run markers that say how to test them.

A Python block is preceded (on the line before its fence, blank lines allowed) by one marker:

* ``<!-- run: python -->``: run in one plain process (a world of one);
* ``<!-- run: torchrun N -->``: run under ``torchrun --nproc_per_node=N``, every rank running it;
* ``<!-- run: skip (reason) -->``: not run; the reason says why (GPU-only, another library...).

``, setup=NAME`` after the mode first runs ``tests/docs/_setups.py::NAME`` in the block's namespace (for
snippets that show an insertion into an existing script). Blocks of one page and one mode run in order
in one namespace, so a later block may use what an earlier one defined.

A ``text`` block preceded by ``<!-- output -->`` is the expected output of the Python block before it
(on rank 0): every line must appear in that block's output, in order, with ``...`` matching anything.
"""

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_FENCE = re.compile(r"^(\s*)(`{3,})\s*([\w+-]*)\s*$")
_RUN = re.compile(r"^<!--\s*run:\s*(.*?)\s*-->$")
_OUTPUT = re.compile(r"^<!--\s*output\s*-->$")


@dataclass
class Block:
    page: str  # path relative to the repository root
    line: int  # line number of the first code line (1-based)
    lang: str
    code: str
    mode: str | None = None  # "python", "torchrun", "skip" or None (no marker)
    nproc: int = 1
    setup: str | None = None
    reason: str = ""
    marker: str = ""
    expected: str | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    """The markdown files whose blocks are tested: README.md and every page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _parse_marker(block: Block, text: str) -> None:
    block.marker = text
    mode, _, options = text.partition(",")
    mode = mode.strip()
    for option in filter(None, (o.strip() for o in options.split(","))):
        key, _, value = option.partition("=")
        if key.strip() == "setup" and value.strip():
            block.setup = value.strip()
        else:
            block.problems.append(f"unknown marker option {option!r}")
    if mode == "python":
        block.mode = "python"
    elif m := re.fullmatch(r"torchrun (\d+)", mode):
        block.mode, block.nproc = "torchrun", int(m.group(1))
    elif m := re.fullmatch(r"skip \((.+)\)", mode):
        block.mode, block.reason = "skip", m.group(1).strip()
    else:
        block.problems.append(f"unknown run mode {mode!r}; use python, torchrun N or skip (reason)")


def parse(path: Path) -> list[Block]:
    """Every fenced block of one markdown file, with its marker and expected output attached."""
    lines = path.read_text(encoding="utf-8").splitlines()
    rel = path.relative_to(ROOT).as_posix()
    blocks: list[Block] = []
    previous = ""  # the last non-blank line before the current one
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            if lines[i].strip():
                previous = lines[i].strip()
            i += 1
            continue
        indent, fence, lang = m.groups()
        end = i + 1
        while end < len(lines) and lines[end].strip() != fence:
            end += 1
        body = [line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : end]]
        block = Block(rel, i + 2, lang.lower(), "\n".join(body) + "\n")
        if run := _RUN.match(previous):
            _parse_marker(block, run.group(1))
        if _OUTPUT.match(previous):
            python = [b for b in blocks if b.lang == "python"]
            if not python or block.lang != "text":
                block.problems.append("<!-- output --> must precede a text block that follows a python block")
            else:
                python[-1].expected = block.code
        blocks.append(block)
        previous = ""
        i = end + 1
    return blocks


def all_blocks() -> list[Block]:
    return [block for path in pages() for block in parse(path)]


def output_matches(expected: str, actual: str) -> bool:
    """True when every non-blank expected line occurs in ``actual`` in order (whitespace-normalized,
    ``...`` matching any text)."""
    normalized = " ".join(actual.split())
    lines = [" ".join(line.split()) for line in expected.splitlines() if line.strip()]
    pattern = ".*?".join(".*?".join(re.escape(part) for part in line.split("...")) for line in lines)
    return re.search(pattern, normalized, flags=re.DOTALL) is not None
