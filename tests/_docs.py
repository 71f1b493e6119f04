"""The documentation pages the tests read: ``docs/*.md`` (the mkdocs site) and the README."""

from __future__ import annotations

from tests.conftest import REPO

DOCS = REPO / "docs"


def page(name: str) -> str:
    """The text of ``docs/NAME`` (``README.md`` for the README)."""
    return (REPO / name if name == "README.md" else DOCS / name).read_text()


def section(name: str, title: str, level: int = 2) -> str:
    """The section ``title`` (a heading of ``level``) of page ``name``, up to the next heading of that
    level or higher (lines in fenced code blocks are never headings); raises ``ValueError`` when the
    page has no such heading."""
    lines, fenced, out, inside = page(name).split("\n"), False, [], False
    for ln in lines:
        if ln.startswith("```"):
            fenced = not fenced
        heading = not fenced and not ln.startswith("```") and ln.startswith("#")
        if heading:
            lvl = len(ln) - len(ln.lstrip("#"))
            if inside and lvl <= level:
                break
            if ln == "#" * level + " " + title:
                inside = True
        if inside:
            out.append(ln)
    if not out:
        raise ValueError(f"docs/{name} has no heading {'#' * level} {title}")
    return "\n".join(out) + "\n"


def pages() -> list[str]:
    """Every Markdown page of the site, relative to ``docs/`` (sub-directories included)."""
    return sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
