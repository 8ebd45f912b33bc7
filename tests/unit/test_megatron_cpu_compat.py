"""`unirl.backends.megatron.compat.cpu`, by hand: its version gate, the CPU stand-ins for
``torch`` and ``Tensor.type()``, and that every line it lists reads ``cuda`` in the installed
megatron-core. (That each patched line that runs is listed: `tests/contract/test_contract.py`.)"""

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core (pip install unirl[megatron])",
)


def test_refuses_an_unchecked_megatron_version(monkeypatch):
    from megatron.core import package_info

    from unirl.backends.megatron.compat import cpu as cpu_compat

    monkeypatch.setattr(package_info, "__version__", "0.17.0")
    with pytest.raises(
        RuntimeError, match=r"found megatron-core 0\.17\.0: install megatron-core=="
    ):
        cpu_compat.check_version()


def test_refuses_to_patch_where_cuda_is_available(monkeypatch):
    from unirl.backends.megatron.compat import cpu as cpu_compat

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpu_compat, "_installed", False)
    with pytest.raises(RuntimeError, match="runs unpatched on GPUs"):
        cpu_compat.install()


def test_listed_lines_read_cuda_in_the_installed_megatron_core():
    import megatron.core

    from unirl.backends.megatron.compat import cpu as cpu_compat

    cpu_compat.check_version()
    root = Path(megatron.core.__file__).parent
    lines = cpu_compat.listed_lines()
    # a new line here is a reviewed change to the patch (32 CUDA lines, 2 of gloo's collectives;
    # activation recompute's RNG save / restore, random.py:55 and :93; the last twelve reviewed:
    # optimizer.offload's HybridDeviceOptimizer, 8 stream lines and 3 is_cuda tests, and the
    # distributed optimizer's undetached fp32 shard, distrib_optimizer.py:421)
    assert len(lines) == 48
    reads = cpu_compat.line_reads()
    for where in sorted(lines):
        path, number = where.rsplit(":", 1)
        code = (root / path).read_text().splitlines()[int(number) - 1]
        assert reads[where] in code, f"{where}: {code!r}"


def test_host_torch_builds_cuda_requests_on_the_cpu():
    from unirl.backends.megatron.compat.cpu import _HostTorch

    host = _HostTorch()
    for device in ("cuda", "cuda:1", torch.device("cuda", 0)):
        assert host.zeros(2, dtype=torch.int, device=device).device == torch.device("cpu")
    assert host.tensor([1.0], device="cuda").tolist() == [1.0]
    assert host.empty(3, device="meta").device == torch.device("meta")  # others unchanged
    assert host.cuda.current_device() == torch.device("cpu")
    assert host.cuda.synchronize() is None
    assert host.float32 is torch.float32 and host.distributed is torch.distributed
    with pytest.raises(AttributeError, match=r"compat\.cpu does not cover it"):
        host.cuda.Event()


def test_cuda_type_names_only_inside_the_patched_call():
    from unirl.backends.megatron.compat.cpu import _with_cpu_type_names

    seen = _with_cpu_type_names(lambda t: (t.type(), t.type(torch.float64).dtype))
    assert seen(torch.zeros(1)) == ("torch.cuda.FloatTensor", torch.float64)
    assert seen(torch.zeros(1, dtype=torch.bfloat16))[0] == "torch.cuda.BFloat16Tensor"
    assert seen(torch.zeros(1, dtype=torch.long))[0] == "torch.LongTensor"
    assert torch.zeros(1).type() == "torch.FloatTensor"
