"""The README and ``docs/``: every relative Markdown link points to a file or folder that
exists, and every ``#anchor`` to a heading of its page (GitHub's slugs); the README
stays a short guide and names the command CI runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 300

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
FENCE = re.compile(r"^ {0,3}(```|~~~)")


def prose_lines(text: str) -> list[str]:
    """The lines of ``text`` outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text (links and code marks undone) lowercased,
    every character but letters, digits, ``-``, ``_`` and spaces dropped, spaces to ``-``."""
    text = LINK.sub(lambda m: re.sub(r"^!?\[|\]\(.*$", "", m.group(0)), heading)
    text = INLINE_CODE.sub(lambda m: m.group(2), text)
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of ``page``; a repeated slug gets ``-1``, ``-2``, ... as on
    GitHub."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose_lines(page.read_text()):
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(page: Path) -> list[str]:
    """The link targets of ``page`` that are not web addresses (code spans left out)."""
    targets = []
    for line in prose_lines(page.read_text()):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            target = match.group(1)
            if not re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
                targets.append(target)
    return targets


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in relative_links(page):
        path_part, _, anchor = target.partition("#")
        linked = (page.parent / path_part).resolve() if path_part else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_points_to_a_file_and_heading_that_exist(page):
    assert relative_links(page) or page.name == "design.md", "a guide page without links?"
    assert broken_links(page) == []


def test_slugs_follow_github_rules():
    assert slug("Coming from Trainer / TRL") == "coming-from-trainer--trl"
    assert slug("Several nodes (`torch.distributed`)") == "several-nodes-torchdistributed"
    assert slug("One run per `--output`") == "one-run-per---output"
    assert slug("Will it fit, how fast, against what?") == "will-it-fit-how-fast-against-what"
    assert slug("keep_alive and [links](x.md)") == "keep_alive-and-links"


def test_a_link_to_a_missing_file_or_heading_is_reported(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n[ok](other.md#a-section) [here](#page) [web](https://example.com/x)\n"
        "[gone](missing.md) [no heading](other.md#nowhere) `[code](missing.md)`\n"
        "```\n[fenced](missing.md)\n```\n"
    )
    assert broken_links(page) == [
        "missing.md: no such file",
        "other.md#nowhere: no heading #nowhere in other.md",
    ]


def test_the_readme_is_a_short_guide():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines; move reference to docs/"
    )


def test_the_readme_names_the_test_command_ci_runs():
    ci = (REPO / ".ci" / "run").read_text()
    (command,) = re.findall(r"^exec\s+(\S+)", ci, re.MULTILINE)
    assert command in (REPO / "README.md").read_text()
