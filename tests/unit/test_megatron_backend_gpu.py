"""The Megatron backend on GPUs: every clause of the contract suite (`tests/contract`) in fp32,
against the suite's independent single-process reference, for every layout the suite registers
for Megatron (packed and padded, TP, PP, VPP, CP, DP, the distributed optimizer, TP x PP) that the
machine's GPUs allow. One NCCL process per GPU; megatron-core runs unpatched (the same layouts run
on the CPU over gloo in `tests/contract`, through `unirl.backends.megatron.compat.cpu`).

bf16 and the larger layouts run in `benchmarks/megatron_contract.py` (results in
`benchmarks/results/megatron_contract/2026-11-30_h200_5a2a3c3_2gpu.json`).
"""

import importlib.util
import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL schedules)"),
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None,
        reason="needs megatron-core (pip install unirl[megatron])",
    ),
]

from tests.contract.backends import REGISTRY  # noqa: E402

# the dense fixture's layouts (the MoE ones: benchmarks/contract_table.py --layouts moe-...)
LAYOUTS = {x.name: x.world_size for x in REGISTRY["megatron"].layouts if x.fixture == "dense"}


@pytest.fixture(scope="module")
def prepared():
    from tests.contract import clauses, launch

    root = Path(tempfile.mkdtemp(prefix="unirl-megatron-gpu-"))
    model_dir, records = launch.prepare(root)
    return root, model_dir, records, clauses.compute_reference(model_dir, records)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_contract_clauses_fp32(name, prepared):
    from tests.contract import clauses, launch
    from tests.contract.backends import REGISTRY

    if LAYOUTS[name] > torch.cuda.device_count():
        pytest.skip(f"layout {name} needs {LAYOUTS[name]} GPUs")
    root, model_dir, records, ref = prepared
    entry = REGISTRY["megatron"]
    layout = next(x for x in entry.layouts if x.name == name)
    measured = launch.run_group(
        entry,
        layout,
        model_dir=model_dir,
        records=records,
        work_dir=root / name,
        device="cuda",
        dtype="fp32",
    )
    patched = [r["rank"] for r in measured.ranks if "cpu_compat_lines" in r]
    assert not patched, f"ranks {patched} patched megatron-core for the CPU on a GPU"
    checks = clauses.all_checks(measured, ref, records, clauses.TOLERANCES["fp32"])
    failed = [c.describe() for items in checks.values() for c in items if not c.ok]
    assert not failed, "\n".join(failed[:20])
