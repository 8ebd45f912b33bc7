"""The wire format against the SDK's own encoder and decoders (`tinker.proto`): a request the
SDK writes (dense and sparse tensors, string and number loss config) decodes to its values, and
the results the server writes read back in the SDK as what was sent."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("tinker")
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import (
    deserialize_forward_backward_output,
    deserialize_sample_response,
)

from unirl.serve.errors import BadRequest
from unirl.serve.wire import (
    WireSequence,
    WireSpan,
    decode_forward_backward,
    encode_forward_backward_output,
    encode_sample_response,
)


def test_a_request_the_sdk_writes_decodes_to_its_values():
    weights_2d = torch.tensor([[0.0, 0.0, 1.5], [2.0, 0.0, 0.0]])  # the SDK sends it sparse
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([7, 8]).append_int(9),
        loss_fn_inputs={"target_tokens": [8, 9, 10], "weights": weights_2d},
    ).with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id="r/0", length=2),
            types.SampledProvenanceSpan(sequence_id="r/0", length=1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id="r/0", offset=1, length=1),
            types.SampledProvenanceSpan(sequence_id="r/0", length=2),
        ],
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum], loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.7, "mode": "x"}
        ),
        model_id="s:train:0",
        seq_id=3,
    )
    body = forward_backward_request_to_proto(request)
    body.forward_only = True
    got = decode_forward_backward(body.SerializeToString())
    assert (got.model_id, got.seq_id, got.loss_fn, got.forward_only) == (
        "s:train:0",
        3,
        "ppo",
        True,
    )
    assert got.loss_fn_config == {"clip_low_threshold": pytest.approx(0.7), "mode": "x"}
    (d,) = got.data
    assert d.tokens.tolist() == [7, 8, 9]
    assert d.inputs["target_tokens"].tolist() == [8, 9, 10]
    np.testing.assert_array_equal(d.inputs["weights"], weights_2d.numpy())
    assert d.input_spans == (
        WireSpan(sampled=False, sequence_id="r/0", offset=0, length=2),
        WireSpan(sampled=True, sequence_id="r/0", offset=0, length=1),
    )
    assert d.target_spans == (
        WireSpan(sampled=False, sequence_id="r/0", offset=1, length=1),
        WireSpan(sampled=True, sequence_id="r/0", offset=0, length=2),
    )


def test_malformed_provenance_is_a_bad_request_naming_the_run():
    """What the SDK's own checks would stop, written to the wire directly: a run of neither kind,
    a negative offset, one list without the other."""
    msg = pb.ForwardBackwardRequest(model_id="s:train:0", loss_fn="stable_reinforce")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([1, 2], np.int32).tobytes()
    datum.model_input_spans.add().sampled_tokens.CopyFrom(
        pb.SampledProvenanceSpan(sequence_id="r/0", length=2)
    )
    with pytest.raises(BadRequest) as err:  # model_input_spans without loss_fn_input_spans
        decode_forward_backward(msg.SerializeToString())
    assert err.value.field == "data[0].loss_fn_input_spans"
    datum.loss_fn_input_spans.add()  # neither prompt_tokens nor sampled_tokens
    with pytest.raises(BadRequest) as err:
        decode_forward_backward(msg.SerializeToString())
    assert err.value.field == "data[0].loss_fn_input_spans[0]"
    datum.loss_fn_input_spans[0].prompt_tokens.CopyFrom(
        pb.PromptProvenanceSpan(sequence_id="r/0", offset=-1, length=2)
    )
    with pytest.raises(BadRequest, match="offset=-1") as err:
        decode_forward_backward(msg.SerializeToString())
    assert err.value.field == "data[0].loss_fn_input_spans[0]"


def test_garbage_is_a_bad_request_naming_the_body():
    with pytest.raises(BadRequest) as err:
        decode_forward_backward(b"\xff\xff\xff")
    assert err.value.field == "body"


def test_results_read_back_in_the_sdk():
    outputs = [
        {"logprobs": np.array([-1.0, -2.5], np.float32)},
        {"logprobs": np.array([-0.5], np.float32)},
    ]
    out = deserialize_forward_backward_output(
        encode_forward_backward_output(outputs, {"loss:sum": 4.0})
    )
    assert out.metrics == {"loss:sum": 4.0}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.5], [-0.5]]
    seqs = [
        WireSequence(tokens=np.array([3, 4]), logprobs=np.array([-0.1, -0.2]), stopped=True),
        WireSequence(tokens=np.array([5]), logprobs=np.array([-0.3]), stopped=False),
    ]
    res = deserialize_sample_response(encode_sample_response(seqs, np.array([np.nan, -1.5])))
    assert [list(s.tokens) for s in res.sequences] == [[3, 4], [5]]
    assert [s.stop_reason for s in res.sequences] == ["stop", "length"]
    assert res.sequences[0].logprobs == pytest.approx([-0.1, -0.2])
    assert res.prompt_logprobs == [None, -1.5]
