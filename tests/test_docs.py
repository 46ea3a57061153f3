"""The README and docs/ link to each other by file and heading: every relative link must reach a
file that exists and, with an #anchor, a heading of that file (GitHub's anchors)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


@functools.cache
def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, -1, -2 ...
    for repeats; headings inside code blocks do not count."""
    seen: dict[str, int] = {}
    out, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6} (.+)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_relative_links_reach_a_file_and_heading():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.exists():
                broken.append(f"{doc.name}: {target} (no file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{doc.name}: {target} (no heading)")
    assert not broken, broken


def test_the_readme_is_a_readable_size():
    """The measured history lives in docs/: the README stays a page a newcomer reads."""
    assert len((REPO / "README.md").read_text().splitlines()) < 700
    assert (REPO / "docs" / "measurements.md").exists()
