"""``peagle-train``: train a P-EAGLE or DFlash drafter on a feature store (docs/design.md §8, §8b).

Every option is a field of a :class:`~peagle_train.train.config.TrainConfig` group (cli/options.py).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import click

from cli.common import OutputPath, Writes, again_command, config_error, echo_json, handle_errors
from cli.options import config_file_options, config_options
from peagle_train.data.loader import EPOCH_ORDERS
from peagle_train.data.multistore import expand_store_args
from peagle_train.model.attention import ATTENTION_CHOICES
from peagle_train.model.checkpoint import latest_checkpoint
from peagle_train.model.config import LAYER_TYPES
from peagle_train.model.warm_start import INIT_LAYERS
from peagle_data.extract.config import ENGINES
from peagle_train.train.config import STREAM_CONTEXTS, STREAM_POLICIES, TrainConfig
from peagle_train.train.loss import LOSSES
from peagle_train.train.run import run_train
from stores.features.feature_schema import STORAGE_DTYPES

OVERRIDES = {
    "store": {"type": click.Path()},
    "output": {"type": OutputPath(directory=True)},
    "lazy_embedding": {"decls": ["--lazy-embedding/--dense-embedding"]},
    "train_embedding": {"decls": ["--train-embedding/--freeze-embedding"]},
    "attention_backend": {"type": click.Choice(ATTENTION_CHOICES)},
    "drafter_layer": {"type": click.Choice(LAYER_TYPES)},
    "init_from": {"type": click.Path(file_okay=False)},
    "init_layers": {"type": click.Choice(INIT_LAYERS)},
    "loss": {"type": click.Choice(LOSSES)},
    "epoch_policy": {"type": click.Choice(STREAM_POLICIES)},
    "epoch_order": {"type": click.Choice(EPOCH_ORDERS)},
    "extract_from": {"type": click.Path(exists=True, file_okay=False)},
    "engine": {"type": click.Choice(list(ENGINES))},
    "context": {"type": click.Choice(STREAM_CONTEXTS)},
    "storage_dtype": {"type": click.Choice(STORAGE_DTYPES)},
}
"""What the field annotations cannot say: paths, the secondary flag, the choices."""


def kept_checkpoint(program: str, args: list[str], params: dict[str, Any]) -> tuple[str, str]:
    """After Ctrl-C (cli.common.handle_errors): the newest checkpoint and the short resume form
    (``--config OUTPUT/train_config.json --resume``, docs/guide-training.md), or, with no checkpoint yet, the command
    again with ``--force``."""
    output = params.get("output")
    checkpoint = latest_checkpoint(output) if output else None
    config = Path(output or ".") / "train_config.json"
    if checkpoint is None or not config.is_file():
        return (f"no checkpoint in {output} yet (one is saved every --save-every steps and at the end)",
                again_command(program, args, force=bool(output) and Path(output).exists()))
    step = checkpoint.name.rsplit("-", 1)[-1]
    return (f"{checkpoint} (step {step}; the steps after it are lost)",
            shlex.join([*shlex.split(program), "--config", str(config), "--resume"]))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@config_options(TrainConfig, overrides=OVERRIDES)
@config_file_options
@handle_errors(kept=kept_checkpoint, writes=Writes({"store": "--store", "extract_from": "--extract-from", "init_from": "--init-from",
                                                   "verifier": "--verifier"}))
def main(**options) -> None:
    """Train a P-EAGLE (or, with --method dflash, a DFlash) drafter on STORE and write checkpoints to OUTPUT; prints
    a JSON summary."""
    with config_error(click.BadParameter):
        cfg = TrainConfig.from_flat(**{**options, "store": expand_store_args(options["store"])})
    summary = run_train(cfg)
    if summary.get("rank", 0) == 0:  # one summary per run, not one per data-parallel rank
        echo_json(summary)


if __name__ == "__main__":
    main()
