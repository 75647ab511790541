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
