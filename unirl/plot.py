"""`unirl plot RUN_DIR`: reward and loss curves of a run as one PNG (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path

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
    panels = [
        (k, title) for k, title in PANELS if any(isinstance(r.get(k), (int, float)) for r in rows)
    ]
    if not rows or not panels:
        raise UnirlError(f"{metrics_path} holds no steps with reward or loss metrics yet")
    cols = 4 if len(panels) > 6 else len(panels)  # a PPO run's 8 panels in two rows
    rows_n = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4 * cols, 3.2 * rows_n), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, (key, title) in zip(axes.flat, panels):
        points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=".")
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    target = Path(out) if out else run_dir / "curves.png"
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target
