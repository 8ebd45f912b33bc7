"""The documentation's snippets the tests run: the code block after ``<!-- snippet: NAME -->`` on a
page under ``docs/`` (the README's long sections moved there; the snippets went with them)."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).parents[2] / "docs"


def doc_snippet(page: str, name: str, lang: str = "python") -> str:
    """The code of snippet ``name`` on ``docs/<page>``, exactly as written there."""
    pattern = rf"<!-- snippet: {re.escape(name)} -->\n```{lang}\n(.*?)\n```"
    match = re.search(pattern, (DOCS / page).read_text(), flags=re.S)
    assert match is not None, f"docs/{page} has no snippet {name!r}"
    return match.group(1)
