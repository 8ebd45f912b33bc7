"""Where a GPU step's idle time comes from, and which lines synchronise the host with the GPU.

A step that is 95% busy loses its last 5% in gaps between kernels: the host has run out of queued
work, usually because a line waited for the GPU (``.item()``, ``.tolist()``, ``if tensor:``,
a device-to-host copy) and then spent host time before the next launch. Kernel tables cannot show
this; two tools here can:

- `gap_report(trace)`: from a torch.profiler chrome trace recorded with ``with_stack=True``, every
  interval in which no kernel, copy or memset runs, charged to the Python frames the host was in
  when the gap began (the wait that drained the queue) and when it ended (the code that launched
  the next kernel), summed per frame and sorted by idle time.
- `kernel_report(trace)`: every kernel's time charged to the host op and Python frames that
  launched it (through the trace's correlation ids), summed per (kernel, launch site): which line
  of ours the small elementwise and reduction kernels come from.
- `SyncSites`: a context manager over ``torch.cuda.set_sync_debug_mode("warn")`` that counts each
  synchronising call by the innermost frames of the caller's code.

``benchmarks/megatron_throughput.py --profile-dir DIR --profile-gaps`` and
``benchmarks/backend_throughput.py --profile-dir DIR --profile-gaps`` write both next to their
kernel tables; ``python benchmarks/profile_gaps.py TRACE.json`` reports a saved trace.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import itertools
import json
import os
import traceback
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

# trace categories of device-side work: the GPU is busy while one of them runs
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
# the frames worth naming: our code and the engines it drives (not torch's own wrappers)
OWN_CODE = ("unirl/", "benchmarks/", "megatron/", "deepspeed/", "transformers/", "liger_kernel/")


def merged_busy(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, overlapping ``(start, end)`` intervals merged into disjoint ones."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def idle_gaps(busy: Sequence[tuple[float, float]], min_us: float) -> list[tuple[float, float]]:
    """The gaps of at least ``min_us`` between consecutive merged busy intervals."""
    return [
        (a_end, b_start)
        for (_, a_end), (b_start, _) in itertools.pairwise(busy)
        if b_start - a_end >= min_us
    ]


def _own_frame(name: str, own: Sequence[str] = OWN_CODE) -> str | None:
    """``path/file.py(123): func`` of our code, shortened to the package path; else None."""
    for marker in own:
        pos = name.find(marker)
        if pos >= 0:
            return name[pos:]
    return None


class _Stacks:
    """The host's Python frames (``python_function`` trace events, nested through their parent
    ids), queried by time."""

    def __init__(self, frames: list[dict[str, Any]], own: Sequence[str]) -> None:
        self.own = own
        self.frames = sorted(frames, key=lambda e: e["ts"])
        self.starts = [e["ts"] for e in self.frames]
        self.by_id = {e.get("args", {}).get("Python id"): e for e in self.frames}

    def at(self, t: float, depth: int = 3, scan: int = 5000) -> str:
        """The innermost ``depth`` frames of our code active at time ``t``, innermost first."""
        hi = bisect.bisect_right(self.starts, t)
        leaf = None
        # the innermost active frame is the one that started last among those still running
        for i in range(hi - 1, max(-1, hi - 1 - scan), -1):
            e = self.frames[i]
            if e["ts"] + e["dur"] >= t:
                leaf = e
                break
        own: list[str] = []
        while leaf is not None and len(own) < depth:
            frame = _own_frame(leaf["name"], self.own)
            if frame is not None:
                own.append(frame)
            leaf = self.by_id.get(leaf.get("args", {}).get("Python parent id"))
        return " <- ".join(own) if own else "(no Python frame of ours)"


class _Ops:
    """Without Python frames: the host's profiled ops (aten ops, CUDA runtime calls, annotated
    ranges) that contain a time, innermost first, by their names."""

    CATEGORIES = frozenset({"cpu_op", "cuda_runtime", "user_annotation"})

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = sorted(events, key=lambda e: e["ts"])
        self.starts = [e["ts"] for e in self.events]

    def at(self, t: float, depth: int = 3, scan: int = 5000) -> str:
        hi = bisect.bisect_right(self.starts, t)
        names: list[str] = []
        for i in range(hi - 1, max(-1, hi - 1 - scan), -1):
            e = self.events[i]
            if e["ts"] + e["dur"] >= t:
                names.append(e["name"][:80])
                if len(names) == depth:
                    break
        return " <- ".join(names) if names else "(no host op)"


def gap_report(
    trace_path: Path, *, min_us: float = 20.0, top: int = 25, own: Sequence[str] = OWN_CODE
) -> dict[str, Any]:
    """Idle time of the GPU in a chrome trace, charged to where the host was (see module doc)."""
    data = json.loads(Path(trace_path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    device = [
        (e["ts"], e["ts"] + e.get("dur", 0))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES
    ]
    if not device:
        raise ValueError(f"{trace_path}: no kernel events (was the trace recorded with CUDA?)")
    frames = [e for e in events if e.get("ph") == "X" and e.get("cat") == "python_function"]
    busy = merged_busy(device)
    gaps = idle_gaps(busy, min_us)
    span = busy[-1][1] - busy[0][0]
    if frames:
        stacks: _Stacks | _Ops = _Stacks(frames, own)
    else:
        stacks = _Ops([e for e in events if e.get("ph") == "X" and e.get("cat") in _Ops.CATEGORIES])
    by_start: collections.Counter[str] = collections.Counter()
    by_end: collections.Counter[str] = collections.Counter()
    count_start: collections.Counter[str] = collections.Counter()
    for a, b in gaps:
        start, end = stacks.at(a + 1.0), stacks.at(b - 1.0)
        by_start[start] += b - a
        by_end[end] += b - a
        count_start[start] += 1
    idle = sum(b - a for a, b in gaps)
    return {
        "span_ms": span / 1e3,
        "busy_ms": sum(b - a for a, b in busy) / 1e3,
        "gaps": len(gaps),
        "min_gap_us": min_us,
        "idle_in_gaps_ms": idle / 1e3,
        "python_frames_recorded": bool(frames),
        "by_host_frame_at_gap_start_ms": {
            k: {"ms": round(v / 1e3, 3), "gaps": count_start[k]}
            for k, v in by_start.most_common(top)
        },
        "by_host_frame_at_gap_end_ms": {k: round(v / 1e3, 3) for k, v in by_end.most_common(top)},
    }


def _short_kernel(name: str, width: int = 60) -> str:
    """A kernel's name without its template arguments, cut to ``width``."""
    return name.split("<", 1)[0].split("(", 1)[0][:width]


def kernel_report(
    trace_path: Path,
    *,
    top: int = 40,
    exclude: Sequence[str] = ("nvjet", "gemm", "flash"),
    own: Sequence[str] = OWN_CODE,
) -> dict[str, Any]:
    """Kernel time by launch site: each kernel (names containing one of ``exclude`` left out:
    the matmuls and attention, whose sites are known) is charged, through its correlation id, to
    the innermost host op around its launch and to the Python frames of ours at that moment."""
    data = json.loads(Path(trace_path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    xs = [e for e in events if e.get("ph") == "X"]
    launches = {
        e["args"]["correlation"]: e["ts"]
        for e in xs
        # Triton launches through the driver API (cuLaunchKernel: "cuda_driver")
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    frames = [e for e in xs if e.get("cat") == "python_function"]
    stacks = _Stacks(frames, own) if frames else None
    ops = _Ops([e for e in xs if e.get("cat") in ("cpu_op", "user_annotation")])
    total: collections.Counter[tuple[str, str, str]] = collections.Counter()
    count: collections.Counter[tuple[str, str, str]] = collections.Counter()
    kept = all_us = 0.0
    for e in xs:
        if e.get("cat") != "kernel":
            continue
        all_us += e.get("dur", 0)
        name = _short_kernel(e["name"])
        if any(x in e["name"] for x in exclude):
            continue
        t = launches.get(e.get("args", {}).get("correlation"))
        if t is None:
            key = (name, "(launch not in trace)", "")
        else:
            op = ops.at(t + 0.01, depth=1)
            key = (name, op, stacks.at(t + 0.01) if stacks is not None else "")
        total[key] += e.get("dur", 0)
        count[key] += 1
        kept += e.get("dur", 0)
    return {
        "kernel_ms": round(all_us / 1e3, 3),
        "reported_ms": round(kept / 1e3, 3),
        "excluded": list(exclude),
        "by_site": [
            {
                "kernel": k,
                "op": op,
                "frames": fr,
                "ms": round(v / 1e3, 3),
                "calls": count[k, op, fr],
            }
            for (k, op, fr), v in total.most_common(top)
        ],
    }


class SyncSites:
    """Count the host-device synchronisations inside the block by the caller's own frames.

    ``torch.cuda.set_sync_debug_mode("warn")`` warns at every synchronising CUDA call (a
    ``.item()``, a ``.tolist()``, a blocking copy to the host, ``torch.cuda.synchronize`` not
    included); each warning is charged to the innermost frames of our code on the stack."""

    def __init__(self, depth: int = 3) -> None:
        self.depth = depth
        self.sites: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def recording(self) -> Iterator[SyncSites]:
        import torch

        passed_on = warnings.showwarning

        def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
            if "synchronizing CUDA operation" not in str(message):
                passed_on(message, category, *args, **kwargs)  # not ours: shown as usual
                return
            own = []
            for fr in traceback.extract_stack()[:-1]:
                frame = _own_frame(f"{fr.filename}({fr.lineno}): {fr.name}")
                if frame is not None and "profile_gaps.py" not in frame:
                    own.append(frame)
            site = " <- ".join(reversed(own[-self.depth :])) or "(no frame of ours)"
            self.sites[site] += 1

        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield self
            finally:
                torch.cuda.set_sync_debug_mode(previous)

    def report(self, top: int = 40) -> dict[str, Any]:
        return {
            "syncs": sum(self.sites.values()),
            "by_site": dict(self.sites.most_common(top)),
        }


def add_profile_gaps_argument(parser: argparse.ArgumentParser, note: str = "") -> None:
    """``--profile-gaps [ops|stack]``, as the throughput benchmarks take it."""
    parser.add_argument(
        "--profile-gaps",
        nargs="?",
        const="ops",
        choices=["ops", "stack"],
        default=None,
        help="--profile-dir: also the GPU's idle gaps, charged to the host's ops (or, 'stack', "
        "to its Python frames: slower, overstates host-bound gaps), and the host syncs by line "
        "(benchmarks/profile_gaps.py)" + note,
    )


def profile_with_gaps(
    fn: Any, out_dir: Path, name: str, *, with_stack: bool = True
) -> dict[str, Any]:
    """Run ``fn`` once while counting its sync sites, then once more under torch.profiler
    (``with_stack``: with Python stacks, which slow the host several-fold and so overstate the
    host-bound gaps; without them the gaps are charged to the host's profiled ops); write
    ``gaps_<name>.json`` (both reports) in ``out_dir`` and return it."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sites = SyncSites()
    torch.cuda.synchronize()
    with sites.recording():
        fn()
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities, with_stack=with_stack) as p:
        fn()
        torch.cuda.synchronize()
    out_dir.mkdir(parents=True, exist_ok=True)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        name = f"{name}_rank{torch.distributed.get_rank()}"  # every rank writes its own
    trace = out_dir / f"trace_gaps_{name}.json"
    p.export_chrome_trace(str(trace))
    report = {"sync_sites": sites.report(), "with_stack": with_stack, "gaps": gap_report(trace)}
    report["kernels_by_site"] = kernel_report(trace)
    if not os.environ.get("UNIRL_KEEP_TRACE"):
        trace.unlink()  # hundreds of MB; the report is what is kept
    (out_dir / f"gaps_{name}.json").write_text(json.dumps(report, indent=1))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="chrome trace (torch.profiler, with_stack=True)")
    parser.add_argument("--min-us", type=float, default=20.0)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--kernels", action="store_true", help="kernel time by launch site, not the idle gaps"
    )
    args = parser.parse_args()
    if args.kernels:
        print(json.dumps(kernel_report(args.trace, top=args.top), indent=1))
    else:
        print(json.dumps(gap_report(args.trace, min_us=args.min_us, top=args.top), indent=1))


if __name__ == "__main__":
    main()
