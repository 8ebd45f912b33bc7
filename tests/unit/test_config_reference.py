"""The configuration reference (`docs/reference/config.md`, written by
`docs/gen_config_reference.py` from the schema): it is current, it has an entry for every key a
resolved config holds, and `unirl check --explain KEY` prints one entry."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).parents[2]
PAGE = ROOT / "docs" / "reference" / "config.md"


def _page_keys() -> set[str]:
    """The keys the committed page has a row for (its first column)."""
    return set(re.findall(r"^\| `([^`]+)` \|", PAGE.read_text(), flags=re.M))


def _leaf_paths(data: dict, prefix: str = "") -> list[str]:
    """Every dotted path to a value that is not a mapping (a resolved config's keys)."""
    paths = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            paths += _leaf_paths(value, f"{path}.")
        else:
            paths.append(path)
    return paths


def _covered(path: str, keys: set[str]) -> bool:
    # A dict-valued key (model.hf_config, rollout.task_options) holds free-form keys below it.
    parts = path.split(".")
    return any(".".join(parts[:n]) in keys for n in range(1, len(parts) + 1))


def test_the_committed_page_is_current():
    """Run in a fresh interpreter: a plug-in that another test registered would change the
    registered names the page lists."""
    run = subprocess.run(
        [sys.executable, "docs/gen_config_reference.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize(
    "example, backend",
    [
        ("tiny_grpo.yaml", "deepspeed"),
        ("tiny_grpo.yaml", "fsdp2"),
        ("tiny_grpo.yaml", "megatron"),
        ("tiny_ppo.yaml", None),  # the critic's section in use
        ("gsm8k.yaml", None),  # an eval section
    ],
)
def test_every_key_of_a_resolved_config_has_an_entry(example, backend):
    from unirl.core.config.run_config import load_config

    sets = [f"backend={backend}"] if backend else []
    cfg = load_config(ROOT / "examples" / example, sets)
    keys = _page_keys()
    missing = [p for p in _leaf_paths(cfg.to_dict()) if not _covered(p, keys)]
    assert missing == []


def test_every_rollout_source_section_has_its_entries():
    """The sources' own sections (``rollout.<name>``), from their options classes' defaults: a
    config only holds the chosen source's, and vLLM's needs vLLM installed to be chosen."""
    from unirl.core.protocols.source_plugin import SOURCES

    keys = _page_keys()
    missing = []
    for name in SOURCES.names():
        options = SOURCES.get(name).options
        if options is not None:
            paths = _leaf_paths(attrs.asdict(options()), f"rollout.{name}.")
            missing += [p for p in paths if not _covered(p, keys)]
    assert "vllm" in SOURCES.names()
    assert missing == []


def test_explain_prints_one_keys_entry(capsys):
    from unirl.cli import main

    assert main(["check", "--explain", "algorithm.clip_low"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "algorithm.clip_low"
    assert "type: float" in out
    assert "default: 0.2" in out  # LossSettings.clip_low's default
    assert "Ratio clip range [1 - clip_low, 1 + clip_high]" in out  # the comment beside it


def test_explain_shows_allowed_values_and_the_rule(capsys):
    from unirl.cli import main

    assert main(["check", "--explain", "model.dtype"]) == 0
    assert 'allowed: "fp32", "bf16"' in capsys.readouterr().out
    assert main(["check", "--explain", "rollout.top_p"]) == 0
    assert "rule: in_range: > 0 and <= 1" in capsys.readouterr().out
    assert main(["check", "--explain", "algorithm.policy_loss"]) == 0
    assert "ppo_clip" in capsys.readouterr().out.split("allowed:")[1]


def test_explain_names_the_closest_keys_for_an_unknown_one(capsys):
    from unirl.cli import main

    assert main(["check", "--explain", "algorithm.clip_lo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("unirl: error: --explain 'algorithm.clip_lo': not a config key")
    assert "'algorithm.clip_low'" in err


def test_check_without_a_config_or_explain_is_one_error_line(capsys):
    from unirl.cli import main

    assert main(["check"]) == 2
    assert capsys.readouterr().err == (
        "unirl: error: unirl check needs a CONFIG file (or --explain KEY for one key's entry)\n"
    )


def _page_defaults() -> dict[str, str]:
    rows = re.findall(r"^\| `([^`]+)` \| (?:[^|\\]|\\\|)* \| ([^|]*) \|", PAGE.read_text(), re.M)
    return {key: default.strip() for key, default in rows}


@pytest.mark.parametrize("backend", ["deepspeed", "fsdp2", "megatron"])
def test_the_pages_defaults_are_what_a_minimal_config_resolves_to(backend, tmp_path):
    """Every default on the page against the config a run really gets when the key is left out
    (the resolved config of a file that sets only what has no default), with each backend's
    section."""
    import json

    from unirl.core.config.run_config import load_config

    given = {"model.hf_config", "batch.micro_batch_size", "backend"}
    minimal = tmp_path / "minimal.yaml"
    minimal.write_text("model: {hf_config: {model_type: llama}}\nbatch: {micro_batch_size: 4}\n")
    resolved = load_config(minimal, [f"backend={backend}"]).to_dict()
    assert backend in resolved
    defaults = _page_defaults()
    wrong = {}
    for path in _leaf_paths(resolved):
        value = resolved
        for part in path.split("."):
            value = value[part]
        if path in defaults and path not in given and defaults[path] != json.dumps(value):
            wrong[path] = (defaults[path], json.dumps(value))
    assert wrong == {}
    assert defaults["critic.optimizer.lr"] == "1e-05"  # CriticConfig: OptimizerConfig(lr=1e-5)
