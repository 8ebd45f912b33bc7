"""The agent gateway's cost (``rollout.source: agent``, unirl/rollouts/gateway/) on the CPU: per
call against calling the engine directly, and episodes per second with 1, 8 and 64 agents at once.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/gateway_overhead.py
    PYTHONPATH=$PWD python benchmarks/gateway_overhead.py --calls 50 --episodes 64 --out x.json

Two engines behind the gateway: ``sampler``, the built-in sampler on the tiny example's model
(examples/tiny_agent.yaml: 2 layers of 64, the tool_lookup task's 17-token vocabulary, 3 new
tokens per call), and ``null``, an engine that returns 3 fixed tokens at once, so that its
numbers are the gateway alone (FastAPI + uvicorn, the request's rendering through the chat
template, the queue, the recording) plus the ``openai`` SDK client's own time.

Per call (one agent, sequential calls, medians over ``--calls``): ``direct_ms``, the engine's
``generate`` on one prompt; ``queue_ms``, the same through the gateway's queue (its thread and a
future, no HTTP); ``remote_ms``, the same engine served as another rank's engine is to the
gateway with several engines (gateway/remote.py: a loopback connection, pickled, authenticated;
here both ends in this process); ``gateway_ms``, a chat completion through the ``openai`` SDK;
``overhead_ms`` = gateway - direct. Episodes: the example's agent (examples/tiny_agent.py: one client per endpoint,
up to three chat calls) over ``--episodes`` episodes with 1, 8 and 64 running at once
(rollout.agent.concurrency); ``episodes_per_s`` and ``calls_per_s`` over the wall time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.result_files import head_commit, new_result_path  # noqa: E402
from benchmarks.run_environment import run_environment  # noqa: E402

logger = logging.getLogger("gateway_overhead")
EXAMPLE = ROOT / "examples" / "tiny_agent.yaml"


class NullEngine:
    """Answers every prompt with three fixed tokens ("c=7" is not needed: any ids), at once."""

    def generate(self, prompts, seeds, max_new_tokens):
        from unirl.rollouts.serving.engine import EngineSample

        return [EngineSample(response_tokens=(5, 6, 2), logprobs=(-1.0, -1.0, -1.0),
                             finished=True) for _ in prompts]  # fmt: skip


def _source(run_dir: Path, concurrency: int) -> Any:
    from unirl.core.config.run_config import load_config
    from unirl.rollouts.gateway.source import build_agent_source

    cfg = load_config(EXAMPLE, [f"logging.run_dir={run_dir}", "progress.enabled=false",
                                f"rollout.agent.concurrency={concurrency}"])  # fmt: skip
    return build_agent_source(cfg)


def _per_call(source: Any, engine: Any, calls: int) -> dict[str, float]:
    import threading

    import openai

    from unirl.rollouts.gateway.remote import EngineServer, RemoteCalls

    source.engine = engine
    gateway = source.start_gateway()
    episode = gateway.open_episode("benchmark", seed=0)
    prompt = [1, 14, 3]  # <bos> ? <sep>: what the template renders for the user's "?"
    direct, queued, remote, served = [], [], [], []
    client = openai.OpenAI(base_url=gateway.base_url, api_key=episode.key, max_retries=0)
    server = EngineServer(engine, version=lambda: 0, lock=threading.Lock())
    far = RemoteCalls(1, server.address, server.authkey, timeout_s=60)
    for i in range(calls + 3):  # 3 warm-ups
        t0 = time.perf_counter()
        engine.generate([prompt], [i], 3)
        t1 = time.perf_counter()
        source._router.submit(0, prompt, seed=i, max_new_tokens=3).result()
        t2 = time.perf_counter()
        client.chat.completions.create(model="p", messages=[{"role": "user", "content": "?"}],
                                       max_tokens=3)  # fmt: skip
        t3 = time.perf_counter()
        far.generate([prompt], [i], 3)
        t4 = time.perf_counter()
        if i >= 3:
            direct.append(t1 - t0), queued.append(t2 - t1), served.append(t3 - t2)
            remote.append(t4 - t3)
        episode.calls.clear()
        episode._started = 0
    gateway.end_episode(episode)
    far.close()
    server.close()
    ms = lambda xs: round(1000 * statistics.median(xs), 3)  # noqa: E731
    return {"direct_ms": ms(direct), "queue_ms": ms(queued), "remote_ms": ms(remote),
            "gateway_ms": ms(served), "overhead_ms": round(ms(served) - ms(direct), 3)}  # fmt: skip


def _episodes(source: Any, engine: Any, episodes: int) -> dict[str, float]:
    import random

    source.engine = engine
    gateway = source.start_gateway()
    rng = random.Random(0)
    problems = [source.task.sample_problem(rng) for _ in range(episodes)]
    from unirl.rollouts.gateway.source import task_of

    t0 = time.perf_counter()
    results = source.runner.run(lambda i: gateway.open_episode(f"episode {i}", seed=i),
                                gateway.end_episode, gateway.base_url,
                                [task_of(p) for p in problems])  # fmt: skip
    wall = time.perf_counter() - t0
    calls = sum(len(r.calls) for r in results)
    failed = sum(r.outcome != "ok" for r in results)
    return {"episodes": episodes, "calls": calls, "failed": failed, "wall_s": round(wall, 3),
            "episodes_per_s": round(episodes / wall, 2), "calls_per_s": round(calls / wall, 2)}  # fmt: skip


def _measure(engine_name: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from unirl.rollouts.gateway.engines import SamplerCalls

    out: dict[str, Any] = {"engine": engine_name}
    for concurrency in [1, *args.concurrency]:
        source = _source(tmp / f"{engine_name}{concurrency}", concurrency)
        engine = NullEngine() if engine_name == "null" else SamplerCalls(source.inner.sampler)
        try:
            if concurrency == 1:
                out["per_call"] = _per_call(source, engine, args.calls)
                source.close()
                source = _source(tmp / f"{engine_name}{concurrency}b", concurrency)
                engine = (
                    NullEngine() if engine_name == "null" else SamplerCalls(source.inner.sampler)
                )
            out[f"concurrency_{concurrency}"] = _episodes(source, engine, args.episodes)
        finally:
            source.close()
        logger.info("%s %s", engine_name, json.dumps(out))
    return out


def main() -> None:
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--episodes", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 64])
    p.add_argument("--engines", nargs="+", default=["sampler", "null"])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    for name in ("httpx", "httpx2", "openai", "uvicorn"):
        logging.getLogger(name).setLevel(logging.WARNING)
    out = args.out or new_result_path("gateway_overhead", "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        results = [_measure(name, args, Path(tmp)) for name in args.engines]
    report = {
        "benchmark": "gateway_overhead",
        **run_environment(("transformers", "fastapi", "uvicorn", "openai")),
        "commit": head_commit(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_average": os.getloadavg(),
        "results": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    logger.info("wrote %s", out)


if __name__ == "__main__":
    main()
