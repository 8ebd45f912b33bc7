"""The README's snippets the tests run: the code block after ``<!-- snippet: NAME -->``."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).parents[2] / "README.md"


def readme_snippet(name: str, lang: str = "python") -> str:
    """The code of the README snippet ``name``, exactly as written there."""
    pattern = rf"<!-- snippet: {re.escape(name)} -->\n```{lang}\n(.*?)\n```"
    match = re.search(pattern, README.read_text(), flags=re.S)
    assert match is not None, f"README.md has no snippet {name!r}"
    return match.group(1)
