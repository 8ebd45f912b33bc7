"""Exception types for mistakes a user can fix. Each message names the key or field, the value
seen, and what to set instead; `assert` stays for internal invariants."""


class UnirlError(Exception):
    """Base of every user-facing unirl error."""


class ConfigError(UnirlError, ValueError):
    """A config key is unknown, has the wrong type, or contradicts another key."""


class RolloutDataError(UnirlError, ValueError):
    """A rollout record breaks the data contract (names the sample index and field)."""


class LossInputError(UnirlError, ValueError):
    """A loss, estimator or log-prob function got tensors that do not fit together."""


class RunError(UnirlError, RuntimeError):
    """A run stopped for a reason the user can fix outside the code: a full disk, a rank that
    hung, a run whose loss or weights stopped being finite. Names what happened and what to do;
    the newest complete checkpoint is left intact."""


class CollectiveTimeoutError(RunError):
    """A collective waited ``parallel.timeout_s`` for a rank that stopped answering. The process
    group cannot be torn down cleanly after it, so the command exits at once."""
