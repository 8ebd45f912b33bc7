"""`unirl.backends.deepspeed.zero3_no_gather`: DeepSpeed's no-gather handles (a partition group
of one rank) skip their stream sync when ``param.data`` is the partition itself, and keep it when
the parameter was copied to the device (offloaded partitions).

The handles are DeepSpeed's own classes; the accelerator is a stand-in that counts the
``current_stream().synchronize()`` calls and reports, as CUDA does, that it does not resolve data
dependencies itself (on the CPU DeepSpeed never syncs here)."""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed"
)


class _Stream:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def synchronize(self) -> None:
        self.calls.append("sync")


class _Accelerator:
    """What the two handles ask of DeepSpeed's accelerator, with the syncs counted."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def resolves_data_dependency(self) -> bool:
        return False

    def current_stream(self) -> _Stream:
        return _Stream(self.calls)

    def current_device_name(self) -> str:
        return "cpu"


@pytest.fixture
def handles(monkeypatch):
    from deepspeed.runtime.zero import partition_parameters as pp

    from unirl.backends.deepspeed import zero3_no_gather

    # DeepSpeed's own methods (an engine built earlier in the session may have installed the
    # patch: functools.wraps keeps the original); restored as they were afterwards
    for cls in (pp.NoGatherHandle, pp.NoGatherCoalescedHandle):
        monkeypatch.setattr(cls, "wait", getattr(cls.wait, "__wrapped__", cls.wait))
    monkeypatch.setitem(zero3_no_gather._state, "installed", False)
    accelerator = _Accelerator()
    monkeypatch.setattr(pp, "get_accelerator", lambda: accelerator)
    return types.SimpleNamespace(pp=pp, module=zero3_no_gather, accelerator=accelerator)


def _param(pp, numel: int = 6) -> torch.nn.Parameter:
    """A parameter as ZeRO-3 leaves it between uses: its data empty, its partition in
    ``ds_tensor`` (the whole parameter: a group of one rank), in flight."""
    p = torch.nn.Parameter(torch.empty(0))
    p.ds_tensor = torch.arange(float(numel))
    p.ds_shape = (2, numel // 2)
    p.ds_status = pp.ZeroParamStatus.INFLIGHT
    p.ds_summary = lambda: "test param"
    return p


def test_deepspeed_handles_sync_before_install(handles):
    pp = handles.pp
    pp.NoGatherHandle(_param(pp)).wait()
    pp.NoGatherCoalescedHandle([_param(pp), _param(pp)]).wait()
    assert handles.accelerator.calls == ["sync", "sync"]  # what the patch removes


def test_partition_on_the_device_is_made_available_without_a_sync(handles):
    pp = handles.pp
    assert handles.module.install()
    one, a, b = _param(pp), _param(pp), _param(pp)
    single = pp.NoGatherHandle(one)
    coalesced = pp.NoGatherCoalescedHandle([a, b])
    single.wait()
    coalesced.wait()
    coalesced.wait()  # complete: a no-op, as in DeepSpeed
    assert handles.accelerator.calls == []
    for p in (one, a, b):
        assert p.ds_status == pp.ZeroParamStatus.AVAILABLE
        assert p.data.shape == (2, 3)
        assert p.data.untyped_storage().data_ptr() == p.ds_tensor.untyped_storage().data_ptr()
        torch.testing.assert_close(p.data.flatten(), torch.arange(6.0))


def test_a_copied_parameter_keeps_deepspeeds_sync(handles):
    """A partition in host memory is copied to the device by ``.to(non_blocking=True)``: the
    sync is what makes the copy safe to read, so it stays (simulated: ``param.data`` replaced by
    a copy after the handle is made)."""
    pp = handles.pp
    assert handles.module.install()
    copied, kept = _param(pp), _param(pp)
    single = pp.NoGatherHandle(copied)
    copied.data = copied.ds_tensor.clone().view(2, 3)
    single.wait()
    assert handles.accelerator.calls == ["sync"]
    assert copied.ds_status == pp.ZeroParamStatus.AVAILABLE
    mixed = pp.NoGatherCoalescedHandle([kept, _param(pp)])
    mixed.wait()  # none copied: no sync
    assert handles.accelerator.calls == ["sync"]
    p, q = _param(pp), _param(pp)
    both = pp.NoGatherCoalescedHandle([p, q])
    q.data = q.ds_tensor.clone().view(2, 3)  # one of them copied: DeepSpeed's sync
    both.wait()
    assert handles.accelerator.calls == ["sync", "sync"]
    assert p.ds_status == q.ds_status == pp.ZeroParamStatus.AVAILABLE


def test_coalesced_handle_still_refuses_a_parameter_not_in_flight(handles):
    pp = handles.pp
    handles.module.install()
    p = _param(pp)
    h = pp.NoGatherCoalescedHandle([p])
    p.ds_status = pp.ZeroParamStatus.AVAILABLE
    with pytest.raises(RuntimeError, match="inflight"):
        h.wait()


def test_other_deepspeed_versions_are_left_alone(handles, monkeypatch):
    import deepspeed

    monkeypatch.setattr(deepspeed, "__version__", "0.0.1")
    original = handles.pp.NoGatherHandle.wait
    assert handles.module.install() is False
    assert handles.pp.NoGatherHandle.wait is original
