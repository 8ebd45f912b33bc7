"""A backend registered from the test suite (`tests.plugins.toy_backend`) runs `unirl check` and
an RL step: adding a backend needs no edit under ``unirl/core``. The step's loss and gradient norm
are compared with a hand-computed expectation and a plain-PyTorch reference written here."""

from __future__ import annotations

import copy

import pytest
import torch
import yaml

from tests.plugins import toy_backend
from unirl.backends import BACKENDS, build_backend
from unirl.cli import main
from unirl.core.backend import InstrumentedBackend
from unirl.core.config.run_config import config_from_dict
from unirl.core.data.rollout import RolloutBatch
from unirl.core.errors import ConfigError
from unirl.core.step import RLStep

VOCAB = 8
# (prompt, response, reward, group): group 0 has rewards 1 and 0 (advantages +-0.5 without std
# normalisation), group 1 equal rewards (advantage 0).
SAMPLES = [
    ([1, 2], [3, 4, 5], 1.0, 0),
    ([1, 2], [6, 7], 0.0, 0),
    ([2, 1], [3, 3, 4, 4], 1.0, 1),
    ([2, 1], [5], 1.0, 1),
]


@pytest.fixture
def toy_registered():
    BACKENDS.register("toy", toy_backend.PLUGIN)
    yield
    BACKENDS.unregister("toy")


def config_data(**over) -> dict:
    return (
        toy_backend.config_data(
            VOCAB, algorithm={"std_normalize": False}, rollout={"max_new_tokens": 8}
        )
        | over
    )


def test_unknown_backend_lists_the_registered_ones():
    with pytest.raises(ConfigError, match=r"backend='toy' is not a registered backend"):
        config_from_dict(config_data())


def test_check_runs_with_the_plugins_section_and_rules(toy_registered, tmp_path, capsys):
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(config_data()))
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "backend=toy" in out
    assert yaml.safe_load(out.split("# resolved config")[1].split("\n", 1)[1])["toy"] == {
        "hidden_size": 8
    }
    # the plug-in's own validation and rules
    assert main(["check", str(path), "--set", "toy.hidden=4"]) == 2
    assert "unknown key 'toy.hidden' (did you mean 'hidden_size'?)" in capsys.readouterr().err
    assert main(["check", str(path), "--set", "parallel.tp=2"]) == 2
    assert (
        "parallel.tp/pp/cp = 2/1/1: backend: toy has no model parallelism"
        in capsys.readouterr().err
    )


def test_rl_step_on_the_toy_backend(toy_registered):
    cfg = config_from_dict(config_data())
    batch = RolloutBatch.from_records(
        [
            {"prompt_tokens": p, "response_tokens": r, "reward": w, "group_id": g}
            for p, r, w, g in SAMPLES
        ]
    )
    backend = build_backend(cfg, total_optimizer_steps=1)
    assert isinstance(backend, InstrumentedBackend)
    initial = copy.deepcopy(backend.model)

    result = RLStep(cfg, backend).run(batch)

    assert result.decision.source == "reuse"  # one on-policy step: no forward-only pass
    assert backend.forward_calls == {"policy": 2, "reference": 0}  # two training microbatches
    # PPO at ratio 1 is -A per token; token-mean over the 10 response tokens:
    # -(0.5 * 3 - 0.5 * 2 + 0 * 4 + 0 * 1) / 10 = -0.05
    assert result.metrics["loss"] == pytest.approx(-0.05, abs=1e-6)

    # Reference gradient: d/dw of -sum_t A_t logp_t / 10 on the initial weights.
    total = torch.zeros(())
    for prompt, response, reward, group in SAMPLES:
        advantage = {(0, 1.0): 0.5, (0, 0.0): -0.5}.get((group, reward), 0.0)
        tokens = torch.tensor(prompt + response)
        logp = torch.log_softmax(initial(tokens[:-1]), dim=-1)
        picked = logp.gather(1, tokens[1:, None])[:, 0][len(prompt) - 1 :]
        total = total - advantage * picked.sum()
    (total / 10).backward()
    norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad) for p in initial.parameters()])
    )
    assert result.metrics["grad_norm"] == pytest.approx(float(norm), rel=1e-5)
    changed = [
        not torch.equal(a, b)
        for a, b in zip(backend.model.state_dict().values(), initial.state_dict().values())
    ]
    assert any(changed)


def test_model_lora_on_a_backend_without_supports_lora_is_refused(toy_registered):
    """A plug-in that does not declare ``supports_lora`` refuses ``model.lora`` at load, naming
    the backends that train adapters."""
    data = config_data()
    data["model"] = {**data["model"], "lora": {"rank": 4}}
    with pytest.raises(ConfigError, match=r"model\.lora is set but backend: toy trains no adapter"):
        config_from_dict(data)
