"""What a serve config decides, in words: printed by ``unirl check SERVE_CONFIG`` and logged by
``unirl serve`` when it starts (the sampling engine, its settings and why)."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

from unirl.rollouts.vllm.plugin import CPU_KV_CACHE_GB
from unirl.serve.config import SERVE_VLLM_KEYS, ServeConfig, serve_config_from_dict
from unirl.serve.sessions import train_config
from unirl.serve.vllm_engine import KEPT_ADAPTERS


def check_serve(data: Mapping[str, Any], *, as_json: bool) -> int:
    """``unirl check`` on a serve config: build it as `unirl serve` does (and the training config
    every client gets, on the first base model), then print `describe_serve`."""
    cfg = serve_config_from_dict(data)
    first = next(iter(cfg.base_models))
    train_config(cfg, cfg.base_model_folder(first), {"rank": 1})
    report = describe_serve(cfg)
    if as_json:
        json.dump(report, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        sys.stdout.write("# unirl serve\n")
        for key, value in report.items():
            sys.stdout.write(f"{key}: {value}\n")
    return 0


def describe_serve(cfg: ServeConfig) -> dict[str, Any]:
    """The server's decisions, key -> explanation."""
    out: dict[str, Any] = {
        "listen": f"http://{cfg.host}:{cfg.port} (API key required)",
        "base_models": dict(cfg.base_models),
        "training": (
            f"each LoRA client a backend of serve.train (backend "
            f"{cfg.train.get('backend', 'the default')}); ranks up to serve.max_lora_rank="
            f"{cfg.max_lora_rank}"
        ),
    }
    return out | _sampling(cfg)


def _sampling(cfg: ServeConfig) -> dict[str, Any]:
    if cfg.sampling == "sampler":
        return {
            "sampling": (
                "sampler: unirl's built-in sampler on the merged weights (W + scale * B A) that "
                "save_weights_for_sampler writes; compute_logprobs by one forward of the prompt; "
                "no top_k (serve.sampling: vllm has it)"
            )
        }
    v = cfg.vllm
    kv = f"auto: {CPU_KV_CACHE_GB} GiB on the CPU, vLLM's own sizing on a GPU"
    return {
        "sampling": (
            "vllm: one vLLM engine per base model, started at the first sample request of that "
            "model (a server that only trains never pays its start or its memory; a model vLLM "
            "cannot serve fails its sample requests, not the server), stopped with the server "
            "(no engine process left); a dead or hung engine is started again by the next request"
        ),
        "sampler_weights": (
            "save_weights_for_sampler writes the adapter (a PEFT folder) and its fingerprint as "
            f"the client holds it; each is served as a LoRA request of its own (up to {KEPT_ADAPTERS} loaded, "
            f"slots of rank {cfg.max_lora_rank}), checked when loaded: the engine's LoRA slot "
            "against the fingerprint, its base weights against the model folder's (checked when "
            "it starts); a failed check fails the request naming the sampler weights"
        ),
        "sample": (
            "SamplingParams -> vLLM: n = num_samples (sample i seeded seed + i), max_tokens, "
            "temperature, top_p, top_k, stop token ids (None: the model's EOS; []: none; stop "
            "strings refused), the sampled tokens' log-probs from the distribution they were "
            "drawn from (processed_logprobs), prompt log-probs at temperature 1"
        ),
        "compute_logprobs": "on the engine too: its prompt log-probs (one prefill)",
        "dtype": cfg.engine_dtype(),
        "max_model_len": cfg.engine_max_model_len(),
        "kv_cache_gb": kv if v.kv_cache_gb == "auto" else v.kv_cache_gb,
        "keys": f"serve.vllm takes {list(SERVE_VLLM_KEYS)} of rollout.vllm's options",
    }
