"""The typed view of the run config (`unirl.core.protocols.config_view`): `UnirlConfig` satisfies it key by
key (a key renamed or retyped in the schema breaks the view here, not in a plug-in at run time),
and no module erases the config's type with a ``X = Any`` alias to dodge an import circle."""

from __future__ import annotations

import ast
import typing
from pathlib import Path
from typing import Any

import attrs
import pytest

from unirl.core.config.routing_replay import ReplayConfig
from unirl.core.config.run_config import UnirlConfig, config_from_dict
from unirl.core.protocols.config_view import RunConfigView

UNIRL = Path(__file__).parents[2] / "unirl"


def _view_keys(view: type) -> dict[str, Any]:
    """A Protocol's read-only keys and the types their properties return."""
    keys = {}
    for klass in reversed(view.__mro__):
        for name, member in vars(klass).items():
            if isinstance(member, property):
                keys[name] = typing.get_type_hints(member.fget)["return"]
    return keys


def _is_view(kind: Any) -> bool:
    return isinstance(kind, type) and getattr(kind, "_is_protocol", False)


def _mismatches(value: Any, view: type, where: str) -> list[str]:
    """Where ``value`` does not have ``view``'s keys with their types (nested views recursively;
    a schema class's field must be declared on that class, not only set on the instance)."""
    found = []
    for name, kind in _view_keys(view).items():
        key = f"{where}.{name}" if where else name
        if attrs.has(type(value)) and name not in attrs.fields_dict(type(value)):
            found.append(f"{key}: not a field of {type(value).__name__}")
            continue
        item = getattr(value, name)
        if _is_view(kind):
            found += _mismatches(item, kind, key)
        elif not isinstance(item, typing.get_origin(kind) or kind):
            found.append(f"{key}: {type(item).__name__}, the view says {kind}")
    return found


def _config() -> UnirlConfig:
    return config_from_dict(
        {
            "backend": "deepspeed",
            "model": {"hf_config": {"model_type": "llama", "hidden_size": 8}},
            "batch": {
                "prompts_per_rollout": 2,
                "samples_per_prompt": 2,
                "samples_per_optimizer_step": 4,
                "micro_batch_size": 2,
            },
            "parallel": {"world_size": 1},
        }
    )


@pytest.mark.parametrize("view", [RunConfigView, ReplayConfig], ids=lambda v: v.__name__)
def test_the_run_config_satisfies_its_views(view):
    assert _view_keys(view), f"{view.__name__} declares no key"
    assert _mismatches(_config(), view, "") == []


def test_the_check_sees_a_missing_or_retyped_key():
    """The check against a config whose ``rollout`` lacks a key and whose ``backend`` is no
    string: both are reported."""

    @attrs.frozen
    class Rollout:
        source: str = "sampler"

    @attrs.frozen
    class Config:
        backend: int = 3
        old_logprobs: str = "auto"
        algorithm: Any = attrs.field(factory=lambda: type("A", (), {"routing_replay": "off"})())
        rollout: Rollout = attrs.field(factory=Rollout)

    assert _mismatches(Config(), RunConfigView, "") == [
        "backend: int, the view says <class 'str'>",
        "rollout.weight_bucket_mb: not a field of Rollout",
    ]


def _any_aliases(path: Path) -> list[str]:
    """Module-level ``Name = Any`` (or ``Name: TypeAlias = Any``) assignments in ``path``."""
    found = []
    for node in ast.parse(path.read_text()).body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, ast.Name) and value.id == "Any":
            found.append(f"{path.relative_to(UNIRL.parent)}:{node.lineno}")
    return found


def test_no_type_erased_by_an_any_alias():
    """``RunConfig = Any`` hides which type a function takes (the import circle it dodged is
    still there in meaning): name the type, a typed view of it (`unirl.core.protocols.config_view`), or
    move the shared piece down."""
    offenders = [hit for path in sorted(UNIRL.rglob("*.py")) for hit in _any_aliases(path)]
    assert offenders == []
