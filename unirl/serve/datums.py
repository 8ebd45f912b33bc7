"""A wire datum checked against the loss it is sent with and the model it trains, turned into
tensors (`TokenDatum`). Every mistake is a `BadRequest` naming ``data[i]`` and the field,
raised before the request is queued."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from unirl.serve.batching import TokenDatum
from unirl.serve.errors import BadRequest
from unirl.serve.losses import SdkLoss
from unirl.serve.stability import StabilityRecords, resolve_spans
from unirl.serve.wire import WireDatum


def _per_position(datum: WireDatum, name: str, n: int, where: str) -> np.ndarray:
    if name not in datum.inputs:
        raise BadRequest(f"{where}.loss_fn_inputs", f"has no {name!r}; this loss needs it")
    arr = datum.inputs[name]
    if arr.ndim != 1 or arr.shape[0] != n:
        raise BadRequest(
            f"{where}.loss_fn_inputs.{name}",
            f"has shape {list(arr.shape)}; it needs one value per model_input token, [{n}]",
        )
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise BadRequest(f"{where}.loss_fn_inputs.{name}", "holds a NaN or an infinity")
    return arr


def _token_ids(arr: np.ndarray, vocab_size: int, field: str) -> torch.Tensor:
    bad = (arr < 0) | (arr >= vocab_size)
    if bad.any():
        pos = int(np.flatnonzero(bad)[0])
        raise BadRequest(
            field,
            f"holds token id {int(arr[pos])} at position {pos}, outside the model's "
            f"vocabulary [0, {vocab_size})",
        )
    return torch.from_numpy(arr.astype(np.int64, copy=True))


def _float(arr: np.ndarray) -> torch.Tensor:
    return torch.tensor(arr, dtype=torch.float32)


def token_datum(
    datum: WireDatum,
    index: int,
    loss: SdkLoss,
    *,
    vocab_size: int,
    max_tokens: int,
    records: StabilityRecords,
) -> TokenDatum:
    where = f"data[{index}]"
    n = int(datum.tokens.size)
    if n == 0:
        raise BadRequest(f"{where}.model_input", "is empty; send at least one token")
    if n > max_tokens:
        raise BadRequest(
            f"{where}.model_input",
            f"has {n} tokens, over this server's tokens_per_microbatch={max_tokens}",
        )
    reads = ["target_tokens", *loss.inputs]
    unknown = sorted(set(datum.inputs) - set(reads))
    if unknown:
        raise BadRequest(
            f"{where}.loss_fn_inputs",
            f"has {unknown}, which this loss does not read; it reads {reads}",
        )
    tokens = _token_ids(datum.tokens, vocab_size, f"{where}.model_input")
    targets_np = _per_position(datum, "target_tokens", n, where)
    targets = _token_ids(targets_np, vocab_size, f"{where}.loss_fn_inputs.target_tokens")
    if loss.weighted:
        mask = _float(_per_position(datum, "weights", n, where))
        return TokenDatum(tokens=tokens, targets=targets, mask=mask)
    advantages = _float(_per_position(datum, "advantages", n, where))
    if loss.provenance:
        return _provenance_datum(datum, where, tokens, targets, advantages, records)
    mask = torch.ones(n, dtype=torch.float32)
    if loss.ratio_masked:
        mask = _ratio_mask(datum, advantages, n, where)
    return TokenDatum(
        tokens=tokens,
        targets=targets,
        mask=mask,
        advantages=advantages,
        sampler_logprobs=_float(_per_position(datum, "logprobs", n, where)),
    )


def _ratio_mask(datum: WireDatum, advantages: torch.Tensor, n: int, where: str) -> torch.Tensor:
    """gspo's ``sequence_ratio_mask`` as 0 / 1: the tokens of the sequence ratio, which are the
    tokens the loss sums here; an advantage outside them would be a term this sum leaves out."""
    mask = (_float(_per_position(datum, "sequence_ratio_mask", n, where)) != 0).float()
    if not mask.any():
        raise BadRequest(
            f"{where}.loss_fn_inputs.sequence_ratio_mask", "marks no token; mark the sampled ones"
        )
    _advantages_inside(
        advantages, mask, where, "outside sequence_ratio_mask; gspo here needs advantages 0 "
        "outside the ratio's tokens (the prompt)",
    )  # fmt: skip
    return mask


def _advantages_inside(advantages: torch.Tensor, mask: torch.Tensor, where: str, why: str) -> None:
    """A non-zero advantage where ``mask`` is 0 is a term the loss's sum leaves out: a 400
    naming the first such position (``why``: what the position is and what the loss needs)."""
    outside = (advantages != 0) & (mask == 0)
    if outside.any():
        pos = int(outside.nonzero()[0])
        raise BadRequest(
            f"{where}.loss_fn_inputs.advantages",
            f"is {float(advantages[pos])} at position {pos}, {why}",
        )


def _provenance_datum(
    datum: WireDatum,
    where: str,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    advantages: torch.Tensor,
    records: StabilityRecords,
) -> TokenDatum:
    """stable_reinforce: the provenance resolved into values. The mask is 1 on the sampled
    targets (REINFORCE is about tokens the sampler drew), the sampler's log-probs are the
    recorded ones; the datum's own ``logprobs`` (the cookbook sends them) must agree."""
    if datum.input_spans is None or datum.target_spans is None:
        raise BadRequest(
            f"{where}.loss_fn_input_spans",
            "is missing; stable_reinforce reads provenance: sample with "
            "record_stability_info=True and attach Datum.with_provenance(...)",
        )
    input_field, target_field = f"{where}.model_input_spans", f"{where}.loss_fn_input_spans"
    resolve_spans(datum.input_spans, tokens.numpy(), input_field, records, check_prompt_tokens=True)
    sampled, recorded = resolve_spans(
        datum.target_spans, targets.numpy(), target_field, records, check_prompt_tokens=False
    )
    if not sampled.any():
        raise BadRequest(
            f"{where}.loss_fn_input_spans", "marks no target as sampled; train on sampled tokens"
        )
    mask = torch.from_numpy(sampled).float()
    _advantages_inside(
        advantages, mask, where, "whose target was not sampled; stable_reinforce needs "
        "advantages 0 on prompt targets",
    )  # fmt: skip
    q = torch.from_numpy(recorded)
    if "logprobs" in datum.inputs:
        sent = _float(_per_position(datum, "logprobs", int(mask.numel()), where))
        off = ((sent - q).abs() > 1e-4) & (mask != 0)
        if off.any():
            pos = int(off.nonzero()[0])
            raise BadRequest(
                f"{where}.loss_fn_inputs.logprobs",
                f"is {float(sent[pos])} at position {pos}; the sampler recorded "
                f"{float(q[pos])} for that sampled token",
            )
    return TokenDatum(
        tokens=tokens, targets=targets, mask=mask, advantages=advantages, sampler_logprobs=q
    )


def token_datums(
    data: Sequence[WireDatum],
    loss: SdkLoss,
    *,
    vocab_size: int,
    max_tokens: int,
    records: StabilityRecords,
) -> tuple[TokenDatum, ...]:
    """Every datum of a request checked and turned into tensors (`token_datum`); only then
    does a request that reads provenance restart its records' day (a rejected one changes
    nothing)."""
    datums = tuple(
        token_datum(d, i, loss, vocab_size=vocab_size, max_tokens=max_tokens, records=records)
        for i, d in enumerate(data)
    )
    if loss.provenance:
        records.touch(
            span.sequence_id
            for d in data
            for span in (*(d.input_spans or ()), *(d.target_spans or ()))
        )
    return datums
