"""The agent source's plug-in: its ``rollout.agent`` section, its rules, what ``unirl check``
says about it and its constructor. Importing this module imports neither torch nor FastAPI."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import attrs

from unirl.core.config.validators import positive
from unirl.core.errors import ConfigError
from unirl.core.protocols.source_plugin import LazySourceBuilder, SourcePlugin
from unirl.rollouts.vllm.plugin import VllmOptions, fit_after_first_step
from unirl.rollouts.vllm.plugin import check as vllm_check

if TYPE_CHECKING:
    from unirl.core.config.run_config import UnirlConfig

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install -e '.[agent]' (fastapi, uvicorn and the agents' openai SDK)"


# Why the gateway cannot record routed experts per call: no engine behind it returns them here.
NO_ROUTED_EXPERTS = (
    "algorithm.routing_replay: rollout replays the experts the engine routed each token to, and "
    "neither engine behind the gateway returns them: the built-in sampler records none, and "
    "vLLM 0.32 returns them (enable_return_routed_experts) only from its Model Runner V2, which "
    "its CPU build cannot run without triton-cpu and unirl does not wire yet (as for "
    "rollout.source: vllm). Use algorithm.routing_replay: record (the trainer records its own "
    "routing of the episodes' tokens)"
)


def _module_function(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    module, _, name = value.rpartition(":")
    if value and (not module or not name):
        raise ConfigError(
            f"rollout.agent.{attribute.name}={value!r}; give the agent function as "
            "'package.module:function' or 'path/to/file.py:function' (e.g. "
            "examples/tiny_agent.py:agent)"
        )


def _optional_finite(instance: Any, attribute: attrs.Attribute, value: float | None) -> None:
    if value is not None and not math.isfinite(value):
        raise ConfigError(f"rollout.agent.{attribute.name}={value!r}; give a finite reward or null")


@attrs.frozen(kw_only=True)
class AgentOptions:
    """The ``rollout.agent`` section. Sampling settings (temperature, top_p, the largest
    max_tokens a call may ask for, stops) come from ``rollout``, so the trainer and the engine
    agree on the distribution; a call that asks for another temperature or top_p is refused."""

    # The agent function, "package.module:function" or "path/to/file.py:function": called once per episode as
    # function(base_url, task, api_key) (unirl/rollouts/gateway/runner.py).
    function: str = attrs.field(default="", validator=_module_function)
    # The engine behind the gateway: the built-in sampler (a copy of the policy in this process)
    # or a vLLM engine (configured by the vllm section below).
    engine: Literal["sampler", "vllm"] = "sampler"
    vllm: VllmOptions = attrs.field(factory=VllmOptions)
    # Episodes run at once (each agent function on a thread of its own).
    concurrency: int = attrs.field(default=8, validator=positive)
    # An episode's agent function must return within this many seconds; one that does not is
    # abandoned and its episode gets the outcome "timeout".
    episode_timeout_s: float = attrs.field(default=300.0, validator=positive)
    # The reward of an episode whose agent failed (crashed, timed out, broke a request limit,
    # returned no reward, made no call); null: such an episode stops the run with its error.
    failure_reward: float | None = attrs.field(default=None, validator=_optional_finite)
    # Where the endpoint listens: loopback by default (agents on this machine); port 0 = a free
    # port chosen when the server starts.
    host: str = "127.0.0.1"
    port: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    # Request limits: the largest request body in bytes; the calls one episode may have in
    # flight at once and in all (a call past either ends its episode as a failure).
    max_request_bytes: int = attrs.field(default=1 << 20, validator=positive)
    max_calls_in_flight: int = attrs.field(default=4, validator=positive)
    max_calls: int = attrs.field(default=64, validator=positive)
    # A Jinja chat template (a file path) for /v1/chat/completions when the tokenizer has none of
    # its own (the built-in tasks' character tokenizer); null: the tokenizer's.
    chat_template: str | None = None
    # How tool calls are read from a completion's text (protocol.py): hermes = Qwen / Hermes
    # <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks; none = never.
    tool_parser: Literal["hermes", "none"] = "hermes"


def _check(cfg: UnirlConfig) -> None:
    a, r = cfg.rollout.source_options, cfg.rollout
    if not a.function:
        raise ConfigError(
            "rollout.source: agent needs rollout.agent.function, the agent as "
            "'package.module:function' (called as function(base_url, task, api_key))"
        )
    if r.environment is not None:
        raise ConfigError(
            f"rollout.environment={r.environment!r} with rollout.source: agent: the agent "
            "function plays the episode; remove rollout.environment"
        )
    if a.engine == "vllm":
        _check_vllm(cfg, a.vllm)
    if cfg.algorithm.routing_replay == "rollout":
        raise ConfigError(NO_ROUTED_EXPERTS)
    if a.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning(
            "rollout.agent.host=%s: the gateway listens beyond loopback; only the per-episode "
            "keys guard it", a.host,
        )  # fmt: skip


def _check_vllm(cfg: UnirlConfig, v: VllmOptions) -> None:
    """The vLLM source's own rules on the engines' section, its keys named under
    rollout.agent.vllm (with sleep: the engines sleep between rollouts, awake while the
    episodes run)."""
    try:  # (building the evolved config runs the vLLM plug-in's rules too)
        engine_cfg = attrs.evolve(
            cfg, rollout=attrs.evolve(cfg.rollout, source="vllm", source_options=v)
        )
        vllm_check(engine_cfg)
    except ConfigError as err:
        raise ConfigError(str(err).replace("rollout.vllm.", "rollout.agent.vllm.")) from None


def _weights(cfg: UnirlConfig) -> Literal["rank0", "every_rank"]:
    # the sampler's copy is on every rank (only rank 0 generates); one vLLM engine on rank 0,
    # several on their leaders (as the vLLM source's)
    a = cfg.rollout.source_options
    return "rank0" if a.engine == "vllm" and a.vllm.engines == 1 else "every_rank"


def _describe(cfg: UnirlConfig) -> Mapping[str, Any]:
    a = cfg.rollout.source_options
    failure = f"reward {a.failure_reward:g}" if a.failure_reward is not None else "the run stops"
    out = {
        "agent": f"{a.function}(base_url, task, api_key), once per episode",
        "engine": (
            "the built-in sampler: a copy of the policy in this process"
            if a.engine == "sampler"
            else _describe_vllm(a.vllm.engines)
        ),
        "endpoint": (
            f"OpenAI-compatible on http://{a.host}:{a.port or '<free port>'}/v1 (chat "
            "completions, completions, models; streaming; tool calls by "
            f"{a.tool_parser}); a per-episode key as the API key"
        ),
        "episodes": (
            f"{a.concurrency} at once on global rank 0, each within {a.episode_timeout_s:g} s, "
            f"{a.max_calls} calls ({a.max_calls_in_flight} in flight); a failed episode: "
            f"{failure}"
        ),
        "samples": (
            "token in, token out: a call whose prompt extends the previous call's prompt + "
            "completion joins its sample (the tokens in between masked), else the episode forks "
            "and trains on its last fork"
        ),
        "policy_version": (
            "stamped per call with the version its engine reported (rollout/staleness from the "
            "oldest call)"
        ),
    }
    if a.engine == "vllm":
        out["fit_after_first_step"] = fit_after_first_step(
            cfg, a.vllm, section="rollout.agent.vllm"
        )
    if a.engine == "vllm" and a.vllm.sleep != "off":
        out["sleep"] = (
            f"rollout.agent.vllm.sleep={a.vllm.sleep}: the engines wake before each rollout's "
            "episodes and sleep after them; a call outside them is refused"
        )
    return out


def _describe_vllm(engines: int) -> str:
    if engines == 1:
        return "one vLLM engine driven from global rank 0 (rollout.agent.vllm)"
    return (
        f"{engines} vLLM engines (rollout.agent.vllm.engines), engine k driven by global rank "
        "k * world / engines, each synced and verified; each episode's calls go to one engine "
        "(its prefix cache holds the episode), a new episode to the engine with the fewest open "
        "episodes; the leaders serve their engines to the gateway on rank 0"
    )


PLUGIN = SourcePlugin(
    name="agent",
    options=AgentOptions,
    build=LazySourceBuilder("unirl.rollouts.gateway.source:build_agent_source"),
    check=_check,
    describe=_describe,
    requires=("fastapi", "uvicorn", "transformers"),
    install_hint=INSTALL_HINT,
    loggers=("uvicorn", "httpx", "httpx2", "openai", "vllm"),
    top_p_logprobs=None,  # the sampler's are untruncated, vLLM's truncated
    weights=_weights,
)
