"""Write docs/reference/config.md, the configuration reference, from the schema.

    python docs/gen_config_reference.py           # rewrite the page
    python docs/gen_config_reference.py --check   # exit 1 when the committed page is stale

Every key of `UnirlConfig`, of each backend's section and of each rollout source's section, with
its type, default, allowed values, the validator that checks it and the comment written beside
the field (`unirl.config_reference`). Rules that tie several keys together run when the whole
config is built; `unirl check CONFIG` applies them and `docs/troubleshooting.md` lists their
errors. `tests/unit/test_config_reference.py` fails when the page is stale or a key lacks its entry.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "config.md"

logger = logging.getLogger("gen_config_reference")

HEADER = """# Configuration reference

Generated from the schema by `docs/gen_config_reference.py`; do not edit by hand (a test fails
when this page is stale). One key: `unirl check --explain KEY`. A config is YAML; any key can be
overridden on the command line with `--set key.path=value`. Rules that tie keys together (a layout
that must fit the world size, a feature that needs another) run when the whole config is built:
`unirl check CONFIG` applies every one and explains its decisions.

Columns: the type (`|` separates alternatives; `null` is YAML's null), the default ("(section)":
a nested section below), the allowed values (a fixed list, or the names registered when the page
was generated; a `package.module:function` string also works where the comment says so), the
validator that checks the value on its own, and the comment written beside the field.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ") if text else ""


def render() -> str:
    """The whole page."""
    sys.path.insert(0, str(ROOT))
    from unirl.config_reference import sections

    out = [HEADER]
    for section in sections():
        title = section.prefix or "top level"
        out.append(f"\n## {title}\n")
        if section.doc:
            out.append(" ".join(section.doc.split()))
        if not section.entries:
            continue
        out.append("\n| key | type | default | allowed | rule | what it does |")
        out.append("| --- | --- | --- | --- | --- | --- |")
        for e in section.entries:
            cells = (f"`{e.key}`", e.type, e.default, e.allowed, e.rule, e.doc)
            out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if the page is stale")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    text = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            logger.error("%s is stale: run python docs/gen_config_reference.py", PAGE)
            return 1
        return 0
    PAGE.write_text(text)
    logger.info("wrote %s", PAGE.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
