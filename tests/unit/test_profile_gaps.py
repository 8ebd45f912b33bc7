"""`benchmarks/profile_gaps.py`: the GPU's idle gaps in a chrome trace, charged to the host's
Python frames (or ops) at their start and end; checked on hand-made traces whose gaps are known."""

from __future__ import annotations

import json

import pytest

from benchmarks.profile_gaps import gap_report, idle_gaps, kernel_report, merged_busy


def _x(cat: str, name: str, ts: float, dur: float, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def test_busy_intervals_merge_and_gaps_below_the_threshold_are_dropped():
    busy = merged_busy([(0, 10), (5, 12), (30, 40), (41, 50), (100, 101)])
    assert busy == [(0, 12), (30, 40), (41, 50), (100, 101)]
    assert idle_gaps(busy, min_us=5) == [(12, 30), (50, 100)]


def test_gaps_are_charged_to_the_python_frames_around_them(tmp_path):
    # host: run() calls wait() (0-40), then launch() (40-70); kernels 0-20 and 60-80:
    # one 40 us gap (20-60) that starts in wait() and ends in launch()
    frames = [
        _x("python_function", "unirl/core/step.py(10): run", 0, 100, **{"Python id": 1}),
        _x(
            "python_function",
            "unirl/x.py(5): wait",
            1,
            39,
            **{"Python id": 2, "Python parent id": 1},
        ),
        _x(
            "python_function",
            "torch/y.py(7): item",
            2,
            37,
            **{"Python id": 3, "Python parent id": 2},
        ),
        _x(
            "python_function",
            "unirl/x.py(9): launch",
            40,
            30,
            **{"Python id": 4, "Python parent id": 1},
        ),
    ]
    kernels = [_x("kernel", "k1", 0, 20), _x("gpu_memcpy", "copy", 60, 20)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": frames + kernels}))
    report = gap_report(path, min_us=10)
    assert report["gaps"] == 1
    assert report["idle_in_gaps_ms"] == pytest.approx(0.040)
    assert report["span_ms"] == pytest.approx(0.080)
    start = "unirl/x.py(5): wait <- unirl/core/step.py(10): run"  # torch's own frame skipped
    assert report["by_host_frame_at_gap_start_ms"] == {start: {"ms": 0.04, "gaps": 1}}
    end = "unirl/x.py(9): launch <- unirl/core/step.py(10): run"
    assert report["by_host_frame_at_gap_end_ms"] == {end: 0.04}


def test_without_python_frames_gaps_are_charged_to_host_ops(tmp_path):
    ops = [
        _x("cpu_op", "aten::item", 10, 50),
        _x("cuda_runtime", "cudaStreamSynchronize", 12, 40),
        _x("cpu_op", "aten::mm", 70, 5),
    ]
    kernels = [_x("kernel", "k1", 0, 15), _x("kernel", "k2", 72, 10), _x("kernel", "k3", 83, 1)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(ops + kernels))  # the bare-list form of a chrome trace
    report = gap_report(path, min_us=5)
    assert report["gaps"] == 1  # 15-72; the 1 us gap before k3 is below the threshold
    assert report["by_host_frame_at_gap_start_ms"] == {
        "cudaStreamSynchronize <- aten::item": {"ms": 0.057, "gaps": 1}
    }
    assert report["by_host_frame_at_gap_end_ms"] == {"aten::mm": 0.057}


def test_a_trace_without_kernels_is_refused(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [_x("cpu_op", "aten::mm", 0, 5)]}))
    with pytest.raises(ValueError, match="no kernel events"):
        gap_report(path)


def test_kernel_time_is_charged_to_the_op_and_frames_that_launched_it(tmp_path):
    # norm() launches two elementwise kernels (3 + 5 us) through aten::add, step() one matmul
    # (excluded) and one through aten::copy_; a kernel whose launch is missing stays visible
    events = [
        _x("python_function", "unirl/step.py(1): step", 0, 100, **{"Python id": 1}),
        _x(
            "python_function",
            "megatron/n.py(7): norm",
            10,
            30,
            **{"Python id": 2, "Python parent id": 1},
        ),
        _x("cpu_op", "aten::add", 12, 5),
        _x("cuda_runtime", "cudaLaunchKernel", 13, 2, correlation=1),
        _x("cpu_op", "aten::add", 20, 5),
        _x("cuda_runtime", "cudaLaunchKernel", 21, 2, correlation=2),
        _x("cpu_op", "aten::mm", 50, 5),
        _x("cuda_runtime", "cudaLaunchKernel", 51, 2, correlation=3),
        _x("cpu_op", "aten::copy_", 60, 5),
        _x("cuda_runtime", "cudaMemcpyAsync", 61, 2, correlation=4),
        _x("cpu_op", "triton_kernel", 70, 5),
        _x("cuda_driver", "cuLaunchKernel", 71, 2, correlation=5),
        _x(
            "kernel",
            "void at::native::vectorized_elementwise_kernel<4, Add>(int)",
            30,
            3,
            correlation=1,
        ),
        _x(
            "kernel",
            "void at::native::vectorized_elementwise_kernel<4, Add>(int)",
            40,
            5,
            correlation=2,
        ),
        _x("kernel", "nvjet_sm90_tst_128x128", 60, 50, correlation=3),
        _x("kernel", "copy_kernel", 120, 7, correlation=4),
        _x("kernel", "lost_kernel", 130, 1, correlation=99),
        _x("kernel", "_rms_bwd_kernel", 140, 4, correlation=5),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    report = kernel_report(path)
    assert report["kernel_ms"] == pytest.approx(0.070)
    assert report["reported_ms"] == pytest.approx(0.020)  # the matmul excluded
    rows = {(r["kernel"], r["op"], r["frames"]): (r["ms"], r["calls"]) for r in report["by_site"]}
    norm = "megatron/n.py(7): norm <- unirl/step.py(1): step"
    assert rows == {
        ("void at::native::vectorized_elementwise_kernel", "aten::add", norm): (0.008, 2),
        ("copy_kernel", "aten::copy_", "unirl/step.py(1): step"): (0.007, 1),
        ("lost_kernel", "(launch not in trace)", ""): (0.001, 1),
        # a Triton kernel, launched through the driver API
        ("_rms_bwd_kernel", "triton_kernel", "unirl/step.py(1): step"): (0.004, 1),
    }
    assert report["by_site"][0]["kernel"] == "void at::native::vectorized_elementwise_kernel"
