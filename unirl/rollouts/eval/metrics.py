"""What an evaluation reports: the mean reward and pass@k over held-out prompts.

pass@k is the chance that at least one of k responses to a prompt passes, estimated without bias
from n >= k responses of which c pass (Chen et al. 2021, "Evaluating Large Language Models
Trained on Code", eq. 1):

    pass@k = 1 - C(n - c, k) / C(n, k)

averaged over prompts; computed as the product 1 - prod_{i = n-c+1}^{n} (1 - k / i), which
never forms the large binomials. With k = n it is the share of prompts with a passing response;
with k = 1 the share of passing responses.
"""

from __future__ import annotations

from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with ``c`` passing responses out of ``n``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0  # every draw of k responses holds a passing one
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def reported_ks(n: int) -> list[int]:
    """The k of the pass@k metrics for n responses per prompt: 1, 2, 4, ... below n, and n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]


def eval_metrics(
    rewards: Sequence[float], lengths: Sequence[int], *, samples_per_prompt: int, threshold: float
) -> dict[str, float]:
    """``eval/*`` metrics of responses grouped by prompt (``samples_per_prompt`` consecutive
    responses each): mean reward, mean response length, and pass@k for `reported_ks`, a
    response passing when its reward is at least ``threshold``."""
    n = samples_per_prompt
    if not rewards or len(rewards) % n:
        raise ValueError(f"eval_metrics: {len(rewards)} rewards are not groups of {n}")
    groups = [rewards[i : i + n] for i in range(0, len(rewards), n)]
    passes = [sum(r >= threshold for r in g) for g in groups]
    metrics = {
        "eval/reward_mean": sum(rewards) / len(rewards),
        "eval/response_length_mean": sum(lengths) / len(lengths),
        "eval/prompts": float(len(groups)),
    }
    for k in reported_ks(n):
        metrics[f"eval/pass@{k}"] = sum(pass_at_k(n, c, k) for c in passes) / len(groups)
    return metrics
