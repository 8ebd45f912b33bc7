"""The generic name -> entry registry: duplicates refused, equal re-registration allowed, unknown
names answered with the key, the valid names and the closest one, built-ins loaded once."""

import pytest

from unirl.core.errors import ConfigError
from unirl.core.registry import Registry


def test_register_get_and_names():
    reg: Registry[int] = Registry("widget", key="parts.widget")
    reg.register("b", 2)
    reg.register("a", 1)
    reg.register("a", 1)  # the same entry again (a module imported twice) is fine
    assert reg.get("a") == 1 and reg.names() == ["a", "b"] and "b" in reg
    assert reg.find("c") is None
    with pytest.raises(ConfigError, match=r"widget 'a' is already registered \(1\)"):
        reg.register("a", 3)


def test_unknown_name_names_key_valid_names_and_closest():
    reg: Registry[str] = Registry("policy loss", key="algorithm.policy_loss")
    reg.register("ppo_clip", "x")
    reg.register("gspo", "y")
    with pytest.raises(ConfigError) as err:
        reg.get("ppo_clpi", hint="or a custom 'package.module:function'")
    assert str(err.value) == (
        "algorithm.policy_loss='ppo_clpi' is not a registered policy loss (did you mean "
        "'ppo_clip'?); valid: ['gspo', 'ppo_clip'], or a custom 'package.module:function'"
    )


def test_load_runs_once_on_first_lookup():
    calls = []
    reg: Registry[int] = Registry("task", key="rollout.task", load=lambda: calls.append(1))
    reg.register("x", 1)  # registering does not load
    assert calls == []
    assert reg.names() == ["x"] and reg.get("x") == 1
    assert calls == [1]


def test_custom_sameness():
    reg: Registry[object] = Registry("task", key="k", same=lambda a, b: type(a) is type(b))
    reg.register("t", [1])
    reg.register("t", [2])  # same type: accepted, replaces
    assert reg.get("t") == [2]
