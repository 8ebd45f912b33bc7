"""The SDK's protobuf wire format for the two payloads it sends or reads as protobuf: the
``forward_backward`` request body and the ``ForwardBackwardOutput`` / ``SampleResponse`` results.
The schema is the SDK's own (``tinker.proto.tinker_public_pb2``), so the server speaks exactly
what the pinned SDK writes; every other endpoint is JSON."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from unirl.serve.errors import BadRequest

_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


@attrs.frozen(kw_only=True)
class WireSpan:
    """One provenance run (``Datum.with_provenance``): ``length`` datum positions that are
    positions ``[offset, offset + length)`` of sequence ``sequence_id``'s request prompt
    (``sampled`` False) or of its sampled tokens (``sampled`` True)."""

    sampled: bool
    sequence_id: str
    offset: int
    length: int


@attrs.frozen(kw_only=True)
class WireDatum:
    tokens: np.ndarray  # [N] int64: the model input
    inputs: Mapping[str, np.ndarray]  # loss_fn_inputs by name, dense
    # Provenance, both or neither: runs tiling the model input / the targets (None: not sent).
    input_spans: tuple[WireSpan, ...] | None = None
    target_spans: tuple[WireSpan, ...] | None = None


@attrs.frozen(kw_only=True)
class FwdBwdRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: Mapping[str, float | str]
    forward_only: bool
    data: tuple[WireDatum, ...]


def _dense(msg: Any, field: str) -> np.ndarray:
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise BadRequest(field, f"has an unsupported dtype {msg.dtype}; send float32 or int64")
    shape = list(msg.shape)
    if msg.HasField("sparse_csr"):
        if len(shape) != 2:
            raise BadRequest(field, f"is sparse with shape {shape}; a sparse tensor is 2-D")
        crow = np.frombuffer(msg.sparse_csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(msg.sparse_csr.col_indices, dtype=np.int64)
        values = np.frombuffer(msg.sparse_csr.values, dtype=dtype)
        out = np.zeros(shape, dtype=dtype)
        for row in range(shape[0]):
            out[row, col[crow[row] : crow[row + 1]]] = values[crow[row] : crow[row + 1]]
        return out
    arr = np.frombuffer(msg.dense, dtype=dtype)
    if shape and int(np.prod(shape)) != arr.size:
        raise BadRequest(field, f"holds {arr.size} values but its shape is {shape}")
    return arr.reshape(shape) if shape else arr


def _datum(msg: Any, i: int) -> WireDatum:
    chunks = []
    for c, chunk in enumerate(msg.model_input):
        if not chunk.HasField("encoded_text"):
            raise BadRequest(
                f"data[{i}].model_input.chunks[{c}]",
                "is not a text chunk; this server takes token chunks only (ModelInput.from_ints)",
            )
        chunks.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
    tokens = np.concatenate(chunks).astype(np.int64) if chunks else np.zeros(0, np.int64)
    inputs = {
        name: _dense(t, f"data[{i}].loss_fn_inputs.{name}")
        for name, t in msg.loss_fn_inputs.items()
    }
    input_spans = _spans(msg.model_input_spans, f"data[{i}].model_input_spans")
    target_spans = _spans(msg.loss_fn_input_spans, f"data[{i}].loss_fn_input_spans")
    if (input_spans is None) != (target_spans is None):
        missing = "model_input_spans" if input_spans is None else "loss_fn_input_spans"
        raise BadRequest(
            f"data[{i}].{missing}",
            "is missing; provenance comes as a pair (Datum.with_provenance sets both)",
        )
    return WireDatum(
        tokens=tokens, inputs=inputs, input_spans=input_spans, target_spans=target_spans
    )


def _spans(msgs: Sequence[Any], field: str) -> tuple[WireSpan, ...] | None:
    """A repeated ``ProvenanceSpan`` as runs; None when empty (proto3 cannot tell an empty list
    from none, and a field of positions is never empty)."""
    if not msgs:
        return None
    spans = []
    for j, msg in enumerate(msgs):
        arm = msg.WhichOneof("span")
        if arm is None:
            raise BadRequest(f"{field}[{j}]", "sets neither prompt_tokens nor sampled_tokens")
        run = getattr(msg, arm)
        if not run.sequence_id or run.offset < 0 or run.length < 0:
            raise BadRequest(
                f"{field}[{j}]",
                f"has sequence_id={run.sequence_id!r}, offset={run.offset}, "
                f"length={run.length}; send a sampled sequence's id, offset >= 0, length >= 0",
            )
        spans.append(
            WireSpan(
                sampled=arm == "sampled_tokens",
                sequence_id=run.sequence_id,
                offset=int(run.offset),
                length=int(run.length),
            )
        )
    return tuple(spans)


def decode_forward_backward(body: bytes) -> FwdBwdRequest:
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:
        raise BadRequest("body", f"is not a ForwardBackwardRequest protobuf ({exc})") from exc
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    return FwdBwdRequest(
        model_id=msg.model_id,
        seq_id=int(msg.seq_id),
        loss_fn=msg.loss_fn,
        loss_fn_config=config,
        forward_only=bool(msg.forward_only),
        data=tuple(_datum(d, i) for i, d in enumerate(msg.data)),
    )


def _batched(arrays: Sequence[np.ndarray], dtype: int) -> Any:
    np_dtype = _DTYPES[dtype]
    flat = [np.ascontiguousarray(a, dtype=np_dtype).reshape(-1) for a in arrays]
    offsets = np.cumsum([0] + [a.nbytes for a in flat]).astype(np.int64)
    return pb.BatchedTensor(
        data=b"".join(a.tobytes() for a in flat), offsets=offsets.tobytes(), dtype=dtype
    )


def encode_forward_backward_output(
    outputs: Sequence[Mapping[str, np.ndarray]], metrics: Mapping[str, float]
) -> bytes:
    """Per datum its output tensors (all float32, 1-D), and the request's metrics."""
    record = pb.ArrayRecord(num_datums=len(outputs))
    for name in outputs[0] if outputs else ():
        record.fields[name].CopyFrom(_batched([o[name] for o in outputs], pb.DTYPE_FLOAT32))
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record])
    for key, value in metrics.items():
        msg.metrics[key] = float(value)
    return msg.SerializeToString()


@attrs.frozen(kw_only=True)
class WireSequence:
    tokens: np.ndarray  # int32
    logprobs: np.ndarray  # float32
    stopped: bool  # ended at a stop token rather than the budget


def encode_sample_response(
    sequences: Sequence[WireSequence], prompt_logprobs: np.ndarray | None
) -> bytes:
    """``prompt_logprobs``: NaN where the SDK shows None (the first prompt token)."""
    msg = pb.SampleResponse()
    for seq in sequences:
        msg.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if seq.stopped else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(seq.tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype=np.float32).tobytes(),
        )
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return msg.SerializeToString()


def decode_sample_sequences(body: bytes) -> list[tuple[np.ndarray, np.ndarray]]:
    """A ``SampleResponse`` this server encoded, back to (tokens int64, log-probs float32) per
    sequence: what a stability record keeps."""
    msg = pb.SampleResponse()
    msg.ParseFromString(body)
    return [
        (
            np.frombuffer(seq.tokens, dtype=np.int32).astype(np.int64),
            np.frombuffer(seq.logprobs, dtype=np.float32).copy(),
        )
        for seq in msg.sequences
    ]
