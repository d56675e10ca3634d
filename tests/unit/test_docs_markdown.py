"""Every Markdown file of the repository parses as its author meant: each fenced code
block is closed by a fence line of its own (an unclosed fence swallows the rest of the
page into one code block), and each relative link points at a file that exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

REPO = Path(__file__).resolve().parents[2]
PARSER = MarkdownIt("commonmark")


def markdown_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.md"], cwd=REPO, capture_output=True, text=True, check=True)
    return [REPO / line for line in out.stdout.splitlines()]


def unclosed_fences(text: str) -> list[int]:
    """1-based lines where a fence opens that no fence line of its own closes: the block
    runs to the end of the page, or holds a fence line (with words after it, it closes
    nothing, and the block goes on to the next bare fence)."""
    lines = text.splitlines()
    bad = []
    for token in PARSER.parse(text):
        if token.type != "fence" or token.map is None:
            continue
        start, end = token.map
        closing = lines[end - 1].strip() if end - 1 > start and end <= len(lines) else ""
        closed = bool(closing) and set(closing) == {token.markup[0]} and len(closing) >= len(token.markup)
        if not closed or any(line.lstrip().startswith(token.markup) for line in token.content.splitlines()):
            bad.append(start + 1)
    return bad


def broken_links(path: Path, text: str) -> list[str]:
    bad = []
    for token in PARSER.parse(text):
        for child in token.children or []:
            href = child.attrs.get("href") if child.type == "link_open" else None
            if not href or re.match(r"^[a-z][a-z0-9+.-]*:|^#", href):
                continue
            target = (path.parent / href.split("#", 1)[0]).resolve()
            if not target.exists():
                bad.append(href)
    return bad


def test_the_checks_catch_what_they_are_for(tmp_path):
    assert unclosed_fences("text\n\n```console\n$ ls\n``` trailing words\nmore\n") == [3]
    assert unclosed_fences("```console\n$ ls\n``` words\n\n```\n") == [1]  # closed by a later fence
    assert unclosed_fences("````md\n```\nnested\n```\n````\n") == []
    assert unclosed_fences("```\ncode\n```\n\n~~~~\nmore\n~~~~\n") == []
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("x")
    assert broken_links(page, "[a](there.md) [b](missing.md#part) [c](https://example.org) [d](#here)") == [
        "missing.md#part"
    ]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_markdown_file(path):
    text = path.read_text()
    assert unclosed_fences(text) == [], "a fenced code block is not closed by a fence line of its own"
    assert broken_links(path, text) == [], "relative links to files that do not exist"
