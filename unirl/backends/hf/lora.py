"""LoRA on the Hugging Face engines (``model.lora``): the policy wrapped by ``peft`` before the
engine (DeepSpeed, FSDP2) wraps it, and the conversions between the wrapped module's names and
the two outside forms of its weights.

- The wrap (`wrap_policy`): ``peft.get_peft_model`` with `peft_lora_config`; A drawn from
  ``model.lora.init_seed`` (a forked torch RNG: the same A on every rank, the caller's stream
  untouched), B zero, or both read from ``model.lora.path``. peft freezes the base weights, so
  the optimizer (`unirl.backends.hf.optim`, trainable parameters only), the gradient norm and
  its clipping only ever see the adapter.
- `adapter_state`: the trained module's adapter tensors in PEFT's names (what
  `peft.get_peft_model_state_dict` gives and `write_peft_folder` writes).
- `merged_state`: the policy as a plain Hugging Face model, ``W + scale * B @ A`` under clean
  names, computed from a gathered state dict (the module is never merged in place), so the
  full-weight sync and its fingerprint see the weights the policy computes with.
- `base_fingerprint`: a hash of the base weights, kept in checkpoints (which hold only the
  adapter) so that a resume onto another base is refused.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch

from unirl.backends.peft_experts import expert_target_parameters, expert_targets
from unirl.backends.peft_folder import (
    PEFT_PREFIX,
    initial_lora_a,
    peft_lora_config,
    read_peft_folder,
)
from unirl.core.config.run_config import ModelConfig
from unirl.core.config.sections.lora import LoraConfig
from unirl.core.errors import ConfigError

ADAPTER = "default"  # peft's name of the one adapter
_BASE = ".base_layer."
_LORA_A, _LORA_B = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"


def _check_targets(model: torch.nn.Module, lora: LoraConfig) -> list[str] | None:
    """Each target names at least one ``torch.nn.Linear`` of ``model``, or (``target_experts``)
    a projection its fused experts hold; returns peft's ``target_parameters`` for the experts
    (`unirl.backends.peft_experts`)."""
    kinds: dict[str, set[str]] = {}
    for name, module in model.named_modules():
        kinds.setdefault(name.rsplit(".", 1)[-1], set()).add(type(module).__name__)
    linears = sorted(
        {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    )
    parameters = expert_target_parameters(model, lora)
    in_experts = expert_targets(lora)
    missing = [t for t in lora.target_modules if t not in kinds and t not in in_experts]
    if missing:
        raise ConfigError(
            f"model.lora.target_modules: {missing} name no module of {type(model).__name__}; "
            f"its linears are {linears}; set model.lora.target_modules to some of them"
        )
    not_linear = [t for t in lora.target_modules if t not in linears and t not in in_experts]
    if not_linear:
        raise ConfigError(
            f"model.lora.target_modules: {not_linear} are "
            f"{sorted(set().union(*(kinds[t] for t in not_linear)))}, not torch.nn.Linear; "
            f"the DeepSpeed / FSDP2 backends adapt linears only: choose from {linears}"
        )
    return parameters


def wrap_policy(model: torch.nn.Module, model_cfg: ModelConfig) -> Any:
    """``model`` (the freshly loaded policy, full on every rank) as a peft model in train mode:
    base frozen, adapter from ``model.lora.path`` or A from ``model.lora.init_seed``, B zero.
    Raises `ConfigError` (nothing wrapped) on a target the model lacks."""
    import peft

    lora = model_cfg.lora
    assert lora is not None
    experts = _check_targets(model, lora)
    state = read_peft_folder(lora.path, lora) if lora.path is not None else None
    config = peft_lora_config(lora, base_model=model_cfg.path, target_parameters=experts)
    config.inference_mode = False  # the adapter trains
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(lora.init_seed)
        wrapped = peft.get_peft_model(model, config)
    if state is not None:
        _load_adapter(wrapped, state, lora)
    else:
        _init_a(wrapped, lora)
    wrapped.train()
    return wrapped


def _init_a(wrapped: Any, lora: LoraConfig) -> None:
    """Every A from `initial_lora_a` (the rule every backend draws by), replacing peft's draw."""
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if is_adapter_name(name) and ".lora_A." in name:
                peft = name.replace(f".{ADAPTER}.weight", ".weight")
                rank, width = param.shape
                param.copy_(initial_lora_a(peft, rank, width, lora.init_seed))


def _load_adapter(wrapped: Any, state: Mapping[str, torch.Tensor], lora: LoraConfig) -> None:
    """``state`` (PEFT names) into ``wrapped``'s adapter; every adapter tensor must be given."""
    from peft import set_peft_model_state_dict

    own = set(adapter_state(wrapped.state_dict()))
    given = set(state)
    if own != given:
        missing, extra = sorted(own - given)[:3], sorted(given - own)[:3]
        raise ConfigError(
            f"model.lora.path={lora.path!r}: the adapter's tensors do not match this model "
            f"(missing {missing}, unknown {extra}); give an adapter trained on this base model "
            "with these model.lora.target_modules"
        )
    dtype = next(p.dtype for p in wrapped.parameters() if p.requires_grad)
    result = set_peft_model_state_dict(wrapped, {k: v.to(dtype) for k, v in state.items()})
    if result.unexpected_keys:
        raise ConfigError(
            f"model.lora.path={lora.path!r}: peft did not load {result.unexpected_keys[:3]}"
        )


def is_adapter_name(name: str) -> bool:
    """Whether ``name`` (a wrapped module's state-dict key) is an adapter tensor."""
    return name.endswith((_LORA_A, _LORA_B))


def adapter_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a wrapped module's state dict (or of its trainable part) in PEFT's
    names: ``…q_proj.lora_A.default.weight`` -> ``…q_proj.lora_A.weight``."""
    return {
        name.replace(f".{ADAPTER}.weight", ".weight"): tensor
        for name, tensor in state.items()
        if is_adapter_name(name)
    }


def expert_wrappers(wrapped: torch.nn.Module) -> dict[str, str]:
    """For each fused expert tensor peft adapts (``target_parameters``), its name in the wrapped
    module's state dict -> the name of the wrapper module holding its adapter (peft nests one
    wrapper per tensor, so the names cannot tell which adapts which)."""
    from peft.tuners.lora.layer import ParamWrapper

    names = {id(m): n for n, m in wrapped.named_modules()}
    return {
        f"{names[id(module.get_base_layer())]}.{module.parameter_name}": name
        for name, module in wrapped.named_modules()
        if isinstance(module, ParamWrapper)
    }


def target_parameters(wrapped: Any) -> list[str] | None:
    """The fused expert tensors peft adapts in ``wrapped`` (its ``target_parameters``; None:
    linears only), which the exported ``adapter_config.json`` must list for peft to reload."""
    listed = wrapped.peft_config[ADAPTER].target_parameters
    return list(listed) if listed else None


def _expert_delta(a: torch.Tensor, b: torch.Tensor, experts: int) -> torch.Tensor:
    """``B_e @ A_e`` per expert of peft's adapter on a fused ``[E, out, in]`` tensor: A
    ``[r * E, in]`` holds expert e's rows at ``e * r ..``, B ``[out, r * E]`` its columns at
    ``e, e + E, ..`` (peft's ``ParamWrapper.get_delta_weight``)."""
    a_eri = a.reshape(experts, -1, a.shape[-1])
    b_eor = b.reshape(b.shape[0], -1, experts).permute(2, 0, 1)
    return b_eor @ a_eri


def merged_state(
    state: Mapping[str, torch.Tensor], scale: float, experts: Mapping[str, str]
) -> dict[str, torch.Tensor]:
    """A wrapped module's full state dict as the plain Hugging Face model it computes: each
    adapted weight ``W + scale * B @ A`` (in fp32, then W's dtype), clean names, no adapter
    tensors. ``experts``: `expert_wrappers` of the module (fused expert tensors, each
    ``W_e + scale * B_e @ A_e``). ``state`` is not modified."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if is_adapter_name(name):
            continue
        if _BASE not in name:
            out[name.removeprefix(PEFT_PREFIX)] = tensor
            continue
        clean = _clean(name)
        if name in experts:
            wrapper = experts[name]
            a, b = state[wrapper + _LORA_A].float(), state[wrapper + _LORA_B].float()
            delta = _expert_delta(a, b, tensor.shape[0])
            out[clean] = (tensor.float() + scale * delta).to(tensor.dtype)
            continue
        module, leaf = name.split(_BASE)
        if leaf != "weight":
            out[clean] = tensor
            continue
        a, b = state[module + _LORA_A].float(), state[module + _LORA_B].float()
        out[clean] = (tensor.float() + scale * (b @ a)).to(tensor.dtype)
    return out


def base_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A wrapped module's full state dict as its base model, the adapter left out: clean
    Hugging Face names, the frozen weights as they are (what a rollout engine that keeps the
    base weights loads once, `unirl.core.backend.TrainsAdapter.stream_base_weights`)."""
    return {_clean(name): tensor for name, tensor in state.items() if not is_adapter_name(name)}


def _clean(name: str) -> str:
    """A wrapped module's state-dict name as the base model's (every ``.base_layer`` out)."""
    clean = name.removeprefix(PEFT_PREFIX)
    while _BASE in clean:
        clean = clean.replace(_BASE, ".")
    return clean


def base_fingerprint(model: torch.nn.Module) -> str:
    """A hash of ``model``'s weights (the base, before the wrap): names, dtypes, shapes, bytes."""
    digest = hashlib.blake2b(digest_size=16)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
            flat = tensor.detach().contiguous().reshape(-1).cpu()
            digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
