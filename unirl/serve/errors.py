"""A request the server refuses: answered 400 with ``detail`` naming the field, before it is
queued, so it changes no weights, optimizer state or checkpoint."""

from __future__ import annotations

from unirl.core.errors import UnirlError


class BadRequest(UnirlError, ValueError):
    """``field``: the request field at fault, as the SDK spells it (``data[3].loss_fn_inputs.
    advantages``); the message says what was seen and what to send."""

    def __init__(self, field: str, problem: str, *, status: int = 400) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field
        self.status = status
