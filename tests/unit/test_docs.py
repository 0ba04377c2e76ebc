"""The README is a door, not the house: short, linking every docs/ page, and no link in the docs leads nowhere."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted((REPO / "docs").glob("*.md"))
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    found = set()
    for heading in re.findall(r"^#+ (.+)$", markdown, re.M):
        text = re.sub(r"[`*]", "", heading).strip().lower()
        found.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return found


def test_the_readme_is_at_most_250_lines_and_links_every_docs_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    linked = {m for m in LINK.findall(readme) if m.startswith("docs/")}
    missing = [p.name for p in DOCS if not any(link.split("#")[0] == f"docs/{p.name}" for link in linked)]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_every_relative_link_and_anchor_in_the_docs_resolves():
    broken = []
    for page in [REPO / "README.md", *DOCS]:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked offline
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken
