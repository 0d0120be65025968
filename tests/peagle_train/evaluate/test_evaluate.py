"""Offline metrics on a hand-built case with known answers; prompt reading; the online report."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from torch import nn

from peagle_train.evaluate.config import EvalConfig
import peagle_train.evaluate.offline as offline_module
from peagle_train.evaluate.offline import evaluate_offline
from peagle_train.evaluate.online import evaluate_prompts
from peagle_train.evaluate.prompts import Prompt, read_prompts, render_turn
from peagle_train.evaluate.report import format_report
from peagle_train.model.config import DrafterConfig
from peagle_train.model.element_mask import attention_mask_reference
from stores.errors import InputError



# ------------------------------------------------------------------ offline, hand-built
# One segment is the worked example of docs/design.md §4: [SYS, USR, HDR, A1, A2, EOT], m = [0,0,0,1,1,1].
SEGMENT = [10, 11, 12, 13, 14, 15]
MASK = [0, 0, 0, 1, 1, 1]
V, D, H = 16, 8, 16  # draft vocab = verifier ids 8..15 (d2t = 8); ids 0..7 are outside it


def make_block(segments: list[list[int]], masks: list[list[int]], outside: tuple[int, ...] = ()) -> SimpleNamespace:
    """A block of ``segments``; the verifier argmax at row p is x_{p+1}, except at the rows in ``outside``,
    where it is verifier id 3, which the draft vocab does not hold."""
    T = sum(map(len, segments))
    final = torch.zeros(T, H)
    row = 0
    for seg in segments:
        for p in range(len(seg) - 1):
            final[row + p, seg[p + 1]] = 1.0
        row += len(seg)
    for r in outside:
        final[r, 3] = 2.0
    return SimpleNamespace(
        input_ids=torch.tensor(sum(segments, [])), loss_mask=torch.tensor(sum(masks, [])),
        position_ids=torch.cat([torch.arange(len(s)) for s in segments]),
        cu_seqlens=torch.tensor([0] + [sum(map(len, segments[:i + 1])) for i in range(len(segments))]),
        aux_hidden=torch.zeros(T, 1, H, dtype=torch.bfloat16), final_hidden=final.bfloat16(),
    )


def worked_block(n_segments: int = 2) -> SimpleNamespace:
    """``n_segments`` copies of the worked example."""
    return make_block([SEGMENT] * n_segments, [MASK] * n_segments)


class RuleDrafter(nn.Module):
    """Drafts the true next token of ``segment``, except at depth ``wrong_depth``, at the elements
    ``(a, d)`` in ``wrong``, and (when ``deep_token`` is set) at every depth > 0, where it drafts
    ``deep_token`` (a verifier id) whatever the context.

    It reads the rope position p of each element (element at p predicts ``x_{p+1}``) and its depth
    d, which is the number of mask elements its attention row allows (its own chain, §8); the anchor
    is ``p - 1 - d``.
    """

    def __init__(self, wrong_depth: int | None = None, num_depths: int = 3, segment: list[int] = SEGMENT,
                 wrong: tuple[tuple[int, int], ...] = (), deep_token: int | None = None):
        super().__init__()
        self.config = DrafterConfig(hidden_size=H, intermediate_size=1, num_attention_heads=1,
                                    num_key_value_heads=1, head_dim=2, vocab_size=V, draft_vocab_size=D,
                                    aux_layer_ids=[1], num_depths=num_depths)
        self.register_buffer("d2t", torch.full((D,), 8))
        self.dummy = nn.Parameter(torch.zeros(1))
        self.wrong_depth, self.segment, self.wrong, self.deep_token = wrong_depth, segment, set(wrong), deep_token

    @property
    def draft_ids(self):
        return torch.arange(D) + self.d2t

    def forward(self, input_ids, aux_hidden, is_mask, position_ids, attn_mask):
        mask = attention_mask_reference(attn_mask.elements)  # [E, E] the rule of what it was given
        depth = (mask & is_mask[None, :]).sum(1)  # [E]
        return torch.stack([position_ids, depth], dim=-1)  # [E, 2]

    def logits(self, hidden):
        out = torch.zeros(hidden.shape[0], D)
        for i, (p, d) in enumerate(hidden.tolist()):
            tok = self.segment[p + 1] - 8
            if d > 0 and self.deep_token is not None:
                tok = self.deep_token - 8
            if d == self.wrong_depth or (p - 1 - d, d) in self.wrong:
                tok = 0  # verifier id 8 = x_0, never a next token
            out[i, tok] = 1.0
        return out


@pytest.mark.parametrize("chunk", [1, 2, 256])
def test_offline_all_correct(chunk):
    report = evaluate_offline(RuleDrafter(), [worked_block()], torch.eye(V, H), chunk_anchors=chunk)
    # Counted anchors a = 1, 2, 3 per segment accept 3, 2, 1 drafts (chains end at the segment end).
    assert report["positions_scored"] == 6
    assert report["mean_accepted"] == pytest.approx(2.0)
    assert report["simulated_acceptance_length"] == pytest.approx(3.0)
    assert report["per_depth_weight"] == [6, 6, 4]
    assert report["per_depth_accuracy"] == [1.0, 1.0, 1.0]
    assert report["per_position_acceptance"] == [1.0, 1.0, 1.0]


def test_offline_all_anchor_in_the_heads_dtype_and_only_when_given_a_head():
    """A bf16 head scores as its float32 values (sliced over the vocab, no float32 copy of it), ties to the lowest
    id as ``argmax``; without a head the all-anchor figures are left out (the replay alone)."""
    ref = evaluate_offline(RuleDrafter(wrong_depth=1), [worked_block()], torch.eye(V, H))
    assert evaluate_offline(RuleDrafter(wrong_depth=1), [worked_block()], torch.eye(V, H).bfloat16()) == ref
    assert evaluate_offline(RuleDrafter(wrong_depth=1), [worked_block()], None) == {}
    x = torch.randn(37, 8)
    head = torch.randn(50, 8).bfloat16()
    head[45] = head[int((x @ head.float().T).argmax(-1)[0])]  # a tie across vocab slices: the lower id wins
    assert torch.equal(offline_module._argmax_chunked(x, head, rows=5, vocab=7), (x @ head.float().T).argmax(-1))


def test_offline_wrong_at_depth_one():
    report = evaluate_offline(RuleDrafter(wrong_depth=1), [worked_block(), worked_block(1)], torch.eye(V, H),
                              chunk_anchors=2)
    assert report["positions_scored"] == 9
    assert report["simulated_acceptance_length"] == pytest.approx(2.0)
    assert report["per_depth_accuracy"] == [1.0, 0.0, 1.0]
    assert report["per_depth_correct"] == [9, 0, 6]
    # depth 1 was reached by anchors 1 and 2 of each segment, never accepted; depth 2 never reached.
    assert report["per_position_acceptance"] == [1.0, 0.0, None]


# x_i = 8 + i; the loss mask differs at the first tokens, so each depth has its own weight:
# depth d predicts x_{d+2}..x_7 and weighs sum(m[d+2:]): m[2:] = 5, m[3:] = 4, m[4:] = 3.
SEG8 = list(range(8, 16))
MASK8 = [0, 0, 1, 1, 0, 1, 1, 1]


@pytest.mark.parametrize("case", ["all_correct", "wrong_at_3_1", "verifier_outside_draft_vocab"])
def test_offline_weights_differ_per_depth(case):
    """Hand-computed chains: a chain stops at the first wrong, missing or weight-0 element.

    Counted anchors (m_{a+2} = 1) are 0, 1, 3, 4, 5. With every draft right they accept
    a=0: d0, d1 (d2 predicts x_4, weight 0) -> 2; a=1: d0 (d1 weight 0) -> 1; a=3: 3;
    a=4: d0, d1 (no d2) -> 2; a=5: d0 -> 1.
    """
    drafter = RuleDrafter(segment=SEG8, wrong=((3, 1),) if case == "wrong_at_3_1" else ())
    outside = (6,) if case == "verifier_outside_draft_vocab" else ()  # the verifier's pick for x_7 is id 3
    report = evaluate_offline(drafter, [make_block([SEG8], [MASK8], outside)], torch.eye(V, H), chunk_anchors=2)
    assert report["per_depth_weight"] == [5, 4, 3]
    assert report["positions_scored"] == 5
    accepted, correct, cond = {
        "all_correct": ([2, 1, 3, 2, 1], [5, 4, 3], [1.0, 1.0, 1.0]),
        # a=3 now stops after d0. Depth 1 is reached by a = 0, 3, 4 (a=1's (1,1) has weight 0).
        "wrong_at_3_1": ([2, 1, 1, 2, 1], [5, 3, 3], [1.0, 2 / 3, None]),
        # (5,0), (4,1), (3,2) predict x_7: a=3 -> 2, a=4 -> 1, a=5 -> 0.
        "verifier_outside_draft_vocab": ([2, 1, 2, 1, 0], [4, 3, 2], [4 / 5, 2 / 3, 0 / 1]),
    }[case]
    assert report["per_depth_correct"] == correct
    assert report["mean_accepted"] == pytest.approx(sum(accepted) / 5)
    assert report["simulated_acceptance_length"] == pytest.approx(1 + sum(accepted) / 5)
    assert report["per_position_acceptance"] == pytest.approx(cond)


def test_offline_equal_counts_mean_a_collapsed_drafter():
    """Why a real run can show per_depth_weight [w, w, w, w] and equal correct counts at depths >= 1.

    A segment whose first tokens carry no loss (system and user turns first) gives every depth the
    same weight; a drafter that drafts one token at every depth > 0 is right exactly where the
    verifier's choice is that token, at every depth alike.
    """
    seg = [8, 9, 10, 11, 12, 13, 14, 13, 15, 13, 9, 10]
    mask = [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1]
    drafter = RuleDrafter(segment=seg, deep_token=13)
    report = evaluate_offline(drafter, [make_block([seg], [mask])], torch.eye(V, H))
    assert report["per_depth_weight"] == [7, 7, 7]  # x_5..x_11 at every depth
    assert report["per_depth_correct"] == [7, 3, 3]  # x_5, x_7, x_9 are 13


def test_offline_real_drafter_chunking_invariant():
    from tests.peagle_train.generate.test_speculative import tiny_drafter

    verifier = SimpleNamespace(config=SimpleNamespace(hidden_size=64, vocab_size=49152))
    drafter = tiny_drafter(verifier, num_depths=4)
    torch.manual_seed(1)
    T = 40
    block = SimpleNamespace(
        input_ids=torch.randint(0, 49152, (T,)), loss_mask=(torch.arange(T) % 5 != 0).long(),
        position_ids=torch.cat([torch.arange(25), torch.arange(15)]), cu_seqlens=torch.tensor([0, 25, 40]),
        aux_hidden=torch.randn(T, 3, 64).bfloat16(), final_hidden=torch.randn(T, 64).bfloat16(),
    )
    lm_head = drafter.lm_head.weight.detach()  # the drafter agrees with "the verifier" at random
    a = evaluate_offline(drafter, [block], lm_head, chunk_anchors=3)
    b = evaluate_offline(drafter, [block], lm_head, chunk_anchors=1000)
    assert a == b
    assert a["positions_scored"] == sum(int(block.loss_mask[i + 2]) for s, n in ((0, 25), (25, 15))
                                        for i in range(s, s + n - 2))
    assert 1.0 <= a["simulated_acceptance_length"] <= 5.0


# ------------------------------------------------------------------ prompts
def write_lines(path, rows) -> str:
    path.write_text("\n".join(json.dumps(r) if not isinstance(r, str) else r for r in rows) + "\n")
    return str(path)


def test_read_prompts_mt_bench_and_openai(tmp_path):
    f = write_lines(tmp_path / "p.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
        "",
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4"}]},
    ])
    p = read_prompts(f)
    assert p[0] == Prompt("81", ["Write a poem.", "Now shorter."], [])
    assert p[1].prompt_id == "3" and p[1].user_turns == ["2+2?"]
    assert [m["content"] for m in p[1].prefix] == ["Be brief.", "Hi", "Hello!"]  # as written, not the verifier's
    # only the last user turn is generated: the trailing reference answer "4" is not used
    assert p[1] == Prompt("3", ["2+2?"], [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                          {"role": "assistant", "content": "Hello!"}])
    assert len(read_prompts(f, limit=1)) == 1


@pytest.mark.parametrize("line,match", [
    ("{not json", "row 1: invalid JSON: Expecting property name enclosed in double quotes at line 1 column 2$"),
    ('{"turns": ["Hi', r"row 1: truncated JSON: line 1 is cut short: its record is still open where the line ends "
                      r"\(column 15\)$"),  # issue 44 item 11: was "invalid JSON (Invalid control character at)"
    ({"turns": []}, "field 'turns'"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "no user message"),
    ({"text": "x"}, "'turns', a 'prompt' or 'question' line, or an OpenAI line"),
    ({"prompt": [{"role": "user", "content": "x"}]},
     r"field 'prompt': expected a non-empty string, got list \(a list of messages goes in 'messages'\)$"),
    ({"messages": "hi"}, "field 'messages': expected a list of {'role': str, 'content': str}, got str$"),
    ({"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get", "arguments": "{}"}}]}, {"role": "user", "content": "ok"}]},
     r"^file .*bad.jsonl, row 1, field 'messages': message 1 \(assistant\): tool calls and tool results are not "
     r"supported in evaluation prompts, which are plain system/user/assistant messages with string content; drop "
     r"the row or its tool turns$"),
    ({"messages": [{"role": "tool", "content": "20C"}, {"role": "user", "content": "ok"}]},
     r"field 'messages': message 0 \(tool\): tool calls and tool results are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]},
     r"field 'messages': message 0 \(user\): content must be a string, got list \(lists of content parts are not "
     r"supported\)$"),
])
def test_read_prompts_errors(tmp_path, line, match):
    f = write_lines(tmp_path / "bad.jsonl", [line])
    with pytest.raises(InputError, match=match):
        read_prompts(f)


def test_read_prompts_takes_prompt_and_question_rows(tmp_path):
    """The question rows regenerate reads (stores/tables/question_rows.py): one user turn each."""
    f = write_lines(tmp_path / "q.jsonl", [{"prompt": "Name a colour."}, {"question": "2+2?", "id": "q2"}])
    assert read_prompts(f) == [Prompt("1", ["Name a colour."]), Prompt("q2", ["2+2?"])]


def test_render_second_turn_feeds_the_answer_back(smollm2_tokenizer):
    prompt = Prompt("1", ["What is 2+2?", "And 3+3?"])
    ids = render_turn(smollm2_tokenizer, prompt, 1, ["It is 4."])
    text = smollm2_tokenizer.decode(ids)
    assert text.index("What is 2+2?") < text.index("It is 4.") < text.index("And 3+3?")
    assert text.rstrip().endswith("<|im_start|>assistant")
    assert ids[:len(render_turn(smollm2_tokenizer, prompt, 0, []))] != []


@pytest.mark.shared_data
def test_real_mt_bench_file_reads():
    from tests.conftest import shared_file

    prompts = read_prompts(shared_file("mt_bench_question.jsonl"))
    assert len(prompts) == 80 and all(len(p.user_turns) == 2 for p in prompts)


# ------------------------------------------------------------------ online report
def test_online_report(tiny_verifier, smollm2_tokenizer, tmp_path):
    from tests.peagle_train.generate.test_speculative import tiny_drafter

    prompts = [Prompt("a", ["Hello there", "Tell me more"]), Prompt("b", ["Name a color."])]
    report = evaluate_prompts(tiny_verifier, tiny_drafter(tiny_verifier), smollm2_tokenizer, prompts,
                              EvalConfig(max_new_tokens=9, num_draft_tokens=3), recurrent_layers=[])
    assert report["identical_to_greedy"] is True and report["mismatches"] == []
    assert report["num_prompts"] == 2 and report["num_turns"] == 3
    assert 1.0 <= report["acceptance_length"] <= 4.0
    assert len(report["per_position_acceptance"]) == 3
    assert report["drafted"] == sum(p["drafted"] for p in report["per_prompt"])
    assert report["tokens_per_second"] > 0 and report["baseline_tokens_per_second"] > 0
    assert "acceptance length" in format_report(report)
    # the generated text and its greedy reference are in the report, turn by turn
    from peagle_train.generate.speculative import greedy_generate

    eos = smollm2_tokenizer.eos_token_id
    first = greedy_generate(tiny_verifier, render_turn(smollm2_tokenizer, prompts[0], 0, []), 9, eos).tokens
    row = report["per_prompt"][0]
    assert row["user"] == "Hello there"
    assert row["reference_text"] == smollm2_tokenizer.decode(first) == row["text"] and row["text"]
    second = render_turn(smollm2_tokenizer, prompts[0], 1, [smollm2_tokenizer.decode(
        [t for t in first if t != eos], skip_special_tokens=True)])
    assert report["per_prompt"][1]["reference_text"] == smollm2_tokenizer.decode(
        greedy_generate(tiny_verifier, second, 9, eos).tokens)
    assert [r["user"] for r in report["per_prompt"]] == ["Hello there", "Tell me more", "Name a color."]


def test_online_progress_advances_within_a_turn_and_ends_at_its_total(tiny_verifier, smollm2_tokenizer):
    # issue 34 item 6: the bar moved once per turn (40-140 s between updates on MT-Bench); now per decoding step
    from peagle_train.evaluate.online import progress_total
    from tests.peagle_train.generate.test_speculative import tiny_drafter

    prompts = [Prompt("a", ["Hello there", "Tell me more"])]
    updates: list[int] = []
    report = evaluate_prompts(tiny_verifier, tiny_drafter(tiny_verifier), smollm2_tokenizer, prompts,
                              EvalConfig(max_new_tokens=9, num_draft_tokens=3), progress=updates.append,
                              recurrent_layers=[])
    assert sum(updates) == progress_total(prompts, 9) == 2 * 9 * 2
    steps = sum(r["verifier_steps"] for r in report["per_prompt"])
    # per turn: one call per plain token, one for the first speculative token and one per verifier step,
    # one for what an early EOS left of the budget
    assert len(updates) == sum(r["new_tokens"] + 1 + 1 for r in report["per_prompt"]) + steps


def test_turn_text_drops_only_the_eos_that_ends_the_turn(smollm2_tokenizer):
    from peagle_train.evaluate.online import turn_text

    eos = smollm2_tokenizer.eos_token_id  # <|im_end|>
    words = smollm2_tokenizer.encode("Blue, like the sea.", add_special_tokens=False)
    assert turn_text(smollm2_tokenizer, words + [eos], [eos]) == "Blue, like the sea."
    assert turn_text(smollm2_tokenizer, words, [eos]) == "Blue, like the sea."  # cut at max_new_tokens
    inner = turn_text(smollm2_tokenizer, [eos] + words, [eos])  # an EOS inside a turn's text stays visible
    assert inner == "<|im_end|>Blue, like the sea."


# ------------------------------------------------------------------ end to end through the CLI
def make_store(path, verifier, verifier_dir, segments: list[list[int]], loss_mask: list[int] | None = None,
               unextracted: int = 0):
    """A one-block feature store of ``segments`` with the verifier's real features (layers 1, 2, 3); loss mask 0 on
    the first two tokens and 1 after them unless given; ``unextracted`` more blocks of the same tokens, not done."""
    from stores.features.feature_store import FeatureStore

    aux, final = [], []
    with torch.no_grad():
        for seg in segments:
            out = verifier.model(input_ids=torch.tensor([seg]), output_hidden_states=True)
            aux.append(torch.stack([out.hidden_states[layer][0] for layer in (1, 2, 3)], dim=1))  # [n, L, H]
            final.append(out.last_hidden_state[0])  # [n, H] post-norm
    T = sum(map(len, segments))
    store = FeatureStore.create(path, n_blocks=1 + unextracted, block_size=T, max_segments=len(segments),
                                layers=[1, 2, 3], hidden_size=64, vocab_size=49152,
                                verifier={"name_or_path": str(verifier_dir), "architecture": "LlamaForCausalLM"})
    cu = [0]
    for seg in segments:
        cu.append(cu[-1] + len(seg))
    for i in range(1 + unextracted):
        store.write_tokens(i, sum(segments, []), [0, 0] + [1] * (T - 2) if loss_mask is None else loss_mask,
                           [p for seg in segments for p in range(len(seg))], cu)
    store.write_features(0, torch.cat(aux).bfloat16(), torch.cat(final).bfloat16())
    store.write_all_n_tokens([T] * (1 + unextracted))
    store.mark_done(0)
    return path


def saved_drafter_and_store(tiny_verifier, tiny_verifier_dir, tmp_path) -> str:
    """A tiny drafter saved under ``tmp_path / "drafter"`` and a two-segment store of its verifier; returns
    the store's path."""
    from peagle_train.model.checkpoint import save_drafter
    from tests.peagle_train.generate.test_speculative import tiny_drafter

    drafter = tiny_drafter(tiny_verifier)
    drafter.config.verifier_name_or_path = str(tiny_verifier_dir)
    save_drafter(drafter, tmp_path / "drafter")
    return make_store(str(tmp_path / "store"), tiny_verifier, tiny_verifier_dir,
                      [[1, 5, 9, 200, 300, 400, 7, 8, 9, 10], [1, 42, 43, 44, 45, 46]])


def test_cli_offline_and_online(tiny_verifier, tiny_verifier_dir, tmp_path):
    from click.testing import CliRunner

    from cli.eval import main

    store = saved_drafter_and_store(tiny_verifier, tiny_verifier_dir, tmp_path)
    prompts = write_lines(tmp_path / "p.jsonl", [{"question_id": 7, "turns": ["Hi", "Again"]}])
    result = CliRunner().invoke(main, ["--drafter", str(tmp_path / "drafter"), "--store", store,
                                       "--prompts", prompts, "--max-new-tokens", "6", "--all-anchor",
                                       "--output", str(tmp_path / "eval.json")])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["identical_to_greedy"] is True and report["num_prompts"] == 1
    assert report["sampling"] == {"top_k": 0, "top_k_from": "off", "top_p": 1.0, "top_p_from": "off"}  # recorded
    assert report["offline"]["positions_scored"] == 8 + 4  # anchors a with m_{a+2} = 1: rows 2..15 are loss 1
    assert report["offline"]["blocks"] == [0] and report["offline"]["split"] == "all"
    no_record = ("the drafter's config.json records no training store: every done block is scored as split 'all'; "
                 "some may have been trained on")
    assert report["offline"]["warnings"] == [no_record] and f"warning: {no_record}\n" in result.stderr
    assert json.loads((tmp_path / "eval.json").read_text()) == report
    assert (tmp_path / "eval.png").stat().st_size > 0
    assert report["config"]["max_new_tokens"] == 6 and report["config"]["store"] == store  # the resolved options
    printed = CliRunner().invoke(main, ["--config", str(tmp_path / "eval.json"), "--print-config"])
    assert printed.exit_code == 0 and yaml.safe_load(printed.stdout) == report["config"]  # repeatable from it
    again = CliRunner().invoke(main, ["--drafter", str(tmp_path / "drafter"), "--store", store,
                                      "--output", str(tmp_path / "eval.json")])
    assert again.exit_code == 2 and "already exists" in again.output  # never overwritten without --force
    assert json.loads((tmp_path / "eval.json").read_text()) == report


def test_cli_offline_refuses_an_incomplete_store_unless_allow_partial(tiny_verifier, tiny_verifier_dir, tmp_path):
    """A store with blocks not extracted is an error: its done blocks alone would be scored (--allow-partial)."""
    from click.testing import CliRunner

    from cli.eval import main

    saved_drafter_and_store(tiny_verifier, tiny_verifier_dir, tmp_path)
    half = make_store(str(tmp_path / "half"), tiny_verifier, tiny_verifier_dir, [[1, 5, 9, 200, 300, 400, 7, 8]],
                      unextracted=1)
    args = ["--drafter", str(tmp_path / "drafter"), "--store", half, "--no-measure-costs", "--max-new-tokens", "6"]
    refused = CliRunner().invoke(main, args)
    assert refused.exit_code != 0
    assert "is an incomplete store: 1 of 2 blocks extracted" in refused.output and "--allow-partial" in refused.output
    allowed = CliRunner().invoke(main, args + ["--allow-partial"])
    assert allowed.exit_code == 0, allowed.output
    report = json.loads(allowed.stdout)
    assert (report["blocks"], report["store_blocks_done"], report["store_blocks_total"]) == ([0], 1, 2)
    assert "warning: " + half + " is an incomplete store" in allowed.stderr


def test_cli_offline_counts_the_conversations_the_drafter_was_trained_on(tiny_verifier, tiny_verifier_dir, tmp_path):
    """A drafter records the hashes of its training segments; the judged segments found there are counted (the
    report's ``contamination`` and a warning), all of them when it was trained on the very conversations."""
    from click.testing import CliRunner

    from cli.eval import main
    from peagle_train.data.segment_hashes import segment_hashes
    from peagle_train.model.checkpoint import load_drafter, save_drafter
    from stores.features.feature_store import FeatureStore

    store = saved_drafter_and_store(tiny_verifier, tiny_verifier_dir, tmp_path)
    args = ["--drafter", str(tmp_path / "drafter"), "--store", store, "--no-measure-costs", "--max-new-tokens", "6"]
    unknown = json.loads(CliRunner().invoke(main, args).stdout)["contamination"]
    assert "records no training segments" in unknown["skipped"]
    tokens = FeatureStore.open(store).read_tokens(0)
    trained = np.append(segment_hashes(tokens["input_ids"], tokens["cu_seqlens"]), np.uint64(12345))
    save_drafter(load_drafter(tmp_path / "drafter"), tmp_path / "drafter", training_segments=trained)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["contamination"] == {"segments": 2, "in_training": 2, "training_segments": 3}
    assert "warning: contamination: 2 of the 2 segments scored" in result.stderr
    save_drafter(load_drafter(tmp_path / "drafter"), tmp_path / "drafter", training_segments=trained[-1:])
    clean = CliRunner().invoke(main, args)
    assert json.loads(clean.stdout)["contamination"] == {"segments": 2, "in_training": 0, "training_segments": 1}
    assert "contamination: none of the 2 segments scored is among the 1 " in clean.stderr


def test_cli_refuses_drafting_past_the_trained_depths(tiny_verifier, tmp_path):
    """--num-draft-tokens above the drafter's num_depths is refused before any weights load (§9)."""
    from click.testing import CliRunner

    from cli.eval import main
    from peagle_train.model.checkpoint import save_drafter
    from tests.peagle_train.generate.test_speculative import tiny_drafter

    save_drafter(tiny_drafter(tiny_verifier, num_depths=4), tmp_path / "drafter")
    prompts = write_lines(tmp_path / "two.jsonl", [{"question_id": 1, "turns": ["Hi"]}, {"question_id": 2, "turns": ["Yo"]}])
    result = CliRunner().invoke(main, ["--drafter", str(tmp_path / "drafter"), "--prompts", prompts,
                                       "--num-draft-tokens", "6"])
    assert result.exit_code == 2, result.output
    assert ("field '--num-draft-tokens': --num-draft-tokens 6 exceeds the drafter's trained num_depths 4: depths "
            "4..5 were never trained; use at most 4 (or train with --num-depths 6)") in result.output


def test_select_eval_blocks_uses_the_recorded_split_of_this_store_only(tmp_path):
    import numpy as np

    from peagle_train.data.loader import split_blocks
    from peagle_train.evaluate.offline import select_eval_blocks
    from peagle_train.data.multistore import store_identity

    path = str(tmp_path / "s.zarr")
    store = SimpleNamespace(path=path, n_blocks=10, layers=[1, 2, 3], done_mask=lambda: np.array(
        [1, 1, 0, 1, 1, 1, 1, 1, 1, 1], dtype=bool), attrs={"source": "sha", "verifier": {"fingerprint": "f"}})
    entry = {"path": "/elsewhere/s.zarr", **store_identity(store), "first_block": 4}  # a copy, 2nd of two stores
    incomplete = f"{path} is an incomplete store: 9 of 10 blocks extracted; only those are scored"
    v2 = {"rule": "conversation_groups", "version": 2}  # split by conversation (docs/design.md §8)
    chosen = select_eval_blocks(store, {"peagle_training": {"stores": [entry], "val_blocks": [1, 6, 7, 11, 14],
                                                            "split": v2}})
    assert (chosen.ids, chosen.split, chosen.warnings) == ([3, 7], "validation", [incomplete])  # 6 is block 2: not done
    assert chosen.report() == {"split": "validation", "blocks": [3, 7], "store_blocks_done": 9,
                               "store_blocks_total": 10, "warnings": [incomplete]}
    chosen = select_eval_blocks(store, {"peagle_training": {"stores": [entry], "val_blocks": [1, 2]}})
    assert (chosen.ids[:2], chosen.split) == ([0, 1], "training")  # it held out none of this store
    assert chosen.warnings[1] == f"the training run held out no block of {path}: every block scored was trained on"
    chosen = select_eval_blocks(store, {"peagle_training": {"stores": [entry], "val_blocks": [1, 6]}})
    assert (chosen.ids[:2], chosen.split) == ([0, 1], "training")  # its held-out block 2 is not extracted here
    assert chosen.warnings[1] == (f"none of the 1 block(s) the training run held out of {path} is extracted "
                                  "(first: [2]): every block scored is a training block")
    foreign = {"peagle_training": {"stores": [dict(entry, source="other")], "val_blocks": [6, 7]}}
    chosen = select_eval_blocks(store, foreign, max_blocks=2)
    off = {**chosen.report(), "num_depths": 1, "positions_scored": 5, "simulated_acceptance_length": 1.5,
           "per_depth_accuracy": [0.5], "per_position_acceptance": [0.5]}
    assert "offline: 2 blocks (other_store; incomplete store: 9 of 10 blocks done), 5 positions" in format_report(off)
    one = {**off, "blocks": [0], "positions_scored": 1}
    assert "offline: 1 block (other_store; incomplete store: 9 of 10 blocks done), 1 position\n" in format_report(one)
    assert (chosen.ids, chosen.split) == ([0, 1], "other_store")
    assert chosen.warnings[1].startswith(f"{path} is not a store this drafter was trained on (it was trained on "
                                         "/elsewhere/s.zarr; ")
    # checkpoints that record only the store's path (and maybe only seed / val_fraction)
    _, val = split_blocks(np.array([0, 1, 3, 4, 5, 6, 7, 8, 9]), 5, 0.3)
    chosen = select_eval_blocks(store, {"peagle_training": {"store": path, "seed": 5, "val_fraction": 0.3}})
    assert (chosen.ids, chosen.split) == (val.tolist(), "validation")
    assert chosen.warnings[1] == (f"the training run drew its validation split of {path} over blocks alone (an "
                                  "earlier peagle), so its held-out blocks may share conversations (windows, mixture "
                                  "copies) with its training blocks; the 'validation' scores may include memorised "
                                  "conversations")
    chosen = select_eval_blocks(store, {"peagle_training": {"store": "other.zarr", "val_blocks": [3]}})
    assert (chosen.ids, chosen.split) == ([0, 1, 3, 4, 5, 6, 7, 8, 9], "other_store")
    assert chosen.warnings[1] == (f"{path} is not the store this drafter was trained on (other.zarr): every done "
                                  "block is scored as split 'other_store', none of them is held-out validation data")
    chosen = select_eval_blocks(store, {}, max_blocks=2)
    assert (chosen.ids, chosen.split) == ([0, 1], "all")
    assert chosen.warnings[1] == ("the drafter's config.json records no training store: every done block is scored "
                                  "as split 'all'; some may have been trained on")


@pytest.mark.parametrize("layer_type, num_layers", [("llama", 1), ("qwen3", 1), ("qwen3", 2)])
def test_offline_chains_are_the_online_drafts(tiny_verifier, layer_type, num_layers):
    """§4 both ways: offline element (a, d) is exactly what online decoding drafts at t = a (the drafter
    cache of online decoding and the offline backend, for each layer type and depth of stack)."""
    from peagle_train.evaluate.offline import segment_predictions
    from peagle_train.generate.speculative import draft_tokens
    from tests.peagle_train.generate.test_speculative import tiny_drafter

    drafter = tiny_drafter(tiny_verifier, draft_vocab_size=512, num_depths=3, layer_type=layer_type,
                           num_layers=num_layers)
    x = torch.tensor([1, 504, 3458, 282, 260, 1115, 30, 77, 78, 79, 80, 81])
    with torch.no_grad():
        hs = tiny_verifier.model(input_ids=x[None], output_hidden_states=True).hidden_states
    g = torch.cat([hs[layer][0] for layer in (1, 2, 3)], dim=-1)  # [n, 3*64]
    block = SimpleNamespace(input_ids=x, position_ids=torch.arange(len(x)), aux_hidden=g)
    pred = segment_predictions(drafter, block, 0, len(x), 3, chunk_anchors=4)  # [n-2, 3]
    for t in range(len(x) - 2):
        online = draft_tokens(drafter, x[:t + 2], g[:t + 1], 3)  # verifier ids
        k = min(3, len(x) - 2 - t)  # depths that exist offline
        assert torch.equal(drafter.draft_ids[pred[t, :k]], online[:k]), t
        assert bool((pred[t, k:] == -1).all())


def _fake_checks(monkeypatch, ev):
    """``plan_eval``'s checks of the inputs stood in for (a fake checkpoint, prompts file and store): the verifier
    ``v``, the store's replay limit 128."""
    from peagle_train.evaluate.checks import CheckedInputs
    from peagle_train.generate.speculative import Truncation

    monkeypatch.setattr(ev, "check_before_weights", lambda drafter, verifier, prompts, store, *a: CheckedInputs(
        prompts=[] if prompts else None, online_verifier="v" if prompts else None, store=store,
        offline_verifier="v" if store else None))
    monkeypatch.setattr(ev, "served_truncation", lambda *a: (Truncation(), {}))
    monkeypatch.setattr(ev, "check_complete", lambda *a: None)
    monkeypatch.setattr(ev, "replay_max_new_tokens", lambda store, given: (128, "default"))


def test_cli_fails_on_a_mismatch_naming_the_prompt(monkeypatch, tmp_path):
    from click.testing import CliRunner

    import peagle_train.evaluate.run as ev
    from cli.eval import main

    fake = {"acceptance_length": 1.0, "acceptance_rate": 0.0, "per_position_acceptance": [0.0], "num_prompts": 2,
            "num_turns": 2, "num_draft_tokens": 1, "accepted": 0, "drafted": 3, "tokens_per_second": 1.0,
            "baseline_tokens_per_second": 1.0, "speedup": 1.0, "identical_to_greedy": False, "mismatches": ["81", "x"]}
    monkeypatch.setattr(ev, "plan_online_report", lambda plan, log: dict(fake))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    for name in ("config.json", "model.safetensors"):  # looks like a checkpoint; never loaded here
        (tmp_path / "d" / name).write_text("{}")
    _fake_checks(monkeypatch, ev)
    result = CliRunner().invoke(main, ["--drafter", "d", "--prompts", "p.jsonl"])
    assert result.exit_code == 1
    assert json.loads(result.stdout)["mismatches"] == ["81", "x"]
    assert "prompts 81, x" in result.stderr


def test_cli_exits_0_when_every_difference_is_a_near_tie(monkeypatch, tmp_path):
    """bf16 greedy runs that differ only at near ties of the verifier's top-2 logits (counted) are not failures."""
    from click.testing import CliRunner

    import peagle_train.evaluate.run as ev
    from cli.eval import main

    fake = {"acceptance_length": 1.0, "acceptance_rate": 0.0, "per_position_acceptance": [0.0], "num_prompts": 2,
            "num_turns": 2, "num_draft_tokens": 1, "accepted": 0, "drafted": 3, "tokens_per_second": 1.0,
            "baseline_tokens_per_second": 1.0, "speedup": 1.0, "identical_to_greedy": False, "mismatches": [],
            "near_tie_divergences": 2, "near_tie_prompts": ["81"], "greedy_check": {"dtype": "bfloat16", "rule": "r"}}
    monkeypatch.setattr(ev, "plan_online_report", lambda plan, log: dict(fake))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "d" / name).write_text("{}")
    _fake_checks(monkeypatch, ev)
    result = CliRunner().invoke(main, ["--drafter", "d", "--prompts", "p.jsonl"])
    assert result.exit_code == 0, result.stderr
    assert "2 turns diverge at a near tie of the verifier's top logits in bfloat16: accepted" in result.stderr


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_report_and_plot_name_the_acceptance_scheme(tiny_verifier, smollm2_tokenizer, tmp_path, monkeypatch, method):
    """At T > 0 the scheme decides the acceptance: the JSON, the text summary, the plot title and legend name it."""
    from tests.peagle_train.generate.test_speculative import tiny_drafter
    from peagle_train.evaluate.report import write_acceptance_plot

    cfg = EvalConfig(max_new_tokens=5, num_draft_tokens=2, temperature=0.7, seed=3, warmup=False,
                     measure_costs=False, draft_sample_method=method)
    report = evaluate_prompts(tiny_verifier, tiny_drafter(tiny_verifier), smollm2_tokenizer,
                              [Prompt("a", ["Hello there"])], cfg, recurrent_layers=[])
    scheme = report["acceptance_scheme"]
    assert report["draft_sample_method"] == method
    assert scheme.startswith(f"rejection sampling at T=0.7, draft_sample_method={method} (")
    assert scheme in format_report(report)
    figs = _captured_figures(monkeypatch)
    write_acceptance_plot(report, tmp_path / "eval.png")
    assert scheme in figs[0].axes[0].get_title()
    assert [t.get_text() for t in figs[0].legends[0].get_texts()] == [
        f"online (peagle): share of verifier steps accepting draft i, T=0.7, {method} drafts"]
    greedy = evaluate_prompts(tiny_verifier, tiny_drafter(tiny_verifier), smollm2_tokenizer,
                              [Prompt("a", ["Hello there"])], EvalConfig(max_new_tokens=3, warmup=False,
                                                                          measure_costs=False),
                              recurrent_layers=[])
    assert greedy["acceptance_scheme"] == "greedy verification (T=0)" and greedy["draft_sample_method"] is None


def test_online_report_with_temperature(tiny_verifier, smollm2_tokenizer):
    from tests.peagle_train.generate.test_speculative import tiny_drafter

    prompts = [Prompt("a", ["Hello there"])]
    cfg = EvalConfig(max_new_tokens=6, num_draft_tokens=2, temperature=0.7, seed=3, warmup=False)
    report = evaluate_prompts(tiny_verifier, tiny_drafter(tiny_verifier), smollm2_tokenizer, prompts, cfg,
                              recurrent_layers=[])
    again = evaluate_prompts(tiny_verifier, tiny_drafter(tiny_verifier), smollm2_tokenizer, prompts, cfg,
                             recurrent_layers=[])
    assert report["identical_to_greedy"] is None and report["mismatches"] == []  # samples are not compared
    assert report["temperature"] == 0.7 and report["seed"] == 3
    assert report["per_prompt"] == again["per_prompt"]  # seeded
    assert "plain sampling" in format_report(report)
    with pytest.raises(ValueError, match="--temperature"):
        EvalConfig(temperature=-0.5)


@pytest.mark.parametrize("eos,scored,mean,pos", [
    # EOT (15) is x_5: anchor 1 accepts d0, d1 and stops before d2 (target EOT); anchor 2 accepts
    # d0 and stops before d1; anchor 3's depth-0 target is EOT, so it is not counted.
    ((15,), 4, 1.5, [1.0, 1.0, None]),
    # 14 and 15 both end generation: anchor 1 accepts d0 only; anchors 2, 3 are not counted.
    ((14, 15), 2, 1.0, [1.0, None, None]),
    ((), 6, 2.0, [1.0, 1.0, 1.0]),
])
def test_offline_chains_stop_before_an_eos_target(eos, scored, mean, pos):
    """Online, an EOS ends the output whether drafted or not; offline chains count the same way."""
    report = evaluate_offline(RuleDrafter(), [worked_block()], torch.eye(V, H), eos_token_ids=eos)
    assert report["positions_scored"] == scored
    assert report["mean_accepted"] == pytest.approx(mean)
    assert report["simulated_acceptance_length"] == pytest.approx(1 + mean)
    assert report["per_position_acceptance"] == pos
    assert report["per_depth_accuracy"] == [1.0, 1.0, 1.0]  # accuracy still scores every element
    assert report["per_depth_weight"] == [6, 6, 4]


def test_cli_drafter_given_a_training_output_uses_final_else_the_newest_checkpoint(monkeypatch, tmp_path):
    from click.testing import CliRunner

    import cli.eval
    import peagle_train.evaluate.run as ev
    from cli.eval import main

    used = []  # the fake offline report holds no acceptance: --no-measure-costs below
    monkeypatch.setattr(ev, "plan_offline_report", lambda plan, log: used.append(plan.drafter) or {"blocks": []})
    monkeypatch.setattr(cli.eval, "format_report", lambda report: "")
    _fake_checks(monkeypatch, ev)  # the fake checkpoints hold "{}"
    monkeypatch.setattr(ev, "template_mode", lambda *a, **k: {"chat_template_kwargs": {}, "mismatches": []})
    out = tmp_path / "run"
    for sub in ("checkpoint-2", "checkpoint-10", "final"):
        (out / sub).mkdir(parents=True)
        for name in ("config.json", "model.safetensors"):
            (out / sub / name).write_text("{}")
    for sub in ("checkpoint-2", "checkpoint-10"):
        (out / sub / "training_state.pt").write_text("")

    result = CliRunner().invoke(main, ["--drafter", str(out), "--store", "s.zarr", "--no-measure-costs"])
    assert result.exit_code == 0, result.output
    assert used == [str(out / "final")]
    assert f"{out} is a training output: using its final checkpoint {out / 'final'}" in result.stderr
    import shutil

    shutil.rmtree(out / "final")  # an unfinished run: its newest complete checkpoint
    result = CliRunner().invoke(main, ["--drafter", str(out), "--store", "s.zarr", "--no-measure-costs"])
    assert result.exit_code == 0 and used[-1] == str(out / "checkpoint-10")
    assert f"using its newest checkpoint {out / 'checkpoint-10'}" in result.stderr
    result = CliRunner().invoke(main, ["--drafter", str(out / "final"), "--store", "s.zarr", "--no-measure-costs"])
    assert result.exit_code == 2 and "is not a drafter checkpoint" in result.stderr
    result = CliRunner().invoke(main, ["--drafter", str(out / "checkpoint-2"), "--store", "s.zarr", "--no-measure-costs"])
    assert result.exit_code == 0 and used[-1] == str(out / "checkpoint-2") and "using" not in result.stderr


# ------------------------------------------------------------------ plots
def test_wilson_interval_known_values():
    from peagle_train.evaluate.report import wilson_interval

    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = wilson_interval(5, 10)
    assert (lo, hi) == (pytest.approx(0.2366, abs=1e-4), pytest.approx(0.7634, abs=1e-4))
    lo, hi = wilson_interval(1, 1)
    assert lo == pytest.approx(0.2065, abs=1e-4) and hi == 1.0
    assert wilson_interval(0, 0) is None
    # the interval holds p exactly even where rounding put a bound past it (0 of 11, 6 of 6 ...), so
    # the plot's error bars p - lo and hi - p are never negative
    for n in range(1, 200):
        for a in range(n + 1):
            lo, hi = wilson_interval(a, n)
            assert 0.0 <= lo <= a / n <= hi <= 1.0, (a, n)
    assert wilson_interval(0, 11)[0] == 0.0 and wilson_interval(6, 6)[1] == 1.0


def _captured_figures(monkeypatch):
    """Keep the figures that plotting code closes, to inspect them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    return figs


ONLINE = {"acceptance_length": 1.14, "num_draft_tokens": 3, "num_turns": 4, "num_drafts": 50,
          "per_position_accepted": [7, 2, 0], "per_position_reached": [50, 7, 2],
          "per_position_acceptance": [0.14, 2 / 7, 0.0]}
OFFLINE = {"simulated_acceptance_length": 1.31, "positions_scored": 2200, "blocks": [1, 2],
           "per_position_accepted": [600, 90, 20], "per_position_reached": [2200, 600, 90],
           "per_depth_correct": [600, 300, 200], "per_depth_weight": [2200, 2180, 2160], "num_depths": 3}


@pytest.mark.parametrize("report", [ONLINE, {**ONLINE, "offline": OFFLINE}, {"offline": OFFLINE},
                                    {**ONLINE, "per_position_accepted": [6, 0, 0], "per_position_reached": [6, 11, 0]}],
                         ids=["online", "both", "offline-only", "all-or-nothing"])
def test_acceptance_plot_has_integer_positions_title_and_counts(tmp_path, monkeypatch, report):
    from peagle_train.evaluate.report import write_acceptance_plot

    figs = _captured_figures(monkeypatch)
    path = write_acceptance_plot(report, tmp_path / "eval.png")
    assert path.stat().st_size > 0
    ax = figs[0].axes[0]
    assert list(ax.get_xticks()) == [0, 1, 2]
    title = ax.get_title()
    texts = {t.get_text() for t in ax.texts}
    if "acceptance_length" in report:
        assert "online: acceptance length 1.140 (K=3, 4 turns, 50 verifier steps" in title
        assert {"n=6", "n=11", "n=0"} <= texts if report["per_position_reached"][0] == 6 else \
            {"n=50", "n=7", "n=2"} <= texts
    if "offline" in report:
        assert "offline: all-anchor acceptance length (diagnostic) 1.310 (2200 positions, 2 blocks)" in title
        assert {"n=2200", "n=600", "n=90"} <= texts
    from matplotlib.container import BarContainer

    labels = [t.get_text() for t in figs[0].legends[0].get_texts()]
    assert labels == [name for key, name in (
        ("acceptance_length", "online (peagle): share of verifier steps accepting draft i"),
        ("offline", "offline: P(accept | earlier accepted)"), ("offline", "offline: per-depth accuracy"))
        if key in report]
    assert sum(isinstance(c, BarContainer) for c in ax.containers) == ("acceptance_length" in report) + ("offline" in report)


VLLM_ONLINE = {**ONLINE, "engine": "vllm", "num_prompts": 2, "identical_to_greedy": True, "accepted": 9,
               "drafted": 150, "acceptance_rate": 0.06, "tokens_per_second": 61.0, "baseline_tokens_per_second": 60.0,
               "speedup": 1.017, "temperature": 0.0,
               "throughput": {"1": {"plain": 60.0, "speculative": 61.0, "speedup": 1.017},
                              "8": {"plain": 400.0, "speculative": 224.0, "speedup": 0.56}}}


def test_vllm_summary_and_plot_show_every_concurrency_and_name_the_engine(tmp_path, monkeypatch):
    # issue 34 item 4: the summary printed concurrency 1 only (1.017x); 0.56x at 8 was in the JSON alone
    from peagle_train.evaluate.report import write_acceptance_plot

    text = format_report(VLLM_ONLINE)
    assert "  tokens/s (vLLM, per concurrency: requests running together)" in text
    assert "    concurrency 1   61.000 speculative, 60.000 greedy (speedup 1.017)" in text
    assert "    concurrency 8   224.000 speculative, 400.000 greedy (speedup 0.560)" in text
    figs = _captured_figures(monkeypatch)
    write_acceptance_plot(VLLM_ONLINE, tmp_path / "eval.png")
    assert "vLLM tokens/s speedup: 1.017x at concurrency 1, 0.560x at concurrency 8" in figs[0].axes[0].get_title()
    assert [t.get_text() for t in figs[0].legends[0].get_texts()] == [
        "online (vLLM): share of verifier steps accepting draft i"]
    peagle = {**VLLM_ONLINE, "engine": None, "throughput": None}
    assert "(speedup 1.017)" in format_report(peagle) and "concurrency" not in format_report(peagle)


def test_reports_carry_the_counts_behind_each_rate():
    report = evaluate_offline(RuleDrafter(wrong_depth=1), [worked_block(), worked_block(1)], torch.eye(V, H))
    assert report["per_position_reached"] == [9, 6, 0] and report["per_position_accepted"] == [9, 0, 0]
    assert report["per_position_acceptance"] == [1.0, 0.0, None]


def test_cli_offline_refuses_a_chunk_altered_in_place_naming_the_block(tiny_verifier, tiny_verifier_dir, tmp_path):
    """Issue 33: a same-size overwrite of a store's aux_hidden chunk once scored a lower acceptance length
    with exit 0; now every read checks the chunk's crc32c: exit 2, the block and the repair command, no report."""
    from click.testing import CliRunner

    from cli.eval import main
    from stores.features.feature_store import FeatureStore

    store = saved_drafter_and_store(tiny_verifier, tiny_verifier_dir, tmp_path)
    chunk = FeatureStore.open(store).chunk_path("aux_hidden", 0)
    data = bytearray(chunk.read_bytes())
    data[40] ^= 0xFF
    chunk.write_bytes(bytes(data))
    result = CliRunner().invoke(main, ["--drafter", str(tmp_path / "drafter"), "--store", store, "--no-measure-costs",
                                       "--output", str(tmp_path / "eval.json")])
    assert result.exit_code == 2, result.output
    assert "block 0 cannot be trusted" in result.output and "crc32c checksum does not match" in result.output
    assert "--resume" in result.output and not (tmp_path / "eval.json").exists()


# ------------------------------------------------------------------ a served mixture of template modes (issue 32)
MIXED_PROMPTS = [{"question_id": 1, "turns": ["Hi", "Again"]}, *({"question_id": i, "turns": [f"Question {i}?"]}
                                                                   for i in range(2, 8))]


def _harmony_template_drafter(tiny_verifier, tiny_verifier_dir, tmp_path, trained_kwargs) -> tuple[str, object]:
    """The tiny verifier with the Harmony-style template (reasoning_effort in its system message) and a tiny
    drafter saved for it, whose checkpoint records the template variables its data was rendered with."""
    import shutil

    from transformers import AutoTokenizer

    from peagle_train.model.checkpoint import save_drafter
    from tests.chat_templates import template
    from tests.peagle_train.generate.test_speculative import tiny_drafter

    verifier = tmp_path / "verifier"
    shutil.copytree(tiny_verifier_dir, verifier)
    tok = AutoTokenizer.from_pretrained(verifier)
    tok.chat_template = template("harmony")
    tok.save_pretrained(verifier)
    drafter = tiny_drafter(tiny_verifier)
    drafter.config.verifier_name_or_path = str(verifier)
    save_drafter(drafter, tmp_path / "drafter")
    config_file = tmp_path / "drafter" / "config.json"
    config = json.loads(config_file.read_text())
    config["peagle_training"] = {**config.get("peagle_training", {}),
                                 "tokenizer": {"name_or_path": str(verifier), "chat_template_kwargs": trained_kwargs}}
    config_file.write_text(json.dumps(config))
    return str(tmp_path / "drafter"), tok


def test_cli_measures_a_reasoning_effort_mixture_per_prompt_and_per_mode(tiny_verifier, tiny_verifier_dir, tmp_path):
    """peagle-eval --reasoning-effort '{"low": 1, "high": 1}': each prompt draws its effort from --seed and its id
    (as regenerate draws a row's), all its turns are rendered in it, and the report gives each turn's mode and
    the acceptance per mode, whose counts add up to the run's."""
    from click.testing import CliRunner

    from cli.eval import main
    from peagle_train.evaluate.prompts import prompt_modes
    from runtime.chat.setting_mixtures import parse_mixture, template_value

    drafter, tok = _harmony_template_drafter(tiny_verifier, tiny_verifier_dir, tmp_path, {})
    prompts_file = write_lines(tmp_path / "p.jsonl", MIXED_PROMPTS)
    result = CliRunner().invoke(main, ["--drafter", drafter, "--prompts", prompts_file, "--max-new-tokens", "4",
                                       "--no-measure-costs", "--seed", "3",
                                       "--reasoning-effort", '{"low": 1, "high": 1}'])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    prompts = read_prompts(prompts_file)
    expected = prompt_modes(prompts, {}, {"reasoning_effort": parse_mixture({"low": 1, "high": 1}, "",
                                                                            template_value)}, 3)
    by_id = {p.prompt_id: m for p, m in zip(prompts, expected)}
    assert [t["chat_template_kwargs"] for t in report["per_prompt"]] == [by_id[t["prompt_id"]]
                                                                         for t in report["per_prompt"]]
    assert {m["reasoning_effort"] for m in expected} == {"low", "high"}
    for t in report["per_prompt"]:  # each turn's prompt is its mode's render
        prompt = next(p for p in prompts if p.prompt_id == t["prompt_id"])
        if t["turn"] == 0:
            assert t["prompt_tokens"] == len(render_turn(tok, prompt, 0, [], t["chat_template_kwargs"]))
    assert report["per_prompt"][1]["chat_template_kwargs"] == report["per_prompt"][0]["chat_template_kwargs"]
    per_mode = report["per_mode"]
    assert set(per_mode) == {'{"reasoning_effort": "low"}', '{"reasoning_effort": "high"}'}
    for key in ("accepted", "drafted", "num_drafts"):
        assert sum(m[key] for m in per_mode.values()) == report[key]
    assert sum(m["prompts"] for m in per_mode.values()) == 7 and sum(m["turns"] for m in per_mode.values()) == 8
    for m in per_mode.values():
        assert m["acceptance_length"] == 1 + m["accepted"] / m["num_drafts"]
    assert report["template_mode"]["mixture"] == {"reasoning_effort": {"low": 0.5, "high": 0.5}}
    assert report["template_mode"]["seed"] == 3 and report["identical_to_greedy"] is True
    assert "per template mode (the mixture, drawn per prompt)" in result.stderr
    assert '    {"reasoning_effort": "low"}: ' in result.stderr


def test_cli_refuses_a_mixture_outside_the_drafters_fixed_mode_unless_allowed(tiny_verifier, tiny_verifier_dir,
                                                                               tmp_path):
    from click.testing import CliRunner

    from cli.eval import main

    drafter, _ = _harmony_template_drafter(tiny_verifier, tiny_verifier_dir, tmp_path, {"reasoning_effort": "high"})
    prompts_file = write_lines(tmp_path / "p.jsonl", MIXED_PROMPTS[1:3])
    args = ["--drafter", drafter, "--prompts", prompts_file, "--max-new-tokens", "2", "--no-measure-costs",
            "--reasoning-effort", '{"low": 1, "high": 1}']
    refused = CliRunner().invoke(main, args)
    assert refused.exit_code == 2, refused.output
    assert 'was trained on data rendered with reasoning_effort "high"' in refused.output
    allowed = CliRunner().invoke(main, [*args, "--allow-template-mode-mismatch"])
    assert allowed.exit_code == 0, allowed.output
    report = json.loads(allowed.stdout)
    assert report["template_mode"]["mismatch_allowed"] is True and report["template_mode"]["chat_template_kwargs"] == {}
    assert {t["chat_template_kwargs"]["reasoning_effort"] for t in report["per_prompt"]} <= {"low", "high"}
    twice = CliRunner().invoke(main, [*args, "--chat-template-kwargs", '{"reasoning_effort": "high"}'])
    assert twice.exit_code == 2 and "reasoning_effort given both by --chat-template-kwargs" in twice.output
