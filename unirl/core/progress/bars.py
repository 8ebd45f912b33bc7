"""Progress of an RL run: a bar per phase (generation: `GenerationProgress`; forward-only and
training passes: `MicrobatchProgress`) and a run-level bar over RL steps (`RunProgress`).

Exactly one rank draws (`Topology.is_reporting_rank`: dp-with-cp rank 0, tp rank 0, last pipeline
stage, where the loss lives); every other rank creates nothing. A phase bar advances once per
microbatch, also under virtual pipeline stages, where Megatron's schedule calls the forward-step
function once per model chunk (VPP-size times per microbatch): the backend ticks only where
`Topology.counts_microbatch(vp_stage)` says a call finishes a microbatch.

The live postfix (loss, tokens/s) never forces a host sync per microbatch: reported tensors are
summed on their device and turned into Python numbers only when the display refreshes (at most
every 0.5 s) and once at close. When bars are off (config, ``UNIRL_PROGRESS=0``, or stderr not a
terminal, e.g. a log file on a cluster) each phase writes one ``logging`` INFO line instead,
every ``progress.log_every`` RL steps (`logs_step`)::

    actor train: 8 microbatches in 1.23 s (loss 0.123, 4567 tok/s)

Log lines never break a bar: the CLI writes records through ``tqdm.write`` (`unirl.log_setup`).

Usage: core's RL step opens the bar and hands it to the backend, which ticks it per finished
microbatch and feeds the postfix::

    with MicrobatchProgress("actor train", n_microbatches, topology, enabled=cfg.progress) as bar:
        backend.forward_backward(mbs, loss_fn=..., spec=..., progress=bar)
        # inside: bar.report(loss=..., tokens=...); bar.tick()
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TextIO

import torch
from tqdm import tqdm

from unirl.core.errors import ConfigError
from unirl.core.progress.step_rate import StepRate
from unirl.core.topology import Topology

logger = logging.getLogger(__name__)

ENV_VAR = "UNIRL_PROGRESS"
REFRESH_S = 0.5  # postfix refresh period: at most one host sync per period, not per microbatch
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def progress_enabled(config_flag: bool, stream: TextIO | None = None) -> bool:
    """Whether to draw bars on `stream` (default ``sys.stderr``).

    ``UNIRL_PROGRESS=1`` / ``0`` wins over everything (the operator's knob for one launch, e.g.
    bars in a captured log); otherwise bars need the config flag and a terminal, because a bar
    redrawn into a file is thousands of carriage-return lines.
    """
    env = os.environ.get(ENV_VAR, "").strip().lower()
    if env in _TRUE:
        return True
    if env in _FALSE:
        return False
    if env:
        raise ConfigError(
            f"environment variable {ENV_VAR}={os.environ[ENV_VAR]!r} is not a boolean; "
            f"set it to 1 (bars on) or 0 (bars off), or unset it to follow the config and the terminal"
        )
    if not config_flag:
        return False
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty is not None and isatty())


class _Sum:
    """A running sum of Python numbers and tensors; tensors stay on their device until `value`."""

    def __init__(self) -> None:
        self.number = 0.0
        self.tensor: torch.Tensor | None = None
        self.reports = 0

    def add(self, x: float | int | torch.Tensor, name: str) -> None:
        if isinstance(x, torch.Tensor):
            if x.numel() != 1:
                raise ValueError(
                    f"MicrobatchProgress.report({name}=...) needs a scalar, got a tensor of shape "
                    f"{tuple(x.shape)}; report the microbatch's reduced value"
                )
            x = x.detach().reshape(()).float()
            # Device-side add: no host sync here.
            self.tensor = x if self.tensor is None else self.tensor + x
        else:
            self.number += float(x)
        self.reports += 1

    def value(self) -> float:
        """The sum as a Python float: one host sync if a tensor was reported."""
        return self.number + (float(self.tensor) if self.tensor is not None else 0.0)


class MicrobatchProgress:
    """The microbatch bar of one phase ("actor forward", "ref forward", "actor train").

    Only the reporting rank draws or logs. `count` is kept on every rank (ticks are cheap) so a
    test or a backend can check it against the planned microbatch count; on pipeline stages other
    than the last nothing ticks, so `count` stays 0 there.
    """

    UNIT = "mb"  # tqdm's rate unit
    NOUN = "microbatches"  # in the summary line
    MISCOUNT_HINT = (
        "the step function is wrapped or ticked the wrong number of times (under VPP, once per "
        "microbatch on the last chunk only)"
    )

    def __init__(
        self,
        phase: str,
        total: int,
        topology: Topology,
        *,
        enabled: bool = True,
        log_summary: bool = True,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`enabled` is the config flag (see `progress_enabled`); `log_summary`: with bars off,
        whether this phase's summary is an INFO line (False: DEBUG, for the RL steps that
        ``progress.log_every`` leaves out, see `logs_step`); `clock` is injectable for tests."""
        if total < 0:
            raise ValueError(f"{type(self).__name__} total={total} must be >= 0 ({self.NOUN})")
        self.phase = phase
        self.total = total
        self._topology = topology
        self._clock = clock
        self._count = 0
        self._reporting = topology.is_reporting_rank
        draw = progress_enabled(enabled, stream)  # on every rank: a bad env var fails everywhere
        self._bar: tqdm | None = None
        self._closed = False
        self._loss = _Sum()
        self._tokens = _Sum()
        self._start = self._last_refresh = clock()
        if self._reporting and draw:
            self._bar = tqdm(
                total=total,
                desc=phase,
                unit=self.UNIT,
                file=sys.stderr if stream is None else stream,
                leave=False,  # the run bar stays; phase bars come and go beneath it
                dynamic_ncols=True,
            )
        self._log_summary = self._reporting and not draw and log_summary

    # -- advancing ------------------------------------------------------------------------

    @property
    def count(self) -> int:
        """Microbatches ticked so far on this rank."""
        return self._count

    def tick(self, n: int = 1) -> None:
        """Count `n` finished microbatches (the backend calls it where a microbatch finishes:
        under VPP only for the last chunk, `Topology.counts_microbatch`)."""
        self._count += n
        if self._bar is not None:
            self._maybe_refresh_postfix()
            self._bar.update(n)

    def report(
        self,
        *,
        loss: float | torch.Tensor | None = None,
        tokens: int | float | torch.Tensor | None = None,
    ) -> None:
        """Feed the postfix: `loss` of one microbatch (shown as the mean over reports) and the
        `tokens` it processed (shown as tokens/s since the phase began; pass tokens summed over
        data-parallel ranks for whole-job throughput). Tensors stay on device until refresh."""
        if not self._reporting:
            return
        if loss is not None:
            self._loss.add(loss, "loss")
        if tokens is not None:
            self._tokens.add(tokens, "tokens")
        if self._bar is not None and self._maybe_refresh_postfix():
            self._bar.refresh()

    # -- display --------------------------------------------------------------------------

    def _stats(self, elapsed: float) -> list[str]:
        """Formatted loss / throughput; converts the device sums (one sync each)."""
        parts = []
        if self._loss.reports:
            parts.append(f"loss {self._loss.value() / self._loss.reports:.4g}")
        if self._tokens.reports and elapsed > 0:
            parts.append(f"{self._tokens.value() / elapsed:.0f} tok/s")
        return parts

    def _maybe_refresh_postfix(self) -> bool:
        now = self._clock()
        if now - self._last_refresh < REFRESH_S:
            return False
        self._last_refresh = now
        assert self._bar is not None
        self._bar.set_postfix_str(", ".join(self._stats(now - self._start)), refresh=False)
        return True

    # -- closing --------------------------------------------------------------------------

    def close(self, error: BaseException | None = None) -> None:
        """Close the bar (idempotent) and, on the reporting rank, log the phase summary: INFO
        when bars are off, DEBUG otherwise. After an error the device sums are not read, as
        reading them could raise again (a failed CUDA kernel) and hide the real error."""
        if self._closed:
            return
        self._closed = True
        if not self._reporting:
            return
        elapsed = self._clock() - self._start
        if error is None:
            stats = self._stats(elapsed)
            line = f"{self.phase}: {self._count} {self.NOUN} in {elapsed:.2f} s"
            line += f" ({', '.join(stats)})" if stats else ""
        else:
            line = (
                f"{self.phase}: stopped by {type(error).__name__} after {self._count} of "
                f"{self.total} {self.NOUN} in {elapsed:.2f} s"
            )
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        logger.log(logging.INFO if self._log_summary else logging.DEBUG, line)
        if error is None and self._count != self.total:
            logger.warning(
                "%s: counted %d %s, planned %d; %s",
                self.phase,
                self._count,
                self.NOUN,
                self.total,
                self.MISCOUNT_HINT,
            )

    def __enter__(self) -> MicrobatchProgress:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.close(exc)


class GenerationProgress(MicrobatchProgress):
    """The generation bar of one rollout: samples done and generated tokens/s.

    Generation is a phase like the others: the training loop opens the bar (on the reporting rank
    only; with bars off, one summary line per rollout) and hands it to the rollout source's
    ``next_rollout(rl_step, progress=bar)``; the source, whatever engine it drives, reports as it
    goes::

        with GenerationProgress("generate", total_samples, topology, enabled=...) as bar:
            batch = source.next_rollout(rl_step, progress=bar)
                # inside the source, as often as it learns something (per decode step, per
                # finished request, or once at the end):
                bar.update(samples=newly_finished, tokens=newly_generated)

    `update` is cheap on every rank and draws only on the reporting rank; an engine that runs on
    another rank (or in its own process) reports when its results arrive. ``tokens`` are new
    (response) tokens, so the rate is the engine's decode throughput; ``samples`` must add up to
    `total` (a warning names the phase otherwise).
    """

    UNIT = "sample"
    NOUN = "samples"
    MISCOUNT_HINT = "the rollout source reported a different number of finished samples"

    def extend(self, samples: int) -> None:
        """A source that draws again within one rollout (dynamic sampling) announces the extra
        draw's samples: they join `total`, so the bar and the miscount check count them."""
        self.total += samples
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.refresh()

    def update(self, *, samples: int = 0, tokens: int = 0) -> None:
        """`samples` finished and `tokens` generated since the last call (plain ints: the
        caller already holds them on the host)."""
        if tokens:
            self.report(tokens=tokens)
        if samples:
            self.tick(samples)


def logs_step(step: int, every: int, total: int | None = None) -> bool:
    """With bars off, whether RL step `step` (counted from 1) writes its INFO lines
    (``progress.log_every``): every `every`-th step, and the last one (`total`)."""
    return step % every == 0 or step == total


# -- the run-level bar ------------------------------------------------------------------------

# The rate and ETA come from `StepRate` (in the postfix), not tqdm's own mean since the start.
RUN_BAR_FORMAT = (
    "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed} elapsed{postfix}]"
)


def _scalar(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)  # once per RL step: metrics are already reduced, the sync is paid
    return None


def _format_metrics(metrics: Mapping[str, Any], show: Iterable[str] | None) -> str:
    keys = list(metrics) if show is None else [k for k in show if k in metrics]
    parts = []
    for key in keys:
        value = _scalar(metrics[key])
        if value is not None:
            parts.append(f"{key}={value:.4g}")
    return " ".join(parts)


class RunProgress:
    """The run-level bar over RL steps, with elapsed time, ETA and the step's key metrics.

    `initial` is the step a resumed run starts from; the rate and ETA follow the recent steps
    of this run, leaving out its warm-up step and the time spent in `excluded()` (checkpoint
    saves, see `StepRate`). With bars off the reporting rank logs one INFO line every `log_every`
    steps (``progress.log_every``) and for the last step::

        step 4/10 (40%): 6.00 s/step, ETA 0:00:36 | reward=0.5 kl=0.01

    The bar itself redraws every step: it is one line, overwritten in place.
    """

    def __init__(
        self,
        total_steps: int,
        topology: Topology,
        enabled: bool = True,
        initial: int = 0,
        *,
        stream: TextIO | None = None,
        show: Iterable[str] | None = None,
        log_every: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`show`: metric keys for the postfix, in order (default: every scalar metric)."""
        if log_every < 1:
            raise ConfigError(f"progress.log_every={log_every} must be >= 1 (RL steps)")
        self._log_every = log_every
        if not 0 <= initial <= total_steps:
            raise ConfigError(
                f"resume step initial={initial} is outside [0, total_steps={total_steps}]; a "
                "checkpoint past the configured number of steps needs a larger total_steps"
            )
        self.total_steps = total_steps
        self._step = initial
        self._show = None if show is None else tuple(show)
        self._clock = clock
        self._reporting = topology.is_reporting_rank
        draw = progress_enabled(enabled, stream)
        self._bar: tqdm | None = None
        self._log_steps = self._reporting and not draw
        self._rate = StepRate(clock)
        if self._reporting and draw:
            self._bar = tqdm(
                total=total_steps,
                initial=initial,
                desc="RL steps",
                unit="step",
                file=sys.stderr if stream is None else stream,
                mininterval=0,  # draw every step: steps are seconds to minutes apart
                miniters=1,
                bar_format=RUN_BAR_FORMAT,
                dynamic_ncols=True,
                leave=True,
            )

    @property
    def step(self) -> int:
        """RL steps done, counting those before a resume."""
        return self._step

    def excluded(self) -> contextlib.AbstractContextManager[None]:
        """Time spent inside (a checkpoint save, the export) is left out of the rate."""
        return self._rate.excluded()

    def advance(self, metrics: Mapping[str, Any] | None = None) -> None:
        """One RL step done; `metrics` (name -> number or 0-d tensor) fill the postfix."""
        self._step += 1
        self._rate.step_done()
        if not self._reporting:
            return
        text = _format_metrics(metrics or {}, self._show)
        per_step = self._rate.seconds_per_step
        eta = self._rate.eta(self.total_steps - self._step)
        assert per_step is not None and eta is not None  # a step was just counted
        timing = f"ETA {datetime.timedelta(seconds=round(eta))}, {per_step:.2f} s/step"
        if self._bar is not None:
            self._bar.set_postfix_str(f"{timing} | {text}" if text else timing, refresh=False)
            self._bar.update(1)
            return
        if not logs_step(self._step, self._log_every, self.total_steps):
            return
        pct = 100.0 * self._step / self.total_steps if self.total_steps else 100.0
        line = f"step {self._step}/{self.total_steps} ({pct:.0f}%): {per_step:.2f} s/step, ETA "
        line += str(datetime.timedelta(seconds=round(eta)))
        logger.info("%s", f"{line} | {text}" if text else line)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> RunProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
