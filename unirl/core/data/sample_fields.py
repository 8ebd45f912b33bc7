"""The fields of a rollout sample: their names, and the converters that normalise one field's value
(token ids to 1-D int64, masks to bool, floats to float32) or raise `RolloutDataError` naming the
field. `unirl.core.data.sample` applies them; `unirl.core.data.sample_checks` checks what depends on
the model or on other fields."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from unirl.core.errors import RolloutDataError

# A log-prob above this is not a log-prob (probabilities or logits passed by mistake); the slack
# absorbs the rounding of a log-softmax whose true value is 0.
LOGPROB_TOLERANCE = 1e-6

REQUIRED_FIELDS = ("prompt_tokens", "response_tokens", "reward", "group_id")
OPTIONAL_FIELDS = (
    "loss_mask",
    "rollout_logprobs",
    "ref_logprobs",
    "values",
    "token_rewards",
    "routed_experts",
    "policy_version",
    "metadata",
)
# Optional float fields with one entry per response token; each is given for all samples or none.
PER_TOKEN_FLOAT_FIELDS = ("rollout_logprobs", "ref_logprobs", "values", "token_rewards")
# Those a packed microbatch carries (token rewards are read once, by the advantage estimator).
PACKED_FLOAT_FIELDS = ("rollout_logprobs", "ref_logprobs", "values")
LOGPROB_FIELDS = ("rollout_logprobs", "ref_logprobs")
# Optional fields given for all samples or none (`RolloutBatch.has`): the per-token floats and
# the MoE experts of every read token (`unirl.core.data.routed_experts`).
ALL_OR_NONE_FIELDS = (*PER_TOKEN_FLOAT_FIELDS, "routed_experts")

# What a per-token field holds, for "give one ... per response token".
_PER_TOKEN_WHAT = {
    "loss_mask": "0/1 entry",
    "rollout_logprobs": "log-prob",
    "ref_logprobs": "log-prob",
    "values": "value estimate",
    "token_rewards": "reward (0 where none was earned)",
}

_MAX_LISTED_PROBLEMS = 20


# -- converters: normalise one field's value or raise naming the field ------------------------


def _describe(value: Any) -> str:
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit for str() (4300 digits by default)
        return f"{type(value).__name__} of {value.bit_length()} bits"
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _first_bad_element(
    field: str, value: Sequence[Any], ok: Callable[[Any], bool], want: str
) -> RolloutDataError:
    for j, v in enumerate(value):
        if not ok(v):
            return RolloutDataError(f"field '{field}' element {j} is {_describe(v)}; {want}")
    return RolloutDataError(f"field '{field}' could not be read as a list; {want}")


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _fits_int64(v: Any) -> bool:
    return _is_int(v) and -(2**63) <= v < 2**63


def _is_finite_float(v: Any) -> bool:
    """A real number that float() can hold: a huge JSON integer (1e400 written as digits) would
    raise OverflowError deep in a tensor constructor."""
    if not _is_real(v):
        return False
    try:
        float(v)
    except OverflowError:
        return False
    return True


def _is_int_dtype(dtype: torch.dtype) -> bool:
    return dtype != torch.bool and not dtype.is_floating_point and not dtype.is_complex


def _is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _check_sequence(field: str, value: Any, want: str) -> None:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise RolloutDataError(f"field '{field}' is {_describe(value)}; {want}")


def _as_tensor_if_array(value: Any) -> Any:
    """numpy arrays (and other array-likes) are read like tensors."""
    if not isinstance(value, torch.Tensor) and hasattr(value, "__array__"):
        try:
            return torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            return value  # not numeric: the converter's type check names it
    return value


def _check_1d(field: str, value: torch.Tensor) -> None:
    if value.dim() != 1:
        raise RolloutDataError(
            f"field '{field}' is a tensor of shape {tuple(value.shape)}; give a 1-D tensor "
            "(one sample per RolloutSample, no batch dimension)"
        )


def _token_converter(field: str) -> Callable[[Any], torch.Tensor]:
    want = "give a list (or 1-D integer tensor) of int token ids"

    def convert(value: Any) -> torch.Tensor:
        value = _as_tensor_if_array(value)
        if isinstance(value, torch.Tensor):
            if not _is_int_dtype(value.dtype):
                raise RolloutDataError(f"field '{field}' is a {value.dtype} tensor; {want}")
            _check_1d(field, value)
            return value.detach().to(device="cpu", dtype=torch.long)
        _check_sequence(field, value, want)
        if not len(value):
            return torch.zeros(0, dtype=torch.long)
        if any(isinstance(v, bool) for v in value):
            # torch.tensor([True, 3]) is an int64 tensor [1, 3]: a bool would train as token 1
            raise _first_bad_element(field, value, _fits_int64, want)
        try:
            tensor = torch.tensor(value)
        except (TypeError, ValueError, RuntimeError):
            raise _first_bad_element(field, value, _fits_int64, want) from None
        if not _is_int_dtype(tensor.dtype) or tensor.dim() != 1:
            raise _first_bad_element(field, value, _fits_int64, want)
        return tensor.to(torch.long)

    return convert


def _is_mask_entry(v: Any) -> bool:
    return isinstance(v, bool) or (_is_int(v) and v in (0, 1))


def _convert_loss_mask(value: Any) -> torch.Tensor | None:
    field, want = "loss_mask", "give one 0/1 (or true/false) entry per response token"
    if value is None:
        return None  # filled with ones in RolloutSample.__attrs_post_init__
    value = _as_tensor_if_array(value)
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            raise RolloutDataError(f"field '{field}' is a {value.dtype} tensor; {want}")
        _check_1d(field, value)
        tensor = value.detach().cpu()
    else:
        _check_sequence(field, value, want)
        if not all(_is_mask_entry(v) for v in value):
            raise _first_bad_element(field, value, _is_mask_entry, want)
        return torch.tensor([bool(v) for v in value], dtype=torch.bool)
    if tensor.dtype != torch.bool:
        bad = ((tensor != 0) & (tensor != 1)).nonzero()
        if len(bad):
            j = int(bad[0])
            raise RolloutDataError(f"field '{field}' element {j} is {tensor[j].item()}; {want}")
    return tensor.to(torch.bool)


def _float_converter(field: str) -> Callable[[Any], torch.Tensor | None]:
    want = "give a list (or 1-D float tensor) of numbers, one per response token"

    def convert(value: Any) -> torch.Tensor | None:
        if value is None:
            return None
        value = _as_tensor_if_array(value)
        if isinstance(value, torch.Tensor):
            if value.dtype == torch.bool or value.is_complex():
                raise RolloutDataError(f"field '{field}' is a {value.dtype} tensor; {want}")
            _check_1d(field, value)
            return value.detach().to(device="cpu", dtype=torch.float32)
        _check_sequence(field, value, want)
        if not all(_is_finite_float(v) for v in value):
            raise _first_bad_element(field, value, _is_finite_float, want)
        return torch.tensor([float(v) for v in value], dtype=torch.float32)

    return convert


def _scalar(field: str, value: Any, ok: Callable[[Any], bool], want: str) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if not ok(value):
        raise RolloutDataError(f"field '{field}' is {_describe(value)}; {want}")
    return value


def _convert_reward(value: Any) -> float:
    want = "give one finite number per sample (a float holds magnitudes up to about 1.8e308)"
    return float(_scalar("reward", value, _is_finite_float, want))


def _convert_group_id(value: Any) -> int:
    want = "give an int in [-2**63, 2**63) naming the prompt this response answers"
    return int(_scalar("group_id", value, _fits_int64, want))


def _convert_policy_version(value: Any) -> int | None:
    if value is None:
        return None
    want = (
        "give the optimizer-step count (an int >= 0) of the weights that generated it, or omit it"
    )
    return int(_scalar("policy_version", value, lambda v: _fits_int64(v) and v >= 0, want))


def _convert_metadata(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise RolloutDataError(f"field 'metadata' is {_describe(value)}; give a dict (or omit it)")
    return dict(value)


def _tensor_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and torch.equal(a, b)


_tensor_eq = attrs.cmp_using(eq=_tensor_equal)
