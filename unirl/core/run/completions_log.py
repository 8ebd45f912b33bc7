"""What the policy generates, readable during a run: every ``logging.completions_every`` RL steps
the first ``logging.completions_per_step`` samples of the rollout (prompt, response, reward, the
policy version that drew them, whether the engine finished them) go to ``completions.jsonl`` in
the run directory, and as a table to TensorBoard and W&B where they are on. Written by the
reporting rank only.

A sample's text is what its rollout source recorded (``metadata["prompt"]`` /
``metadata["response"]``: the generating sources decode it once); a rollout read from a file
without text shows its token ids. Resuming drops the records after the checkpoint's step, as the
metrics log does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from unirl.core.data.rollout import RolloutBatch, RolloutSample
from unirl.core.run.metrics_log import MetricsLog, keep_whole_lines


def _text(sample: RolloutSample, key: str, ids: list[int]) -> str:
    value = sample.metadata.get(key)
    return str(value) if value is not None else f"token ids {ids}"


def completion_rows(batch: RolloutBatch, step: int, count: int) -> list[dict[str, Any]]:
    """The first ``count`` samples of ``batch`` as plain rows."""
    rows = []
    for index, sample in enumerate(batch.samples[:count]):
        finished = sample.metadata.get("finished")
        rows.append(
            {
                "step": step,
                "sample": index,
                "group": sample.group_id,
                "prompt": _text(sample, "prompt", [int(t) for t in sample.prompt_tokens]),
                "response": _text(sample, "response", [int(t) for t in sample.response_tokens]),
                "reward": float(sample.reward),
                "policy_version": sample.policy_version,
                "finished": None if finished is None else bool(finished),
            }
        )
    return rows


class CompletionsLog:
    """``completions.jsonl`` under ``run_dir``, written every ``every`` RL steps (``every`` > 0)."""

    def __init__(
        self, run_dir: Path, *, every: int, count: int, resume_from_step: int | None = None
    ) -> None:
        self.every, self.count = every, count
        self.path = run_dir / "completions.jsonl"
        if self.path.exists():
            keep_whole_lines(self.path, resume_from_step)
        self._file = self.path.open("a")

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == 1

    def write(self, step: int, batch: RolloutBatch, metrics_log: MetricsLog | None) -> None:
        """Step ``step``'s rows into the file (and as the ``completions`` table of the metrics
        log's TensorBoard / W&B) when the step is due (the first step always is)."""
        if not self.due(step):
            return
        rows = completion_rows(batch, step, self.count)
        self._file.write("".join(json.dumps(row) + "\n" for row in rows))
        self._file.flush()
        if metrics_log is not None:
            metrics_log.write_table("completions", step, rows)

    def close(self) -> None:
        self._file.close()
