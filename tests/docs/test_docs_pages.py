"""The docs are complete and current: the generated config reference, the README's promises, the links."""

import importlib.util
import re

import pytest
from _markdown import ROOT, pages

import torchacc


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_reference_is_generated_from_the_current_code():
    current = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert current == _generator().render(), (
        "docs/config.md is out of date with torchacc/config.py: run .venv/bin/python scripts/gen_config_docs.py"
    )


def test_config_reference_names_every_field():
    text = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    paths = []

    def walk(node, prefix):
        for name, value in torchacc.Config.from_dict({}).to_dict().items() if node is None else node.items():
            path = f"{prefix}{name}"
            if isinstance(value, dict):
                walk(value, f"{path}.")
            else:
                paths.append(path)

    walk(None, "")
    missing = [p for p in paths if f"| `{p}` |" not in text]
    assert len(paths) > 20 and not missing, missing


def test_readme_keeps_the_two_setup_commands_and_the_five_files():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "make demo" in text and "make test" in text
    section = text.split("## Dive into the code", 1)[1].split("\n## ", 1)[0]
    entries = re.findall(r"^\d+\. `([^`]+)`: .+$", section, flags=re.MULTILINE)
    assert len(entries) == 5, section
    assert all((ROOT / path).is_file() for path in entries), entries


def _anchors(path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#{1,6} (.+)$", path.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        missing_anchor = anchor and path.suffix == ".md" and path.exists() and anchor not in _anchors(path)
        if not path.exists() or missing_anchor:
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


_SHELL_LANGS = {"bash", "sh", "shell", "console"}
# A command that runs only inside torchacc's environment: torchrun, torchacc or python with arguments,
# after any VAR=value assignments. `.venv/bin/torchrun ...` names the environment itself and does not count.
_ENV_COMMAND = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:torchrun|torchacc|python3?)\s+\S")


def _first_env_command(text: str) -> tuple[int, str] | None:
    """The line number and text of the first command that needs the environment: a line of a shell
    block, or an inline code span outside code blocks (`make demo` runs `torchrun ...`)."""
    fence = None
    for number, line in enumerate(text.splitlines(), start=1):
        if match := re.match(r"^\s*(`{3,})\s*([\w+-]*)", line):
            if fence is None:
                fence = (match.group(1), match.group(2).lower())
            elif line.strip() == fence[0]:
                fence = None
            continue
        if fence is not None:
            candidates = [line.strip()] if fence[1] in _SHELL_LANGS else []
        else:
            candidates = re.findall(r"`([^`]+)`", line)
        for command in candidates:
            if _ENV_COMMAND.match(command):
                return number, command
    return None


@pytest.mark.parametrize("name", ["README.md", "docs/index.md", "docs/launching.md"])
def test_first_commands_say_how_to_enter_the_environment(name):
    """`make setup`/`make demo` install into .venv; a page's first bare `torchrun`/`torchacc`/`python`
    command only works once it is activated, so the page must say so before it."""
    text = (ROOT / name).read_text(encoding="utf-8")
    first = _first_env_command(text)
    assert first is not None, f"{name}: no torchrun/torchacc/python command found; update this test"
    number, command = first
    before = "\n".join(text.splitlines()[: number - 1])
    assert ".venv/bin/activate" in before, (
        f"{name}:{number}: `{command}` needs torchacc's environment, but the page does not say "
        "`. .venv/bin/activate` before it (or write `.venv/bin/torchrun ...`)"
    )
