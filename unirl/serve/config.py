"""The server's own config section (``serve.yaml``): where it listens, who may call it, what it
accepts, which base models it trains and the unirl training config each training client gets.

    host: 127.0.0.1            # loopback unless told otherwise
    port: 8000
    api_key_env: UNIRL_SERVE_API_KEY   # or api_key: tml-...; one of them is required
    base_models: {tiny-llama: /models/tiny-llama}
    state_dir: /runs/serve     # saved states and sampler weights; survives a restart
    sample_seed: null          # or an integer: seedless sample requests become reproducible
    sampling: sampler          # or vllm: sample / compute_logprobs on a vLLM engine per base model
    vllm: {dtype: fp32}        # with sampling: vllm, rollout.vllm's options (SERVE_VLLM_KEYS)
    train: {backend: fsdp2, ...}   # a unirl config without model.path (set per base model)
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import attrs
import yaml

from unirl.core.config.from_data import _convert
from unirl.core.config.sections.model import ModelConfig
from unirl.core.errors import ConfigError
from unirl.rollouts.vllm.plugin import (  # neither torch nor vLLM
    INSTALL_HINT,
    MAX_LORA_RANKS,
    VllmOptions,
)

# The SDK refuses an API key without this prefix before it sends anything.
API_KEY_PREFIX = "tml-"


def _positive(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if value <= 0:
        raise ConfigError(f"serve.{attribute.name}={value} must be a positive integer")


@attrs.frozen(kw_only=True)
class ServeConfig:
    """Everything `unirl serve` reads; the training side is ``train`` (a unirl config)."""

    base_models: Mapping[str, str]
    train: Mapping[str, Any]
    state_dir: str
    host: str = "127.0.0.1"
    port: int = attrs.field(default=8000, validator=_positive)
    api_key: str | None = None
    api_key_env: str | None = None
    # A request body larger than this is refused (413) before it is parsed.
    max_request_bytes: int = attrs.field(default=16 * 1024 * 1024, validator=_positive)
    # Datums in one forward / forward_backward request.
    max_datums_per_request: int = attrs.field(default=1024, validator=_positive)
    # Requests of one training client queued together are packed into microbatches of at most
    # this many tokens (one backend forward_backward call for all of them); also the longest
    # datum accepted.
    tokens_per_microbatch: int = attrs.field(default=4096, validator=_positive)
    # Samples: the most new tokens one request may ask for.
    max_sample_tokens: int = attrs.field(default=1024, validator=_positive)
    # A sample request without a seed: None draws a random one; an integer derives it from
    # this, the prompt and the prompt's earlier requests (reproducible loops; `SampleSeeds`).
    sample_seed: int | None = None
    # The engine behind sample / compute_logprobs: sampler (unirl's built-in sampler on the merged
    # weights save_weights_for_sampler writes) or vllm (one vLLM engine per base model, each saved
    # adapter served as a LoRA request and verified; `unirl.serve.vllm_sampling`).
    sampling: Literal["sampler", "vllm"] = "sampler"
    # The vLLM engine's options (``rollout.vllm``'s schema; only `SERVE_VLLM_KEYS` apply here).
    vllm: VllmOptions = attrs.field(factory=VllmOptions)
    # The largest LoRA rank a training client may ask for (lora_config.rank); a vLLM engine
    # reserves its adapter slots at this rank (rounded up to one vLLM offers).
    max_lora_rank: int = attrs.field(default=128, validator=_positive)

    def resolved_api_key(self) -> str:
        """The key the SDK must send (``X-API-Key``); `ConfigError` when none is configured."""
        key = self.api_key
        if key is None and self.api_key_env is not None:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise ConfigError(
                    f"serve.api_key_env={self.api_key_env!r}: that environment variable is not "
                    "set; export it (a key starting with 'tml-') or set serve.api_key"
                )
        if key is None:
            raise ConfigError(
                "serve: no API key: set api_key_env (an environment variable holding it) or "
                "api_key; the server never runs without one"
            )
        if not key.startswith(API_KEY_PREFIX):
            raise ConfigError(
                f"serve: the API key must start with {API_KEY_PREFIX!r} (the tinker SDK refuses "
                "any other before sending it); pick a key such as tml-<random>"
            )
        return key

    def base_model_folder(self, name: str) -> Path:
        return Path(self.base_models[name])

    def _train_model(self, key: str) -> Any:
        """``train.model.<key>``, or its schema default."""
        model = dict(self.train.get("model") or {})
        return model.get(key, getattr(attrs.fields(ModelConfig), key).default)

    def train_model_dtype(self) -> str:
        """``train.model.dtype``: the built-in sampler's on a GPU."""
        return str(self._train_model("dtype"))

    def engine_dtype(self) -> str:
        """The vLLM engine's weights dtype: ``serve.vllm.dtype``, "model" = ``train.model.dtype``."""
        dtype = self.vllm.dtype
        return self.train_model_dtype() if dtype == "model" else dtype

    def engine_max_model_len(self) -> int:
        """The vLLM engine's longest prompt + sample: ``serve.vllm.max_model_len``, else
        ``train.model.max_seq_len``."""
        return int(self.vllm.max_model_len or self._train_model("max_seq_len"))


# The rollout.vllm keys a serve engine uses. The others describe a training run's engines (their
# count and GPUs, sleep between steps, the weight stream, restarts): the serve engine loads its
# base model's folder and each adapter from its saved folder, one engine per base model.
SERVE_VLLM_KEYS = (
    "dtype",
    "kv_cache_gb",
    "gpu_memory_utilization",
    "enforce_eager",
    "max_model_len",
    "tensor_parallel_size",
    "stall_timeout_s",
)


def _vllm_section(data: Mapping[str, Any]) -> VllmOptions:
    """``serve.vllm`` as `VllmOptions`: only `SERVE_VLLM_KEYS`, and only with ``sampling: vllm``
    (a key that changes nothing is refused, not ignored); vLLM must be installed."""
    section = data.get("vllm")
    sampling = data.get("sampling", attrs.fields(ServeConfig).sampling.default)
    if sampling not in ("sampler", "vllm"):
        raise ConfigError(f"serve.sampling={sampling!r}: use sampler (built in) or vllm")
    if section is not None and sampling != "vllm":
        raise ConfigError(
            f"serve.vllm is set but serve.sampling={sampling!r}: the section configures the vLLM "
            "engine of sampling: vllm; set serve.sampling: vllm or remove serve.vllm"
        )
    if not isinstance(section or {}, Mapping):
        raise ConfigError(f"serve.vllm: expected a mapping of keys, got {section!r}")
    unused = sorted(set(section or {}) - set(SERVE_VLLM_KEYS))
    if unused:
        raise ConfigError(
            f"serve.vllm: {unused} configure a training run's engines and change nothing under "
            f"unirl serve (one engine per base model, loaded from its folder); remove them. The "
            f"keys that apply: {list(SERVE_VLLM_KEYS)}"
        )
    if sampling == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            f"serve.sampling: vllm needs vLLM, which is not installed: {INSTALL_HINT}"
        )
    return _convert(dict(section or {}), VllmOptions, "serve.vllm")


def serve_config_from_dict(data: Mapping[str, Any]) -> ServeConfig:
    """Check the keys and build the config; a mistake is a `ConfigError` naming the key."""
    known = {a.name for a in attrs.fields(ServeConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"serve: unknown key(s) {unknown}; known keys: {sorted(known)}")
    missing = [a.name for a in attrs.fields(ServeConfig) if a.default is attrs.NOTHING]
    missing = [name for name in missing if name not in data]
    if missing:
        raise ConfigError(f"serve: missing required key(s) {missing}")
    if not isinstance(data["base_models"], Mapping) or not data["base_models"]:
        raise ConfigError("serve.base_models must map at least one model name to a local folder")
    if "path" in dict(data["train"].get("model") or {}):
        raise ConfigError(
            "serve.train.model.path is set per base model from serve.base_models; remove it"
        )
    if "batch" in data["train"]:
        raise ConfigError(
            "serve.train.batch: the server packs its own microbatches from the queued requests; "
            "remove it and set serve.tokens_per_microbatch"
        )
    cfg = ServeConfig(**{**data, "vllm": _vllm_section(data)})
    if cfg.sampling == "vllm" and cfg.max_lora_rank > MAX_LORA_RANKS[-1]:
        raise ConfigError(
            f"serve.max_lora_rank={cfg.max_lora_rank}: a vLLM engine reserves adapter slots of "
            f"rank at most {MAX_LORA_RANKS[-1]} (serve.sampling: vllm); lower it"
        )
    return cfg


def load_serve_config(path: str | os.PathLike[str]) -> ServeConfig:
    with open(path) as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: a serve config is a mapping of keys, got {type(data).__name__}")
    return serve_config_from_dict(data)
