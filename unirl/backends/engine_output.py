"""What an engine ``print``s while a backend drives it: below DEBUG, DEBUG records of
``unirl.engines`` instead of terminal lines (DeepSpeed's op build prints "... built
successfully"). Here, beside the backends that call it, not in the app's logging set-up
(`unirl.log_setup`): no backend imports the app layer (tests/unit/test_layering.py)."""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def engine_prints() -> Iterator[None]:
    """Below DEBUG, what an engine ``print``s inside becomes DEBUG records of ``unirl.engines``
    (Python-level prints only; at DEBUG it goes to stdout as usual)."""
    logger = logging.getLogger("unirl.engines")
    if logger.isEnabledFor(logging.DEBUG):
        yield
        return
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            yield
    finally:
        for line in captured.getvalue().splitlines():
            if line.strip():
                logger.debug("%s", line)
