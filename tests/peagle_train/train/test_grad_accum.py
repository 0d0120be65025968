"""One optimizer step optimises the pooled objective Σ w·KL / Σ w over all its blocks and ranks.

The accumulated gradient of :func:`accumulate_step` must equal the gradient of a single
:func:`loss_and_accuracy` over the concatenated elements of every block (one process with
``--grad-accum 2``; two real gloo ranks with two blocks each), and the logged loss must be that
pooled value, with and without gradient checkpointing. Blocks of very different weight make a mean of
block means differ from it.
"""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from peagle_train.data.cod import sample_cod_elements
from peagle_train.data.loader import Block
from peagle_train.model.config import DrafterConfig
from peagle_train.model.drafter import PEagleDrafter
from peagle_train.train.loss import loss_and_accuracy
from peagle_train.train.step import accumulate_step, block_hidden, block_loss

H, V, L, K, CHUNK = 32, 64, 2, 3, 16
REPO = Path(__file__).resolve().parents[3]
#: supervised tokens per block: 40 of 48 (about 100 weighted elements) and 1 (one element)
SUPERVISED = [40, 1, 25, 3]


def make_model() -> tuple[PEagleDrafter, torch.Tensor]:
    """A 1-layer drafter (seed 0, full vocab V) and the verifier head ``[V, H]`` it is scored against."""
    cfg = DrafterConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, vocab_size=V, draft_vocab_size=V, aux_layer_ids=[1, 2], num_depths=K)
    torch.manual_seed(0)
    model = PEagleDrafter(cfg)
    model.init_from_verifier(torch.randn(V, H), torch.randn(V, H))
    return model, torch.randn(V, H, generator=torch.Generator().manual_seed(1))


def make_blocks(ids: list[int]) -> list[tuple[Block, object]]:
    """Block b (48 tokens, one segment; its last ``SUPERVISED[b]`` tokens supervised) and its COD elements."""
    out = []
    for b in ids:
        g = torch.Generator().manual_seed(100 + b)
        T = 48
        mask = torch.zeros(T, dtype=torch.long)
        mask[T - SUPERVISED[b]:] = 1
        block = Block(block_id=b, input_ids=torch.randint(0, V, (T,), generator=g), loss_mask=mask,
                      position_ids=torch.arange(T), cu_seqlens=torch.tensor([0, T]),
                      aux_hidden=torch.randn(T, L * H, generator=g).to(torch.bfloat16),
                      final_hidden=(3 * torch.randn(T, H, generator=g)).to(torch.bfloat16))
        el = sample_cod_elements(block.cu_seqlens, block.loss_mask, K, 0.7, 0.2, None,
                                 torch.Generator().manual_seed(200 + b))
        out.append((block, el))
    return out


def pooled_reference(model, vhead, blocks) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of ONE weighted KL over the concatenated elements of ``blocks``."""
    model = copy.deepcopy(model)
    model.embed_tokens.sparse = False
    hidden, weight, depth, target, finals, offset = [], [], [], [], [], 0
    for block, el in blocks:
        h, rows, tidx = block_hidden(model, torch.float32, block, el)
        hidden.append(h)
        weight.append(el.weight[rows])
        depth.append(el.depth[rows])
        target.append(tidx + offset)
        finals.append(block.final_hidden)
        offset += block.n_tokens
    out = loss_and_accuracy(torch.cat(hidden), model.lm_head.weight, torch.cat(finals), vhead,
                               torch.cat(weight), torch.cat(depth), K, CHUNK, target_index=torch.cat(target))
    out.loss.backward()
    return float(out.loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def accumulated(accelerator, model, vhead, blocks) -> tuple[dict, dict[str, torch.Tensor]]:
    """:func:`accumulate_step` over ``blocks`` (one micro-batch each); sums and dense gradients."""
    unwrapped = accelerator.unwrap_model(model)
    params = [p for p in model.parameters() if p.requires_grad]
    sums = accumulate_step(accelerator, model, params, iter(blocks), len(blocks),
                           lambda item: block_loss(model, unwrapped.lm_head.weight, vhead, *item, K, CHUNK))
    grads = {n: (p.grad.to_dense() if p.grad.is_sparse else p.grad).clone()
             for n, p in unwrapped.named_parameters() if p.grad is not None}
    return sums, grads


def assert_same_grads(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and len(want) > 5
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["kept", "gradient-checkpointing"])
def test_grad_accum_gradient_is_the_pooled_gradient(checkpointing):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model, vhead = make_model()
    model.embed_tokens.sparse = True  # as run_train in one process (lazy embedding): a sparse gradient
    blocks = make_blocks([0, 1])
    weights = [float(el.weight.sum()) for _, el in blocks]
    assert weights[0] > 50 * weights[1] > 0  # very unequal blocks

    want_loss, want = pooled_reference(model, vhead, blocks)  # activations kept
    model.gradient_checkpointing = checkpointing
    calls = [0]
    model.layers[0].register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    sums, got = accumulated(accelerator, model, vhead, blocks)
    assert calls == [4 if checkpointing else 2]  # two blocks, each layer forward recomputed once
    assert float(sums["weight_sum"].sum()) == sum(weights)
    assert float(sums["loss_sum"].sum()) / float(sums["weight_sum"].sum()) == pytest.approx(want_loss, rel=1e-5)
    assert_same_grads(got, want)

    # the old rule, mean of the two block means, gives the 1-element block half the step: not the same
    model.zero_grad(set_to_none=True)
    for block, el in blocks:
        (block_loss(model, model.lm_head.weight, vhead, block, el, K, CHUNK).loss / 2).backward()
    old = model.fc.weight.grad
    assert (old - want["fc.weight"]).norm() > 0.1 * want["fc.weight"].norm()


RANK_SCRIPT = """
import importlib.util, sys, torch
from accelerate import Accelerator
spec = importlib.util.spec_from_file_location("ga", sys.argv[1])
ga = importlib.util.module_from_spec(spec); spec.loader.exec_module(ga)
accelerator = Accelerator(cpu=True)
rank, world = accelerator.process_index, accelerator.num_processes
ids = [rank, rank + 2]  # rank 0: blocks 0 and 2, rank 1: blocks 1 and 3
for name, checkpointing in (("kept", False), ("gradient-checkpointing", True)):
    model, vhead = ga.make_model()
    model.gradient_checkpointing = checkpointing
    model = accelerator.prepare(model)
    calls = [0]
    accelerator.unwrap_model(model).layers[0].register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    sums, grads = ga.accumulated(accelerator, model, vhead, ga.make_blocks(ids))
    torch.save({"rank": rank, "world": world, "blocks": ids, "sums": sums, "grads": grads, "layer_calls": calls[0],
                "backend": str(accelerator.state.backend)}, f"{sys.argv[2]}/{name}-rank{rank}.pt")
    accelerator.wait_for_everyone()
# as Trainer.close: free the DDP wrapper (it holds the gloo group) before destroying the group, or
# about one launch in five aborts a rank at exit ("terminate called without an active exception")
del model
accelerator.free_memory()
accelerator.end_training()
"""


@pytest.mark.slow  # two processes each import torch, accelerate and torch.distributed
def test_two_gloo_ranks_accumulate_the_pooled_gradient(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(script), __file__, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    model, vhead = make_model()
    want_loss, want = pooled_reference(model, vhead, make_blocks([0, 1, 2, 3]))
    total = sum(float(el.weight.sum()) for _, el in make_blocks([0, 1, 2, 3]))
    for name, layer_calls in (("kept", 2), ("gradient-checkpointing", 4)):  # 2 blocks; each recomputed
        ranks = [torch.load(tmp_path / f"{name}-rank{r}.pt", weights_only=False) for r in (0, 1)]
        assert [r["rank"] for r in ranks] == [0, 1] and [r["world"] for r in ranks] == [2, 2]
        assert [r["blocks"] for r in ranks] == [[0, 2], [1, 3]] and ranks[0]["backend"] == "gloo"
        assert [r["layer_calls"] for r in ranks] == [layer_calls, layer_calls]
        for r in ranks:  # every rank holds the same, pooled gradient and the same global sums
            assert_same_grads(r["grads"], want)
            assert float(r["sums"]["loss_sum"].sum()) / float(r["sums"]["weight_sum"].sum()) == pytest.approx(
                want_loss, rel=1e-5)
        assert float(ranks[0]["sums"]["weight_sum"].sum()) == total
