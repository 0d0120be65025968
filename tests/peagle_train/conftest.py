"""Fixtures shared by the trainer and evaluation tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every trainer and evaluation test runs on one torch thread (``one_thread`` in tests/conftest.py)."""


@pytest.fixture(scope="session")
def make_tiny_llama():
    """``make(path, hidden=64, vocab=256)``: save a random 3-layer Llama (seed 0) and return ``path``."""

    def make(path, hidden: int = 64, vocab: int = 256):
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=128, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=3,
                          rope_theta=10000.0, tie_word_embeddings=False)
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).save_pretrained(path)
        return path

    return make
