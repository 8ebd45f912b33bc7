"""The wire format against the SDK's own encoder and decoders (`tinker.proto`): a request the
SDK writes (dense and sparse tensors, string and number loss config) decodes to its values, and
the results the server writes read back in the SDK as what was sent."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("tinker")
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import (
    deserialize_forward_backward_output,
    deserialize_sample_response,
)

from unirl.serve.errors import BadRequest
from unirl.serve.wire import (
    WireSequence,
    decode_forward_backward,
    encode_forward_backward_output,
    encode_sample_response,
)


def test_a_request_the_sdk_writes_decodes_to_its_values():
    weights_2d = torch.tensor([[0.0, 0.0, 1.5], [2.0, 0.0, 0.0]])  # the SDK sends it sparse
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([7, 8]).append_int(9),
        loss_fn_inputs={"target_tokens": [8, 9, 10], "weights": weights_2d},
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
