"""The `unirl` command.

    unirl check CONFIG [--set key.path=value ...] [--world-size N] [--json]
    unirl check --explain KEY
    unirl train CONFIG [--set key.path=value ...] [--rollouts FILE] [--resume | --overwrite]
    unirl plot RUN_DIR [--out FILE.png]
    unirl convert SOURCE OUT [--tp N --pp N --vpp N --ep N --etp N] [--dtype fp32|bf16]
    unirl serve SERVE_CONFIG

`check` validates a config and explains what a run would do: the resolved config, the parallel
layout, the microbatch plan, the old-log-prob decision, the LM head and where the optimizer
state lives, with their reasons. `train` runs the RL
job (under torchrun / the deepspeed launcher for several processes). `plot` draws the reward and
loss curves of a run. `convert` turns a Hugging Face folder into a
Megatron weights folder for a parallel layout, and such a folder or any run checkpoint into a
Hugging Face folder (`unirl.convert`; under torchrun for layouts of several ranks). `serve`
runs the Tinker training API (`unirl.serve`). Every expected failure (a bad config or bad rollout data, a directory
that holds another run or cannot be written, a full disk, a hung rank, a run whose numbers stopped
being finite) exits with status 2 and one line ``unirl: error: ...`` naming the key, file or
sample and the fix; ``--debug`` adds the traceback. Any other exception is a bug in unirl and
shows its traceback.
"""

from __future__ import annotations

import argparse
import copy
import errno
import json
import logging
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import yaml

from unirl import __version__
from unirl.core.errors import StuckCollectiveError, UnirlError
from unirl.cpu_threads import apply_cpu_thread_defaults
from unirl.log_setup import apply_log_level, install_handler

if TYPE_CHECKING:
    from unirl.core.config.run_config import UnirlConfig

# torch is imported inside the commands, after `apply_cpu_thread_defaults` has set OpenMP's
# environment (read once, when torch loads its OpenMP runtime).

logger = logging.getLogger("unirl")


def _plan_summary(cfg: UnirlConfig) -> dict[str, Any]:
    b, lay = cfg.batch, cfg.layout
    summary: dict[str, Any] = {
        "rollout_samples": lay.rollout_samples,
        "optimizer_steps_per_rollout": lay.optimizer_steps_per_rollout,
        "epochs_per_rollout": b.epochs_per_rollout,
        "samples_per_optimizer_step": b.samples_per_optimizer_step,
        "samples_per_rank_per_step": lay.samples_per_rank_per_step,
    }
    if lay.microbatches_per_step is not None:
        summary["micro_batch_size"] = b.micro_batch_size
        summary["microbatches_per_step_per_rank"] = lay.microbatches_per_step
    else:
        summary["max_tokens_per_microbatch"] = b.max_tokens_per_microbatch
        summary["microbatches_per_step_per_rank"] = (
            "decided per rollout from the sample lengths (same count on every data-parallel rank)"
        )
    return summary


def _rollout_summary(cfg: UnirlConfig) -> dict[str, Any]:
    """The source and what its plug-in says about it (`SourcePlugin.describe`)."""
    from unirl.core.protocols.source_plugin import SOURCES
    from unirl.rollouts.check import rank0_waits_note

    source = cfg.rollout.source
    return {
        "source": source,
        **SOURCES.get(source).describe(cfg),
        "verify_sync": _verify_note(cfg),
        "rank0_waits": rank0_waits_note(cfg),
    }


def _verify_note(cfg: UnirlConfig) -> str:
    """What ``rollout.verify_sync`` does for this source (unirl/core/weights/fingerprint.py)."""
    from unirl.core.protocols.source_plugin import weight_receivers

    if weight_receivers(cfg) == "none":
        return "no weight sync: the source receives no weights"
    if not cfg.rollout.verify_sync:
        return "off (rollout.verify_sync: false): a sync that lands partly goes unnoticed"
    return (
        "on: after every sync the receiver fingerprints the weights it holds per layer "
        "(float64 count, sum, sum of squares, max |x|) and they must match what the trainer "
        "sent, else the run stops naming the layer and step (time/verify_s)"
    )


def check_report(cfg: UnirlConfig) -> dict[str, Any]:
    from unirl.backends.cudnn_attention import plan_note
    from unirl.backends.lora_summary import lora_summary
    from unirl.core.config.derived import head_path
    from unirl.core.config.optimizer_offload import choose_optimizer_offload
    from unirl.core.config.recompute_plan import recompute_note
    from unirl.core.critic import critic_summary
    from unirl.core.mismatch import mismatch_note
    from unirl.core.old_logprobs import (
        configured_staleness,
        decide_old_logprobs,
        logprob_roles,
        uncorrected_staleness,
    )
    from unirl.rollouts.shaping.settings import shaping_summary

    staleness = configured_staleness(cfg)
    decision = decide_old_logprobs(cfg, staleness=staleness)
    head = head_path(cfg)
    offload = choose_optimizer_offload(cfg)
    lay, p = cfg.layout, cfg.parallel
    return {
        "config": cfg.to_dict(),
        "layout": {
            "backend": cfg.backend,
            "world_size": lay.world_size,
            "dp": lay.dp,
            "tp": p.tp,
            "pp": p.pp,
            "vpp": p.vpp,
            "cp": p.cp,
            "zero_stage": p.zero_stage,
        },
        "plan": _plan_summary(cfg),
        "rollout": _rollout_summary(cfg),
        "shaping": shaping_summary(cfg),
        "old_logprobs": decision.to_dict()
        | {
            "explanation": decision.explain(),
            "mismatch": mismatch_note(cfg, decision.source),
            "roles": logprob_roles(cfg, decision),
            "staleness_warning": uncorrected_staleness(cfg, staleness),
        },
        "head": {"loss_in_head": head.loss_in_head, "reason": head.reason},
        "attention": plan_note(cfg.model.max_seq_len, cfg.model.dtype, cfg.parallel.cp),
        "recompute": recompute_note(cfg),
        "optimizer_state": {"offload": offload.offload, "reason": offload.reason},
        "critic": critic_summary(cfg),
        "lora": lora_summary(cfg),
    }


def _print_report(report: dict[str, Any]) -> None:
    """The decisions first (what the run will do, and why), then the resolved config with the
    keys the user set marked."""
    out = sys.stdout
    lay = report["layout"]
    out.write("# layout\n")
    out.write(
        f"backend={lay['backend']} world_size={lay['world_size']} dp={lay['dp']} tp={lay['tp']} "
        f"pp={lay['pp']} vpp={lay['vpp']} cp={lay['cp']} zero_stage={lay['zero_stage']}\n"
    )
    out.write("\n# old-log-prob decision\n")
    out.write(report["old_logprobs"]["explanation"] + "\n")
    out.write(report["old_logprobs"]["mismatch"] + "\n")
    out.write("\n# log-prob roles\n")
    for role, origin in report["old_logprobs"]["roles"].items():
        out.write(f"{role}: {origin}\n")
    if report["old_logprobs"]["staleness_warning"]:
        out.write("WARNING: " + report["old_logprobs"]["staleness_warning"] + "\n")
    out.write("\n# LM head and loss\n" + report["head"]["reason"] + "\n")
    out.write("\n# attention\n" + report["attention"] + "\n")
    out.write("\n# activation recompute\n" + report["recompute"] + "\n")
    out.write("\n# optimizer state\n" + report["optimizer_state"]["reason"] + "\n")
    out.write("\n# critic\n" + report["critic"] + "\n")
    if report["lora"]:
        out.write("\n# LoRA adapter (model.lora)\n" + "\n".join(report["lora"]) + "\n")
    for title, key in (
        ("microbatch plan", "plan"),
        ("rollouts", "rollout"),
        ("rollout shaping (DAPO)", "shaping"),
    ):
        out.write(f"\n# {title}\n")
        for name, value in report[key].items():
            out.write(f"{name}: {value}\n")
    out.write("\n# resolved config (keys you set: # set; every other value is the default)\n")
    out.write("\n".join(_config_lines(report["config"], set(report["set_keys"]))) + "\n")


def _set_keys(data: Any, prefix: str = "") -> list[str]:
    """The dotted keys the user's file and ``--set`` gave a value (every leaf of a mapping they
    gave, such as model.hf_config's)."""
    keys = []
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        keys += _set_keys(value, path) if isinstance(value, dict) and value else [path]
    return keys


def _config_lines(config: dict[str, Any], set_keys: set[str], prefix: str = "") -> list[str]:
    """``config`` as YAML, a ``# set`` comment on every key the user set (or inside one)."""
    lines = []
    pad = "  " * (len(prefix.split(".")) if prefix else 0)
    for key, value in config.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        mark = "  # set" if path in set_keys else ""
        if isinstance(value, dict) and value and not mark:
            lines.append(f"{pad}{key}:")
            lines += _config_lines(value, set_keys, path)
            continue
        text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
        text = text.removesuffix("\n...").removesuffix("...").strip()
        lines.append(f"{pad}{key}: {text}{mark}")
    return lines


def _cmd_check(args: argparse.Namespace) -> int:
    from unirl.core.config.paths import check_local_paths
    from unirl.core.config.run_config import config_from_dict, load_config_data
    from unirl.rollouts.check import check_rollout_config

    if args.explain is not None:
        from unirl.config_reference import explain

        sys.stdout.write(explain(args.explain) + "\n")
        return 0
    if args.config is None:
        from unirl.core.errors import ConfigError

        raise ConfigError("unirl check needs a CONFIG file (or --explain KEY for one key's entry)")
    data = load_config_data(args.config, args.set)
    if "base_models" in data:  # a `unirl serve` config (docs/guides/serve.md)
        from unirl.serve.describe import check_serve

        return check_serve(data, as_json=args.json)
    cfg = config_from_dict(copy.deepcopy(data), world_size=args.world_size)
    apply_log_level(cfg.logging.level)
    check_local_paths(cfg)
    check_rollout_config(cfg)
    report = check_report(cfg) | {"set_keys": _set_keys(data)}
    if args.json:
        json.dump(report, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        _print_report(report)
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from unirl.core.config.run_config import load_config
    from unirl.train import train, with_rollout_file

    cfg = load_config(args.config, args.set)
    if args.rollouts:
        cfg = with_rollout_file(cfg, args.rollouts)
    summary = train(cfg, resume=args.resume, overwrite=args.overwrite)
    if not summary.reporting:
        return 0
    reward = summary.last_metrics.get("reward/mean")
    logger.info(
        "done: %d RL steps in %s (last reward mean %s)%s",
        summary.steps_done,
        summary.run_dir,
        "n/a" if reward is None else f"{reward:.3f}",
        f"; Hugging Face export in {summary.hf_export}" if summary.hf_export else "",
    )
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from unirl.plot import plot_run

    out = plot_run(args.run_dir, args.out)
    sys.stdout.write(f"{out}\n")
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from unirl.convert import LAYOUT_FLAGS, convert

    layout = {k: getattr(args, k) for k in LAYOUT_FLAGS}
    out = convert(
        args.source,
        args.out,
        layout,
        args.dtype,
        trust_code=args.trust_checkpoint_code,
        adapter=args.merge_adapter,
        merged=args.merged,
    )
    if int(os.environ.get("RANK", "0")) == 0:
        sys.stdout.write(f"{out}\n")
    return 0


_EXAMPLES = """examples:
  unirl train examples/tiny_grpo.yaml                       # GRPO on the CPU, one process
  unirl train examples/tiny_grpo.yaml --set backend=fsdp2   # the same job on another backend
  unirl check examples/tiny_grpo.yaml --world-size 4        # the layout, plan and decisions
  unirl check --explain algorithm.clip_high                 # one config key: default, meaning
  unirl train CONFIG --resume                               # continue from the newest checkpoint
  torchrun --nproc_per_node 2 -m unirl.cli train examples/qwen2_megatron_tp2.yaml
  unirl plot runs/tiny_grpo                                 # reward and loss curves
  unirl convert runs/x/checkpoints/step_40 ./hf-out         # a checkpoint -> Hugging Face
  unirl convert BASE_HF ./merged --merge-adapter runs/x/adapter  # LoRA adapter merged in

every key: docs/reference/config.md; errors and their fixes: docs/troubleshooting.md
"""


def _add_set(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key, e.g. --set batch.micro_batch_size=2",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="unirl",
        description=__doc__.split("\n\n")[0],
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"unirl {__version__}")
    # the deepspeed launcher passes --local_rank=N before the command; the backend reads the
    # LOCAL_RANK environment variable instead
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an expected error too"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="validate a config and explain its decisions")
    check.add_argument("config", nargs="?", help="YAML config file")
    check.add_argument(
        "--explain",
        metavar="KEY",
        default=None,
        help="print one config key's reference entry (type, default, allowed values, meaning), "
        "e.g. --explain algorithm.clip_high; needs no CONFIG",
    )
    _add_set(check)
    check.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="number of processes to plan for (default: WORLD_SIZE or 1)",
    )
    check.add_argument("--json", action="store_true", help="print one JSON object")
    check.set_defaults(func=_cmd_check)

    train = sub.add_parser("train", help="run RL training")
    train.add_argument("config", help="YAML config file")
    _add_set(train)
    train.add_argument("--rollouts", metavar="FILE", help="train on rollouts from a JSONL file")
    train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="delete a previous run in logging.run_dir (metrics, checkpoints, export) first",
    )
    train.set_defaults(func=_cmd_train)

    plot = sub.add_parser("plot", help="plot reward and loss curves of a run (needs matplotlib)")
    plot.add_argument("run_dir", help="a run directory holding metrics.jsonl")
    plot.add_argument("--out", default=None, help="PNG path (default RUN_DIR/curves.png)")
    plot.set_defaults(func=_cmd_plot)

    _add_convert_parser(sub)
    serve = sub.add_parser("serve", help="serve the Tinker training API (needs the serve extra)")
    serve.add_argument("config", help="the server's YAML config (docs/guides/serve.md)")
    serve.set_defaults(func=_cmd_serve)
    return parser


def _cmd_serve(args: argparse.Namespace) -> int:
    from unirl.serve.config import load_serve_config
    from unirl.serve.server import serve

    serve(load_serve_config(args.config))
    return 0


def _add_convert_parser(sub: Any) -> None:
    """`unirl convert`'s arguments."""
    conv = sub.add_parser(
        "convert",
        help="Hugging Face folder -> Megatron weights for a layout; Megatron weights or a run "
        "checkpoint -> Hugging Face folder",
    )
    conv.add_argument(
        "source", help="a Hugging Face folder, a Megatron weights folder or checkpoints/step_N"
    )
    conv.add_argument("out", help="the new folder to write (must not exist)")
    for flag, what in (
        ("tp", "tensor parallel"),
        ("pp", "pipeline stages"),
        ("vpp", "virtual stages per pipeline stage"),
        ("ep", "expert parallel"),
        ("etp", "expert tensor parallel (default: tp)"),
    ):
        conv.add_argument(f"--{flag}", type=int, default=None, help=f"{what} (Megatron target)")
    conv.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default=None,
        help="dtype of the Megatron weights (default: the Hugging Face folder's)",
    )
    conv.add_argument(
        "--trust-checkpoint-code",
        action="store_true",
        help="a checkpoint's recorded config names code to import (a custom loss, reward, "
        "hook): build it anyway (only for checkpoints whose origin you trust)",
    )
    conv.add_argument(
        "--merge-adapter",
        metavar="ADAPTER",
        default=None,
        help="a PEFT adapter folder (a LoRA run's adapter/) to merge into the Hugging Face "
        "SOURCE; OUT is then the full merged model",
    )
    conv.add_argument(
        "--merged",
        action="store_true",
        help="a LoRA run's checkpoint as the full merged model (default: its adapter)",
    )
    conv.set_defaults(func=_cmd_convert)


def main(argv: Sequence[str] | None = None) -> int:
    install_handler()  # log lines go through tqdm: they never break a progress bar
    apply_cpu_thread_defaults()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:
        # the reader went away (`unirl check --json | head`): not a disk error; end quietly, as
        # a Unix tool killed by SIGPIPE does, and keep the exit's own flush from raising again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except (UnirlError, OSError) as exc:
        if args.debug:
            traceback.print_exc()
        sys.stderr.write(f"unirl: error: {_one_line(exc)}\n")
        if isinstance(exc, StuckCollectiveError):
            from unirl.backends.watchdog import exit_now

            exit_now(2)  # a process group with a pending collective cannot be torn down
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("unirl: interrupted\n")
        return 130


def _one_line(exc: BaseException) -> str:
    """The message of an expected error. An OSError outside the paths unirl checks up front
    (a disk that fills mid-run, a file removed under it) names the file and the fix."""
    if isinstance(exc, UnirlError):
        return str(exc)
    assert isinstance(exc, OSError)
    where = f" ({exc.filename})" if exc.filename else ""
    fix = _OS_FIXES.get(exc.errno or 0, "check the path and run again (--resume continues a run)")
    return f"{exc.strerror or exc}{where}; {fix}"


_OS_FIXES = {
    errno.ENOSPC: "the disk is full: free space and run again with --resume",
    errno.EDQUOT: "the disk quota is used up: free space and run again with --resume",
    errno.EFBIG: "a file grew past the allowed size: raise the limit and run again with --resume",
    errno.EACCES: "make the path writable (or choose another) and run again",
    errno.EROFS: "the filesystem is read-only: choose another directory",
}


if __name__ == "__main__":
    sys.exit(main())
