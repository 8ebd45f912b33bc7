"""`unirl plot RUN_DIR`: reward and loss curves of a run as one PNG (matplotlib, optional).

The reward panel draws the evaluation's mean reward (``eval/reward_mean``, the ``eval`` section)
beside the training reward, on the same RL-step axis; a run with evaluations gets a pass@k panel
too (every ``eval/pass@k`` it logged)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from unirl.core.errors import UnirlError
from unirl.core.run.metrics_log import read_metrics

PANELS = (
    ("reward/mean", "reward (mean)"),
    ("loss", "loss"),
    ("kl", "KL to reference"),
    ("entropy", "entropy"),
    ("grad_norm", "grad norm"),
    ("pg_clipfrac", "clip fraction"),
    ("critic/value_loss", "critic value loss"),
    ("critic/explained_variance", "critic explained variance"),
)
# Further lines in the panel of a key: (metric, legend label); the panel's own line is "train".
BESIDE = {"reward/mean": (("eval/reward_mean", "eval (held-out)"),)}
PASS_AT = "eval/pass@"


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def panel_lines(
    rows: Sequence[Mapping[str, Any]],
) -> list[tuple[str, list[tuple[str, str | None]]]]:
    """The panels to draw: (title, [(metric, legend label or None)]) for each metric the rows
    hold, the eval's pass@k panel (k ascending) second when they hold any."""
    logged = {k for r in rows for k, v in r.items() if _number(v)}
    panels: list[tuple[str, list[tuple[str, str | None]]]] = []
    for key, title in PANELS:
        if key not in logged:
            continue
        beside = [(k, label) for k, label in BESIDE.get(key, ()) if k in logged]
        panels.append((title, [(key, "train" if beside else None), *beside]))
    ks = sorted((k for k in logged if k.startswith(PASS_AT)), key=lambda k: int(k[len(PASS_AT) :]))
    if ks:
        pass_panel = ("eval pass@k (held-out)", [(k, k[len("eval/") :]) for k in ks])
        panels.insert(1 if panels else 0, pass_panel)
    return panels


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise UnirlError(f"{metrics_path} does not exist; give the run_dir of a `unirl train` run")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UnirlError("unirl plot needs matplotlib: pip install 'unirl[plot]'") from None
    rows = read_metrics(metrics_path)
    panels = panel_lines(rows)
    if not rows or not panels:
        raise UnirlError(f"{metrics_path} holds no steps with reward or loss metrics yet")
    cols = 4 if len(panels) > 6 else len(panels)  # a PPO run's 8 panels in two rows
    rows_n = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4 * cols, 3.2 * rows_n), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, (title, lines) in zip(axes.flat, panels):
        for key, label in lines:
            points = [(r["step"], r[key]) for r in rows if _number(r.get(key))]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=label)
        if len(lines) > 1:
            ax.legend(fontsize="small")
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    target = Path(out) if out else run_dir / "curves.png"
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target
