"""Replayed acceptance (peagle_train/evaluate/replay.py): the walk and the statistics on hand-made arrays whose
answer is known, then the walk against peagle's own speculative decoder on the same tokens (T = 0 and T = 1)."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from peagle_train.evaluate.offline import segment_predictions
from peagle_train.evaluate.replay import (ReplayedTurn, TurnNotDecodable, TurnReplay, acceptance_summary, bootstrap_al,
                                          by_context_length, paired_al_difference, prompt_key, turn_spans, walk_turn)
from peagle_train.generate.speculative import plain_generate, speculative_generate
from peagle_train.model.config import DrafterConfig
from peagle_train.model.dflash import DFlashConfig, DFlashDrafter

P0, P1, A1, A2, A3, A4, EOS = 10, 11, 21, 22, 23, 24, 2


def test_walk_accepts_the_leading_run_and_stops_at_the_eos_as_the_engine_counts():
    tokens = np.array([P0, P1, A1, A2, A3, A4, EOS])
    pred = np.full((5, 2), -1)
    pred[1] = [A2, A3]  # step 1: newest x_2 = A1, anchor 1 drafts x_3, x_4: both right, bonus x_5
    pred[4] = [EOS, 99]  # step 2: newest x_5, anchor 4 drafts x_6 = EOS: the EOS ends the turn, not counted
    assert walk_turn(pred, tokens, 2, 7, 2, 10, {EOS}) == ([2, 0], [2, 0], [2, 5])
    pred[1] = [A2, 99]  # wrong at depth 1: one accepted, bonus x_4, then anchor 3 drafts x_5, x_6
    pred[3] = [A4, EOS]
    assert walk_turn(pred, tokens, 2, 7, 2, 10, {EOS}) == ([1, 1], [2, 1], [2, 4])


def test_walk_drafts_fewer_near_max_new_tokens():
    tokens = np.array([P0, A1, A2, A3, A4])  # 4 tokens, no EOS: cut by max_new_tokens = 4
    right = np.array([[A2, A3, A4], [A3, A4, -1], [A4, -1, -1]])
    assert walk_turn(right, tokens, 1, 5, 3, 4, {EOS}) == ([2], [2], [1])  # k = min(3, 4 - 1 - 1)
    wrong = np.full((3, 3), 7)
    assert walk_turn(wrong, tokens, 1, 5, 3, 4, {EOS}) == ([0, 0, 0], [2, 1, 0], [1, 2, 3])


@pytest.mark.parametrize("tokens, start, end, reason", [
    ([A1, A2, EOS], 0, 3, "no prompt before it"),
    ([P0, A1, A2, A3, A4, EOS], 1, 6, "longer than max_new_tokens"),
    ([P0, A1, EOS, A3, EOS], 1, 5, "an EOS before its end"),
    ([P0, A1, A2], 1, 3, "cut before max_new_tokens without an EOS"),
])
def test_walk_refuses_turns_decoding_would_not_produce(tokens, start, end, reason):
    with pytest.raises(TurnNotDecodable) as e:
        walk_turn(np.full((4, 2), -1), np.array(tokens), start, end, 2, 4, {EOS})
    assert e.value.reason == reason


def test_turn_spans_are_the_runs_of_the_loss_mask():
    assert turn_spans(np.array([0, 0, 1, 1, 0, 1, 0, 1])) == [(2, 4), (5, 6), (7, 8)]
    assert turn_spans(np.array([0, 0])) == []


def test_acceptance_summary_counts_as_the_online_report():
    s = acceptance_summary([2, 0, 1], [2, 0, 3], 3)  # the middle step scored no draft: left out of AL
    assert s["acceptance_length"] == 2.5 and s["num_drafts"] == 2 and s["steps"] == 3
    assert s["per_position_reached"] == [2, 2, 1] and s["per_position_accepted"] == [2, 1, 0]
    assert s["per_position_acceptance"] == [1.0, 0.5, 0.0] and s["acceptance_rate"] == 3 / 5


def test_bootstrap_se_of_two_conversations_is_the_known_one():
    # resamples: both conv 0 (AL 2), both conv 1 (AL 4), one each (AL 3): variance 0.5
    al, se = bootstrap_al(np.array([1, 3]), np.array([1, 1]), samples=20000, seed=1)
    assert al == 3.0 and se == pytest.approx(0.5 ** 0.5, rel=0.02)
    assert bootstrap_al(np.array([2, 4]), np.array([1, 2]), seed=0)[1] < 1e-12  # every conversation the same ratio
    assert bootstrap_al(np.array([2]), np.array([1])) == (3.0, None)
    assert bootstrap_al(np.array([1, 3]), np.array([1, 1]), seed=5) == bootstrap_al(np.array([1, 3]), np.array([1, 1]),
                                                                                     seed=5)  # seeded


def test_paired_difference_removes_the_conversations_spread():
    acc_a, drafts = np.array([0, 5, 10, 2]), np.array([10, 10, 10, 10])
    d = paired_al_difference(acc_a, drafts, acc_a + 10, drafts)  # every conversation +1 AL
    assert d["difference"] == pytest.approx(1.0, abs=1e-12) and d["se"] < 1e-12 and d["conversations"] == 4
    _, unpaired_se = bootstrap_al(acc_a, drafts)
    assert unpaired_se > 0.1  # the drafters' own SEs are large; their paired difference has none
    with pytest.raises(ValueError, match="differ in number"):
        paired_al_difference(acc_a, drafts, acc_a[:3], drafts[:3])


def _judge_draws(rng: np.random.Generator, prompts: int, samples: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A T = 1 judge set: ``samples`` answers per prompt, each with 20 drafting steps; a prompt's acceptance
    probability is drawn once (easy and hard prompts), so its samples are correlated, as real ones are."""
    p = np.repeat(rng.beta(2, 5, prompts), samples)
    drafts = np.full(prompts * samples, 20)
    return rng.binomial(drafts * 3, p), drafts, np.repeat(np.arange(prompts), samples)


def test_bootstrap_over_prompts_matches_the_spread_of_new_judge_sets():
    # 80 prompts x 3 samples: the SE that resamples a prompt's samples together matches the SD of the AL over
    # independent judge sets; resampling the 240 samples as independent conversations is far too small
    rng = np.random.default_rng(0)
    truth = np.std([bootstrap_al(*_judge_draws(rng, 80, 3)[:2])[0] for _ in range(400)], ddof=1)
    acc, drafts, prompts = _judge_draws(rng, 80, 3)
    _, by_prompt = bootstrap_al(acc, drafts, seed=1, clusters=prompts)
    _, by_conversation = bootstrap_al(acc, drafts, seed=1)
    assert 0.8 < by_prompt / truth < 1.25
    assert by_conversation / truth < 0.75
    # paired: drafter B's per-prompt gain varies by prompt; its SE over prompts matches new judge sets' spread
    acc_b = acc + rng.binomial(drafts, np.repeat(rng.uniform(0, 0.2, 80), 3))
    d = paired_al_difference(acc, drafts, acc_b, drafts, seed=1, clusters=prompts)
    assert (d["conversations"], d["units"]) == (240, 80)
    assert d["se"] > 1.3 * paired_al_difference(acc, drafts, acc_b, drafts, seed=1)["se"]


def test_prompt_key_is_the_tokens_before_the_first_answer():
    a = prompt_key(np.array([P0, P1, A1, A2]), np.array([0, 0, 1, 1]))
    assert a == prompt_key(np.array([P0, P1, A3, EOS]), np.array([0, 0, 1, 1]))  # another sample, same prompt
    assert a != prompt_key(np.array([P1, P0, A1, A2]), np.array([0, 0, 1, 1]))


def test_context_bins_split_steps_by_position():
    turns = [ReplayedTurn(0, 5, (1, 2, 0), (3, 3, 3), (5, 300, 600)), ReplayedTurn(1, 9, (3,), (3,), (10,))]
    bins = by_context_length(turns, edges=(0, 256, 512))
    assert [(b["from"], b["to"], b["acceptance_length"], b["num_drafts"], b["conversations"]) for b in bins] == [
        (0, 256, 3.0, 2, 2), (256, 512, 3.0, 1, 1), (512, None, 1.0, 1, 1)]


def test_turn_replay_counts_refusals_and_reports_paired_inputs():
    replay = TurnReplay(2, 10, frozenset({EOS}))
    tokens = np.array([P0, P1, A1, A2, A3, A4, EOS])
    pred = np.full((5, 2), -1)
    pred[1] = [A2, A3]
    replay.add_segment(7, tokens, np.array([0, 0, 1, 1, 1, 1, 1]), pred, "block 0 segment 0")
    replay.add_segment(8, tokens, np.array([1, 1, 0, 0, 0, 0, 0]), pred, "block 0 segment 1")
    r = replay.report()
    assert (r["acceptance_length"], r["turns"], r["conversations"], r["se"]) == (3.0, 1, 1, None)
    assert r["refused_turns"] == {"no prompt before it": 1}
    assert r["refused_examples"]["no prompt before it"].startswith("block 0 segment 1: turn [0, 2)")
    assert r["per_conversation"] == {"conversation": [7], "prompt": [prompt_key(tokens[:2], np.zeros(2))],
                                     "accepted": [2], "num_drafts": [1]}
    assert r["segments_unchecked"] == 0
    assert "skipped" in TurnReplay(2, 10, frozenset({EOS})).report()
    replay.add_segment(9, tokens, np.array([0, 0, 1, 1, 1, 1, 1]), pred, "block 1 segment 0", whole=False)
    replay.add_segment(10, tokens, np.array([0, 0, 1, 1, 1, 1, 1]), pred, "block 2 segment 0", whole=None)
    r = replay.report()
    assert r["refused_turns"] == {"no prompt before it": 1, "in a window, not a whole conversation": 1}
    assert (r["turns"], r["segments_unchecked"]) == (2, 1)  # unknown: walked, and counted


# ------------------------------------------------------------------ against peagle's own engine
class NoisyOracle(nn.Module):
    """Drafts the known sequence ``full`` (element at position p drafts ``full[p + 1]``), wrong at depth 0 where
    ``p % 7 == 0`` and at depths > 0 where ``p % 3 == 0``: runs of several lengths, from nothing but positions.
    With ``full`` None it drafts a repeat of the newest token at depth 0 and token 0 deeper (for samples)."""

    def __init__(self, verifier, full: list[int] | None, num_depths: int):
        super().__init__()
        V = verifier.config.vocab_size
        self.config = DrafterConfig(hidden_size=64, intermediate_size=1, num_attention_heads=1, num_key_value_heads=1,
                                    head_dim=2, vocab_size=V, draft_vocab_size=V, aux_layer_ids=[1, 2, 3],
                                    num_depths=num_depths)
        self.register_buffer("d2t", torch.zeros(V, dtype=torch.long))
        self.dummy = nn.Parameter(torch.zeros(1))
        self.full = full

    @property
    def draft_ids(self):
        return torch.arange(self.config.draft_vocab_size) + self.d2t

    def forward(self, input_ids, aux_hidden, is_mask, position_ids, attn, **_):
        return torch.stack([position_ids, is_mask.long(), input_ids], dim=-1)  # [E, 3]

    def logits(self, hidden):
        out = torch.zeros(hidden.shape[0], self.config.draft_vocab_size)
        for i, (pos, m, x) in enumerate(hidden.tolist()):
            if self.full is None:  # copy: depth 0 drafts its own input token again, deeper depths token 0
                out[i, 0 if m else x] = 1.0
                continue
            tok = self.full[pos + 1] if pos + 1 < len(self.full) else 0
            out[i, (tok + 1) % out.shape[1] if pos % (3 if m else 7) == 0 else tok] = 1.0
        return out


def _replayed(verifier, drafter, prompt: list[int], tokens: list[int], K: int, M: int, eos: set[int]):
    """The walk of ``prompt + tokens`` (one turn) with the drafter's offline chains (the store's path)."""
    x = torch.tensor(prompt + tokens)
    with torch.no_grad():
        hs = verifier.model(input_ids=x[None], output_hidden_states=True).hidden_states
    block = SimpleNamespace(input_ids=x, position_ids=torch.arange(len(x)),
                            aux_hidden=torch.cat([hs[layer][0] for layer in (1, 2, 3)], dim=-1))
    pred = segment_predictions(drafter, block, 0, len(x), K, chunk_anchors=5)
    drafted = torch.where(pred >= 0, drafter.draft_ids[pred.clamp_min(0)], -1).numpy()
    return walk_turn(drafted, x.numpy(), len(prompt), len(x), K, M, eos)


PROMPT = [1, 504, 3458, 282, 260, 1115, 30]


@pytest.mark.parametrize("M, eos_at", [(20, None), (24, 18), (7, None)])
def test_replay_equals_peagles_engine_at_t0(tiny_verifier, M, eos_at):
    free = plain_generate(tiny_verifier, PROMPT, 24).tokens
    eos = {free[eos_at]} if eos_at is not None else {2}
    oracle = NoisyOracle(tiny_verifier, PROMPT + free, num_depths=4)
    spec = speculative_generate(tiny_verifier, oracle, PROMPT, M, 4, eos)
    acc, dr, _ = _replayed(tiny_verifier, oracle, PROMPT, spec.tokens, 4, M, eos)
    assert (acc, dr) == (spec.accepted_per_step, spec.drafted_per_step)
    assert 0 < sum(acc) < sum(dr)  # runs of several lengths: the test can fail


def test_replay_equals_peagles_engine_at_t1_on_its_sampled_output(tiny_verifier):
    sharp = copy.deepcopy(tiny_verifier)
    with torch.no_grad():
        sharp.model.norm.weight.mul_(20.0)  # logits x20 (features unchanged): samples at T = 1 often the argmax
    oracle = NoisyOracle(sharp, None, num_depths=3)  # the tiny verifier's samples repeat a token: some accepted
    rejected = 0
    for seed in range(3):
        spec = speculative_generate(sharp, oracle, PROMPT, 24, 3, {2}, temperature=1.0,
                                    generator=torch.Generator().manual_seed(seed))
        acc, dr, _ = _replayed(sharp, oracle, PROMPT, spec.tokens, 3, 24, {2})
        assert (acc, dr) == (spec.accepted_per_step, spec.drafted_per_step), seed
        assert sum(acc) > 0, seed
        rejected += sum(dr) - sum(acc)
        print(f"T=1 seed {seed}: accepted {acc}, drafted {dr}")
    assert rejected > 0


def repeating_drafter(verifier, token: int, num_depths: int):
    """A real drafter (the tiny one, draft vocab every 7th id, its whole forward run) whose every draft is ``token``:
    its final norm's weight is zero, so every logit is 0 and the argmax is draft id 0, which ``d2t`` maps to
    ``token`` (the draft vocab: ``token .. token + 511``). The tiny verifier's greedy answers repeat a token, so its
    drafts are kept along those runs and rejected where the answer moves on."""
    from tests.peagle_train.generate.test_speculative import tiny_drafter

    drafter = tiny_drafter(verifier, draft_vocab_size=512, num_depths=num_depths)
    with torch.no_grad():
        drafter.norm.weight.zero_()
        drafter.d2t.fill_(token)
        drafter.t2d.zero_()
        drafter.t2d[token:token + 512] = True
    return drafter


def _most_common(tokens: list[int]) -> int:
    return max(set(tokens), key=tokens.count)


def test_replay_equals_peagles_engine_with_a_real_drafter(tiny_verifier):
    from tests.peagle_train.generate.test_speculative import tiny_drafter

    random = tiny_drafter(tiny_verifier, draft_vocab_size=512, num_depths=3)
    drafter = repeating_drafter(tiny_verifier, _most_common(plain_generate(tiny_verifier, PROMPT, 24).tokens), 3)
    for d in (random, drafter):
        spec = speculative_generate(tiny_verifier, d, PROMPT, 24, 3, {2})
        acc, dr, _ = _replayed(tiny_verifier, d, PROMPT, spec.tokens, 3, 24, {2})
        assert (acc, dr) == (spec.accepted_per_step, spec.drafted_per_step)
    assert 0 < sum(acc) < sum(dr), (acc, dr)  # the repeating drafter: drafts kept and drafts rejected


def _judge_store(tiny_verifier, tiny_verifier_dir, tmp_path, M: int):
    """A saved repeating drafter and a store of the verifier's own greedy continuations of 2 prompts (its turns the
    replay walks), with the engine's outputs: ``(store path, outputs)``."""
    from peagle_train.model.checkpoint import save_drafter
    from tests.peagle_train.evaluate.test_evaluate import make_store

    prompts = [PROMPT, [1, 42, 43, 44, 45]]
    drafter = repeating_drafter(tiny_verifier, _most_common(plain_generate(tiny_verifier, PROMPT, M).tokens), 3)
    drafter.config.verifier_name_or_path = str(tiny_verifier_dir)
    save_drafter(drafter, tmp_path / "drafter")
    outs = [speculative_generate(tiny_verifier, drafter, p, M, 3, {2}) for p in prompts]
    mask = [m for p, o in zip(prompts, outs) for m in [0] * len(p) + [1] * len(o.tokens)]  # the continuations
    path = make_store(str(tmp_path / "judge"), tiny_verifier, tiny_verifier_dir,
                      [p + o.tokens for p, o in zip(prompts, outs)], loss_mask=mask)
    return path, outs


def test_cli_store_reports_the_replayed_al(tiny_verifier, tiny_verifier_dir, tmp_path, monkeypatch):
    """``peagle-eval --store JUDGE``: a store of the verifier's own greedy continuations (2 conversations) gives
    the replayed AL of peagle's engine on the same prompts, drafts kept and rejected, without loading any weight
    of the verifier; ``--all-anchor`` adds the all-anchor diagnostic (the verifier's output head alone) and leaves
    the replay as it was."""
    from click.testing import CliRunner
    from transformers import AutoModelForCausalLM

    import peagle_train.evaluate.offline as offline
    from cli.eval import main

    M = 9
    path, outs = _judge_store(tiny_verifier, tiny_verifier_dir, tmp_path, M)
    args = ["--drafter", str(tmp_path / "drafter"), "--store", path, "--max-new-tokens", str(M), "--no-measure-costs"]

    def no_weights(*a, **k):
        raise AssertionError("the replay loaded verifier weights")

    with monkeypatch.context() as m:
        m.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
        m.setattr(offline, "load_output_head", no_weights, raising=False)
        result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    replay = report["replay"]
    steps = [(a, d) for o in outs for a, d in zip(o.accepted_per_step, o.drafted_per_step)]
    assert replay["steps"] == len(steps) and replay["num_drafts"] == sum(1 for _, d in steps if d > 0)
    assert replay["accepted"] == sum(a for a, _ in steps) and replay["drafted"] == sum(d for _, d in steps)
    assert 0 < replay["accepted"] < replay["drafted"], replay  # the equality is tested on kept drafts too
    assert (replay["turns"], replay["conversations"], replay["refused_turns"]) == (2, 2, {})
    assert "replayed acceptance length" in result.stderr and "all-anchor diagnostic: not computed" in result.stderr
    assert report["all_anchor"] is False and "simulated_acceptance_length" not in report
    assert replay["segments_unchecked"] == 2 and "is a --context window store" in result.stderr
    both = CliRunner().invoke(main, args + ["--all-anchor"])
    assert both.exit_code == 0, both.output
    full = json.loads(both.stdout)
    assert full["all_anchor"] is True and full["replay"] == replay
    assert full["positions_scored"] > 0 and "all-anchor acceptance length (diagnostic)" in both.stderr


def test_cli_store_walks_its_turns_with_the_limit_the_store_records(tiny_verifier, tiny_verifier_dir, tmp_path):
    """A judge store records the max_new_tokens its turns were generated with: ``peagle-eval --store`` walks them
    with it (the default 128 would refuse every turn cut at 9 tokens), and refuses another one naming both."""
    from click.testing import CliRunner

    from cli.eval import main
    from peagle_train.model.checkpoint import save_drafter
    from stores.features.feature_store import FeatureStore
    from tests.peagle_train.evaluate.test_evaluate import make_store
    from tests.peagle_train.generate.test_speculative import tiny_drafter

    drafter = tiny_drafter(tiny_verifier, num_depths=3)
    drafter.config.verifier_name_or_path = str(tiny_verifier_dir)
    save_drafter(drafter, tmp_path / "drafter")
    M = 9
    out = speculative_generate(tiny_verifier, drafter, PROMPT, M, 3, {2})
    assert len(out.tokens) == M and 2 not in out.tokens  # cut by the limit, no EOS
    path = make_store(str(tmp_path / "judge"), tiny_verifier, tiny_verifier_dir, [PROMPT + out.tokens],
                      loss_mask=[0] * len(PROMPT) + [1] * M)
    FeatureStore.open(path, mode="r+").record_generation(M, 0.0, 0)
    args = ["--drafter", str(tmp_path / "drafter"), "--store", path, "--no-measure-costs"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["max_new_tokens"], report["max_new_tokens_from"]) == (M, "store")
    assert (report["replay"]["max_new_tokens"], report["replay"]["turns"], report["replay"]["refused_turns"]) == (M, 1, {})
    assert report["replay"]["accepted"] == sum(out.accepted_per_step)
    other = CliRunner().invoke(main, args + ["--max-new-tokens", "16"])
    assert other.exit_code != 0
    assert "generated with max_new_tokens 9, but --max-new-tokens gives 16" in other.output
    assert CliRunner().invoke(main, args + ["--max-new-tokens", "9"]).exit_code == 0


# ------------------------------------------------------------------ DFlash drafters
class DFlashOracle(DFlashDrafter):
    """A DFlash drafter that drafts the known sequence ``full`` (slot j of the block anchored at position p drafts
    ``full[p + j]``) only where it was given exactly the step's inputs: the anchor token ``full[p]``, the context
    rows ``0..p-1`` at positions ``0..p-1``; wrong where ``(p + 2 j) % 5 == 0``: runs of several lengths."""

    def __init__(self, verifier, full: list[int], block_size: int):
        V = verifier.config.vocab_size
        super().__init__(DFlashConfig(hidden_size=verifier.config.hidden_size, intermediate_size=8, num_attention_heads=1,
                                      num_key_value_heads=1,
                                      head_dim=8, vocab_size=V, draft_vocab_size=V, aux_layer_ids=[1, 2, 3],
                                      num_hidden_layers=0, mask_token_id=5, block_size=block_size))
        self.full = full

    def forward(self, aux_hidden, context_positions, block_ids, block_positions, mask):
        B, T = self.config.block_size, aux_hidden.shape[0]
        q = torch.arange(block_ids.numel())
        anchor = q - q % B
        seen = mask[:, :T]
        last = torch.where(seen, context_positions[None, :], -1).max(1).values  # [Q] newest context position seen
        return torch.stack([block_positions, q % B, block_ids[anchor], seen.sum(1), last], dim=-1)  # [Q, 5]

    def logits(self, hidden):
        out = torch.zeros(hidden.shape[0], self.config.draft_vocab_size)
        for i, (pos, j, anchor_id, n_ctx, last) in enumerate(hidden.tolist()):
            p = pos - j
            tok = self.full[pos] if pos < len(self.full) else 0
            right = anchor_id == self.full[p] and n_ctx == p and last == p - 1 and (p + 2 * j) % 5 != 0
            out[i, tok if right else (tok + 1) % out.shape[1]] = 1.0
        return out


@pytest.mark.parametrize("M, eos_at", [(20, None), (24, 18)])
def test_dflash_replay_equals_peagles_engine_at_t0(tiny_verifier, M, eos_at):
    free = plain_generate(tiny_verifier, PROMPT, 24).tokens
    eos = {free[eos_at]} if eos_at is not None else {2}
    oracle = DFlashOracle(tiny_verifier, PROMPT + free, block_size=4)
    spec = speculative_generate(tiny_verifier, oracle, PROMPT, M, 3, eos)
    assert spec.tokens == plain_generate(tiny_verifier, PROMPT, M, eos).tokens
    acc, dr, _ = _replayed(tiny_verifier, oracle, PROMPT, spec.tokens, 3, M, eos)
    assert (acc, dr) == (spec.accepted_per_step, spec.drafted_per_step)
    assert 0 < sum(acc) < sum(dr) and max(acc) == 3  # runs of several lengths, whole blocks too: the test can fail


@pytest.mark.parametrize("K", [3, 2])
def test_dflash_replay_equals_peagles_engine_with_a_real_drafter(tiny_verifier, K):
    """Also with K < B - 1 drafts a step (blocks of K + 1, as vLLM runs them at num_speculative_tokens K)."""
    from tests.peagle_train.generate.test_speculative import tiny_dflash

    drafter = tiny_dflash(tiny_verifier, block_size=4)
    spec = speculative_generate(tiny_verifier, drafter, PROMPT, 16, K, {2})
    acc, dr, _ = _replayed(tiny_verifier, drafter, PROMPT, spec.tokens, K, 16, {2})
    assert (acc, dr) == (spec.accepted_per_step, spec.drafted_per_step)


def test_cli_store_reports_the_replayed_al_of_a_dflash_drafter(tiny_verifier, tiny_verifier_dir, tmp_path):
    """``peagle-eval --store JUDGE`` with a DFlash checkpoint: the replayed AL is the one peagle's engine decodes the
    same prompts with, step for step (the oracle engine run anchor by anchor; the saved drafter is a real one)."""
    from click.testing import CliRunner

    from cli.eval import main
    from peagle_train.model.dflash_checkpoint import save_dflash
    from tests.peagle_train.evaluate.test_evaluate import make_store
    from tests.peagle_train.generate.test_speculative import tiny_dflash

    drafter = tiny_dflash(tiny_verifier, block_size=4)
    drafter.config.verifier_name_or_path = str(tiny_verifier_dir)
    save_dflash(drafter, tmp_path / "drafter")
    prompts, M = [PROMPT, [1, 42, 43, 44, 45]], 9
    outs = [speculative_generate(tiny_verifier, drafter, p, M, 3, {2}) for p in prompts]
    mask = [m for p, o in zip(prompts, outs) for m in [0] * len(p) + [1] * len(o.tokens)]
    path = make_store(str(tmp_path / "judge"), tiny_verifier, tiny_verifier_dir,
                      [p + o.tokens for p, o in zip(prompts, outs)], loss_mask=mask)
    result = CliRunner().invoke(main, ["--drafter", str(tmp_path / "drafter"), "--store", path, "--max-new-tokens",
                                       str(M), "--no-measure-costs"])
    assert result.exit_code == 0, result.output
    replay = json.loads(result.stdout)["replay"]
    steps = [(a, d) for o in outs for a, d in zip(o.accepted_per_step, o.drafted_per_step)]
    assert replay["steps"] == len(steps) and replay["drafted"] == sum(d for _, d in steps)
    assert replay["accepted"] == sum(a for a, _ in steps)
    assert (replay["turns"], replay["conversations"], replay["refused_turns"]) == (2, 2, {})
