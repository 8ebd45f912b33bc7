"""Config rules that other packages own: a rule is a function of the built config that raises
`ConfigError` naming the key, the value and the fix, run once when the config is built (so
``unirl check`` and ``unirl train`` meet the same errors at the same time).

Why a registry: the rules of the ``rollout.*`` keys (prompts, rewards, stops, environments,
``eval``) belong to `unirl.rollouts`, which core may not import; the rollouts package registers
them here when it is imported (``import unirl`` imports it). They run in the order they were
registered, after the chosen source's own ``check``.

    CONFIG_RULES.register("rollout.prompts", check_prompts)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unirl.core.registry import Registry, same_callable

# A rule over the whole `unirl.core.config.run_config.UnirlConfig` (not imported: the config
# imports this module).
ConfigRule = Callable[[Any], None]

CONFIG_RULES: Registry[ConfigRule] = Registry("config rule", key="config rule", same=same_callable)


def check_registered_rules(cfg: Any) -> None:
    """Run every registered rule over ``cfg``, in registration order (the first error wins)."""
    for rule in CONFIG_RULES.in_order():
        rule(cfg)
