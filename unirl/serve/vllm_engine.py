"""One vLLM engine per base model behind ``sample`` / ``compute_logprobs`` (``serve.sampling:
vllm``), with the verified adapter-only sync of `unirl.rollouts.vllm.adapter`.

The engine starts on the base model's folder with LoRA enabled (`KEPT_ADAPTERS` slots of rank
``serve.max_lora_rank``) and its base weights are checked against the folder's once
(`unirl.core.weights.fingerprint`). Sampler weights saved by ``save_weights_for_sampler`` are
an adapter (a PEFT folder) and, in their ``meta.json``, the fingerprint of the adapter as the
training client held it when it saved (`saved_fingerprint`). The first request for them loads
the folder as a LoRA request of its own (one LoRA id per saved adapter) and checks the engine's
LoRA slot against that fingerprint, and its base weights against the start's: a check that fails
removes the adapter and fails the request with an error naming the sampler weights, so no
answer ever comes from other weights than the ones the client named. Later requests reuse the
loaded adapter; the least recently used of more than `KEPT_ADAPTERS` is removed (and checked
again when loaded again).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors.torch import load_file

from unirl.core.config.from_data import _convert
from unirl.core.config.sections.lora import LoraConfig
from unirl.core.errors import ConfigError, RunError
from unirl.core.weights.adapter import adapter_fingerprint
from unirl.core.weights.fingerprint import (
    Fingerprint,
    SyncVerificationError,
    compare,
    fingerprinted,
)
from unirl.core.weights.stream import as_buckets, drain
from unirl.rollouts.vllm.adapter import check_served_adapter, lora_engine_kwargs
from unirl.rollouts.vllm.engine import VllmEngine
from unirl.rollouts.vllm.fingerprint import WORKER_EXTENSION, engine_fingerprint
from unirl.rollouts.vllm.launch import EngineLaunch, plan_launch
from unirl.rollouts.vllm.plugin import VllmOptions
from unirl.serve import state
from unirl.serve.config import ServeConfig

logger = logging.getLogger(__name__)

# Adapters an engine keeps loaded: an RL loop samples from the newest sampler weights, a few
# clients at once from theirs; vLLM reserves this many LoRA slots of max_lora_rank.
KEPT_ADAPTERS = 4
_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def lora_config(lora: Mapping[str, Any]) -> LoraConfig:
    """A training client's ``model.lora`` section (its meta) as the config, defaults filled."""
    return _convert(dict(lora), LoraConfig, "model.lora")


def saved_fingerprint(
    adapter: Mapping[str, torch.Tensor], lora: Mapping[str, Any], dtype: str
) -> dict[str, list[float]]:
    """What ``meta.json`` keeps of an adapter saved for vLLM: its fingerprint as an engine of
    ``dtype`` holds it (B scaled by alpha / rank, `unirl.core.weights.adapter`), per layer."""
    fp = adapter_fingerprint(adapter, scale=lora_config(lora).scale, dtype=_TORCH_DTYPES[dtype])
    return {key: list(stats) for key, stats in fp.keys.items()}


def _eos_ids(folder: Path) -> list[int]:
    """The model's EOS ids (config.json's ``eos_token_id``, one or a list)."""
    eos = json.loads((folder / "config.json").read_text()).get("eos_token_id")
    return [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def _folder_fingerprint(folder: Path, dtype: str) -> Fingerprint:
    """The fingerprint of the safetensors weights in ``folder`` as the engine holds them."""
    out = Fingerprint(dtype=_TORCH_DTYPES[dtype])
    for file in sorted(folder.glob("*.safetensors")):
        drain(fingerprinted(as_buckets(load_file(file)), out))
    return out


class ServeEngine:
    """The engine of one base model and the adapters it holds (saved folder -> LoRA request)."""

    def __init__(self, cfg: ServeConfig, base_model: str) -> None:
        self.base_model = base_model
        self.folder = cfg.base_model_folder(base_model)
        self.dtype = cfg.engine_dtype()
        self.max_model_len = cfg.engine_max_model_len()
        self.eos_ids = _eos_ids(self.folder)
        self.vocab_size = int(json.loads((self.folder / "config.json").read_text())["vocab_size"])
        self.receiver = f"the vLLM engine of base model {base_model!r}"
        try:
            self.engine = _start(cfg, self.folder, self.dtype, self.max_model_len)
        except RunError as exc:  # it names rollout.vllm's keys: here they are serve.vllm's
            named = str(exc).replace("rollout.vllm", "serve.vllm")
            raise RunError(f"serve.sampling: vllm, base model {base_model!r}: {named}") from exc
        try:  # the base weights it serves are the folder's, and stay so (checked per adapter)
            self.base = engine_fingerprint(self.engine.llm)
            compare(
                _folder_fingerprint(self.folder, self.dtype),
                self.base,
                receiver=self.receiver,
                version=0,
                what="base weights",
            )
        except Exception:
            self.engine.close()
            raise
        self.adapters: OrderedDict[tuple[Path, str], Any] = OrderedDict()
        self._next_id = 1  # vLLM's LoRA id 0 is no adapter

    @property
    def failed(self) -> bool:
        """Whether the engine died or hung (`unirl.rollouts.vllm.health`)."""
        watch = self.engine.watch
        return watch is not None and watch.failed is not None

    def adapter(self, saved: Path, model_path: str) -> Any:
        """The LoRA request of the sampler weights saved in ``saved`` (``model_path``), loaded
        and checked the first time (module docstring). Saved again under the same name (a
        new folder renamed into place, `state.PartialWrite`), they are new weights: the key
        is the folder and its meta.json's content, which holds the adapter's fingerprint (not
        its inode: a file system gives a freed inode to a later file)."""
        meta = state.read_meta(saved, "model_path")
        key = (saved, hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest())
        if key in self.adapters:
            self.adapters.move_to_end(key)
            return self.adapters[key]
        if meta.get("adapter_dtype") != self.dtype:
            raise SyncVerificationError(
                f"the sampler weights {model_path} were saved for an engine of dtype "
                f"{meta.get('adapter_dtype')}, and this one runs {self.dtype} (serve.vllm.dtype); "
                "save them again with save_weights_for_sampler",
                "adapter",
            )
        stale = [k for k in self.adapters if k[0] == saved]  # replaced by a newer save
        while stale or len(self.adapters) >= KEPT_ADAPTERS:
            old = self.adapters.pop(stale.pop()) if stale else self.adapters.popitem(False)[1]
            self.engine.llm.llm_engine.remove_lora(old.lora_int_id)
        request = self._load(saved / state.ADAPTER, model_path, meta["adapter_fingerprint"])
        self.adapters[key] = request
        return request

    def _load(self, folder: Path, model_path: str, saved: dict[str, list[float]]) -> Any:
        """Load the PEFT folder as a LoRA request of its own and check the engine's slot
        against ``saved`` (the fingerprint kept at the save) and its base weights."""
        from vllm.lora.request import LoRARequest

        # vLLM keys prefix-cache blocks by the LoRA name and path (not its id): weights saved
        # again under one name have the same path, so each load gets a name of its own, else a
        # prompt seen before is answered from the keys and values of the replaced adapter
        request = LoRARequest(
            lora_name=f"{model_path}#{self._next_id}",
            lora_int_id=self._next_id,
            lora_path=str(folder),
        )
        self._next_id += 1
        self._deliver_adapter(request)
        try:
            check_served_adapter(
                self.engine.llm,
                Fingerprint.of([saved]),
                lora_id=request.lora_int_id,
                base=self.base,
                receiver=self.receiver,
                version=request.lora_int_id,
            )
        except SyncVerificationError as exc:
            self.engine.llm.llm_engine.remove_lora(request.lora_int_id)
            raise SyncVerificationError(
                f"the sampler weights {model_path}: the engine does not serve the adapter the "
                f"training client saved there, so nothing is sampled from it ({exc})",
                exc.layer,
            ) from exc
        return request

    def _deliver_adapter(self, request: Any) -> None:
        """The engine loads the adapter of ``request`` into a LoRA slot (a fault test drops it)."""
        self.engine.llm.llm_engine.add_lora(request)

    def close(self) -> None:
        self.engine.close()


def serve_launch(options: VllmOptions, *, cuda: bool, gpus: int) -> EngineLaunch:
    """The engine's launch on a server that sees ``gpus`` GPUs: it loads the folder (no weight
    stream) and, on GPUs, takes the first ``tensor_parallel_size`` of them (the training
    clients' backends run on the first)."""
    tp = options.tensor_parallel_size
    if cuda and tp > gpus:
        raise ConfigError(
            f"serve.vllm.tensor_parallel_size={tp} > the {gpus} GPUs this server sees; lower it "
            "or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
        )
    options = attrs.evolve(options, weight_transfer="file")
    # the engine's GPUs are the server's, as a training run's engine takes its ranks' GPUs
    machine = gpus if cuda else 1
    return plan_launch(
        options, engine=0, cuda=cuda, local_rank=0, world_size=machine, local_world_size=machine
    )


def _start(cfg: ServeConfig, folder: Path, dtype: str, max_model_len: int) -> VllmEngine:
    """The engine on ``folder``, as a training run launches one (launch.py: its GPUs, or the
    CPU), with the workers' fingerprint extension and LoRA slots for every client's rank."""
    cuda = torch.cuda.is_available()
    launch = serve_launch(cfg.vllm, cuda=cuda, gpus=torch.cuda.device_count() if cuda else 0)
    options = attrs.evolve(cfg.vllm, weight_transfer="file")
    lora = lora_engine_kwargs(LoraConfig(rank=cfg.max_lora_rank))
    extra = {
        **launch.llm_kwargs(),
        "worker_extension_cls": WORKER_EXTENSION,
        **lora,
        "max_loras": KEPT_ADAPTERS,
        "max_cpu_loras": KEPT_ADAPTERS,
    }
    logger.info("unirl serve: starting vLLM on %s (%s)", folder, dtype)
    return VllmEngine.start(
        str(folder),
        options,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=0,  # every request carries its own seed
        temperature=1.0,
        top_p=1.0,
        max_new_tokens=1,
        stop_token_ids=[],
        extra=extra,
        env=launch.env,
    )
