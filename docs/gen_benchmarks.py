"""Write docs/reference/benchmark-results.md, the benchmark tables, from benchmarks/results/.

    python docs/gen_benchmarks.py           # rewrite the page
    python docs/gen_benchmarks.py --check   # exit 1 when the committed page is stale

Every file under ``benchmarks/results/<benchmark>/`` is one row of its benchmark's table, newest
first: the date, card or machine and commit (from the file name, ``benchmarks/result_files.py``;
the card's name from the file where it records one), the headline figures (read by this
benchmark's summariser below) and the command (from the file; else the one the "Result files"
tables of ``benchmarks/README.md`` give, marked so). The published anchors (``ANCHORS``) stand
beside the benchmarks they compare with. A file whose schema no summariser knows is listed with its
date and command only, so a new benchmark never breaks the page; ``tests/unit/test_docs_generated.py``
fails when the committed page is stale (a result file committed without regenerating).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "reference" / "benchmark-results.md"
REGENERATE = "python docs/gen_benchmarks.py"

logger = logging.getLogger("gen_benchmarks")

PRIME_RL = (
    "[prime-rl's trainer benchmarks]"
    "(https://github.com/PrimeIntellect-ai/prime-rl/blob/main/benchmarks/results/BENCHMARKS.md)"
)


@attrs.frozen
class Anchor:
    """A published number users compare unirl's with, and the benchmarks it stands beside."""

    what: str
    hardware: str
    figures: str
    source: str
    benchmarks: tuple[str, ...]


# The anchors (issue #49 and #45 quote them); MFU with 989 TFLOP/s per GPU, as unirl's.
ANCHORS: tuple[Anchor, ...] = (
    Anchor(
        "Qwen3-4B full RL, 65,536-token sequences",
        "8 x H100",
        "35.4% MFU, 28.97k tokens/s",
        PRIME_RL,
        ("megatron_throughput", "backend_throughput"),
    ),
    Anchor(
        "Qwen3-4B full RL, 16,384-token sequences",
        "8 x H100",
        "13.9% MFU",
        PRIME_RL,
        ("megatron_throughput", "backend_throughput"),
    ),
    Anchor(
        "Qwen3-0.6B full RL, 65,536-token sequences",
        "1 x H100",
        "26.8% MFU",
        PRIME_RL,
        ("megatron_throughput", "backend_throughput"),
    ),
    Anchor(
        "Qwen3-4B LoRA rank 16 RL",
        "1 x H100",
        "21.7% MFU, 6.23k tokens/s",
        PRIME_RL,
        ("megatron_throughput", "backend_throughput"),
    ),
)

NAME = re.compile(
    r"^(?P<date>\d{4}-\d{2}-\d{2})_(?P<hardware>cpu|h100|h200)_(?P<commit>[0-9a-f]{7,12})"
    r"(?:_(?P<variant>[a-z0-9][a-z0-9.-]*))?\.(?P<ext>json|jsonl|txt|png)$"
)


# ---------------------------------------------------------------- formatting helpers


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _k(x: float) -> str:
    return f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.0f}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    """A table cell holding ``text`` as code (a backtick inside cannot close it early)."""
    return f"`{_cell(text)}`" if "`" not in text else f"``{_cell(text)}``"


# ---------------------------------------------------------------- headline summarisers
# One per benchmark: the file's data in, one short cell out. A KeyError / TypeError /
# ValueError / IndexError / AttributeError (a schema the summariser does not know) makes the
# row fall back to the date and command.


def _throughput_modes(results: dict) -> list[str]:
    out = []
    for mode, run in results.items():
        s = run["summary"]
        # the plain-loop mode times whole steps only
        tokens = s.get("train_tokens_per_s", s.get("step_tokens_per_s"))
        mfu = s.get("train_mfu", s.get("step_mfu_training_flops"))
        out.append(f"{mode}: {_k(tokens)} tok/s, {_pct(mfu)} MFU, {run['peak_memory_gib']:.1f} GiB")
    return out


def _megatron_throughput(d: dict) -> str:
    p, b = d["parallel"], d["batch"]
    shape = (
        f"{d['model']['name']} ({d['model']['num_hidden_layers']} layers), {b['tokens']:,} "
        f"tokens in {b['tokens_per_microbatch']:,}-token microbatches, "
        f"tp{p['tp']} pp{p['pp']} cp{p['cp']} on {p['gpus']} GPU"
    )
    if b.get("fused_head"):
        shape += ", fused head"
    return "; ".join([shape, *_throughput_modes(d["results"])])


def _backend_throughput(d: dict) -> str:
    if "runs" in d:
        parts = []
        for name, run in d["runs"].items():
            table = run.get("table") or {}
            for engine, row in table.items():
                parts.append(
                    f"{name} [{engine}]: {_k(row['tokens_per_s'])} tok/s, {_pct(row['mfu'])} MFU"
                )
        if not parts:
            raise KeyError("table")
        return "; ".join(parts)
    rows = [
        f"{engine}: {_k(r['tokens_per_s'])} tok/s, {_pct(r['mfu'])} MFU, "
        f"{r['peak_memory_gib']:.1f} GiB"
        for engine, r in d["table"].items()
    ]
    return f"{d['model']['name']}, {d['batch']['tokens']:,} tokens; " + "; ".join(rows)


def _logprobs(d: dict) -> str:
    first = d["results"][0]["size"]
    rows = [r for r in d["results"] if r["size"] == first]
    cells = [
        f"{r['method']} {r['fwd_bwd_ms']:.2f} ms, {r['fwd_bwd_extra_x_logits']:.1f}x logits"
        for r in rows
    ]
    return f"{first} fwd+bwd: " + "; ".join(cells)


def _fused_head(d: dict) -> str:
    parts = []
    for row in d["results"]:
        methods = row["methods"]
        best = sorted(methods.items(), key=lambda kv: kv[1]["ms_median"])[:3]
        shown = ", ".join(
            f"{name} {m['ms_median']:.1f} ms ({m['beyond_grads_gib']:.2f} GiB)" for name, m in best
        )
        parts.append(f"{row['tokens']:,} x {row['hidden']:,}: {shown}")
    return "fastest: " + "; ".join(parts)


def _layouts_passing(layouts: dict) -> str:
    """How many layouts passed every clause, failed one, or did not run (no clauses: cut by the
    deadline or needing more GPUs than the machine had)."""
    ran = [lay["clauses"].values() for lay in layouts.values() if lay.get("clauses")]
    passed = sum(all(c["ok"] for c in clauses) for clauses in ran)
    text = f"every clause passes in {passed} of {len(layouts)} layouts"
    if len(ran) > passed:
        text += f", {len(ran) - passed} fail one"
    if len(layouts) > len(ran):
        text += f", {len(layouts) - len(ran)} did not run"
    return text


def _megatron_contract(d: dict) -> str:
    return "; ".join(f"{run}: {_layouts_passing(lays)}" for run, lays in d["results"].items())


def _contract_table(d: dict) -> str:
    return "; ".join(
        f"{backend} {d['dtype']}: {_layouts_passing(lays)}"
        for backend, lays in d["results"].items()
    )


def _cpu_vs_trl(d: dict) -> str:
    parts = []
    for name, w in d["workloads"].items():
        s = w["summary"]
        parts.append(
            f"{name}: unirl {s['unirl']['median_step_s']:.3f} s/step, TRL "
            f"{s['trl']['median_step_s']:.3f} s/step ({w['ratio_step_unirl_over_trl']:.2f}x)"
        )
    return "; ".join(parts)


def _rollout_engines(d: dict) -> str:
    return (
        f"vLLM {_k(d['vllm']['tokens_per_s'])} tok/s, built-in sampler "
        f"{_k(d['sampler']['tokens_per_s'])} tok/s (median rollout ratio "
        f"{d['speedup_median']:.2f}x)"
    )


def _weight_transfer(d: dict) -> str:
    if "models" in d:
        return "; ".join(
            f"{model} flat on CUDA: {m['flat_on_cuda']['gb']:.1f} GB in "
            f"{min(m['flat_on_cuda']['sync_s']) * 1000:.0f} ms"
            for model, m in d["models"].items()
        )
    parts = []
    for name, run in d["runs"].items():
        if isinstance(run, dict):
            parts.append(
                f"{d['backend']} {name}: sync {run['sync_s']:.2f} s, "
                f"{run['sync_peak_above_trainer_gib']:.2f} GiB above the trainer"
            )
    if not parts:
        raise KeyError("runs")
    return "; ".join(parts)


def _moe_experts(d: dict) -> str:
    e = d["results"]["experts"]
    return (
        f"{d['shape']['name']} experts, {d['tokens']:,} tokens: grouped "
        f"{e['grouped']['fwd_bwd_ms']:.1f} ms ({_pct(e['grouped']['mfu'])} MFU), sequential "
        f"{e['sequential']['fwd_bwd_ms']:.1f} ms"
    )


def _async_steps(d: dict) -> str:
    return "; ".join(f"{k}: {v['seconds_per_step']:.3f} s/step" for k, v in d["speed"].items())


def _dynamic_sampling(d: dict) -> str:
    parts = []
    for name, run in d["runs"].items():
        at = run["first_step_at_target"]
        parts.append(f"{name}: target at step {at}" if at else f"{name}: target not reached")
    return "; ".join(parts)


def _verify_sync(d: dict) -> str:
    return "; ".join(
        f"{r['model']} ({r['parameters']:,} params): verify {r['verify_s'] * 1000:.1f} ms, "
        f"{_pct(r['verify_over_sync_off'])} of a sync"
        for r in d["results"]
    )


def _serve_overhead(d: dict) -> str:
    text = (
        f"LoRA step through the tinker SDK + server {d['server_step_median_s']:.2f} s, "
        f"backend directly {d['direct_step_median_s']:.2f} s (median); overhead per pair "
        f"{_pct(d['overhead_median_of_pairs'])}; {d['small_forward_requests_per_s']:.1f} small "
        "forward requests/s"
    )
    if d.get("device") == "cuda":  # the one-GPU rows (--shape qwen3-4b): throughput and memory
        text += (
            f"; {d['shape']} on {d['backend']}: {d['server_tokens_per_s']:,.0f} / "
            f"{d['direct_tokens_per_s']:,.0f} tok/s, peak {d['peak_memory_gib']:.1f} GiB"
        )
    return text


def _same_config_backends(d: dict) -> str:
    rewards = ", ".join(f"{b} {r:.3f}" for b, r in d["reward_at_150"].items())
    return (
        f"max reward difference over {d['common_steps']} common steps "
        f"{d['max_reward_diff_common_steps']:.3f}; reward at step 150: {rewards}"
    )


def _megatron_kernels(d: dict) -> str:
    saved = ", ".join(
        f"{k.removesuffix('_ms')} {v:.1f} ms" for k, v in d["per_step_saving_ms"].items()
    )
    return f"saved per training step: {saved}"


def _tiny_multiturn(d: dict) -> str:
    return (
        f"reward/mean {d['reward_mean_first_step']:.3f} at the first step, "
        f"{d['reward_mean_last_50_steps']:.3f} over the last 50; first step at 0.9: "
        f"{d['first_step_reward_mean_at_least_0.9']}"
    )


def _routing_replay_mismatch(d: dict) -> str:
    parts = []
    for r in d["results"]:
        first = r["step_1"]
        parts.append(
            f"{r['engine_dtype']} noise {r['router_noise']} replay {r['routing_replay']}: "
            f"step-1 abs diff {first['train_rollout_logprob_abs_diff']:.2g}"
        )
    return "; ".join(parts)


def _weight_sync_memory(d: dict) -> str:
    parts = []
    for backend, lay in d["layouts"].items():
        peak = max(s["rss_peak_above_mib"] for rank in lay["ranks"] for s in rank["streams"])
        parts.append(
            f"{backend} ({lay['layout']}): sync peak {peak:.0f} MiB above the trainer "
            f"(limit {lay['limit_mib']:.0f} MiB)"
        )
    return "; ".join(parts)


def _metrics_jsonl(rows: list[dict]) -> str:
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    if not rewards:
        raise KeyError("reward/mean")
    tail = rewards[-10:]
    return (
        f"{len(rows)} steps; reward/mean {rewards[0]:.3f} at the first step, "
        f"{sum(tail) / len(tail):.3f} over the last {len(tail)}"
    )


SUMMARISERS: dict[str, Callable[[dict], str]] = {
    "megatron_throughput": _megatron_throughput,
    "backend_throughput": _backend_throughput,
    "logprobs": _logprobs,
    "fused_head": _fused_head,
    "megatron_contract": _megatron_contract,
    "contract_table": _contract_table,
    "cpu_vs_trl": _cpu_vs_trl,
    "rollout_engines": _rollout_engines,
    "weight_transfer": _weight_transfer,
    "moe_experts": _moe_experts,
    "async_steps": _async_steps,
    "dynamic_sampling": _dynamic_sampling,
    "verify_sync": _verify_sync,
    "serve_overhead": _serve_overhead,
    "same_config_backends": _same_config_backends,
    "megatron_kernels": _megatron_kernels,
    "tiny_multiturn": _tiny_multiturn,
    "routing_replay_mismatch": _routing_replay_mismatch,
    "weight_sync_memory": _weight_sync_memory,
}
SCHEMA_DRIFT = (KeyError, TypeError, ValueError, IndexError, AttributeError)


# ---------------------------------------------------------------- one result file


@attrs.frozen
class Row:
    """One result file as the page shows it."""

    benchmark: str
    name: str
    date: str
    hardware: str
    commit: str
    machine: str
    headline: str
    command: str
    command_from_readme: bool


def readme_commands(readme: Path) -> dict[tuple[str, str], str]:
    """(benchmark, file name) -> the command the "Result files" tables of benchmarks/README.md give."""
    if not readme.exists() or "\n## Result files\n" not in readme.read_text():
        return {}
    section = readme.read_text().split("\n## Result files\n", 1)[1]
    commands: dict[tuple[str, str], str] = {}
    benchmark = ""
    for line in section.splitlines():
        if line.startswith("### "):
            benchmark = line[4:].strip()
        elif line.startswith("| `") and benchmark:
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            if len(cells) >= 6:
                command = cells[5].replace("\\|", "|")
                if command.count("`") == 2 and command[0] == command[-1] == "`":
                    command = command[1:-1]
                commands[(benchmark, cells[0].strip("`"))] = command
    return commands


def _load(path: Path) -> dict | list | None:
    """The file's JSON (a list of rows for JSONL), or None for text, images and broken JSON."""
    if path.suffix not in (".json", ".jsonl"):
        return None
    try:
        text = path.read_text()
        if path.suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        logger.warning("%s is not valid JSON: listed with its date and command only", path)
        return None


def _environment(data: object) -> dict:
    """The file's own record of where and how it ran (top level or ``environment``)."""
    if not isinstance(data, dict):
        return {}
    env = data.get("environment")
    return env if isinstance(env, dict) else {}


def _command(data: object) -> str:
    """The command the file records (top-level ``command``, ``environment.command``, ``commands``)."""
    if not isinstance(data, dict):
        return ""
    for value in (data.get("command"), _environment(data).get("command")):
        if isinstance(value, str) and value.strip():
            return value.strip()
    commands = data.get("commands")
    if isinstance(commands, dict) and commands:
        return "; ".join(str(v) for v in commands.values())
    return ""


def _machine(data: object, hardware: str) -> str:
    """The card(s) the file names, or its machine note, else the file name's hardware."""
    env = _environment(data)
    gpus = env.get("gpus") if env else (data.get("gpus") if isinstance(data, dict) else None)
    if isinstance(gpus, list) and gpus:
        return ", ".join(f"{n} x {card}" for card, n in Counter(gpus).items())
    if isinstance(env.get("gpu"), str):
        return f"1 x {env['gpu']}"
    machine = data.get("machine") if isinstance(data, dict) else None
    if isinstance(machine, str) and machine:
        # a note such as "2 CPU cores, shared with other jobs (load ...)": its first clause
        return re.split(r"[(;]", machine, maxsplit=1)[0].strip().rstrip(",")
    return {"cpu": "CPU", "h100": "H100", "h200": "H200"}[hardware]


def _headline(benchmark: str, path: Path, data: object) -> str:
    if data is None:
        kind = {".txt": "a log or profile table", ".png": "a plot"}.get(path.suffix, "unreadable")
        return f"({kind}: see the file)"
    summarise = SUMMARISERS.get(benchmark)
    try:
        if isinstance(data, list):
            return _metrics_jsonl(data)
        if summarise is not None:
            return summarise(data)
    except SCHEMA_DRIFT as error:
        logger.info(
            "%s: no headline (%s %s): listed with date and command", path, type(error), error
        )
    return "(no headline figures this generator reads: see the file)"


def read_row(path: Path, commands: dict[tuple[str, str], str]) -> Row | None:
    """The row of one result file, or None for a file outside the dated layout."""
    match = NAME.match(path.name)
    if match is None:
        logger.warning("%s does not follow the results layout: left off the page", path)
        return None
    benchmark = path.parent.name
    data = _load(path)
    command = _command(data)
    from_readme = not command
    if from_readme:
        command = commands.get((benchmark, path.name), "")
    return Row(
        benchmark=benchmark,
        name=path.name,
        date=match["date"],
        hardware=match["hardware"],
        commit=match["commit"],
        machine=_machine(data, match["hardware"]),
        headline=_headline(benchmark, path, data),
        command=command,
        command_from_readme=from_readme and bool(command),
    )


# ---------------------------------------------------------------- the page

HEADER = f"""# Benchmark results

Generated from every file under `benchmarks/results/` by `docs/gen_benchmarks.py`; do not edit by
hand (a test fails when this page is stale: after adding a result file run `{REGENERATE}`).
One table per benchmark, newest first: the date, the card or machine, the commit measured, the
headline figures read from the file and the command that made it (from the file; "README:"
marks a command taken from the "Result files" tables of `benchmarks/README.md` because the file
records none). What each benchmark measures and how to read its numbers:
[Benchmarks](../benchmarks.md) and `benchmarks/README.md`. Where a published number exists for
the same kind of run it stands beside the table; MFU everywhere uses 989 TFLOP/s per GPU (dense
bf16 H100 / H200).
"""


def _anchor_table(anchors: list[Anchor]) -> list[str]:
    out = ["| published anchor | hardware | figures | source |", "| --- | --- | --- | --- |"]
    for a in anchors:
        out.append(f"| {a.what} | {a.hardware} | {a.figures} | {a.source} |")
    return out


def _row_cells(row: Row) -> str:
    command = _code(row.command) if row.command else "(none recorded)"
    if row.command_from_readme:
        # the README's cell is Markdown already when it mixes code and words
        command = "README: " + (_cell(row.command) if "`" in row.command else command)
    cells = (
        row.date,
        _cell(row.machine),
        f"`{row.commit}`",
        f"`{row.name}`",
        _cell(row.headline),
        command,
    )
    return "| " + " | ".join(cells) + " |"


def render(results: Path = RESULTS) -> str:
    """The whole page, from ``results`` and the README beside it."""
    commands = readme_commands(results.parent / "README.md")
    rows: dict[str, list[Row]] = {}
    for path in sorted(p for p in results.rglob("*") if p.is_file()):
        row = read_row(path, commands)
        if row is not None:
            rows.setdefault(row.benchmark, []).append(row)
    out = [HEADER, "## Published anchors\n", *_anchor_table(list(ANCHORS))]
    for benchmark in sorted(rows):
        out.append(f"\n## {benchmark}\n")
        out.append("| date | card or machine | commit | file | headline | command |")
        out.append("| --- | --- | --- | --- | --- | --- |")
        newest_first = sorted(rows[benchmark], key=lambda r: (r.date, r.name), reverse=True)
        out += [_row_cells(r) for r in newest_first]
        beside = [a for a in ANCHORS if benchmark in a.benchmarks]
        if beside:
            out.append("\nBeside it, the published anchors:\n")
            out += _anchor_table(beside)
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if the page is stale")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    text = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            logger.error("%s is stale: run %s and commit the page", PAGE, REGENERATE)
            return 1
        return 0
    PAGE.write_text(text)
    logger.warning("wrote %s", PAGE.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
