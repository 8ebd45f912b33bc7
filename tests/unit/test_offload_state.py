"""The offloaded optimizer's checkpoint files (`unirl.backends.megatron.offload_state`) on
stand-ins for megatron's `HybridDeviceOptimizer` (the attributes it reads: ``sub_optimizers``,
``inner_param_to_orig_param``, ``state``): every offloaded optimizer saved and restored, a
checkpoint with another count refused, all reset, and host memory not doubled (the file written
from the live state tensors, read back memory-mapped). The end-to-end resume of a chained
(dense + expert) offloaded optimizer against AdamW by hand: tests/distributed/
test_optimizer_offload.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from unirl.core.errors import ConfigError

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="needs megatron-core"
)


class Hybrid:
    """The part of a HybridDeviceOptimizer that the checkpoint touches: host masters stepped
    by a torch AdamW, each mapped to its model shard."""

    def __init__(self, seed: int, sizes: tuple[int, ...]) -> None:
        g = torch.Generator().manual_seed(seed)
        self.shards = [torch.randn(n, generator=g) for n in sizes]
        self.masters = [s.clone() for s in self.shards]
        self.sub_optimizers = [torch.optim.AdamW(self.masters, lr=0.1)]
        self.inner_param_to_orig_param = dict(zip(self.masters, self.shards))
        self.state: dict = {}
        self.synced = 0

    def step(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for m in self.masters:
            m.grad = torch.randn(m.shape, generator=g)
        self.sub_optimizers[0].step()

    def _sync_sub_optimizers_state_to_hdo(self) -> None:
        self.synced += 1


def _stepped(n: int) -> list[Hybrid]:
    hybrids = [Hybrid(i, (3, 5) if i == 0 else (4,)) for i in range(n)]
    for h in hybrids:
        h.step(10)
    return hybrids


def _mapped_from(tensor: torch.Tensor, path: Path) -> bool:
    """Whether the tensor's memory is a mapping of ``path`` (/proc/self/maps)."""
    ptr = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(path.resolve()):
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= ptr < high:
                return True
    return False


def test_every_offloaded_optimizer_round_trips(tmp_path):
    from unirl.backends.megatron.offload_state import host_file, load_host_state, save_host_state

    saved = _stepped(2)
    want = [
        [(m.clone(), {k: v.clone() for k, v in h.sub_optimizers[0].state[m].items()})
         for m in h.masters]
        for h in saved
    ]  # fmt: skip
    save_host_state(saved, tmp_path, rank=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "optimizer_host_rank00003_0.pt",
        "optimizer_host_rank00003_1.pt",
    ]
    fresh = [Hybrid(7, (3, 5)), Hybrid(8, (4,))]
    load_host_state(fresh, tmp_path, rank=3)
    for h, expected in zip(fresh, want):
        assert h.synced == 1
        for m, (master, state) in zip(h.masters, expected):
            torch.testing.assert_close(m, master, rtol=0, atol=0)
            torch.testing.assert_close(h.inner_param_to_orig_param[m], master, rtol=0, atol=0)
            loaded = h.sub_optimizers[0].state[m]
            assert loaded.keys() == state.keys()
            for key in state:
                torch.testing.assert_close(loaded[key], state[key], rtol=0, atol=0)
    # the second one's moments really were restored (a missed file leaves it at zero state)
    file = host_file(tmp_path, 3, 1)
    assert _mapped_from(fresh[1].sub_optimizers[0].state[fresh[1].masters[0]]["exp_avg"], file)


def test_a_checkpoint_with_another_count_is_refused(tmp_path):
    from unirl.backends.megatron.offload_state import load_host_state, save_host_state

    save_host_state(_stepped(2), tmp_path, rank=0)
    with pytest.raises(ConfigError, match=r"2 offloaded optimizer state file.*has 1"):
        load_host_state([Hybrid(0, (3, 5))], tmp_path, rank=0)


def test_reset_resets_every_offloaded_optimizer():
    from unirl.backends.megatron.offload_state import reset_host_state

    hybrids = _stepped(2)
    for h in hybrids:
        h.state = {"x": 1}
        for s in h.shards:
            s.add_(1.0)
    reset_host_state(hybrids)
    for h in hybrids:
        assert h.state == {} and not h.sub_optimizers[0].state
        for m, s in zip(h.masters, h.shards):
            torch.testing.assert_close(m, s, rtol=0, atol=0)


def test_the_host_state_is_written_without_a_copy(tmp_path, monkeypatch):
    """torch.save gets the live host tensors: no second copy of the state in host memory."""
    from unirl.backends.megatron import offload_state

    written = []
    monkeypatch.setattr(offload_state.torch, "save", lambda obj, path: written.append(obj))
    (hybrid,) = _stepped(1)
    offload_state.save_host_state([hybrid], tmp_path, rank=0)
    ((first, second),) = written
    opt = hybrid.sub_optimizers[0]
    for entry, master in zip((first, second), hybrid.masters):
        assert entry["master"].data_ptr() == master.data_ptr()
        assert entry["exp_avg"].data_ptr() == opt.state[master]["exp_avg"].data_ptr()
        assert entry["exp_avg_sq"].data_ptr() == opt.state[master]["exp_avg_sq"].data_ptr()
