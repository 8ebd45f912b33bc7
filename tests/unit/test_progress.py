"""Progress bars: one tick per microbatch (also under VPP), one drawing rank, closed on every path,
one log line per phase when quiet, no host sync per microbatch, an ETA on the run bar."""

from __future__ import annotations

import io
import logging
import re

import pytest
import torch
from tqdm import tqdm

from unirl.core.errors import ConfigError
from unirl.core.progress import bars as progress
from unirl.core.progress.bars import (
    GenerationProgress,
    MicrobatchProgress,
    RunProgress,
    logs_step,
    progress_enabled,
)
from unirl.core.topology import Topology

LOGGER = "unirl.core.progress.bars"


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


class FakeClock:
    """Returns the scripted times in order, then keeps the last; or steps by `step` per call."""

    def __init__(self, times=(0.0,), step=0.0):
        self.times, self.step, self.now = list(times), step, None

    def __call__(self) -> float:
        if self.times:
            self.now = self.times.pop(0)
        else:
            self.now += self.step
        return self.now


@pytest.fixture(autouse=True)
def no_env_override(monkeypatch):
    monkeypatch.delenv("UNIRL_PROGRESS", raising=False)


@pytest.fixture
def spy_tqdm(monkeypatch):
    """Records every tqdm created by progress.py, and every close."""
    created, closed = [], []

    class Spy(tqdm):
        def __init__(self, *args, **kwargs):
            created.append(self)
            super().__init__(*args, **kwargs)

        def close(self):
            closed.append(self)
            super().close()

    monkeypatch.setattr(progress, "tqdm", Spy)
    return created, closed


def test_tick_counts_n():
    with MicrobatchProgress("actor train", 5, Topology(), enabled=False) as bar:
        bar.tick()
        bar.tick(4)
    assert bar.count == 5  # 1 + 4


# -- which rank draws ------------------------------------------------------------------------------


def test_only_reporting_rank_creates_a_bar(spy_tqdm, monkeypatch):
    created, _ = spy_tqdm
    monkeypatch.setenv("UNIRL_PROGRESS", "1")  # force bars everywhere a bar may be drawn
    counts = {}
    # tp=2, dp=2: only rank 0 is dp rank 0 and tp rank 0 (pp=1, so every rank is the last stage).
    for rank in range(4):
        topo = Topology.from_rank(rank, 4, tp=2)
        with MicrobatchProgress("actor train", 3, topo, stream=FakeTTY()) as bar:
            for _ in range(3):
                bar.tick()
                bar.report(loss=torch.tensor(1.0), tokens=10)
        counts[rank] = bar.count
        assert len(created) == 1, f"rank {rank}: {len(created)} bars"  # rank 0's only
    assert counts == {0: 3, 1: 3, 2: 3, 3: 3}  # counted on every rank, drawn on one


def test_non_reporting_ranks_log_nothing_when_quiet(spy_tqdm, caplog):
    created, _ = spy_tqdm
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    for rank in (1, 2, 3):
        topo = Topology.from_rank(rank, 4, tp=2)
        with MicrobatchProgress("actor train", 2, topo, stream=io.StringIO()) as bar:
            bar.tick(2)
        with RunProgress(5, topo, stream=io.StringIO()) as run:
            run.advance({"reward": 1.0})
        assert run.step == 1
    assert created == [] and caplog.records == []


# -- closing ---------------------------------------------------------------------------------------


def test_bar_closed_after_exception_in_with_block(spy_tqdm, caplog):
    created, closed = spy_tqdm
    caplog.set_level(logging.INFO, logger=LOGGER)
    with (
        pytest.raises(KeyError),
        MicrobatchProgress("actor train", 4, Topology(), stream=FakeTTY()) as bar,
    ):
        bar.tick()
        raise KeyError("boom")
    assert len(created) == 1 and closed == created
    assert bar.count == 1


def test_close_is_idempotent(spy_tqdm):
    _, closed = spy_tqdm
    bar = MicrobatchProgress("actor train", 0, Topology(), stream=FakeTTY())
    bar.close()
    bar.close()
    assert len(closed) == 1


# -- quiet mode ------------------------------------------------------------------------------------


def test_quiet_mode_one_line_per_phase(spy_tqdm, caplog):
    created, _ = spy_tqdm
    caplog.set_level(logging.INFO, logger=LOGGER)
    stream = io.StringIO()  # not a terminal: quiet even though enabled
    # Phase 1 from t=0 to t=2: losses 0.5, 0.25, 0.125, 0.125 -> mean 1.0 / 4 = 0.25;
    # tokens 4 x 100 = 400 in 2 s -> 200 tok/s.
    clock = FakeClock([0.0], step=0.0)
    with MicrobatchProgress("actor train", 4, Topology(), stream=stream, clock=clock) as bar:
        for loss in (0.5, 0.25, 0.125, 0.125):
            bar.tick()
            bar.report(loss=torch.tensor(loss), tokens=100)
        clock.now = 2.0
    # Phase 2: no loss or tokens reported, from t=0 to t=0.5.
    clock = FakeClock([0.0, 0.5])
    with MicrobatchProgress("ref forward", 2, Topology(), stream=stream, clock=clock) as bar:
        bar.tick(2)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "actor train: 4 microbatches in 2.00 s (loss 0.25, 200 tok/s)",
        "ref forward: 2 microbatches in 0.50 s",
    ]
    assert all(r.levelno == logging.INFO for r in caplog.records)
    assert created == [] and stream.getvalue() == ""


def test_quiet_mode_after_exception_says_where_it_stopped(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock = FakeClock([0.0, 1.5])
    with (
        pytest.raises(ValueError),
        MicrobatchProgress("actor train", 8, Topology(), enabled=False, clock=clock) as bar,
    ):
        bar.tick(3)
        raise ValueError
    assert [r.getMessage() for r in caplog.records] == [
        "actor train: stopped by ValueError after 3 of 8 microbatches in 1.50 s"
    ]


def test_count_mismatch_warns(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    with MicrobatchProgress("actor train", 4, Topology(), enabled=False) as bar:
        bar.tick(8)  # e.g. a VPP=2 schedule counted per call
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "counted 8 microbatches, planned 4" in warnings[0]


@pytest.mark.parametrize(
    "flag, stream, env, expected",
    [
        (True, FakeTTY(), None, True),
        (True, io.StringIO(), None, False),  # a log file: quiet
        (False, FakeTTY(), None, False),  # disabled in config
        (True, object(), None, False),  # no isatty at all
        (False, io.StringIO(), "1", True),  # env wins over config and terminal
        (True, FakeTTY(), "0", False),
        (True, FakeTTY(), "off", False),
        (False, io.StringIO(), "yes", True),
    ],
)
def test_progress_enabled(monkeypatch, flag, stream, env, expected):
    if env is not None:
        monkeypatch.setenv("UNIRL_PROGRESS", env)
    assert progress_enabled(flag, stream) is expected


def test_progress_enabled_rejects_bad_env(monkeypatch):
    monkeypatch.setenv("UNIRL_PROGRESS", "maybe")
    with pytest.raises(ConfigError, match=r"UNIRL_PROGRESS='maybe'.*set it to 1"):
        progress_enabled(True, FakeTTY())


def test_env_override_draws_on_non_tty(spy_tqdm, monkeypatch):
    created, _ = spy_tqdm
    monkeypatch.setenv("UNIRL_PROGRESS", "1")
    stream = io.StringIO()
    with MicrobatchProgress("actor train", 2, Topology(), enabled=False, stream=stream) as bar:
        bar.tick(2)
    assert len(created) == 1 and "actor train" in stream.getvalue()


# -- no host sync per microbatch -------------------------------------------------------------------

_HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__bool__,
    torch.Tensor.__index__,
    torch.Tensor.__format__,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
}


class SyncCountingTensor(torch.Tensor):
    """Counts every read of its value on the host (each would be a sync on a GPU); results of
    operations on it stay of this type, so sums of reported losses are counted too."""

    reads = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _HOST_READS:
            SyncCountingTensor.reads += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def counting(x):
    return torch.tensor(x).as_subclass(SyncCountingTensor)


def test_postfix_reads_device_values_at_most_twice_per_refresh(spy_tqdm, monkeypatch):
    monkeypatch.setattr(SyncCountingTensor, "reads", 0)
    stream = FakeTTY()
    # Each clock call (one per tick, one per report) advances 0.05 s: 40 microbatches -> 80 calls
    # -> 4 s of clock -> at most 4 / 0.5 = 8 refreshes + the close, 2 reads each (loss, tokens).
    clock = FakeClock([0.0], step=0.05)
    with MicrobatchProgress("actor train", 40, Topology(), stream=stream, clock=clock) as bar:
        for _ in range(40):
            bar.tick()
            bar.report(loss=counting(0.5), tokens=counting(10))
    assert 2 <= SyncCountingTensor.reads <= 2 * (8 + 1)  # vs 80 reads if converted per report
    assert "loss 0.5" in stream.getvalue() and "tok/s" in stream.getvalue()


def test_quiet_mode_reads_device_values_once_per_phase(monkeypatch, caplog):
    monkeypatch.setattr(SyncCountingTensor, "reads", 0)
    caplog.set_level(logging.INFO, logger=LOGGER)
    with MicrobatchProgress(
        "actor train", 16, Topology(), enabled=False, clock=FakeClock([0.0, 1.0])
    ) as bar:
        for _ in range(16):
            bar.tick()
            bar.report(loss=counting(2.0), tokens=counting(8))
    assert SyncCountingTensor.reads <= 2  # the loss sum and the token sum, at close
    # 16 x 2.0 / 16 = 2; 16 x 8 = 128 tokens in 1 s.
    assert (
        caplog.records[0].getMessage()
        == "actor train: 16 microbatches in 1.00 s (loss 2, 128 tok/s)"
    )


def test_after_exception_device_values_are_not_read(monkeypatch):
    monkeypatch.setattr(SyncCountingTensor, "reads", 0)
    with (
        pytest.raises(RuntimeError),
        MicrobatchProgress("actor train", 4, Topology(), enabled=False) as bar,
    ):
        bar.report(loss=counting(1.0))
        raise RuntimeError
    assert SyncCountingTensor.reads == 0


def test_report_rejects_non_scalar():
    bar = MicrobatchProgress("actor train", 1, Topology(), enabled=False)
    with pytest.raises(ValueError, match=r"loss=.*shape \(2,\)"):
        bar.report(loss=torch.ones(2))


# -- run-level bar ---------------------------------------------------------------------------------


def test_run_bar_total_initial_and_eta(spy_tqdm):
    created, closed = spy_tqdm
    stream = FakeTTY()
    with RunProgress(10, Topology(), initial=3, stream=stream) as run:
        assert run.step == 3
        run.advance({"reward": 0.5, "kl": torch.tensor(0.0125), "note": "text"})
        run.advance({"reward": 0.75})
    assert run.step == 5 and len(created) == 1 and closed == created
    text = stream.getvalue()
    assert "3/10" in text and "5/10" in text
    assert re.search(r"ETA (\d+:)?\d\d:\d\d", text), text
    assert "reward=0.5" in text and "kl=0.0125" in text and "note" not in text


def test_run_bar_show_selects_metrics():
    stream = FakeTTY()
    with RunProgress(4, Topology(), stream=stream, show=["kl", "missing"]) as run:
        run.advance({"reward": 0.5, "kl": 0.25})
    assert "kl=0.25" in stream.getvalue() and "reward" not in stream.getvalue()


def test_run_quiet_logs_eta_from_this_runs_steps(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    # Resumed at step 3 of 10, started at t=0. The first step of a process is warm-up: it is
    # the estimate only until a steady step exists.
    # t=6:  warm-up step of 6 s -> 6 s/step; 10 - 4 = 6 steps left -> 36 s.
    # t=8:  first steady step, 2 s -> 2 s/step (warm-up left out); 5 left -> 10 s.
    clock = FakeClock([0.0, 6.0, 8.0])
    with RunProgress(10, Topology(), enabled=False, initial=3, clock=clock) as run:
        run.advance({"reward": 0.5})
        run.advance({})
    assert [r.getMessage() for r in caplog.records] == [
        "step 4/10 (40%): 6.00 s/step, ETA 0:00:36 | reward=0.5",
        "step 5/10 (50%): 2.00 s/step, ETA 0:00:10",
    ]


def test_run_rate_follows_recent_steps_and_leaves_out_checkpoints(caplog):
    # finding 9: a mean since the start let warm-up and checkpoint saves inflate the ETA
    caplog.set_level(logging.INFO, logger=LOGGER)
    times = [
        0.0,  # start
        30.0,  # step 1: 30 s of warm-up
        31.0,  # step 2: 1 s
        32.0,  # step 3: 1 s
        33.0, 53.0,  # step 4 ends at 33, then a 20 s checkpoint save (excluded)
        53.0,  # step 4 counted: 33 - 32 = 1 s
        55.0,  # step 5: 2 s -> EMA 1 + 0.3 * (2 - 1) = 1.3
        57.0,  # step 6: 2 s -> 1.3 + 0.3 * (2 - 1.3) = 1.51
    ]  # fmt: skip
    clock = FakeClock(times)
    with RunProgress(60, Topology(), enabled=False, clock=clock) as run:
        for step in range(1, 7):
            if step == 4:
                with run.excluded():
                    pass
            run.advance({})
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "step 1/60 (2%): 30.00 s/step, ETA 0:29:30",  # only the warm-up so far: 59 x 30 s
        "step 2/60 (3%): 1.00 s/step, ETA 0:00:58",
        "step 3/60 (5%): 1.00 s/step, ETA 0:00:57",
        "step 4/60 (7%): 1.00 s/step, ETA 0:00:56",
        "step 5/60 (8%): 1.30 s/step, ETA 0:01:12",  # 55 x 1.3 = 71.5 -> 72
        "step 6/60 (10%): 1.51 s/step, ETA 0:01:22",  # 54 x 1.51 = 81.54
    ]


def test_run_bar_shows_the_same_rate(spy_tqdm):
    stream = FakeTTY()
    clock = FakeClock([0.0, 10.0, 12.0])
    with RunProgress(5, Topology(), stream=stream, clock=clock) as run:
        run.advance({"reward": 0.5})
        run.advance({"reward": 0.5})
    assert "ETA 0:00:06, 2.00 s/step | reward=0.5" in stream.getvalue()


def test_run_initial_past_total_is_a_config_error():
    with pytest.raises(ConfigError, match=r"initial=12 .*total_steps=10"):
        RunProgress(10, Topology(), initial=12)


# -- progress.log_every -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "every, total, logged",
    [
        (1, 5, [1, 2, 3, 4, 5]),
        (2, 5, [2, 4, 5]),  # every second step, and the last
        (3, 6, [3, 6]),
        (10, 4, [4]),  # only the last
    ],
)
def test_logs_step(every, total, logged):
    assert [s for s in range(1, total + 1) if logs_step(s, every, total)] == logged


def test_run_quiet_logs_every_n_steps_and_the_last(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock = FakeClock(step=1.0)  # 1 s per step
    with RunProgress(5, Topology(), enabled=False, clock=clock, log_every=2) as run:
        for _ in range(5):
            run.advance({"reward": 0.5})
    steps = [re.match(r"step (\d+)/5", r.getMessage()).group(1) for r in caplog.records]
    assert steps == ["2", "4", "5"]
    with pytest.raises(ConfigError, match=r"progress\.log_every=0"):
        RunProgress(5, Topology(), enabled=False, log_every=0)


def test_phase_summary_left_out_is_debug(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with MicrobatchProgress("actor train", 1, Topology(), enabled=False, log_summary=False) as bar:
        bar.tick()
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]


# -- the generation bar ---------------------------------------------------------------------------


def test_generation_bar_counts_samples_and_tokens_per_second(spy_tqdm, caplog):
    created, closed = spy_tqdm
    caplog.set_level(logging.INFO, logger=LOGGER)
    stream = FakeTTY()
    clock = FakeClock([0.0, 0.1, 0.2, 2.0])  # start, one refresh per update, close
    with GenerationProgress("generate", 6, Topology(), stream=stream, clock=clock) as bar:
        bar.update(samples=2, tokens=40)
        bar.update(samples=4, tokens=60)
    assert bar.count == 6 and len(created) == 1 and closed == created
    assert created[0].unit == "sample" and (created[0].n, created[0].total) == (6, 6)
    assert "generate:" in stream.getvalue() and "tok/s" in stream.getvalue()
    # bars on: the summary is DEBUG; quiet: one INFO line, 100 tokens in 2 s = 50 tok/s
    caplog.clear()
    clock = FakeClock([0.0, 2.0])  # start, close (quiet: updates read no clock)
    with GenerationProgress("generate", 6, Topology(), enabled=False, clock=clock) as bar:
        bar.update(samples=2, tokens=40)
        bar.update(samples=4, tokens=60)
    assert [r.getMessage() for r in caplog.records] == ["generate: 6 samples in 2.00 s (50 tok/s)"]


def test_generation_bar_only_on_the_reporting_rank_and_miscount_warns(spy_tqdm, caplog):
    created, _ = spy_tqdm
    caplog.set_level(logging.INFO, logger=LOGGER)
    other = Topology(world_size=2, rank=1, dp_size=2, dp_rank=1)
    with GenerationProgress("generate", 4, other, stream=FakeTTY()) as bar:
        bar.update(samples=4, tokens=9)
    assert created == [] and caplog.records == [] and bar.count == 4
    with GenerationProgress("generate", 4, Topology(), enabled=False) as bar:
        bar.update(samples=3, tokens=9)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "generate: counted 3 samples, planned 4; the rollout source reported a different "
        "number of finished samples"
    ]
