"""Time one training step at the demo's sizes, in wall and process-CPU seconds.

SmolLM2-135M drafter (H 576, 1 layer, vocab 49152), T = 512 tokens in two segments, 70% supervised,
K = 4, draft vocab 4096: :meth:`peagle_train.train.trainer.Trainer.train_step` (COD sampling, forward +
loss, backward, clipping + LazyRowAdamW with lazy embedding rows), and COD sampling alone.

Usage (from the repository root, inside .venv):
    python bench/bench_train_step.py --steps 4
"""

from __future__ import annotations

import argparse
import time

import torch

import peagle_train.train.trainer as trainer_module
from peagle_train.data.loader import Block
from peagle_train.model.config import DrafterConfig
from peagle_train.model.drafter import PEagleDrafter
from peagle_train.train.config import TrainConfig
from peagle_train.train.step import sample_elements
from peagle_train.train.trainer import Trainer
from peagle_train.train.kinds import drafter_kind

T, K, D, H, V, L = 512, 4, 4096, 576, 49152, 3


def setup() -> tuple[Trainer, Block]:
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=H, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                        head_dim=64, vocab_size=V, draft_vocab_size=D, aux_layer_ids=[2, 15, 27], num_depths=K)
    model = PEagleDrafter(cfg)
    model.init_from_verifier(0.02 * torch.randn(V, H), 0.02 * torch.randn(V, H), torch.zeros(D, dtype=torch.long))
    cu = torch.tensor([0, 200, T])
    block = Block(torch.randint(0, V, (T,)), (torch.rand(T) < 0.7).long(),
                  torch.cat([torch.arange(200), torch.arange(T - 200)]), cu,
                  torch.randn(T, L * H).bfloat16(), (3 * torch.randn(T, H)).bfloat16(), block_id=0)
    train_cfg = TrainConfig.from_flat(store="-", output="-", lr=1e-4, num_depths=K, loss_chunk_size=2048)
    return Trainer(train_cfg, model, 0.05 * torch.randn(D, H), kind=drafter_kind(train_cfg.model.method),
                   max_steps=10 ** 9, warmup=0), block


def _timed(fn) -> tuple[float, float, object]:
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - w, time.process_time() - c, out


def step(trainer: Trainer, block: Block, seed: int) -> dict:
    """COD sampling alone, then one :meth:`Trainer.train_step` on ``block`` (COD seed ``seed``)."""
    gen = lambda: torch.Generator().manual_seed(seed)  # noqa: E731
    cod = _timed(lambda: sample_elements(block, trainer.cfg, gen()))
    full = _timed(lambda: trainer.train_step([(block, gen())]))
    return {"cod": cod[:2], "step": full[:2], "loss": full[2]["loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    trainer, block = setup()
    step(trainer, block, seed=100)  # warm-up
    runs = [step(trainer, block, seed=i) for i in range(args.steps)]
    print(f"{trainer_module.__file__}  threads {torch.get_num_threads()}  loss {runs[0]['loss']:.4f}")
    for phase in ("cod", "step"):
        wall = sum(r[phase][0] for r in runs) / len(runs)
        cpu = sum(r[phase][1] for r in runs) / len(runs)
        print(f"  {phase:13s} wall {wall:.3f} s  cpu {cpu:.3f} s")


if __name__ == "__main__":
    main()
