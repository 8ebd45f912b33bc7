"""What the job takes for a hung rank (`unirl.backends.watchdog.is_collective_timeout`): the
errors gloo and NCCL raise when a collective waits past the process group's timeout, and never
one of unirl's own errors whose message happens to say "timed out"."""

import torch.distributed as dist

from unirl.backends.watchdog import is_collective_timeout, is_peer_gone
from unirl.rollouts.rewards.workers import RewardTimeoutError


def test_gloo_and_nccl_timeouts_are_collective_timeouts():
    # gloo's message (torch 2.x, a recv past the group's timeout)
    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
        "300000ms for recv operation to complete"
    )
    assert is_collective_timeout(gloo)
    assert is_collective_timeout(
        dist.DistBackendError("Watchdog caught collective operation timeout")
    )


def test_a_reward_that_timed_out_is_not_a_hung_rank():
    reward = RewardTimeoutError(
        "rollout.reward='m:f' timed out on sample 3 (prompts.jsonl line 4, response 'x'): it took "
        "longer than rollout.reward_timeout_s=1.0"
    )
    assert not is_collective_timeout(reward)


def test_a_collective_whose_peer_died_is_a_lost_rank():
    """gloo's error when the rank at the other end was killed: a lost rank (one error line),
    not a traceback; unirl's own errors never are."""
    gloo = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
        "closed by peer [127.0.0.1]:13696. This is typically caused by a remote worker crashing."
    )
    assert is_peer_gone(gloo) and not is_collective_timeout(gloo)
    assert not is_peer_gone(RewardTimeoutError("Connection closed by peer, said the judge"))
    assert not is_peer_gone(RuntimeError("CUDA out of memory"))
