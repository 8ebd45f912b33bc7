"""The sampling records behind stable_reinforce (`unirl.serve.stability`): a sample response
kept per sequence id, resolved provenance values written out by hand, a record that expires a
day after its last use, and the oldest dropped past the cap."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tinker")

from unirl.serve import stability
from unirl.serve.errors import BadRequest
from unirl.serve.wire import WireSequence, WireSpan, encode_sample_response


def _response(*seqs: tuple[list[int], list[float]]) -> bytes:
    wire = [WireSequence(tokens=np.array(t), logprobs=np.array(lp), stopped=True) for t, lp in seqs]
    return encode_sample_response(wire, None)


def test_records_resolve_into_the_sampled_mask_and_the_sampler_logprobs():
    records = stability.StabilityRecords()
    records.record("req-1", [4, 5, 6], _response(([7, 8], [-0.5, -1.5]), ([9], [-0.25])))
    # targets of rl_loop's datum for sequence 0: prompt[1:] (padded 0 here), then 7, 8
    spans = [
        WireSpan(sampled=False, sequence_id="req-1/0", offset=1, length=2),
        WireSpan(sampled=True, sequence_id="req-1/0", offset=0, length=2),
    ]
    sampled, q = stability.resolve_spans(
        spans, np.array([0, 0, 7, 8]), "t", records, check_prompt_tokens=False
    )
    assert sampled.tolist() == [False, False, True, True]
    assert q.tolist() == [0.0, 0.0, -0.5, -1.5]
    with pytest.raises(BadRequest, match="hold 5 there") as err:  # the input's prompt is checked
        stability.resolve_spans(spans[:1], np.array([0, 6]), "m", records, check_prompt_tokens=True)
    assert err.value.field == "m[0]"
    assert stability.resolve_spans(
        [WireSpan(sampled=True, sequence_id="req-1/1", offset=0, length=1)],
        np.array([9]),
        "t",
        records,
        check_prompt_tokens=False,
    )[1].tolist() == [-0.25]


def test_a_record_expires_a_day_after_its_last_use_and_the_oldest_go_past_the_cap(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(stability.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(stability, "KEPT_SEQUENCES", 2)
    records = stability.StabilityRecords()
    records.record("a", [1], _response(([2], [-1.0])))
    now[0] += 86000.0
    records.get("a/0", "f")  # read while checking a request: no restart
    records.touch(["a/0"])  # the request was accepted: its day starts again
    now[0] += 86000.0
    assert records.get("a/0", "f").tokens.tolist() == [2]
    now[0] += 86401.0
    with pytest.raises(BadRequest, match="no sampling record") as err:
        records.get("a/0", "data[0].loss_fn_input_spans[1].sequence_id")
    assert err.value.field == "data[0].loss_fn_input_spans[1].sequence_id"
    records.record("b", [1], _response(([2], [-1.0]), ([3], [-2.0])))
    records.record("c", [1], _response(([4], [-1.0])))  # three kept sequences: b/0 goes
    with pytest.raises(BadRequest):
        records.get("b/0", "f")
    assert records.get("b/1", "f").logprobs.tolist() == [-2.0]


@pytest.mark.parametrize(
    "loss, key", [("stable_reinforce", "kl_coeff"), ("dro", "beta"), ("ppo", "clip_high_threshold")]
)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_loss_fn_config_value_is_a_400_naming_the_key(loss, key, value):
    """protobuf's map<string, float> carries NaN and inf: they are the client's mistake (a 400
    naming ``loss_fn_config.<key>``), never a server error (a 500, which the SDK retries)."""
    from unirl.serve.losses import sdk_loss

    with pytest.raises(BadRequest, match="finite") as err:
        sdk_loss(loss).settings({key: value})
    assert err.value.field == f"loss_fn_config.{key}"


def test_a_rejected_request_does_not_restart_its_records_day(monkeypatch):
    """Checked in full before anything changes: a request whose datum 1 is wrong does not restart
    the day of the records its datum 0 named (a request that trains does)."""
    from unirl.serve.datums import token_datums
    from unirl.serve.losses import sdk_loss
    from unirl.serve.wire import WireDatum

    now = [1000.0]
    monkeypatch.setattr(stability.time, "monotonic", lambda: now[0])
    records = stability.StabilityRecords()
    records.record("r", [4, 5], _response(([7, 8], [-0.5, -1.5])))

    def datum(last_target: int) -> WireDatum:
        sid = "r/0"  # model input 4 5 7, targets (0) 7 8: rl_loop's datum
        return WireDatum(
            tokens=np.array([4, 5, 7]),
            inputs={
                "target_tokens": np.array([0, 7, last_target]),
                "advantages": np.array([0.0, 1.0, 1.0], dtype=np.float32),
            },
            input_spans=(
                WireSpan(sampled=False, sequence_id=sid, offset=0, length=2),
                WireSpan(sampled=True, sequence_id=sid, offset=0, length=1),
            ),
            target_spans=(
                WireSpan(sampled=False, sequence_id=sid, offset=1, length=1),
                WireSpan(sampled=True, sequence_id=sid, offset=0, length=2),
            ),
        )

    def send(*data: WireDatum):
        loss = sdk_loss("stable_reinforce")
        return token_datums(data, loss, vocab_size=16, max_tokens=64, records=records)

    now[0] += 86000.0
    with pytest.raises(BadRequest, match="claims token 9") as err:
        send(datum(8), datum(9))  # datum 1's last target is not the sampled 8
    assert err.value.field == "data[1].loss_fn_input_spans[1]"
    now[0] += 1000.0  # a day and 600 s after sampling: the rejected request restarted nothing
    with pytest.raises(BadRequest, match="no sampling record"):
        send(datum(8))
    records.record("r", [4, 5], _response(([7, 8], [-0.5, -1.5])))
    now[0] += 86000.0
    (got,) = send(datum(8))  # accepted: its day starts again
    assert got.sampler_logprobs.tolist() == [0.0, -0.5, -1.5]
    now[0] += 1000.0
    assert send(datum(8))[0].mask.tolist() == [0.0, 1.0, 1.0]
