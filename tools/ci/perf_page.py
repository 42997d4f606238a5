"""The documentation's performance page, made from ``results/README.md`` so the two never disagree.

``results/README.md`` is the page of today's numbers (date, GPU, commit). The docs build
(``docs/hooks/pages.py``) turns it into ``performance.md`` each time the site is built; nothing
generated is committed. Run alone, this prints the page (or writes it with ``--output``):

    python tools/ci/perf_page.py [--results results] [--output performance.md]

The page is the source with its title replaced, a line naming where it comes from, and its
relative links turned into paths under ``results/`` (the site holds none of those files, and a
link to a missing page fails a strict build). Tables and prose are copied unchanged.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

TITLE = "# Performance"
SOURCE = "results/README.md"

# [text](target) or ![text](target), target without spaces or parentheses.
_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
# Inline code spans, which hold no links: `code` or ``code with ` inside``.
_CODE_SPAN = re.compile(r"(`+).+?\1")
_DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")


def _is_relative(target: str) -> bool:
    return not (target.startswith(("#", "/")) or re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target))


def _rewrite_links(text: str) -> str:
    """``[text](relative)`` as ``text (`results/relative`)``; absolute links and anchors kept."""

    def replace(match: re.Match) -> str:
        text, target = match[2], match[3]
        if not _is_relative(target):
            return match[0]
        return f"{text} (`results/{target}`)" if text else f"`results/{target}`"

    pieces, position = [], 0
    for span in _CODE_SPAN.finditer(text):
        pieces.append(_LINK.sub(replace, text[position:span.start()]))
        pieces.append(span[0])
        position = span.end()
    pieces.append(_LINK.sub(replace, text[position:]))
    return "".join(pieces)


def performance_page(source: str, source_name: str = SOURCE) -> str:
    """The performance page from the text of ``results/README.md``.

    Parameters
    ----------
    source : str
        The Markdown of the results page: a level-1 title first, and the date of its numbers
        (YYYY-MM-DD) in the text before its first section.
    source_name : str
        How the page names its source.

    Returns
    -------
    str
        Markdown: ``# Performance``, a line naming the source, then the source's body with
        relative links rewritten (fenced code blocks and code spans untouched).

    Raises
    ------
    ValueError
        If the source does not start with a level-1 title, or states no date before its first
        ``##`` section (a page of numbers must say when they were measured).

    Examples
    --------
    >>> page = performance_page("# Current results\\n\\nMeasured 2026-01-02 on a GPU.\\n\\n[runs](v1/a.md)\\n")
    >>> print(page)  # doctest: +NORMALIZE_WHITESPACE
    # Performance
    <BLANKLINE>
    *Generated from `results/README.md` when this site was built. The files it names are in the repository's `results/` folder.*
    <BLANKLINE>
    Measured 2026-01-02 on a GPU.
    <BLANKLINE>
    runs (`results/v1/a.md`)
    """
    lines = source.splitlines()
    first = next((index for index, line in enumerate(lines) if line.strip()), None)
    if first is None or not lines[first].startswith("# "):
        found = "an empty file" if first is None else repr(lines[first][:60])
        raise ValueError(f"{source_name} must start with a level-1 title ('# ...'); got {found}")
    body = lines[first + 1:]
    first_section = next((index for index, line in enumerate(body) if line.startswith("## ")), len(body))
    if not _DATE.search("\n".join(body[:first_section])):
        raise ValueError(
            f"{source_name} must say when its numbers were measured: a YYYY-MM-DD date before its first "
            f"'## ' section; found none"
        )
    out, fenced = [], False
    for line in body:
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        out.append(line if fenced else _rewrite_links(line))
    note = (f"*Generated from `{source_name}` when this site was built. The files it names are in the "
            f"repository's `results/` folder.*")
    return "\n".join([TITLE, "", note, *out]).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Make the docs' performance page from results/README.md.")
    parser.add_argument("--results", type=Path, default=Path(__file__).resolve().parents[2] / "results",
                        help="the results folder (default: the repository's)")
    parser.add_argument("--output", type=Path, help="write the page here (default: print it)")
    args = parser.parse_args(argv)
    readme = args.results / "README.md"
    try:
        page = performance_page(readme.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        print(f"perf_page: {error}", file=sys.stderr)
        return 1
    if args.output is None:
        sys.stdout.write(page)
    else:
        args.output.write_text(page, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
