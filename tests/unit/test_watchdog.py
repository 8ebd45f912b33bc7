"""What the job takes for a hung rank (`unirl.backends.watchdog.is_collective_timeout`): the
errors gloo and NCCL raise when a collective waits past the process group's timeout, and never
one of unirl's own errors whose message happens to say "timed out"."""

import torch.distributed as dist

from unirl.backends.watchdog import is_collective_timeout
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
