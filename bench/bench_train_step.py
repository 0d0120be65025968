"""Time one training step at the demo's sizes, per phase, in wall and process-CPU seconds.

SmolLM2-135M drafter (H 576, 1 layer, vocab 49152), T = 512 tokens in two segments, 70% supervised,
K = 4, draft vocab 4096: COD sampling, forward + loss, backward, clipping + optimizer. Also runs
against an older checkout (``git worktree add /tmp/base <commit>``; ``PYTHONPATH=/tmp/base``):
without ``build_optimizer`` there it uses dense AdamW, as that code did.

Usage (from the repository root, inside .venv):
    python bench/bench_train_step.py --steps 4
"""

from __future__ import annotations

import argparse
import time

import torch

import peagle_train.train as train
from peagle_train.cod import sample_cod_elements
from peagle_train.data import Block
from peagle_train.model import DrafterConfig, PEagleDrafter

T, K, D, H, V, L = 512, 4, 4096, 576, 49152, 3


def setup():
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=H, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                        head_dim=64, vocab_size=V, draft_vocab_size=D, aux_layer_ids=[2, 15, 27], num_depths=K)
    model = PEagleDrafter(cfg)
    model.init_from_verifier(0.02 * torch.randn(V, H), 0.02 * torch.randn(V, H), torch.zeros(D, dtype=torch.long))
    cu = torch.tensor([0, 200, T])
    block = Block(0, torch.randint(0, V, (T,)), (torch.rand(T) < 0.7).long(),
                  torch.cat([torch.arange(200), torch.arange(T - 200)]), cu,
                  torch.randn(T, L * H).bfloat16(), (3 * torch.randn(T, H)).bfloat16())
    params = [p for p in model.parameters() if p.requires_grad]
    if hasattr(train, "build_optimizer"):
        from peagle_train.optim import clip_grad_norm

        model.embed_tokens.sparse = True  # as run_train does in one process
        opt = train.build_optimizer(model, train.TrainConfig(store="-", output="-", lr=1e-4))
    else:  # the code before the speed-up
        clip_grad_norm = torch.nn.utils.clip_grad_norm_
        opt = torch.optim.AdamW(params, lr=1e-4)
    return model, 0.05 * torch.randn(D, H), block, params, opt, clip_grad_norm


def step(model, vhead, block, params, opt, clip, seed: int) -> dict:
    out, marks = {}, [(time.perf_counter(), time.process_time())]

    def mark(name):
        marks.append((time.perf_counter(), time.process_time()))
        out[name] = (marks[-1][0] - marks[-2][0], marks[-1][1] - marks[-2][1])

    el = sample_cod_elements(block.cu_seqlens, block.loss_mask, K, 0.7, 0.2, None, torch.Generator().manual_seed(seed))
    mark("cod")
    res = train.block_loss(model, model.lm_head.weight, vhead, block, el, K, 2048)
    mark("forward+loss")
    res.loss.backward()
    mark("backward")
    clip(params, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    mark("optimizer")
    out["loss"] = float(res.loss.detach())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    model, vhead, block, params, opt, clip = setup()
    step(model, vhead, block, params, opt, clip, seed=100)  # warm-up
    runs = [step(model, vhead, block, params, opt, clip, seed=i) for i in range(args.steps)]
    print(f"{train.__file__}  threads {torch.get_num_threads()}  loss {runs[0]['loss']:.4f}")
    for phase in ("cod", "forward+loss", "backward", "optimizer"):
        wall = sum(r[phase][0] for r in runs) / len(runs)
        cpu = sum(r[phase][1] for r in runs) / len(runs)
        print(f"  {phase:13s} wall {wall:.3f} s  cpu {cpu:.3f} s")
    wall = sum(sum(v[0] for k, v in r.items() if k != "loss") for r in runs) / len(runs)
    cpu = sum(sum(v[1] for k, v in r.items() if k != "loss") for r in runs) / len(runs)
    print(f"  {'step':13s} wall {wall:.3f} s  cpu {cpu:.3f} s")


if __name__ == "__main__":
    main()
