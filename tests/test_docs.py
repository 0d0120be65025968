"""The user docs hold together: the README stays a front door, and every relative link of the README and
docs/*.md reaches a file and, when it names one, a heading of it (GitHub's anchors)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PENDING: set = set()
"""Guides the README lists that parallel branches add (issue 34 item 9); drop each once it is merged."""


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors of ``markdown``: lowercased, punctuation but ``-`` and ``_`` dropped, spaces as
    ``-``, a repeated heading suffixed ``-1``, ``-2``, ...; headings inside code blocks do not count."""
    out, seen, code = set(), {}, False
    for line in markdown.splitlines():
        if line.startswith("```"):
            code = not code
        m = None if code else re.match(r"^#{1,6} (.*)$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(markdown: str) -> list[str]:
    """The targets of ``[text](target)`` outside code blocks and inline code."""
    prose = re.sub(r"```.*?```", "", markdown, flags=re.S)
    prose = re.sub(r"`[^`]*`", "", prose)  # a span may wrap onto the next line
    return re.findall(r"\]\(([^)\s]+)\)", prose)


def test_anchors_follow_github():
    text = "# A: b, `c` (d)\n## Every command: `--help`, `--force`\n```\n# not a heading\n```\n## A: b, `c` (d)\n"
    assert anchors(text) == {"a-b-c-d", "every-command---help---force", "a-b-c-d-1"}


def test_the_readme_is_a_front_door():
    """Issue 34 item 9: at most about 300 lines; the rest lives in the guides it links."""
    readme = (REPO / "README.md").read_text()
    assert readme.count("\n") <= 300
    for guide in ("setup", "data", "extraction", "training", "evaluation", "clusters", "streaming", "reasoning"):
        assert f"(docs/guide-{guide}.md)" in readme


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves(doc):
    bad = []
    for target in links(doc.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if dest in PENDING:
            continue
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            bad.append(f"{target}: no such heading")
    assert bad == [], f"{doc.name}: {bad}"
