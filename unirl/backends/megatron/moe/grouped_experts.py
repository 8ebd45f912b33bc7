"""All local experts of a megatron-core MoE layer in two ``torch._grouped_mm`` calls, no
Transformer Engine and no ``grouped_gemm`` package.

megatron-core without TE has two expert modules: `SequentialMLP`, one matmul per expert in a
Python loop (and a host sync for the split sizes), and `GroupedMLP`, which needs the
``grouped_gemm`` package (`TEGroupedMLP` needs TE). `GroupedExperts` is a `SequentialMLP` whose
forward runs the SwiGLU expert MLP of every local expert at once::

    h = x @ W1_e^T   (rows of expert e)      one torch._grouped_mm, offsets = cumsum(tokens/expert)
    a = silu(h_gate) * h_up * prob          as megatron's MLP computes it for experts
    y = a @ W2_e^T                           one torch._grouped_mm

Same parameters as `SequentialMLP` (``local_experts.{i}.linear_fc1.weight`` ``[2F/tp, H]`` and
``linear_fc2.weight`` ``[H, F/tp]``, the same ``sharded_state_dict``), so checkpoints, the
distributed optimizer and the Hugging Face conversion see no difference. The cost of keeping that
layout: each forward stacks the per-expert weights into one ``[E, out, in]`` tensor (a copy,
freed after the matmul, made again in backward; ``benchmarks/moe_experts.py`` measures it).
The weight gradient of the stacked tensor goes, under megatron's DDP, straight into the
experts' ``main_grad`` from one ``_foreach_add_`` (megatron's gradient-accumulation-fusion
protocol, `_into_main_grad`), not through an AccumulateGrad copy and a Python DDP hook's add per
expert weight.

Where it runs fast: ``torch._grouped_mm`` has a grouped kernel for bf16 on CUDA compute
capability 9.0 / 10.0 (H100, H200, B200); other CUDA dtypes (fp32, fp16) and devices, and the CPU,
run torch's fallback, a loop of ``mm`` per group (same numbers, no speed-up). `select_experts`
picks `GroupedExperts` on CUDA and `SequentialMLP` on the CPU, with the reason. Use in a layer
spec (``MoESubmodules.experts``)::

    choice = select_experts(device, config)
    logger.info("MoE experts: %s (%s)", choice.name, choice.reason)
    mlp_spec.submodules.experts = experts_spec(choice)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.spec_utils import ModuleSpec

from unirl.core.errors import ConfigError

logger = logging.getLogger(__name__)

# The dtypes torch._grouped_mm accepts (it refuses float64).
_GROUPED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def grouped_mm_available() -> bool:
    """Whether this torch has ``torch._grouped_mm`` (torch >= 2.8)."""
    return hasattr(torch, "_grouped_mm")


def _into_main_grad(dw_eoi: torch.Tensor, weights_oi: Sequence[torch.Tensor]) -> tuple:
    """megatron's gradient-accumulation-fusion protocol for the experts' weights: add the stacked
    weight gradient into each weight's ``main_grad`` (megatron DDP's buffer) in one
    ``_foreach_add_``, mark ``grad_added_to_main_grad`` and hand autograd an uninitialised
    gradient per weight (megatron's own linear layers hand an uninitialised one,
    tensor_parallel/layers.py:581-610; here the stacked gradient's slices), which AccumulateGrad
    keeps without a copy and DDP's hook then drops without adding it again.
    Before, each expert weight's gradient slice went through AccumulateGrad and DDP's hook
    (``main_grad.add_`` from Python, one launch each, per microbatch). Numbers: ``main_grad +=
    dw_e`` as DDP's hook computes it (the bf16 gradient upcast exactly, then added). The bytes
    moved stay those of one add per weight: a bf16 gradient into an fp32 ``main_grad`` takes
    torch's per-tensor loop inside ``_foreach_add_`` (its multi-tensor kernels need one dtype),
    a bf16 ``main_grad`` its multi-tensor kernels."""
    slices = dw_eoi.unbind(0)
    torch._foreach_add_([w.main_grad for w in weights_oi], list(slices))
    for w in weights_oi:
        w.grad_added_to_main_grad = True
    # DDP (overlap_grad_reduce) counts each weight ready in its hook: a gradient for every one.
    # The stacked gradient's own slices serve (the hook drops them unread), not a new
    # allocation per weight, which would hold a second stack of the weights at once;
    # megatron's zero_out_wgrad weights get zeros, as its linear layers give them.
    return tuple(
        torch.zeros_like(w) if getattr(w, "zero_out_wgrad", False) else g
        for w, g in zip(weights_oi, slices)
    )


def _zero_empty_experts(dw_eoi: torch.Tensor, offs_e: torch.Tensor) -> None:
    """Zero the weight gradient of experts that got no rows where ``torch._grouped_mm`` leaves
    them unset (compute capability 10.x, pytorch#172439); a device-side mask, no host sync."""
    if dw_eoi.device.type != "cuda" or torch.cuda.get_device_capability(dw_eoi.device)[0] < 10:
        return
    rows = torch.diff(offs_e, prepend=offs_e.new_zeros(1))
    dw_eoi.masked_fill_((rows == 0)[:, None, None], 0)


def _fuses_into_main_grad(weights_oi: Sequence[torch.Tensor]) -> bool:
    """Whether megatron's DDP wraps these weights: it gives each a ``main_grad`` and the
    ``grad_added_to_main_grad`` flag its backward hook reads (distributed_data_parallel.py:119,
    :438 in megatron-core 0.16.1)."""
    return all(
        hasattr(w, "grad_added_to_main_grad") and hasattr(w, "main_grad") for w in weights_oi
    )


class _GroupedLinear(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] @ W_e^T`` for every expert ``e`` at once.

    The weights come in as the experts' own parameters (one input each), so each keeps its own
    gradient; their stacked copy lives only inside forward and backward, never saved between.
    Under megatron's DDP the stacked weight gradient goes straight into the weights'
    ``main_grad`` (`_into_main_grad`); elsewhere (a bare module, tests) each weight gets its
    slice of it as ``.grad``.
    """

    @staticmethod
    def forward(ctx: Any, x_ti: torch.Tensor, offs_e: torch.Tensor, *weights_oi: torch.Tensor):
        ctx.save_for_backward(x_ti, offs_e, *weights_oi)
        w_eio = torch.stack(weights_oi).transpose(1, 2)  # column-major, as the kernel wants
        return torch._grouped_mm(x_ti, w_eio, offs=offs_e)

    @staticmethod
    def backward(ctx: Any, dy_to: torch.Tensor):
        x_ti, offs_e, *weights_oi = ctx.saved_tensors
        dy_to = dy_to.contiguous()
        dx_ti = None
        if ctx.needs_input_grad[0]:
            dx_ti = torch._grouped_mm(dy_to, torch.stack(weights_oi), offs=offs_e)
        dws: tuple[torch.Tensor | None, ...] = (None,) * len(weights_oi)
        if any(ctx.needs_input_grad[2:]):
            # [E, out, in]: per expert dy_e^T @ x_e, the rows of expert e the contracted dim;
            # an expert with no rows gets zeros
            dw_eoi = torch._grouped_mm(dy_to.t(), x_ti, offs=offs_e)
            _zero_empty_experts(dw_eoi, offs_e)
            if _fuses_into_main_grad(weights_oi):
                dws = _into_main_grad(dw_eoi, weights_oi)
            else:
                dws = tuple(dw_eoi.unbind(0))
        return dx_ti, None, *dws


def grouped_linear(
    x_ti: torch.Tensor, offs_e: torch.Tensor, weights_oi: Sequence[torch.Tensor]
) -> torch.Tensor:
    """``x[rows of e] @ W_e^T`` for every expert ``e`` (rows sorted by expert, ``offs_e`` their
    cumulative ends), each weight with its own gradient (`_GroupedLinear`)."""
    return _GroupedLinear.apply(x_ti, offs_e, *weights_oi)


def unsupported_reason(config: Any) -> str | None:
    """Why `GroupedExperts` cannot compute this megatron ``TransformerConfig``'s experts, or
    ``None``. It computes what Qwen3-MoE's experts are: SwiGLU, no bias, bf16/fp16/fp32."""
    if not (config.gated_linear_unit and config.activation_func is F.silu):
        return "the experts are not SwiGLU (gated_linear_unit with silu)"
    if config.add_bias_linear:
        return "the experts have biases (add_bias_linear)"
    if config.fp8 or config.fp4:
        return "fp8 / fp4 experts need Transformer Engine"
    if config.use_te_activation_func:
        return "use_te_activation_func needs Transformer Engine"
    if config.params_dtype not in _GROUPED_DTYPES:
        return f"torch._grouped_mm does not take {config.params_dtype}"
    # The kernel reads rows in 16-byte steps: every row length (H, 2F/tp, F/tp) a multiple of it.
    per_row = 16 // torch.empty((), dtype=config.params_dtype).element_size()
    tp = config.expert_tensor_parallel_size or 1
    for name, size in (
        ("hidden_size", config.hidden_size),
        ("moe_ffn_hidden_size / expert_tensor_parallel_size", config.moe_ffn_hidden_size // tp),
    ):
        if size % per_row:
            return f"{name}={size} is not a multiple of {per_row} ({config.params_dtype})"
    return None


class GroupedExperts(SequentialMLP):
    """See the module docstring. Built by megatron's `MoELayer` from a ``ModuleSpec`` like
    `SequentialMLP`, called with ``(permuted_local_hidden_states [T, H], tokens_per_expert
    [E_local], permuted_probs [T])`` (rows sorted by local expert) and returning
    ``(output [T, H], None)``."""

    def __init__(
        self,
        num_local_experts: int,
        config: Any,
        submodules: MLPSubmodules,
        pg_collection: Any = None,
    ) -> None:
        reason = unsupported_reason(config)
        if reason is not None:
            raise ConfigError(
                f"GroupedExperts cannot compute these experts: {reason}; use megatron's "
                "SequentialMLP (unirl.backends.megatron.moe.grouped_experts.select_experts picks it)"
            )
        super().__init__(num_local_experts, config, submodules, pg_collection)
        for expert in self.local_experts:
            # Local matmuls only: expert TP's reductions are the token dispatcher's, as in
            # SequentialMLP (megatron sets explicit_expert_comm whenever expert TP or EP > 1).
            for linear in (expert.linear_fc1, expert.linear_fc2):
                assert linear.explicit_expert_comm or self.tp_group.size() == 1, linear
                assert linear.bias is None, linear

    def _weighted_swiglu(self, h_tf2: torch.Tensor, probs_t: torch.Tensor) -> torch.Tensor:
        """megatron's `MLP.forward` activation for experts (``per_token_scale`` = the probs),
        fused or not as the config says, so the numbers are SequentialMLP's."""
        cfg = self.config
        if cfg.bias_activation_fusion:
            return weighted_bias_swiglu_impl(
                h_tf2, None, probs_t.unsqueeze(-1), cfg.activation_func_fp8_input_store
            )
        gate, up = torch.chunk(h_tf2, 2, dim=-1)
        if (val := cfg.activation_func_clamp_value) is not None:
            gate = gate.clamp(min=None, max=val)
            up = up.clamp(min=-val, max=val)
        a_tf = cfg.activation_func(gate) * (up + cfg.glu_linear_offset)
        return (a_tf * probs_t.unsqueeze(-1)).to(a_tf.dtype)

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        x_th, probs_t = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:  # as SequentialMLP
            assert self.config.moe_router_topk == 1, "moe_apply_probs_on_input needs top-1"
            x_th = (probs_t.unsqueeze(-1) * x_th).to(x_th.dtype)
            probs_t = torch.ones_like(probs_t)
        assert x_th.dim() == 2, x_th.shape
        # End row of each expert's group (no host sync, unlike SequentialMLP's split sizes).
        offs_e = torch.cumsum(tokens_per_expert.to(x_th.device), dim=0, dtype=torch.int32)
        h_tf2 = self._fc1(x_th.contiguous(), offs_e)
        a_tf = self._weighted_swiglu(h_tf2, probs_t)
        return self._fc2(a_tf.contiguous(), offs_e), None

    def _fc1(self, x_th: torch.Tensor, offs_e: torch.Tensor) -> torch.Tensor:
        """Every local expert's ``linear_fc1`` on its rows (a LoRA subclass adds its branch)."""
        return grouped_linear(x_th, offs_e, [e.linear_fc1.weight for e in self.local_experts])

    def _fc2(self, a_tf: torch.Tensor, offs_e: torch.Tensor) -> torch.Tensor:
        return grouped_linear(a_tf, offs_e, [e.linear_fc2.weight for e in self.local_experts])


@attrs.frozen(kw_only=True)
class ExpertsChoice:
    """The experts module of the MoE layers and why (logged once at model build)."""

    module: type
    name: str
    reason: str


def select_experts(device: torch.device, config: Any, requested: str = "auto") -> ExpertsChoice:
    """`GroupedExperts` on CUDA where torch has ``torch._grouped_mm`` and the config is one it
    computes, else megatron's `SequentialMLP`; the reason says which condition decided.
    ``requested`` (``megatron.experts``): ``grouped`` / ``sequential`` force one, and a forced
    ``grouped`` the config or torch cannot compute is refused, naming why."""
    if requested == "sequential":
        return ExpertsChoice(
            module=SequentialMLP, name="sequential", reason="megatron.experts: sequential"
        )
    if requested == "grouped":
        reason = (
            f"torch {torch.__version__} has no torch._grouped_mm (torch >= 2.8 has)"
            if not grouped_mm_available()
            else unsupported_reason(config)
        )
        if reason is not None:
            raise ConfigError(
                f"megatron.experts: grouped cannot compute this model's experts: {reason}; "
                "use megatron.experts: auto or sequential"
            )
        where = (
            "on CUDA"
            if device.type == "cuda"
            else f"on the {device.type}: torch's per-expert "
            "fallback of the grouped matmul (the GPU path's code, no speed-up)"
        )
        return ExpertsChoice(
            module=GroupedExperts, name="grouped", reason=f"megatron.experts: grouped, {where}"
        )
    if device.type != "cuda":
        return ExpertsChoice(
            module=SequentialMLP,
            name="sequential",
            reason=f"the device is {device.type}: torch._grouped_mm has no grouped kernel there "
            "(it loops over experts too), so megatron's own SequentialMLP, the reference path",
        )
    if not grouped_mm_available():
        return ExpertsChoice(
            module=SequentialMLP,
            name="sequential",
            reason=f"torch {torch.__version__} has no torch._grouped_mm (torch >= 2.8 has)",
        )
    reason = unsupported_reason(config)
    if reason is not None:
        return ExpertsChoice(module=SequentialMLP, name="sequential", reason=reason)
    capability = torch.cuda.get_device_capability(device)
    fast = config.params_dtype == torch.bfloat16 and capability in ((9, 0), (10, 0))
    kernel = (
        "its grouped kernel"
        if fast
        else f"torch's per-expert fallback ({config.params_dtype}, compute capability "
        f"{capability[0]}.{capability[1]}: the grouped kernel is bf16 on 9.0 / 10.0)"
    )
    return ExpertsChoice(
        module=GroupedExperts,
        name="grouped",
        reason=f"CUDA with torch._grouped_mm: all local experts in two calls, {kernel}",
    )


def experts_spec(choice: ExpertsChoice) -> ModuleSpec:
    """The ``MoESubmodules.experts`` spec of the local (non-TE) layer spec for ``choice``."""
    return ModuleSpec(
        module=choice.module,
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
    )
