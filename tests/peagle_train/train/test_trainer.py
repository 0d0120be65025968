"""The frozen-tensor guard (issue 36): a few :meth:`Trainer.train_step` steps move every trainable tensor,
norms included, and no frozen one, in every precision / attention backend / checkpointing / embedding /
layer / loss setting peagle trains with.

A mixed-precision setting that froze the drafter's norm weights cost 13.5-28.9% of acceptance length in a
speculators-based run; nothing in the loss curve shows it. The settings peagle offers (docs/design.md §8):
float32, or bf16 autocast (what a CUDA run uses; CPU autocast stands in for it here, the same code path
through ``accelerator.autocast()``); the attention backends sdpa, split and flex (CUDA only); gradient
checkpointing off/on; the embedding trained lazily (sparse rows), densely, or frozen; the llama and qwen3
(per-head q/k norms) layers; every ``--loss``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from peagle_train.data.loader import Block
from peagle_train.model.config import DrafterConfig
from peagle_train.model.drafter import PEagleDrafter
from peagle_train.train.config import TrainConfig
from peagle_train.train.loss import LOSSES
from peagle_train.train.trainer import Trainer
from peagle_train.train.kinds import drafter_kind

H, V, L, K, T = 32, 64, 2, 3, 40
STEPS = 3
CUDA = torch.cuda.is_available()


@pytest.fixture
def fresh_accelerator_state():
    """accelerate keeps one process-wide state whose mixed precision cannot change once set; each case
    starts and leaves a clean one (``_reset_state`` is what accelerate's own test cases call)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _blocks(device: str) -> list[Block]:
    """``STEPS`` blocks of two segments each, half their tokens supervised."""
    out = []
    for b in range(STEPS):
        g = torch.Generator().manual_seed(10 + b)
        mask = (torch.rand(T, generator=g) < 0.6).long()
        out.append(Block(block_id=b, input_ids=torch.randint(1, V, (T,), generator=g), loss_mask=mask,
                         position_ids=torch.cat([torch.arange(24), torch.arange(T - 24)]),
                         cu_seqlens=torch.tensor([0, 24, T]),
                         aux_hidden=torch.randn(T, L * H, generator=g).to(torch.bfloat16),
                         final_hidden=(3 * torch.randn(T, H, generator=g)).to(torch.bfloat16)).to(device))
    return out


def _moved_after_steps(precision: str, backend: str, checkpointing: bool, embedding: str, layer: str, loss: str,
                       device: str, tamper=None) -> tuple[dict[str, float], dict[str, float], PEagleDrafter]:
    """``(trainable, frozen, model)``: the largest change of each tensor over ``STEPS`` steps, by name;
    ``tamper(model)`` runs before training."""
    cfg = TrainConfig.from_flat(store="unused", output="unused", num_depths=K, num_layers=2, lr=1e-2,
                                warmup_steps=0, max_steps=STEPS, loss=loss, gradient_checkpointing=checkpointing,
                                lazy_embedding=embedding == "lazy", train_embedding=embedding != "frozen",
                                attention_backend=backend, loss_chunk_size=16)
    dcfg = DrafterConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, vocab_size=V, draft_vocab_size=V, aux_layer_ids=[1, 2], num_depths=K,
                         num_hidden_layers=2, layer_type=layer)
    torch.manual_seed(0)
    model = PEagleDrafter(dcfg)
    model.init_from_verifier(torch.randn(V, H), torch.randn(V, H))
    model.embed_tokens.weight.requires_grad_(cfg.optim.train_embedding)
    if tamper is not None:
        tamper(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    accelerator = Accelerator(cpu=device == "cpu", mixed_precision="bf16" if precision == "bf16-autocast" else "no")
    vhead = torch.randn(V, H, generator=torch.Generator().manual_seed(1)).to(device)
    trainer = Trainer(cfg, model.to(device), vhead, kind=drafter_kind(cfg.model.method), accelerator=accelerator,
                      attention=backend, max_steps=STEPS,
                      warmup=0)
    for i, block in enumerate(_blocks(device)):
        trainer.train_step([(block, torch.Generator().manual_seed(100 + i))])
    after = dict(trainer.unwrapped.named_parameters())
    change = {n: float((after[n].detach().cpu() - before[n]).abs().max()) for n in before}
    return ({n: c for n, c in change.items() if n in trainable}, {n: c for n, c in change.items() if n not in trainable},
            trainer.unwrapped)


def _cases():
    """Every precision x backend x checkpointing x embedding x layer with the default loss, and every loss
    with the default settings of both precisions; the CUDA-only ones (flex, bf16 on CUDA) skip without CUDA."""
    cases = []
    for precision, backend, ckpt, emb, layer in itertools.product(
            ("float32", "bf16-autocast"), ("sdpa", "split", "flex"), (False, True), ("lazy", "dense", "frozen"),
            ("llama", "qwen3")):
        cases.append((precision, backend, ckpt, emb, layer, "kl_div"))
    for precision, loss in itertools.product(("float32", "bf16-autocast"), LOSSES):
        if loss != "kl_div":
            cases.append((precision, "split", False, "lazy", "llama", loss))
    marks = {"flex": pytest.mark.skipif(not CUDA, reason="flex_attention trains on CUDA only (no CPU backward)")}
    return [pytest.param(*c, marks=[marks[c[1]]] if c[1] in marks else [],
                         id=f"{c[0]}-{c[1]}-{'ckpt' if c[2] else 'kept'}-{c[3]}-emb-{c[4]}-{c[5]}") for c in cases]


def _not_moved(trainable: dict[str, float]) -> list[str]:
    """The trainable tensors whose largest change is at most 1e-4 (AdamW at lr 1e-2 moves a weight with any
    gradient by about 1e-2 per step)."""
    return [n for n, c in trainable.items() if not c > 1e-4]


@pytest.mark.parametrize("precision,backend,checkpointing,embedding,layer,loss", _cases())
def test_every_trainable_tensor_moves_and_no_frozen_one(fresh_accelerator_state, precision, backend, checkpointing,
                                                         embedding, layer, loss):
    device = "cuda" if CUDA else "cpu"
    trainable, frozen, model = _moved_after_steps(precision, backend, checkpointing, embedding, layer, loss, device)
    names = set(trainable)
    norms = {n for n in names if "norm" in n}
    assert {"norm.weight", "layers.0.hidden_norm.weight", "layers.0.input_layernorm.weight",
            "layers.1.post_attention_layernorm.weight", "mask_hidden", "fc.weight"} <= names
    if layer == "qwen3":
        assert {"layers.0.self_attn.q_norm.weight", "layers.1.self_attn.k_norm.weight"} <= norms
    assert ("embed_tokens.weight" in names) == (embedding != "frozen")
    still = _not_moved(trainable)
    assert not still, f"trainable tensors that did not move in {STEPS} steps: {still}"
    assert frozen.keys() >= {"lm_head.weight"} and all(c == 0.0 for c in frozen.values()), frozen
    for name, p in model.named_parameters():  # the master weights stay float32 under autocast
        assert p.dtype == torch.float32, name


def test_a_norm_that_never_moves_is_caught(fresh_accelerator_state):
    """The guard can fail: a norm that requires grad but whose gradient never arrives (the shape of the
    mixed-precision bug) is named, and only it."""
    def cut(model):
        model.layers[0].hidden_norm.weight.register_hook(torch.zeros_like)

    trainable, _, _ = _moved_after_steps("float32", "split", False, "lazy", "llama", "kl_div", "cpu", tamper=cut)
    assert _not_moved(trainable) == ["layers.0.hidden_norm.weight"]
