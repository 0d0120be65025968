"""Training metrics: ``metrics.jsonl``, the accelerate trackers fed the same rows, and the plot.

``metrics.jsonl`` holds one JSON object per line: a training step (``"split": "train"``: step, loss
(the pooled objective), acc per depth, tokens/s, lr, the block ids read, grad norm, ...) or a
validation (``"split": "val"``: ``val_loss``, ``val_acc``, ``blocks``). :class:`MetricsLog` appends rows and sends
them to the trackers of ``--report-to`` (TensorBoard event files under ``trackers/peagle/``, wandb
runs under ``trackers/wandb/``) as :func:`tracker_values`; :func:`plot_metrics` draws
``training.png`` from the file.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import torch

from stores.errors import InputError, MissingDependencyError
from stores.files import strict_json
from stores.staging import write_text_atomic

__all__ = ["TRACKERS", "TRACKER_PROJECT", "MetricsLog", "parse_report_to", "resolve_trackers", "tracker_values",
           "plot_metrics", "rolling_mean", "smoothing_window", "read_metrics", "write_metrics", "pooled_accuracy"]

#: accelerate trackers ``--report-to`` accepts: name -> (module that must import, pip requirement)
TRACKERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard>=2.14"),
    "wandb": ("wandb", "wandb"),
}
#: project name given to ``Accelerator.init_trackers`` (TensorBoard subdirectory, wandb project)
TRACKER_PROJECT = "peagle"


def parse_report_to(report_to: str | None) -> list[str]:
    """The tracker names of ``--report-to`` (comma-separated, ``all`` for every installed one).

    Returns the names in the given order without duplicates (``all`` among them as given); ``[]`` for None.

    Raises:
        InputError: an empty list or a name that is neither a key of :data:`TRACKERS` nor ``all``.
    """
    if report_to is None:
        return []
    names = list(dict.fromkeys(n.strip().lower() for n in report_to.split(",")))
    choices = ", ".join([*TRACKERS, "all"])
    if not names or any(not n for n in names):
        raise InputError(f"expected comma-separated tracker names ({choices}), got {report_to!r}",
                         field="--report-to")
    unknown = [n for n in names if n not in TRACKERS and n != "all"]
    if unknown:
        raise InputError(f"unknown tracker {', '.join(map(repr, unknown))}; choose from {choices} "
                         "(comma-separated)", field="--report-to")
    return names


def resolve_trackers(report_to: str | None) -> list[str]:
    """The tracker names to pass to ``Accelerator(log_with=...)``, each checked to be installed.

    ``all`` means every tracker of :data:`TRACKERS` whose package is installed (at least one).

    Raises:
        InputError: see :func:`parse_report_to`.
        MissingDependencyError: a named tracker (or, for ``all``, every tracker) is not installed;
            the message names the pip package.
    """
    names = parse_report_to(report_to)
    if not names:
        return []
    installed = [n for n in TRACKERS if importlib.util.find_spec(TRACKERS[n][0]) is not None]
    if names == ["all"]:
        if not installed:
            raise MissingDependencyError(
                "--report-to all found no tracker installed; install one: "
                + " or ".join(f"pip install '{req}'" for _, req in TRACKERS.values()))
        return installed
    missing = [n for n in names if n != "all" and n not in installed]  # named explicitly: must be there
    if missing:
        raise MissingDependencyError(
            f"--report-to {','.join(missing)} needs "
            + ", ".join(f"the {TRACKERS[n][0]!r} package" for n in missing)
            + ": pip install " + " ".join(f"'{TRACKERS[n][1]}'" for n in missing)
            + (" (or pip install -e '.[trackers]')" if missing == ["tensorboard"] else ""))
    return installed if "all" in names else names


def tracker_values(row: dict) -> dict[str, float]:
    """A ``metrics.jsonl`` row as tracker scalars: ``"<split>/<key>"``, lists as ``<key>_d<i>``.

    A validation key loses its ``val_`` prefix (``val_loss`` -> ``val/loss``, ``val_acc`` ->
    ``val/acc_d0``...); ``split``, ``step`` and ``blocks`` (ids, not a metric) are left out, and so
    is a None (a depth without elements this step).
    """
    split = row.get("split", "train")
    out: dict[str, float] = {}
    for key, value in row.items():
        if key in ("split", "step", "blocks"):
            continue
        name = f"{split}/{key.removeprefix(split + '_')}"
        items = [(f"_d{i}", x) for i, x in enumerate(value)] if isinstance(value, list) else [("", value)]
        for suffix, v in items:
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[name + suffix] = v
    return out


def write_metrics(path: Path, rows: list[dict]) -> None:
    """Append ``rows`` to ``path``, one JSON object per line.

    Raises:
        NonFiniteError: a row holds a NaN or infinite value (strict JSON); nothing is written.
    """
    lines = [strict_json(r, f"{path}: the row of step {r.get('step')}") + "\n" for r in rows]
    with path.open("a") as f:
        f.writelines(lines)


def read_metrics(path: Path) -> list[dict]:
    """The rows of ``metrics.jsonl`` (``[]`` when it does not exist)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def pooled_accuracy(sums: list[dict[str, torch.Tensor]]) -> list[float | None]:
    """Per-depth accuracy pooled over steps: ``Σ correct / Σ counts`` of ``sums`` (each ``correct
    [K]``, ``counts [K]``), weighted by elements, not one vote per step; None for a depth without
    weight, ``[]`` for no step."""
    if not sums:
        return []
    correct = torch.stack([s["correct"] for s in sums]).sum(0)
    counts = torch.stack([s["counts"] for s in sums]).sum(0)
    return [(float(c) / float(n)) if n > 0 else None for c, n in zip(correct, counts)]


class MetricsLog:
    """``metrics.jsonl`` of one run and the trackers fed its rows (main process only writes).

    Args:
        path: the ``metrics.jsonl`` file.
        accelerator: the run's ``Accelerator`` (its trackers), or None for a file-only log.
        trackers: tracker names from :func:`resolve_trackers` (``[]``: none).
    """

    def __init__(self, path: Path, accelerator=None, trackers: list[str] | None = None):
        self.path, self.accelerator, self.trackers = Path(path), accelerator, list(trackers or [])

    def record(self, row: dict) -> None:
        """Append ``row`` to metrics.jsonl and send it to the trackers."""
        write_metrics(self.path, [row])
        values = tracker_values(row) if self.trackers else {}
        if values:
            self.accelerator.log(values, step=row["step"])

    def start(self, hparams: dict[str, Any], step: int, resume: bool) -> None:
        """Start the trackers (no-op without any) with ``hparams`` at ``step`` (the resumed step).

        With ``resume`` TensorBoard purges the events a killed run wrote after that step (with
        ``--resume`` and no checkpoint yet, all of them: the run starts again at step 1).
        """
        if not self.trackers:
            return
        out = self.path.parent
        (out / "trackers").mkdir(exist_ok=True)  # wandb falls back to a temp dir when its dir is missing
        self.accelerator.init_trackers(TRACKER_PROJECT, config=hparams, init_kwargs={
            "tensorboard": {"purge_step": step + 1} if resume else {},
            "wandb": {"name": out.name, "dir": str(out / "trackers")}})

    def finish_trackers(self) -> None:
        """Error path: flush and close the trackers (``end_training`` would also tear down the process
        group, which the other ranks of a failing run may still be blocked in)."""
        for tracker in self.accelerator.trackers if self.trackers else []:
            try:
                tracker.finish()
            except Exception:  # the original error matters more
                pass

    def truncate(self, last_step: int) -> int:
        """Drop the rows after ``last_step`` (a resumed run computes those steps again), so the file keeps one
        row a step; the file is replaced atomically (a kill leaves the old file or the new one, never half).

        Returns:
            The number of rows removed (0 when there is no file).
        """
        rows = read_metrics(self.path)
        kept = [r for r in rows if r.get("step", 0) <= last_step]
        if len(kept) < len(rows):
            write_text_atomic(self.path, "".join(strict_json(r, str(self.path)) + "\n" for r in kept))
        return len(rows) - len(kept)

    def last_row(self, split: str) -> dict | None:
        """The last row of ``split`` (None when there is none)."""
        return next((r for r in reversed(read_metrics(self.path)) if r.get("split") == split), None)

    def has_row(self, split: str, step: int) -> bool:
        """Whether the file already holds a row of ``split`` at ``step``."""
        return any(r.get("split") == split and r.get("step") == step for r in read_metrics(self.path))


def smoothing_window(n_points: int) -> int:
    """The rolling-mean window of training.png: a twentieth of the logged steps (at least 1)."""
    return max(1, n_points // 20)


def rolling_mean(values: list[float | None], window: int) -> list[float]:
    """Trailing mean of the last ``window`` values at each point (fewer at the start), skipping None/NaN;
    NaN where the window holds none."""
    out = []
    for i in range(len(values)):
        seen = [v for v in values[max(0, i - window + 1):i + 1] if v is not None and v == v]
        out.append(sum(seen) / len(seen) if seen else float("nan"))
    return out


def plot_metrics(metrics_path: Path, png_path: Path) -> Path | None:
    """Write a PNG of training loss and per-depth accuracy against steps (matplotlib, Agg); None
    when ``metrics_path`` has no training row.

    Each training curve is drawn faint step by step and as its trailing mean over
    :func:`smoothing_window` logged steps (one step's loss is one block's: noise); the validation rows
    (``--val-every`` and the end) are points joined by a line, the accuracy's in each depth's colour. The
    accuracy panel has two legends: the colours (one per depth) and the line styles (train each step, train
    smoothed, validation), which hold for every depth.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    rows = read_metrics(metrics_path)
    train = [r for r in rows if r.get("split") == "train"]
    if not train:
        return None
    steps = [r["step"] for r in train]
    window = smoothing_window(len(train))
    smoothed = f"mean of {window} logged steps" if window > 1 else "each step"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    losses = [r["loss"] for r in train]
    if window > 1:
        ax1.plot(steps, losses, color="C0", alpha=0.25, linewidth=0.8, label="train, each step")
    ax1.plot(steps, rolling_mean(losses, window), color="C0", label=f"train, {smoothed}")
    val = [r for r in rows if r.get("split") == "val"]
    if val:
        ax1.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", color="C1",
                 label=f"validation ({len(val)} points)")
    ax1.set(xlabel="step", ylabel="KL loss", title="loss")
    ax1.legend(fontsize=8)
    for d in range(len(train[0]["acc"])):
        ys = [r["acc"][d] if r["acc"][d] is not None else float("nan") for r in train]
        if window > 1:
            ax2.plot(steps, ys, color=f"C{d}", alpha=0.2, linewidth=0.8)
        ax2.plot(steps, rolling_mean(ys, window), color=f"C{d}", label=f"depth {d}")
        vals = [(r["step"], r["val_acc"][d]) for r in val if d < len(r.get("val_acc") or []) and r["val_acc"][d] is not None]
        if vals:
            ax2.plot(*zip(*vals), "o--", color=f"C{d}", markersize=4, linewidth=0.8)
    top = max([a for r in train for a in r["acc"] if a is not None]
              + [a for r in val for a in (r.get("val_acc") or []) if a is not None] or [0.0])
    # the axis follows the data (small accuracies early in training stay readable), never past 1
    ax2.set(xlabel="step", ylabel="weighted argmax agreement", title=f"per-depth accuracy (train: {smoothed})",
            ylim=(0, min(1.0, max(0.02, 1.15 * top))))
    # two legends: the colour is the depth, the line style what the line is (every depth's validation alike)
    depths = ax2.legend(fontsize=7, loc="upper left", title="colour", title_fontsize=7)
    ax2.add_artist(depths)
    styles = [Line2D([], [], color="0.3", alpha=0.25, linewidth=0.8, label="train, each step")] if window > 1 else []
    styles.append(Line2D([], [], color="0.3", label=f"train, {smoothed}"))
    if val:
        styles.append(Line2D([], [], color="0.3", marker="o", linestyle="--", markersize=4, linewidth=0.8,
                             label=f"validation ({len(val)} points)"))
    ax2.legend(handles=styles, fontsize=7, loc="upper right", title="line (every depth)", title_fontsize=7)
    for ax in (ax1, ax2):  # steps are integers: no 0.5 ticks on a short run
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
