#!/usr/bin/env python3
"""Checks the documentation's relative links (standard library only).

1. The built book (``mdbook build docs`` writes ``target/book``): every relative ``href`` /
   ``src`` in every HTML page must name a file of the book, and a ``#fragment`` an ``id``
   (or ``<a name>``) in that file.
2. ``README.md``, ``ARCHITECTURE.md`` and ``BENCHMARKING.md`` at the repository root: every
   relative Markdown link must name a file or directory that exists (a ``#fragment`` of a
   link into ``docs/src`` is not checked here: the book's check covers those pages).

``404.html`` is skipped (its links are relative to the site root). Links with a scheme (``https:``, ``mailto:``, ...) or starting with ``//`` are not checked:
the machines that build this have no network. Exits 1 and lists every broken link, else
prints one summary line and exits 0.

Usage: scripts/check-doc-links.py [--book DIR] [--root DIR]
"""

from __future__ import annotations

import argparse
import html.parser
import pathlib
import re
import sys
import urllib.parse

ROOT_DOCS = ("README.md", "ARCHITECTURE.md", "BENCHMARKING.md", "CHANGELOG.md")


class _Page(html.parser.HTMLParser):
    """Collects the links and the anchor targets of one HTML page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.links: list[tuple[int, str]] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name == "id" or (tag == "a" and name == "name"):
                self.ids.add(value)
            elif name in ("href", "src"):
                self.links.append((self.getpos()[0], value))


def _is_external(link: str) -> bool:
    return link.startswith("//") or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", link) is not None


def check_book(book: pathlib.Path) -> tuple[list[str], int]:
    """Broken links of the built book, and how many links were checked."""
    pages: dict[pathlib.Path, _Page] = {}
    for path in sorted(book.rglob("*.html")):
        if path.name == "404.html" and path.parent == book:
            # Served for any missing URL, so mdBook gives it <base href="/">: its links
            # resolve against the site's root, not this directory.
            continue
        page = _Page()
        page.feed(path.read_text(encoding="utf-8"))
        pages[path.resolve()] = page
    if not pages:
        return [f"{book}: no HTML pages (was `mdbook build docs` run?)"], 0
    broken: list[str] = []
    checked = 0
    for path, page in pages.items():
        for line, link in page.links:
            if _is_external(link):
                continue
            checked += 1
            target, _, fragment = link.partition("#")
            target = urllib.parse.unquote(target.split("?", 1)[0])
            dest = (path.parent / target).resolve() if target else path
            where = f"{path.relative_to(book.resolve())}:{line}: {link}"
            if book.resolve() not in dest.parents and dest != book.resolve():
                broken.append(f"{where} (points outside the book)")
                continue
            if dest.is_dir():
                dest = dest / "index.html"
            if not dest.is_file():
                broken.append(f"{where} (no such file)")
                continue
            if fragment:
                fragment = urllib.parse.unquote(fragment)
                ids = pages[dest].ids if dest in pages else set()
                if fragment not in ids:
                    broken.append(f"{where} (no anchor #{fragment} in {dest.name})")
    return broken, checked


# [text](target) and [text](target "title"); images too. Code spans are removed first.
_MD_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_MD_REF = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)


def _strip_code(text: str) -> str:
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text)


def check_root_docs(root: pathlib.Path) -> tuple[list[str], int]:
    """Relative links of the root Markdown files that name a missing file."""
    broken: list[str] = []
    checked = 0
    for name in ROOT_DOCS:
        path = root / name
        if not path.is_file():
            broken.append(f"{name}: missing")
            continue
        text = _strip_code(path.read_text(encoding="utf-8"))
        for match in list(_MD_LINK.finditer(text)) + list(_MD_REF.finditer(text)):
            link = match.group(1)
            if _is_external(link) or link.startswith("#"):
                continue
            checked += 1
            target = urllib.parse.unquote(link.partition("#")[0])
            if not (path.parent / target).exists():
                line = text.count("\n", 0, match.start()) + 1
                broken.append(f"{name}:{line}: {link} (no such file)")
    return broken, checked


def main(argv: list[str] | None = None) -> int:
    here = pathlib.Path(__file__).resolve().parent.parent
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--book", type=pathlib.Path, default=here / "target" / "book", help="the built book (docs/book.toml: build-dir)")
    p.add_argument("--root", type=pathlib.Path, default=here, help="the repository root")
    args = p.parse_args(argv)
    book_broken, book_checked = check_book(args.book)
    root_broken, root_checked = check_root_docs(args.root)
    broken = book_broken + root_broken
    for b in broken:
        print(f"broken link: {b}", file=sys.stderr)
    if broken:
        print(f"{len(broken)} broken link(s)", file=sys.stderr)
        return 1
    print(f"doc links ok: {book_checked} in the book, {root_checked} in {', '.join(ROOT_DOCS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
