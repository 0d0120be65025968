"""``peagle-train``: train a P-EAGLE drafter on a feature store (DESIGN.md §8)."""

from __future__ import annotations

import click

from cli.common import echo_json, handle_errors


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--store", required=True, multiple=True, type=click.Path(),
              help="Feature store written by `peagle-data extract`; repeat it (or give a file listing one store "
                   "per line) to train on several stores of one verifier and layer set.")
@click.option("--output", required=True, type=click.Path(), help="Output directory (checkpoints, metrics, plot).")
@click.option("--verifier", default=None, help="Verifier MODEL (default: the store's verifier).")
@click.option("--max-steps", type=int, default=None, help="Optimizer steps (default: one pass over the blocks).")
@click.option("--num-depths", type=int, default=8, show_default=True, help="K, parallel draft depths.")
@click.option("--max-anchors", type=int, default=None, help="Cap on COD seeds per block (default: none).")
@click.option("--down-sample-ratio", type=float, default=0.7, show_default=True, help="COD keep ratio per depth.")
@click.option("--down-sample-ratio-min", type=float, default=0.2, show_default=True, help="Floor of the keep ratio.")
@click.option("--draft-vocab-size", type=int, default=None,
              help="Draft vocab: the N most frequent supervised tokens (default: the verifier's vocab).")
@click.option("--num-layers", type=int, default=1, show_default=True, help="Drafter decoder layers.")
@click.option("--lr", type=float, default=3e-4, show_default=True, help="Peak learning rate (AdamW).")
@click.option("--warmup-steps", type=int, default=None, help="Warm-up steps (default: 5% of max steps).")
@click.option("--weight-decay", type=float, default=0.0, show_default=True, help="AdamW weight decay.")
@click.option("--grad-clip", type=float, default=1.0, show_default=True, help="Max gradient norm.")
@click.option("--grad-accum", type=int, default=1, show_default=True, help="Blocks per optimizer step and rank.")
@click.option("--save-every", type=int, default=None, help="Steps between checkpoints (default: only at the end).")
@click.option("--save-total-limit", type=int, default=None,
              help="Keep only the newest N checkpoint-N/ directories (each a full copy of the drafter weights "
                   "plus optimizer state); final/ is never removed (default: keep all).")
@click.option("--val-fraction", type=float, default=0.05, show_default=True, help="Blocks held out for validation.")
@click.option("--val-max-blocks", type=int, default=16, show_default=True,
              help="Validation scores at most this many held-out blocks.")
@click.option("--log-every", type=int, default=1, show_default=True, help="Steps between metrics.jsonl lines.")
@click.option("--mask-token-id", type=int, default=None,
              help="Token fed at depth > 0; must never occur as a supervised token in the store (default: an "
                   "unused special or reserved token, see the README).")
@click.option("--loss-chunk-size", type=int, default=2048, show_default=True, help="Elements per logits chunk.")
@click.option("--lazy-embedding/--dense-embedding", default=True, show_default=True,
              help="AdamW on the embedding rows a step touched (fast) or on the whole table.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of split, shuffles, COD and init.")
@click.option("--attention-backend", type=click.Choice(["auto", "sdpa", "flex"]), default="auto",
              show_default=True,
              help="Drafter attention: flex (flex_attention block masks, CUDA only), sdpa (dense mask), "
                   "auto (flex on CUDA, sdpa otherwise).")
@click.option("--report-to", default=None,
              help="Also log the metrics.jsonl rows to accelerate trackers: tensorboard, wandb (comma-separated) "
                   "or all installed; files under OUTPUT/trackers. wandb runs offline with WANDB_MODE=offline.")
@click.option("--resume", is_flag=True, help="Continue from the latest checkpoint in --output.")
@click.option("--allow-incomplete", is_flag=True, help="Train on the done blocks of an unfinished store.")
@click.option("--force", is_flag=True, help="Delete an existing --output first.")
@handle_errors
def main(**options) -> None:
    """Train a P-EAGLE drafter on STORE and write checkpoints to OUTPUT; prints a JSON summary."""
    from peagle_train.multistore import expand_store_args
    from peagle_train.train import TrainConfig, run_train

    options["store"] = expand_store_args(options["store"])
    try:
        cfg = TrainConfig(**options)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    summary = run_train(cfg)
    if summary.get("rank", 0) == 0:  # one summary per run, not one per data-parallel rank
        echo_json(summary)


if __name__ == "__main__":
    main()
