"""`unirl check` on the DAPO data side: what dynamic sampling, the overlong penalty and the
truncation mask do to the step, and the rules `unirl train` meets too (one error naming the key,
the value and the fix)."""

from __future__ import annotations

from pathlib import Path

import pytest

from unirl.cli import main

TINY = str(Path(__file__).parents[2] / "examples" / "tiny_grpo.yaml")


def test_check_explains_all_three(capsys):
    argv = ["check", TINY, "--set", "rollout.dynamic_sampling.enabled=true",
            "--set", "rollout.dynamic_sampling.max_draws=3",
            "--set", "rollout.overlong.buffer_tokens=4", "--set", "rollout.overlong.penalty_factor=0.5",
            "--set", "algorithm.mask_truncated=true"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    section = out[out.index("# rollout shaping (DAPO)") :]
    # 16 prompts x 8 samples per draw, up to 3 draws
    assert "up to 3 draws (48 prompts, 384 samples generated)" in section
    assert "the step always trains 16 groups" in section
    assert "reward += 0 up to 4 response tokens, then linear to -0.5 at 8" in section
    assert "mask_truncated: on:" in section and "group's baseline" in section


def test_check_says_off(capsys):
    assert main(["check", TINY]) == 0
    out = capsys.readouterr().out
    assert "dynamic_sampling: off" in out and "overlong_penalty: off" in out
    assert "mask_truncated: off" in out


@pytest.mark.parametrize(
    ("sets", "words"),
    [
        (["rollout.dynamic_sampling.enabled=true", "rollout.dynamic_sampling.criterion=nope"],
         "rollout.dynamic_sampling.criterion"),
        (["rollout.dynamic_sampling.enabled=true", "batch.samples_per_prompt=1",
          "batch.samples_per_optimizer_step=16", "batch.micro_batch_size=16"],
         "batch.samples_per_prompt=1; set it to 2 or more"),
        (["rollout.dynamic_sampling.enabled=true", "rollout.source=file",
          "rollout.file=examples/tiny_rollouts.jsonl"],
         "rollout.source: file reads finished rollouts"),
        (["rollout.overlong.buffer_tokens=9"], "rollout.overlong.buffer_tokens=9 is longer"),
        (["rollout.dynamic_sampling.on_exhausted=skip"], "rollout.dynamic_sampling.on_exhausted"),
    ],
)  # fmt: skip
def test_check_refuses_what_train_refuses(sets, words, capsys):
    argv = ["check", TINY]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 2
    assert words in capsys.readouterr().err


def test_the_docs_recipe_checks_on_the_tiny_example(tmp_path, capsys):
    import yaml

    from tests.unit.doc_snippets import doc_snippet

    cfg = yaml.safe_load(Path(TINY).read_text())
    recipe = doc_snippet("getting-started/real-model.md", "dapo", "yaml")
    for section, keys in yaml.safe_load(recipe).items():
        cfg[section] = {**cfg.get(section, {}), **keys}
    path = tmp_path / "dapo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["check", str(path)]) == 0
    assert "up to 4 draws (64 prompts, 512 samples generated)" in capsys.readouterr().out
