"""``peagle-data regenerate``: the turn logic, the local back end on a tiny random verifier, resume,
rejects, greedy without the verifier's generation_config, the generated token ids and tokenize on them,
decoding without clean-up, and the server back end against a real ``transformers serve`` and a real
vLLM server (the real SmolLM2) started on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli.data import main as data_main
from peagle_data.readers.rows import Conversation
from peagle_data.regenerate.run import RegenerateConfig, RegenerateRun, Regeneration, prompt_drops, run_regenerate
from peagle_data.regenerate.backends import (Answer, LocalBackend, Request, ServerBackend, _answer_of,
                                            _with_template_kwargs, check_effort_field, prompt_tokens, split_reasoning)
from tests.chat_templates import qwen_tokenizer, template
from stores.errors import InputError, OutputExistsError

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from families import HYBRID, save_family  # noqa: E402
from servers import free_port, start, stop, wait_until_up  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
ROWS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                  {"role": "assistant", "content": "old 1"}, {"role": "user", "content": "And then?"},
                  {"role": "assistant", "content": "old 2"}]},
    {"conversations": [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "4"}]},
    {"messages": [{"role": "user", "content": "only a question"}]},
    {"id": "tool1", "tools": TOOLS,
     "messages": [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                  {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}]},
    {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Red."}]},
]


def write_rows(path: Path, rows=ROWS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def without_token_ids(path: Path) -> list[dict]:
    """The rows of ``path`` without the assistant turns' ``token_ids`` (a server that returns none)."""
    return [{**r, "messages": [{k: v for k, v in m.items() if k != "token_ids"} for m in r["messages"]]}
            for r in lines(path)]


# --------------------------------------------------------------------------------------------
# turn logic (a scripted answerer: the logic under test is which history each turn sees)


class Scripted:
    """Answers ``A<n>`` where n is the number of messages the request holds; scripted overrides by n."""

    workers = 1
    record = {"backend": "scripted"}

    def __init__(self, overrides=None):
        self.requests, self.overrides = [], overrides or {}

    def answer(self, req):
        self.requests.append(req.messages)
        return self.overrides.get(len(req.messages), Answer(content=f"A{len(req.messages)}", completion_tokens=1))

    def generate(self, reqs):
        return [self.answer(r) for r in reqs]


def drive(conv, turns="all", backend=None, on_truncated="keep"):
    backend = backend or Scripted()
    job = Regeneration(conv, turns, on_truncated)
    while (req := job.next_request()) is not None:
        job.feed(backend.answer(req))
    return job, backend


def conv(messages, tools=None):
    return Conversation(conversation_id="c", source="f:1", messages=messages, tools=tools)


def test_every_assistant_turn_sees_the_regenerated_history():
    msgs = ROWS[0]["messages"]
    job, backend = drive(conv(msgs))
    assert job.reject is None
    assert job.row()["messages"] == [msgs[0], msgs[1], {"role": "assistant", "content": "A2"}, msgs[3],
                                     {"role": "assistant", "content": "A4"}]
    assert backend.requests == [msgs[:2], [msgs[0], msgs[1], {"role": "assistant", "content": "A2"}, msgs[3]]]


def test_turns_last_keeps_the_original_history():
    msgs = ROWS[0]["messages"]
    job, backend = drive(conv(msgs), turns="last")
    assert job.row()["messages"] == msgs[:4] + [{"role": "assistant", "content": "A4"}]
    assert backend.requests == [msgs[:4]]


def test_tool_call_turns_are_kept_and_the_turn_after_the_result_is_regenerated():
    msgs = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."},
            {"role": "user", "content": "thanks"}]
    job, backend = drive(conv(msgs, TOOLS))
    assert job.row() == {"id": "c", "tools": TOOLS, "messages": msgs[:3] + [{"role": "assistant", "content": "A3"}]
                         + msgs[4:]}
    assert backend.requests == [msgs[:3]]
    only_calls = conv(msgs[:3])
    assert drive(only_calls)[0].reject == "nothing to regenerate: every assistant turn calls tools"


def test_a_verifier_tool_call_ends_the_conversation_there():
    msgs = ROWS[0]["messages"]
    call = [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]
    job, _ = drive(conv(msgs), backend=Scripted({2: Answer(content="", tool_calls=call, finish_reason="tool_calls")}))
    assert job.row()["messages"] == msgs[:2] + [{"role": "assistant", "content": "", "tool_calls": call}]
    assert job.ended_at_tool_call


def test_empty_answers_and_errors_reject_the_row():
    msgs = ROWS[0]["messages"]
    assert drive(conv(msgs), backend=Scripted({4: Answer(content="")}))[0].reject == \
        "empty answer: assistant turn 4 (message 5)"
    assert drive(conv(msgs), backend=Scripted({2: Answer(error="server error: x")}))[0].reject == "server error: x"
    job, _ = drive(conv(msgs), backend=Scripted({2: Answer(content="", reasoning="hmm")}))
    assert job.row()["messages"][2] == {"role": "assistant", "content": "", "reasoning_content": "hmm"}


def test_on_truncated_drop_rejects_the_row_and_keep_keeps_the_answer():
    msgs = ROWS[0]["messages"]
    cut = Scripted({2: Answer(content="A2 cut", finish_reason="length")})
    job, _ = drive(conv(msgs), backend=cut, on_truncated="drop")
    assert job.reject == "truncated answer: assistant turn 2 (message 3) was cut at --max-new-tokens (--on-truncated drop)"
    job, _ = drive(conv(msgs), backend=cut)  # marked, so that tokenize supervises no end-of-turn after it
    assert job.row()["messages"][2] == {"role": "assistant", "content": "A2 cut", "finish_reason": "length"}
    with pytest.raises(ValueError, match="--on-truncated must be one of"):
        RegenerateConfig(on_truncated="trim")


def test_turns_first_regenerates_the_first_turn_and_ends_the_conversation_there():
    msgs = ROWS[0]["messages"]
    job, backend = drive(conv(msgs), turns="first")
    assert job.row()["messages"] == msgs[:2] + [{"role": "assistant", "content": "A2"}]
    assert backend.requests == [msgs[:2]]
    tool_first = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                  {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}]
    assert drive(conv(tool_first, TOOLS), turns="first")[0].reject == \
        "nothing to regenerate: the first assistant turn calls tools"


def test_echo_summary_names_the_token_limit_and_the_cut_turns(capsys):
    from cli.data_regenerate import _echo_summary

    counts = {"read": 2, "written": 2, "rejected": 0, "rejected_by_reason": {}, "turns_regenerated": 6,
              "turns_truncated": 4, "turns_cut_mid_character": 1, "prompt_tokens": 10, "completion_tokens": 60,
              "conversations_with_dropped_content": 0}
    _echo_summary({"counts": counts, "resumed_rows": 0}, "o.jsonl", 16)
    assert capsys.readouterr().out.splitlines()[1] == (
        "turns regenerated 6 (4 cut at --max-new-tokens 16, 1 of them inside a character, dropped)  "
        "prompt tokens 10  completion tokens 60")


def _completion(content, finish, reasoning=None):
    from types import SimpleNamespace as NS

    msg = NS(content=content, tool_calls=None, model_extra={"reasoning_content": reasoning} if reasoning else {})
    return NS(choices=[NS(message=msg, finish_reason=finish)], usage=NS(prompt_tokens=5, completion_tokens=16))


def test_server_answers_cut_inside_a_character_end_before_it():
    a = _answer_of(_completion("Bonjour, je m'appelle l'Américan. \ufffd", "length"))
    assert (a.content, a.cut_partial_char, a.finish_reason, a.error) == \
        ("Bonjour, je m'appelle l'Américan. ", True, "length", None)
    r = _answer_of(_completion("", "length", reasoning="plan \ufffd"))
    assert (r.content, r.reasoning, r.cut_partial_char) == ("", "plan ", True)
    whole = _answer_of(_completion("ok 😀", "length"))
    assert (whole.content, whole.cut_partial_char) == ("ok 😀", False)
    inner = _answer_of(_completion("a \ufffd b", "stop"))
    assert inner.error.startswith("undecodable answer: the server's answer holds U+FFFD other than at a cut")
    assert _answer_of(_completion("a \ufffd", "stop")).error.startswith("undecodable answer")


def test_a_server_answer_writing_a_closing_think_tag_is_content_when_the_prompt_opened_no_block():
    text = "The tag </think> closes it."
    a = _answer_of(_completion(text, "stop"), prompt_opened=False)  # the prompt rendered with --tokenizer
    assert (a.content, a.reasoning) == (text, None)
    assert _answer_of(_completion(text, "stop")).reasoning == "The tag"  # unknown prompt (no --tokenizer)


def test_server_answers_keep_vllms_token_ids():
    resp = _completion("ok", "stop")
    assert _answer_of(resp).token_ids is None  # a server that returns none (transformers serve)
    resp.choices[0].model_extra = {"token_ids": [1, 2]}  # vLLM's return_token_ids
    assert _answer_of(resp).token_ids == [1, 2]


def test_split_reasoning():
    assert split_reasoning("<think>\nplan\n</think>\n\nAnswer") == ("Answer", "plan")
    assert split_reasoning("plan</think>Answer") == ("Answer", "plan")  # the prompt opened the block
    assert split_reasoning("<think>cut short") == ("", "cut short")
    assert split_reasoning("no reasoning <think> here") == ("no reasoning <think> here", None)


# --------------------------------------------------------------------------------------------
# local back end on a tiny random verifier


REPETITION_PENALTY = 1.3  # in the tiny verifier's generation_config.json: greedy must not apply it


def _penalised_llama(out: Path, initializer_range: float, copy_tokenizer) -> Path:
    """A random 2-layer Llama (weights of std ``initializer_range``) with the SmolLM2 tokenizer, saved in
    ``out``; its generation_config.json sets repetition_penalty 1.3 (as some hub models do)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      initializer_range=initializer_range, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                      pad_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2,
                     repetition_penalty=REPETITION_PENALTY).save_pretrained(out)
    copy_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory, copy_smollm2_tokenizer) -> Path:
    """Large weights (std 0.5), so greedy answers vary."""
    return _penalised_llama(tmp_path_factory.mktemp("regen_verifier"), 0.5, copy_smollm2_tokenizer)


@pytest.fixture(scope="module")
def local(verifier_dir):
    return LocalBackend(str(verifier_dir), max_new_tokens=6, temperature=0.0, batch_size=3, device="cpu")


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, local):
    """One uninterrupted local run over ROWS (chunks of 2 rows)."""
    d = tmp_path_factory.mktemp("regen_local")
    inp = write_rows(d / "in.jsonl")
    out = d / "out.jsonl"
    summary = run_regenerate(RegenerateRun(inputs=[str(inp)], output=out,
                                           settings=RegenerateConfig(max_new_tokens=6, chunk_rows=2)),
                                           make_backend=lambda: local)
    return inp, out, summary


def test_local_answers_equal_one_prompt_generate(local_run, local):
    import torch

    _, out, summary = local_run
    rows = lines(out)
    assert [r["id"] for r in rows] == ["in:1", "in:2", "in:5"]
    first = rows[0]["messages"]
    assert [m["role"] for m in first] == ["system", "user", "assistant", "user", "assistant"]
    assert first[:2] == ROWS[0]["messages"][:2] and first[3] == ROWS[0]["messages"][3]
    # turn 2 of row 1 equals a direct greedy generate on its prompt (batch of one, no padding)
    ids = local.prompt_ids(Request(messages=first[:4]))
    gen = local.model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    gen = gen[:gen.index(2) + 1] if 2 in gen else gen
    assert first[4]["content"] == local.tokenizer.decode(gen, skip_special_tokens=True) != "old 2"
    assert first[4]["token_ids"] == gen  # the ids beside the text
    c = summary["counts"]
    assert (c["read"], c["written"], c["rejected"], c["turns_regenerated"]) == (5, 3, 2, 4)
    assert c["rejected_by_reason"] == {"no assistant turn": 1, "template drops tools": 1}
    # every answer is cut at 6 tokens, one of them inside a character: its partial bytes are not written
    assert (c["turns_truncated"], c["turns_cut_mid_character"]) == (4, 1)
    assert not any("\ufffd" in (m.get("content") or "") for r in rows for m in r["messages"])
    # the SmolLM2 template renders neither the tools nor the tool call: the verifier never saw them
    assert lines(out.with_name("out.rejects.jsonl")) == [
        {"source": f"{out.parent}/in.jsonl:3", "reason": "no assistant turn", "conversation_id": "in:3"},
        {"source": f"{out.parent}/in.jsonl:4", "reason": TOOLS_DROPPED, "conversation_id": "tool1"}]
    manifest = json.loads(out.with_name("out.manifest.json").read_text())
    assert manifest["complete"] and manifest["generation"]["max_new_tokens"] == 6
    assert manifest["model"]["backend"] == "local" and not out.with_name("out.jsonl.partial").exists()
    assert manifest["model"]["sampling"] == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                             "repetition_penalty": 1.0, "presence_penalty": 0.0,
                                             "frequency_penalty": 0.0, "top_k_from": "off", "top_p_from": "off"}
    assert manifest["model"]["verifier_generation_config_ignored"] == {"repetition_penalty": REPETITION_PENALTY}
    assert manifest["model"]["not_sent"] == [] and c["turns_with_token_ids"] == 4


@pytest.mark.parametrize("family", HYBRID)
def test_local_back_end_with_a_hybrid_verifier_is_its_greedy_output(family, tmp_path, smollm2_tokenizer_dir,
                                                                    monkeypatch):
    """A hybrid verifier (recurrent layers) answers a left-padded batch exactly: each answer's generated ids are
    the argmax of a full forward over the prompt alone and the tokens before it (the pads are masked out of the
    state). The ids are read as generated (a random model's answer may be rejected for a cut character)."""
    import torch

    d = save_family(family, tmp_path / family, tokenizer_dir=smollm2_tokenizer_dir, vocab_size=49152)
    local = LocalBackend(str(d), max_new_tokens=5, temperature=0.0, batch_size=2, device="cpu")
    generated = {}
    answer_of = local.answer_of
    monkeypatch.setattr(local, "answer_of", lambda gen, prompt, *a: generated.setdefault(len(prompt), gen)
                        and answer_of(gen, prompt, *a))
    requests = [Request(messages=[{"role": "user", "content": "Hi"}]),
                Request(messages=[{"role": "system", "content": "Be brief and kind."},
                                  {"role": "user", "content": "What is the capital of France, and why?"}])]
    answers = local.generate(requests)
    for request, answer in zip(requests, answers):
        ids = local.prompt_ids(request)
        want = []
        with torch.no_grad():
            while len(want) < 5 and (not want or want[-1] not in local.eos_ids):
                want.append(int(local.model(input_ids=torch.tensor([ids + want])).logits[0, -1].argmax()))
        got = generated[len(ids)]
        end = next((i + 1 for i, t in enumerate(got) if t in local.eos_ids), len(got))  # pads after an EOS
        assert got[:end] == want
        assert answer.prompt_tokens == len(ids)
    assert len(generated) == 2  # two prompt lengths: the shorter one was padded


@pytest.fixture(scope="module")
def repeating_verifier_dir(tmp_path_factory, copy_smollm2_tokenizer) -> Path:
    """Small weights (std 0.1): its greedy answers repeat tokens, so the penalty would change them."""
    return _penalised_llama(tmp_path_factory.mktemp("repeating_verifier"), 0.1, copy_smollm2_tokenizer)


def test_greedy_is_peagle_evals_argmax_not_the_verifiers_generation_config(tmp_path, repeating_verifier_dir):
    """The verifier's generation_config.json (repetition_penalty 1.3) is not applied: every
    regenerated turn's ids are peagle-eval's greedy reference and generate(repetition_penalty=1.0)."""
    import torch

    from peagle_train.generate.speculative import greedy_generate
    from runtime.model_cache import load_tokenizer, load_verifier

    d = str(repeating_verifier_dir)
    inp = write_rows(tmp_path / "in.jsonl", [ROWS[0], ROWS[1], ROWS[4]])
    out = tmp_path / "out.jsonl"
    run_regenerate(RegenerateRun(inputs=[str(inp)], output=out, settings=RegenerateConfig(max_new_tokens=6)),
                   make_backend=lambda: LocalBackend(d, max_new_tokens=6, temperature=0.0, batch_size=3, device="cpu"))
    model, tok = load_verifier(d), load_tokenizer(d)
    assert model.generation_config.repetition_penalty == REPETITION_PENALTY
    own_config, turns = [], 0
    for row in lines(out):
        msgs = row["messages"]
        for i in [i for i, m in enumerate(msgs) if m["role"] == "assistant"]:
            prompt = tok.apply_chat_template(msgs[:i], add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"]
            ids = torch.tensor([prompt])
            reference = greedy_generate(model, prompt, 6, [2]).tokens
            plain = model.generate(ids, max_new_tokens=6, do_sample=False, repetition_penalty=1.0)[0, len(prompt):]
            own = model.generate(ids, max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()  # with its 1.3
            assert msgs[i]["token_ids"] == reference == plain.tolist()
            own_config.append(own != reference)
            turns += 1
    # what regenerate wrote before, applying the verifier's file: other ids on every turn
    assert turns == 4 and sum(own_config) == 4
    manifest = json.loads(out.with_name("out.manifest.json").read_text())
    assert manifest["model"]["verifier_generation_config_ignored"] == {"repetition_penalty": REPETITION_PENALTY}
    assert manifest["model"]["sampling"]["repetition_penalty"] == 1.0


def test_sampling_is_softmax_over_the_whole_vocabulary(repeating_verifier_dir):
    """At T > 0 the local generation config has no top-k (transformers' global default 50) nor any
    other warper: peagle-eval's softmax(z / T)."""
    local = LocalBackend(str(repeating_verifier_dir), max_new_tokens=4, temperature=0.7, batch_size=1, device="cpu")
    gc, _ = local.model._prepare_generation_config(local._generation_config(2))
    assert (gc.do_sample, gc.temperature, gc.top_k, gc.top_p, gc.repetition_penalty, gc.min_p) == \
        (True, 0.7, 0, 1.0, 1.0, 0.0)
    processors = local.model._get_logits_processor(gc, input_ids_seq_length=3, encoder_input_ids=None,
                                                   prefix_allowed_tokens_fn=None, logits_processor=None)
    assert [type(p).__name__ for p in processors] == ["TemperatureLogitsWarper", "MinPLogitsWarper"]


def test_top_k_and_top_p_come_from_the_generation_config_as_vllm_serves_them(tmp_path, repeating_verifier_dir):
    """A verifier whose generation_config.json sets top_k 20 / top_p 0.95 (Qwen3's): at T > 0 the local back end
    samples with them (transformers' temperature, top-k, top-p warpers: vLLM's rule and order) and records them
    with their source; --top-k / --top-p take their place; top-k 1 at T = 1 is the greedy answer."""
    import shutil

    from transformers import GenerationConfig

    from peagle_data.regenerate.backends import Request

    d = tmp_path / "served"
    shutil.copytree(repeating_verifier_dir, d)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2, do_sample=True, top_k=20, top_p=0.95,
                     repetition_penalty=REPETITION_PENALTY).save_pretrained(d)
    local = LocalBackend(str(d), max_new_tokens=4, temperature=0.7, batch_size=1, device="cpu")
    gc, _ = local.model._prepare_generation_config(local._generation_config(2))
    assert (gc.top_k, gc.top_p, gc.repetition_penalty) == (20, 0.95, 1.0)
    processors = local.model._get_logits_processor(gc, input_ids_seq_length=3, encoder_input_ids=None,
                                                   prefix_allowed_tokens_fn=None, logits_processor=None)
    assert [type(p).__name__ for p in processors] == ["TemperatureLogitsWarper", "TopKLogitsWarper",
                                                      "TopPLogitsWarper", "MinPLogitsWarper"]
    sampling = local.record["sampling"]
    assert (sampling["top_k"], sampling["top_p"], sampling["top_k_from"], sampling["top_p_from"]) == \
        (20, 0.95, "generation_config", "generation_config")
    assert local.record["verifier_generation_config_ignored"] == {"do_sample": True,
                                                                  "repetition_penalty": REPETITION_PENALTY}
    mine = LocalBackend(str(d), max_new_tokens=4, temperature=0.7, batch_size=1, device="cpu", top_k=5, top_p=1.0)
    assert (mine.record["sampling"]["top_k"], mine.record["sampling"]["top_k_from"], mine.record["sampling"]["top_p"]) \
        == (5, "option", 1.0)
    request = [Request(messages=[{"role": "user", "content": "Tell me a story about a cat."}])]
    greedy = LocalBackend(str(d), max_new_tokens=8, temperature=0.0, batch_size=1, device="cpu").generate(request)
    one = LocalBackend(str(d), max_new_tokens=8, temperature=1.0, batch_size=1, device="cpu", top_k=1)
    assert one.generate(request)[0].token_ids == greedy[0].token_ids


TOOLS_DROPPED = ("template drops tools: the tools passed with the conversation do not appear in the render (the "
                 "template ignores the tools list) (and 1 more dropped part); the verifier would answer without "
                 "seeing it; regenerate with a verifier whose template renders it, or pass --on-dropped-content "
                 "keep to regenerate the row anyway (counted in the manifest)")


def test_prompt_drops_is_the_tokenize_check_of_the_prompt(local):
    msgs = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "content": "sunny"}]
    assert prompt_drops(local.tokenizer, Request(msgs, TOOLS)) == TOOLS_DROPPED
    assert prompt_drops(local.tokenizer, Request(msgs, None)).startswith(
        "template drops tool_calls: the tool_calls of message 1 (assistant) does not appear in the render")
    assert prompt_drops(local.tokenizer, Request(ROWS[0]["messages"][:4], None)) is None


def test_on_dropped_content_keep_regenerates_the_row_counted(tmp_path, local):
    inp = write_rows(tmp_path / "in.jsonl", [ROWS[3], ROWS[4]])
    summary = run_regenerate(RegenerateRun(inputs=[str(inp)], output=tmp_path / "o.jsonl", settings=RegenerateConfig(
        max_new_tokens=6, on_dropped_content="keep")), make_backend=lambda: local)
    c = summary["counts"]
    assert (c["written"], c["rejected"], c["conversations_with_dropped_content"]) == (2, 0, 1)
    assert [r["id"] for r in lines(tmp_path / "o.jsonl")] == ["tool1", "in:2"]


def test_the_output_tokenizes(local_run, local, tmp_path, verifier_dir):
    from peagle_data.prepare.config import TokenizeConfig, TokenizeRun
    from peagle_data.prepare.tokenizing import run_tokenize

    from peagle_data.chat.tokens import tokenize_conversation
    from runtime.model_cache import load_tokenizer

    _, out, _ = local_run
    summary = run_tokenize(TokenizeRun(inputs=[str(out)], tokenizer=str(verifier_dir), output=tmp_path / "tok",
                                       settings=TokenizeConfig()))
    # regenerate already refused the row whose tools the SmolLM2 template drops: every row is used. One
    # answer of the random verifier is a tokenization its tokenizer does not make ("MRI" "Discussion"
    # re-tokenizes as "MR" "ID" ...): that last turn trains on the generated ids, not on the text's
    c = summary["counts"]
    assert c["used"] == 3 and c["rejected_by_reason"] == {} and c["turns_on_generated_ids"] == 1
    # answers cut at 6 tokens are marked; tokenize supervises their text and no <|im_end|> after it
    rows = lines(out)
    cut = [m for row in rows for m in row["messages"] if m.get("finish_reason") == "length"]
    assert len(cut) == 4 and c["cut_assistant_turns"] == len(cut)
    # every row trains on exactly the ids the verifier generated, after exactly its prompt's ids
    tok = load_tokenizer(str(verifier_dir))
    for row, spliced in zip(rows, (0, 0, 1)):
        t = tokenize_conversation(tok, row["messages"])
        assert t.input_ids[t.loss_mask == 1].tolist() == [i for m in row["messages"] for i in m.get("token_ids", [])]
        assert t.on_generated_ids == spliced
    prompt = local.prompt_ids(Request(messages=rows[2]["messages"][:1]))
    t = tokenize_conversation(tok, rows[2]["messages"])
    assert t.input_ids.tolist() == prompt + rows[2]["messages"][1]["token_ids"] + [2, 198]  # <|im_end|> "\n" of
    # the template after the cut turn, unsupervised
    assert tok.convert_ids_to_tokens(rows[2]["messages"][1]["token_ids"][2:4]) == ["MRI", "Discussion"]


def test_prompt_too_long_is_a_reject(tmp_path, local):
    inp = write_rows(tmp_path / "in.jsonl", [ROWS[4], {"messages": [{"role": "user", "content": "word " * 300},
                                                                  {"role": "assistant", "content": "x"}]}])
    summary = run_regenerate(RegenerateRun(inputs=[str(inp)], output=tmp_path / "o.jsonl",
                                           settings=RegenerateConfig(max_new_tokens=6)), make_backend=lambda: local)
    assert summary["counts"]["rejected_by_reason"] == {"prompt too long": 1}
    reason = lines(tmp_path / "o.rejects.jsonl")[0]["reason"]
    assert reason.startswith("prompt too long: ") and "exceed the verifier's 256 positions" in reason


def test_max_prompt_tokens_rejects_longer_prompts_before_generation(tmp_path, local):
    long_row = {"messages": [{"role": "user", "content": "word " * 40}, {"role": "assistant", "content": "x"}]}
    inp = write_rows(tmp_path / "in.jsonl", [ROWS[4], long_row])
    n_long = len(local.prompt_ids(Request(messages=long_row["messages"][:1])))
    n_short = len(local.prompt_ids(Request(messages=ROWS[4]["messages"][:1])))
    assert n_short < 50 < n_long
    summary = run_regenerate(RegenerateRun(inputs=[str(inp)], output=tmp_path / "o.jsonl",
                                           settings=RegenerateConfig(max_new_tokens=4, max_prompt_tokens=50)),
                             make_backend=lambda: local)
    assert summary["counts"]["rejected_by_reason"] == {"prompt too long": 1} and summary["counts"]["written"] == 1
    assert lines(tmp_path / "o.rejects.jsonl")[0]["reason"] == \
        f"prompt too long: {n_long} prompt tokens exceed --max-prompt-tokens 50"
    with pytest.raises(InputError, match="--max-prompt-tokens needs a tokenizer"):  # a server without --tokenizer
        run_regenerate(RegenerateRun(inputs=[str(inp)], output=tmp_path / "p.jsonl",
                                     settings=RegenerateConfig(max_prompt_tokens=30)), make_backend=Scripted)
    with pytest.raises(ValueError, match="--max-prompt-tokens must be >= 1"):
        RegenerateConfig(max_prompt_tokens=0)


class Killed(Exception):
    pass


class DiesAfter:
    """The local back end, killed at its n-th generate call."""

    def __init__(self, backend, n):
        self.backend, self.n, self.calls, self.record = backend, n, 0, backend.record
        self.tokenizer = backend.tokenizer

    def generate(self, reqs):
        self.calls += 1
        if self.calls == self.n:
            raise Killed
        return self.backend.generate(reqs)


def test_resume_gives_the_uninterrupted_file_without_redoing_rows(tmp_path, local_run, local):
    inp, full, full_summary = local_run
    out = tmp_path / "out.jsonl"
    cfg = RegenerateConfig(max_new_tokens=6, chunk_rows=2)
    # dies in the 3rd chunk (call 1: chunk 1 turn 1, 2: turn 2; chunk 2 needs none: row 3 is a reader
    # reject, row 4 a template-drops reject; 3: chunk 3)
    with pytest.raises(Killed):
        run_regenerate(RegenerateRun(inputs=[str(inp)], output=out, settings=cfg),
                                     make_backend=lambda: DiesAfter(local, 3))
    partial = out.with_name("out.jsonl.partial")
    assert len(lines(partial)) == 2 and not out.exists()
    with partial.open("a") as f:  # a row written after the checkpoint, its line cut by the kill
        f.write('{"id": "in:9", "mess')
    with pytest.raises(OutputExistsError):
        run_regenerate(RegenerateRun(inputs=[str(inp)], output=out, settings=cfg), make_backend=lambda: local)
    with pytest.raises(InputError, match="--max-new-tokens was 6, now 7 \\(generation\\)"):
        run_regenerate(RegenerateRun(inputs=[str(inp)], output=out,
                                     settings=RegenerateConfig(max_new_tokens=7, chunk_rows=2), resume=True),
                                     make_backend=lambda: local)
    other_batches = DiesAfter(local, 0)
    other_batches.record = {**local.record, "batch_size": 5}  # other padding: not the same greedy file
    with pytest.raises(InputError, match="--batch-size was 3, now 5 \\(model\\)"):
        run_regenerate(RegenerateRun(inputs=[str(inp)], output=out, settings=cfg, resume=True),
                                     make_backend=lambda: other_batches)
    counting = DiesAfter(local, 0)
    summary = run_regenerate(RegenerateRun(inputs=[str(inp)], output=out, settings=cfg, resume=True),
                                           make_backend=lambda: counting)
    assert out.read_bytes() == full.read_bytes()
    assert out.with_name("out.rejects.jsonl").read_bytes() == full.with_name("out.rejects.jsonl").read_bytes()
    assert summary["resumed_rows"] == 4 and summary["counts"] == full_summary["counts"]
    assert counting.calls == 1  # one wave for chunk 3 (row 5); chunks 1 and 2 were on disk


# --------------------------------------------------------------------------------------------
# server back end: a real transformers serve on 127.0.0.1


@contextlib.contextmanager
def transformers_serve(model_dir: Path):
    """``transformers serve`` of ``model_dir`` on 127.0.0.1 and a free port; yields its URL."""
    pytest.importorskip("fastapi", reason="transformers serve needs the test extra (transformers[serving])")
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    exe = Path(sys.executable).parent / "transformers"
    exe = str(exe) if exe.exists() else shutil.which("transformers")
    if exe is None:
        pytest.fail("the `transformers` command is not installed beside this Python")
    log = tempfile.TemporaryFile()
    proc = start([exe, "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"],
                 env=env, stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"

    def tail() -> str:
        log.seek(0)
        return log.read().decode(errors="replace")[-2000:]

    try:
        wait_until_up(proc, url + "/health", "transformers serve", tail, timeout_s=180, poll_s=0.5)
        yield url
    finally:
        stop(proc, grace_s=30)
        log.close()


@pytest.fixture(scope="module")
def server(verifier_dir):
    """``transformers serve`` of the tiny verifier; yields its URL."""
    with transformers_serve(verifier_dir) as url:
        yield url


@pytest.mark.slow
def test_transformers_serve_is_told_greedy_without_the_verifiers_repetition_penalty(repeating_verifier_dir, tmp_path):
    """transformers serve applies the model's generation_config.json (repetition_penalty 1.3) unless told:
    --server-kind transformers sends a whole neutral generation_config, the OpenAI fields alone
    (frequency_penalty 0, its repetition_penalty 1) also neutralise it; both equal the local back end."""
    import openai

    d = str(repeating_verifier_dir)
    inp = write_rows(tmp_path / "in.jsonl", [ROWS[1], ROWS[4]])
    local = tmp_path / "local.jsonl"
    run_regenerate(RegenerateRun(inputs=[str(inp)], output=local, settings=RegenerateConfig(max_new_tokens=6)),
                   make_backend=lambda: LocalBackend(d, max_new_tokens=6, temperature=0.0, batch_size=1, device="cpu"))
    with transformers_serve(repeating_verifier_dir) as url:
        for kind in ("transformers", "openai"):
            out = tmp_path / f"{kind}.jsonl"
            run_regenerate(RegenerateRun(inputs=[str(inp)], output=out, settings=RegenerateConfig(max_new_tokens=6)),
                           make_backend=lambda: ServerBackend([url], None, 6, 0.0, kind=kind))
            assert without_token_ids(out) == without_token_ids(local), kind
        client = openai.OpenAI(base_url=url + "/v1", api_key="EMPTY")
        for row in lines(local):  # a request that states only temperature 0 gets the penalised answer
            resp = client.chat.completions.create(model=d, messages=row["messages"][:-1], max_tokens=6, temperature=0)
            assert resp.choices[0].message.content != row["messages"][-1]["content"]


@pytest.mark.slow
def test_server_greedy_output_equals_the_local_back_end(server, local_run, local, tmp_path, verifier_dir):
    inp, full, full_summary = local_run
    out = tmp_path / "s.jsonl"
    # two addresses of the one server: requests spread over both slots' clients; prompts checked with
    # the verifier's template, as the local back end checks them; told a whole neutral generation_config
    backend = ServerBackend([server, server + "/v1/"], None, max_new_tokens=6, temperature=0.0, concurrency=2,
                            tokenizer=local.tokenizer, kind="transformers")
    summary = run_regenerate(RegenerateRun(inputs=[str(inp)], output=out,
                                           settings=RegenerateConfig(max_new_tokens=6, chunk_rows=2)),
                                           make_backend=lambda: backend)
    # transformers serve returns no token ids: the same rows without them
    assert without_token_ids(out) == without_token_ids(full) and "token_ids" not in out.read_text()
    c, f = summary["counts"], full_summary["counts"]
    assert (c["written"], c["rejected"], c["turns_regenerated"], c["completion_tokens"]) == \
        (f["written"], f["rejected"], f["turns_regenerated"], f["completion_tokens"])
    model = json.loads(out.with_name("s.manifest.json").read_text())["model"]
    assert (model["model"], model["server_kind"], model["token_ids"]) == (str(verifier_dir), "transformers", False)
    assert model["not_sent"] == ["bad_words_ids", "suppress_tokens", "begin_suppress_tokens", "sequence_bias",
                                 "forced_bos_token_id", "forced_eos_token_id", "exponential_decay_length_penalty"]
    assert c["turns_with_token_ids"] == 0
    assert out.with_name("s.rejects.jsonl").read_bytes() == full.with_name("out.rejects.jsonl").read_bytes()


@pytest.mark.slow
def test_server_errors_after_retries_are_rejects(tmp_path):
    inp = write_rows(tmp_path / "in.jsonl", [ROWS[4]])
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    backend = ServerBackend([dead], "m", max_new_tokens=4, temperature=0.0, retries=1, timeout=5)
    summary = run_regenerate(RegenerateRun(inputs=[str(inp)], output=tmp_path / "o.jsonl",
                                           settings=RegenerateConfig(max_new_tokens=4)), make_backend=lambda: backend)
    assert summary["counts"]["rejected_by_reason"] == {"server error": 1}
    assert lines(tmp_path / "o.rejects.jsonl")[0]["reason"].startswith(f"server error: {dead}/v1: APIConnectionError")


@pytest.mark.slow
def test_cli_regenerates_through_the_server(server, local_run, tmp_path, verifier_dir):
    inp, full, _ = local_run
    out = tmp_path / "c.jsonl"
    args = ["regenerate", str(inp), "--output", str(out), "--server", server, "--max-new-tokens", "6",
            "--tokenizer", str(verifier_dir)]
    res = CliRunner().invoke(data_main, args)
    assert res.exit_code == 0, res.output
    assert "read 5  written 3  rejected 2" in res.output and without_token_ids(out) == without_token_ids(full)
    # not a vLLM server: told the OpenAI API's fields only (frequency_penalty 0 is transformers serve's
    # repetition_penalty 1), and the rest is said
    assert ("WARNING: the server could not be told these sampling settings, its own defaults applied: top_k, min_p, "
            "repetition_penalty, every other default of the server's generation config") in res.output
    assert "turns regenerated 4 (4 cut at --max-new-tokens 6, 1 of them inside a character, dropped)" in res.output
    assert json.loads(out.with_name("c.manifest.json").read_text())["model"]["tokenizer"] == str(verifier_dir)
    again = CliRunner().invoke(data_main, args)
    assert again.exit_code == 2 and "already exists" in again.output


def test_cli_needs_exactly_one_back_end(tmp_path):
    inp = write_rows(tmp_path / "in.jsonl")
    res = CliRunner().invoke(data_main, ["regenerate", str(inp), "--output", str(tmp_path / "o.jsonl")])
    assert res.exit_code == 2 and "exactly one of --verifier" in res.output


QWEN_LIKE_TEMPLATE = {  # the shape of transformers serve's Qwen response template (ChatML, as SmolLM2's)
    "defaults": {"role": "assistant"}, "start_anchor": "<|im_start|>assistant\n", "fields": {
        "reasoning_content": {"open": "<think>", "close": "</think>", "content": "text"},
        "tool_calls": {"open_pattern": r"\s*<tool_call>", "close": "</tool_call>", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>)", "content": "text"}}}


def test_local_answer_parsing(local, monkeypatch):
    tok = local.tokenizer
    prompt = local.prompt_ids(Request(messages=[{"role": "user", "content": "hi"}]))

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    answer = ids("<think>\nplan\n</think>\n\nHello<|im_end|>")
    a = local.answer_of(answer + [2, 2], prompt)  # cut after the first end-of-sequence id (2 is <|im_end|>)
    assert (a.content, a.reasoning, a.finish_reason, a.completion_tokens) == ("Hello", "plan", "stop", len(answer))
    assert answer[-1] == 2 and 2 not in answer[:-1]
    cut = local.answer_of(ids("Hello there"), prompt)
    assert (cut.content, cut.reasoning, cut.finish_reason) == ("Hello there", None, "length")
    odd = local.answer_of(ids("a<|im_start|>b<|im_end|>"), prompt)
    assert odd.error.startswith("unparsed answer format: the answer holds special tokens (<|im_start|>)")
    monkeypatch.setattr(tok, "response_template", QWEN_LIKE_TEMPLATE, raising=False)
    call = local.answer_of(ids('Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call><|im_end|>'),
                           prompt)
    assert (call.content, call.finish_reason) == ("Sure.", "tool_calls")
    assert call.tool_calls == [{"type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]
    think = local.answer_of(ids("<think>\nplan\n</think>\n\nHello<|im_end|>"), prompt)
    assert (think.content, think.reasoning) == ("Hello", "plan")


def test_local_answer_cut_inside_a_character_ends_before_it(local):
    tok = local.tokenizer
    prompt = local.prompt_ids(Request(messages=[{"role": "user", "content": "hi"}]))
    ids = tok("Bonjour, je m'appelle l'Américan. 😀 ok", add_special_tokens=False)["input_ids"]
    emoji = ids.index(40303)  # 'ĠðŁĺ': a space and 3 of the emoji's 4 bytes; the next id ends it
    cut = local.answer_of(ids[:emoji + 1], prompt)
    assert (cut.content, cut.finish_reason, cut.cut_partial_char, cut.completion_tokens, cut.error) == \
        ("Bonjour, je m'appelle l'Américan.", "length", True, emoji + 1, None)
    whole = local.answer_of(ids[:emoji + 2], prompt)
    assert (whole.content, whole.cut_partial_char) == ("Bonjour, je m'appelle l'Américan. 😀", False)
    fffd = tok("\ufffd", add_special_tokens=False)["input_ids"]  # the verifier's own U+FFFD is kept
    own = local.answer_of(ids[:3] + fffd + [2], prompt)
    assert (own.content, own.error) == ("Bonjour,\ufffd", None)
    broken = local.answer_of([40303] + ids[-1:] + [2], prompt)  # 3 bytes of a 4-byte character, then ' ok'
    assert broken.error == ("invalid UTF-8: the answer's tokens hold bytes that are not UTF-8 (byte 1 of 7: "
                            "b'\\xf0\\x9f\\x98'); their decode would write U+FFFD the verifier did not say")


def test_wire_messages_carry_only_the_apis_keys():
    from peagle_data.regenerate.backends import _wire_messages

    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "finish_reason": "length", "token_ids": [64]},
            {"role": "assistant", "content": "b", "weight": 0}]
    assert _wire_messages(msgs) == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                                    {"role": "assistant", "content": "b"}]


def test_resume_of_an_output_written_before_a_setting_existed():
    from peagle_data.regenerate.run import _check_resume

    settings = {"inputs": ["i"], "files": ["f"], "model": {"backend": "local"},
                "generation": {"turns": "all", "max_prompt_tokens": None}}
    old = {**settings, "generation": {"turns": "all"}}  # written before --max-prompt-tokens
    _check_resume(old, settings, "o.jsonl")
    with pytest.raises(InputError, match="--max-prompt-tokens was None, now 64 \\(generation\\)"):  # set now
        _check_resume(old, {**settings, "generation": {"turns": "all", "max_prompt_tokens": 64}}, "o.jsonl")


def test_resume_names_the_option_and_allows_only_those_that_change_no_answer():
    from peagle_data.regenerate.run import _check_resume

    record = {"backend": "server", "servers": ["http://a/v1"], "model": "m", "concurrency": 8, "retries": 5}
    settings = {"inputs": ["i"], "files": ["f"], "model": record, "generation": {"turns": "all"}}
    _check_resume(settings, {**settings, "model": {**record, "servers": ["http://b/v1"], "concurrency": 2,
                                                   "retries": 9}}, "o.jsonl")  # may change
    with pytest.raises(InputError) as e:
        _check_resume(settings, {**settings, "model": {**record, "model": "other"}}, "o.jsonl")
    assert str(e.value) == ("--resume: o.jsonl was written with other settings: --served-model was 'm', now 'other' "
                            "(model); rerun with the same settings, or with --force to start over (a resume may "
                            "change only --device, --concurrency, --server, --retries, --timeout)")
    with pytest.raises(InputError, match="--verifier \\(its content fingerprint\\) was 'a', now 'b' \\(model\\)"):
        local = {"backend": "local", "verifier": "v", "verifier_fingerprint": "a", "dtype": "float32"}
        _check_resume({**settings, "model": local},
                      {**settings, "model": {**local, "verifier_fingerprint": "b"}}, "o.jsonl")
    with pytest.raises(InputError, match="INPUT was \\['i'\\], now \\['j'\\] \\(inputs\\)"):
        _check_resume(settings, {**settings, "inputs": ["j"]}, "o.jsonl")
    older = {**settings, "model": {**local, "verifier_fingerprint": "whole-file"}}  # begun before the identity
    _check_resume(older, {**settings, "model": {**local, "verifier_fingerprint": "b"}}, "o.jsonl", "whole-file")
    with pytest.raises(InputError, match="--verifier \\(its content fingerprint\\) was 'whole-file', now 'b'"):
        _check_resume(older, {**settings, "model": {**local, "verifier_fingerprint": "b"}}, "o.jsonl", "other")
    plain = {"temperature": 0.0, "top_k": 0, "top_p": 1.0}  # begun before top_k_from / top_p_from were recorded
    sourced = {**plain, "top_k_from": "off", "top_p_from": "off"}
    _check_resume({**settings, "model": {**local, "sampling": plain}},
                  {**settings, "model": {**local, "sampling": sourced}}, "o.jsonl")
    with pytest.raises(InputError, match="sampling was .*'top_k': 0.*now .*'top_k': 20"):
        _check_resume({**settings, "model": {**local, "sampling": plain}},
                      {**settings, "model": {**local, "sampling": {**sourced, "top_k": 20,
                                                                   "top_k_from": "generation_config"}}}, "o.jsonl")
    with pytest.raises(InputError, match="sampling was"):  # a recorded source is compared
        _check_resume({**settings, "model": {**local, "sampling": sourced}},
                      {**settings, "model": {**local, "sampling": {**sourced, "top_k_from": "option"}}}, "o.jsonl")


# --------------------------------------------------------------------------------------------
# server back end: a real vLLM server (vllm serve) on 127.0.0.1, the real SmolLM2 verifier


@pytest.fixture(scope="module")
def penalised_smollm2(tmp_path_factory, smollm2_tokenizer_dir) -> Path:
    """The real SmolLM2 verifier (weights linked) whose generation_config.json sets repetition_penalty
    1.3: vLLM's server, like transformers, applies it to any request that does not say otherwise."""
    from runtime.model_cache import resolve_model

    src = resolve_model("smollm2-135m")
    out = tmp_path_factory.mktemp("smollm2_penalised")
    for f in src.iterdir():
        if f.is_file() and f.name != "generation_config.json":
            (out / f.name).symlink_to(f.resolve())
    gen = json.loads((src / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**gen, "repetition_penalty": REPETITION_PENALTY}))
    return out


@pytest.fixture(scope="module")
def vllm_server(penalised_smollm2, tmp_path_factory):
    """``vllm serve`` (its OpenAI API server) of the penalised SmolLM2 in float32, eager, 2 GiB of
    KV cache; yields its URL; stopped after the module."""
    port = free_port()
    log = tmp_path_factory.mktemp("vllm_log") / "server.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
    with log.open("wb") as out:
        proc = start([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(penalised_smollm2),
                      "--dtype", "float32", "--enforce-eager", "--host", "127.0.0.1", "--port", str(port),
                      "--max-model-len", "2048"], env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(proc, url + "/health", "vllm serve", lambda: log.read_text()[-3000:], timeout_s=480)
        yield url
    finally:
        stop(proc)


@pytest.mark.vllm
@pytest.mark.slow
def test_regenerate_through_vllm_serve_equals_the_local_back_end(vllm_server, penalised_smollm2, tmp_path):
    """``peagle-data regenerate --server`` against a real vLLM server gives the local back end's file,
    token ids included: both greedy without the verifier's repetition_penalty, which vLLM applies to a
    request that leaves it out; tokenize trains on exactly the ids vLLM generated."""
    import openai

    from peagle_data.chat.tokens import tokenize_conversation
    from runtime.model_cache import load_tokenizer

    rows = [ROWS[0], ROWS[1], ROWS[4], {"messages": [{"role": "user", "content": "In Python, what does x != y do?"},
                                                    {"role": "assistant", "content": "old"}]}]
    inp = write_rows(tmp_path / "in.jsonl", rows)
    served, local = tmp_path / "served.jsonl", tmp_path / "local.jsonl"
    res = CliRunner().invoke(data_main, ["regenerate", str(inp), "--output", str(served), "--server", vllm_server,
                                         "--max-new-tokens", "32", "--tokenizer", str(penalised_smollm2)])
    assert res.exit_code == 0, res.output
    assert "read 4  written 4  rejected 0" in res.output and "WARNING" not in res.output
    backend = LocalBackend(str(penalised_smollm2), max_new_tokens=32, temperature=0.0, batch_size=1, device="cpu")
    run_regenerate(RegenerateRun(inputs=[str(inp)], output=local, settings=RegenerateConfig(max_new_tokens=32)),
                   make_backend=lambda: backend)
    assert served.read_bytes() == local.read_bytes()
    manifest = json.loads(served.with_name("served.manifest.json").read_text())
    assert (manifest["model"]["server_kind"], manifest["model"]["not_sent"], manifest["model"]["token_ids"]) == \
        ("vllm", [], True)
    assert manifest["model"]["sampling"] == json.loads(local.with_name("local.manifest.json").read_text())[
        "model"]["sampling"]
    assert manifest["counts"]["turns_regenerated"] == manifest["counts"]["turns_with_token_ids"] == 5
    # what vLLM answers a request that states only temperature 0: the verifier's repetition penalty applies
    client = openai.OpenAI(base_url=vllm_server + "/v1", api_key="EMPTY")
    written = lines(served)
    differs = 0
    for row in written[1:]:
        resp = client.chat.completions.create(model=str(penalised_smollm2), messages=row["messages"][:-1],
                                              max_tokens=32, temperature=0, extra_body={"return_token_ids": True})
        differs += resp.choices[0].model_extra["token_ids"] != row["messages"][-1]["token_ids"]
    assert differs >= 1
    # every written turn re-tokenizes, inside the template, to exactly the ids vLLM generated
    tok = load_tokenizer(str(penalised_smollm2))
    for row in written:
        t = tokenize_conversation(tok, row["messages"])
        assert t.input_ids[t.loss_mask == 1].tolist() == [i for m in row["messages"] for i in m.get("token_ids", [])]


# --------------------------------------------------------------------------------------------
# decoding that round-trips (clean_up_tokenization_spaces), and tokenize on the generated ids

SPACED = "if x != y: print('social' .)"
"""Text that a clean-up of tokenization spaces rewrites (``x!= y``, ``'social'.``)."""


@pytest.fixture
def cleaning_tokenizer(local, monkeypatch):
    """The verifier's SmolLM2 tokenizer configured with ``clean_up_tokenization_spaces=True`` (every
    Llama-3.x tokenizer config says so; transformers releases before 5 apply it to BPE tokenizers)."""
    tok = local.tokenizer
    monkeypatch.setattr(tok, "clean_up_tokenization_spaces", True)
    monkeypatch.setattr(tok, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", True,
                        raising=False)
    return tok


def test_answers_are_decoded_without_cleaning_up_spaces(local, cleaning_tokenizer):
    tok = cleaning_tokenizer
    ids = tok(SPACED, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "if x!= y: print('social'.)"  # a default decode: other ids on re-tokenizing
    assert tok.convert_ids_to_tokens(tok(tok.decode(ids), add_special_tokens=False)["input_ids"]) == \
        ["if", "Ġx", "!=", "Ġy", ":", "Ġprint", "('", "social", "'", ".)"]
    assert tok.convert_ids_to_tokens(ids) == ["if", "Ġx", "Ġ!=", "Ġy", ":", "Ġprint", "('", "social", "'", "Ġ.",
                                              ")"]
    prompt = local.prompt_ids(Request(messages=[{"role": "user", "content": "hi"}]))
    answer = local.answer_of(ids + [2], prompt)
    assert (answer.content, answer.token_ids, answer.finish_reason) == (SPACED, ids + [2], "stop")
    cut = local.answer_of(ids[:3], prompt)  # cut at the token limit: the cut-character check decodes too
    assert (cut.content, cut.token_ids, cut.finish_reason) == ("if x !=", ids[:3], "length")
    tok.response_template = QWEN_LIKE_TEMPLATE  # the response_template path decodes for parse_response
    try:
        parsed = local.answer_of(ids + [2], prompt)
    finally:
        del tok.response_template
    assert (parsed.content, parsed.token_ids) == (SPACED, ids + [2])


def test_tokenize_trains_on_the_generated_ids_and_rejects_a_text_that_does_not_round_trip(local, cleaning_tokenizer):
    from peagle_data.chat.tokens import tokenize_conversation, tokenize_turns
    from runtime.chat.chat_template import ChatTemplateError

    tok = local.tokenizer
    ids = tok(SPACED, add_special_tokens=False)["input_ids"] + [2]
    user = {"role": "user", "content": "Compare x and y"}
    good = [user, {"role": "assistant", "content": SPACED, "token_ids": ids}]
    t = tokenize_conversation(tok, good)
    assert t.input_ids[t.loss_mask == 1].tolist() == ids
    cleaned = [user, {"role": "assistant", "content": tok.decode(ids, skip_special_tokens=True), "token_ids": ids}]
    with pytest.raises(ChatTemplateError) as e:
        tokenize_conversation(tok, cleaned)
    assert str(e.value) == (
        f"generated ids do not round-trip: assistant message 1 re-tokenizes inside the chat template to "
        f"{len(ids) - 1} ids, the verifier generated {len(ids)} (token_ids); first difference at token 2: '!=' for "
        "the generated 'Ġ!=', and they decode to another text than the message's content: the text was decoded "
        "with clean_up_tokenization_spaces (peagle's regenerate never does) or edited after regenerate, or tokenize "
        "runs with another tokenizer than the one that generated the ids")
    # without token_ids the cleaned text trains, as before: nothing to check it against
    t = tokenize_conversation(tok, [user, {k: v for k, v in cleaned[1].items() if k != "token_ids"}])
    assert t.loss_mask.sum() == len(ids) - 1
    # a cut reply (finish_reason length): its ids up to the cut, no end-of-turn token
    cut = [user, {"role": "assistant", "content": SPACED, "finish_reason": "length", "token_ids": ids[:-1]}]
    t = tokenize_conversation(tok, cut)
    assert t.input_ids[t.loss_mask == 1].tolist() == ids[:-1]
    # the same text, another tokenization ("\n\n" as one token where the tokenizer makes two): the last
    # turn trains on the generated ids; an earlier one, whose re-tokenized text was the next turn's
    # context, is a reject
    text = "Plan:\n\n1. go"
    canonical = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(canonical)[:4] == ["Plan", ":", "Ċ", "Ċ"]
    own = canonical[:2] + tok.convert_tokens_to_ids(["ĊĊ"]) + canonical[4:] + [2]
    assert tok.decode(own, skip_special_tokens=True) == text
    last = [user, {"role": "assistant", "content": text, "token_ids": own}]
    t = tokenize_conversation(tok, last)
    assert t.input_ids[t.loss_mask == 1].tolist() == own and t.on_generated_ids == 1
    assert t.input_ids.tolist() == tokenize_conversation(tok, [user, {"role": "assistant", "content": text}]
                                                         ).input_ids.tolist()[:-(len(canonical) + 2)] + own + [198]
    earlier = last + [{"role": "user", "content": "again"}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(ChatTemplateError, match=r"assistant message 1 .* \(the same text, another tokenization\); "
                                                "the verifier saw the re-tokenized text"):
        tokenize_conversation(tok, earlier)
    # per-turn rows (a template that rewrites history) check each supervised turn the same way
    stale = good + [{"role": "user", "content": "again"},
                    {"role": "assistant", "content": "x", "token_ids": tok("y", add_special_tokens=False)["input_ids"]
                     + [2]}]
    with pytest.raises(ChatTemplateError, match="assistant message 3 re-tokenizes.*decode to another text"):
        tokenize_turns(tok, stale)


@pytest.mark.parametrize("text", ["def f(x):\n    return [0];\n", "echo $num * "])
def test_an_answer_cut_after_whitespace_trains_on_its_generated_ids(local, text):
    """Issue 33, kind 8: an answer cut at --max-new-tokens whose last generated token is whitespace
    (``...0];\n``, ``... $num * ``) was refused by tokenize/pack as "generated ids do not round-trip"."""
    from peagle_data.chat.tokens import tokenize_conversation

    tok = local.tokenizer
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids[-1:])[0] in ("Ċ", "Ġ")
    prompt = local.prompt_ids(Request(messages=[{"role": "user", "content": "Code?"}]))
    answer = local.answer_of(ids, prompt)  # no end-of-sequence id: cut at the token limit
    assert (answer.content, answer.token_ids, answer.finish_reason) == (text, ids, "length")
    row = [{"role": "user", "content": "Code?"},
           {"role": "assistant", "content": answer.content, "finish_reason": "length", "token_ids": answer.token_ids}]
    t = tokenize_conversation(tok, row)
    assert t.input_ids[t.loss_mask == 1].tolist() == ids and t.on_generated_ids == 0
    assert t.input_ids.tolist() == prompt + ids + tok.convert_tokens_to_ids(["<|im_end|>", "Ċ"])


def test_readers_keep_token_ids_and_reject_malformed_ones(tmp_path):
    from peagle_data.readers.conversations import read_conversations

    ok = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "token_ids": [64, 2]}]}
    bad = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "token_ids": [64, -1]}]}
    items = list(read_conversations([str(write_rows(tmp_path / "in.jsonl", [ok, bad]))]))
    assert items[0].messages[1] == {"role": "assistant", "content": "a", "token_ids": [64, 2]}
    assert items[1].reason == "invalid token_ids: messages[1].token_ids must be a list of token ids (ints >= 0)"


def test_each_server_kind_is_told_the_neutral_sampling_parameters():
    from peagle_data.regenerate.backends import BackendConfig, _request_params

    assert _request_params("vllm", 0.0, 8) == {
        "max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "extra_body": {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "return_token_ids": True}}
    assert _request_params("openai", 0.5, 8) == {"max_tokens": 8, "temperature": 0.5, "top_p": 1.0,
                                                 "presence_penalty": 0.0, "frequency_penalty": 0.0}
    told = _request_params("transformers", 0.5, 8)
    assert set(told) == {"max_tokens", "temperature", "top_p", "extra_body"}
    gc = json.loads(told["extra_body"]["generation_config"])
    assert (gc["do_sample"], gc["temperature"], gc["top_k"], gc["top_p"], gc["repetition_penalty"],
            gc["no_repeat_ngram_size"], gc["max_new_tokens"]) == (True, 0.5, 0, 1.0, 1.0, 0, 8)
    assert json.loads(_request_params("transformers", 0.0, 8)["extra_body"]["generation_config"])["do_sample"] is False
    with pytest.raises(ValueError, match="--server-kind goes with --server"):
        BackendConfig(verifier="m", server_kind="vllm")
    with pytest.raises(ValueError, match="--server-kind must be one of"):
        BackendConfig(servers=("http://a:1",), server_kind="sglang")


def test_a_closing_think_tag_in_an_answer_the_prompt_did_not_open_is_content(local):
    """A ``</think>`` the verifier writes in its answer, after a prompt without an open think block, is
    text of the answer: it was split off as reasoning (``"The tag"``), so the row trained on other text."""
    text = "The tag </think> closes it."
    assert split_reasoning(text, prompt_opened=False) == (text, None)
    assert split_reasoning(text, prompt_opened=True) == ("closes it.", "The tag")
    assert split_reasoning("<think>plan</think>Answer", prompt_opened=False) == ("Answer", "plan")
    tok = local.tokenizer
    prompt = local.prompt_ids(Request(messages=[{"role": "user", "content": "q"}]))
    generated = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    answer = local.answer_of(generated, prompt)
    assert (answer.content, answer.reasoning, answer.token_ids) == (text, None, generated)
    opened = tok.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    answer = local.answer_of(generated, opened)
    assert (answer.content, answer.reasoning) == ("closes it.", "The tag")


# --------------------------------------------------------------------------------------------
# Template variables (--chat-template-kwargs): the local prompt in the mode, servers told them


def test_every_request_of_a_row_carries_the_template_kwargs(smollm2_tokenizer):
    off = {"enable_thinking": False}
    job = Regeneration(conv([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x"},
                             {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "y"}]),
                       "all", "keep", chat_template_kwargs=off)
    seen = []
    while (req := job.next_request()) is not None:
        seen.append(req.chat_template_kwargs)
        job.feed(Answer(content="A", completion_tokens=1))
    assert seen == [off, off]
    tok = qwen_tokenizer(smollm2_tokenizer)
    tok.chat_template = template("qwen3_hybrid")
    messages = [{"role": "user", "content": "Hi"}]
    on_ids = prompt_tokens(tok, Request(messages=messages))
    off_ids = prompt_tokens(tok, Request(messages=messages, chat_template_kwargs=off))
    assert tok.decode(off_ids) == tok.decode(on_ids) + "<think>\n\n</think>\n\n"
    assert prompt_drops(tok, Request(messages=messages, chat_template_kwargs=off)) is None
    with pytest.raises(ValueError, match="may not set 'chat_template'"):
        RegenerateConfig(chat_template_kwargs={"chat_template": "x"})


def test_servers_are_sent_the_template_kwargs_as_vllm_takes_them():
    """vLLM's (and SGLang's) request field ``chat_template_kwargs``, beside the sampling fields."""
    from types import SimpleNamespace as NS

    sent = []

    def create(**kwargs):
        sent.append(kwargs)
        return _completion("ok", "stop")

    backend = ServerBackend(["http://127.0.0.1:1"], "m", max_new_tokens=4, temperature=0.0, kind="vllm")
    backend.clients = {b: NS(chat=NS(completions=NS(create=create))) for b in backend.bases}
    msgs = [{"role": "user", "content": "Hi"}]
    assert backend.answer(Request(messages=msgs, chat_template_kwargs={"reasoning_effort": "high"})).content == "ok"
    assert backend.answer(Request(messages=msgs)).content == "ok"
    assert sent[0]["extra_body"] == {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "return_token_ids": True,
                                     "chat_template_kwargs": {"reasoning_effort": "high"},
                                     "reasoning_effort": "high"}  # vLLM's gpt-oss path reads only this field
    assert "chat_template_kwargs" not in sent[1]["extra_body"]  # none given: none sent
    assert backend.params["extra_body"] == sent[1]["extra_body"]  # the shared parameters are not changed


def test_reasoning_effort_to_vllm_refused_where_vllm_would_derive_enable_thinking(smollm2_tokenizer):
    """vLLM sets ``enable_thinking = effort != "none"`` for a request with a ``reasoning_effort`` field; a template
    reading it renders a prompt the row's variables do not say, so such a row is refused before it is sent."""
    from types import SimpleNamespace as NS

    sent = []
    tok = qwen_tokenizer(smollm2_tokenizer)
    tok.chat_template = template("qwen3_hybrid") + "{%- if reasoning_effort is defined %}{% endif %}"  # reads both
    backend = ServerBackend(["http://127.0.0.1:1"], "m", max_new_tokens=4, temperature=0.0, kind="vllm",
                            tokenizer=tok)
    backend.clients = {b: NS(chat=NS(completions=NS(create=lambda **kw: sent.append(kw) or _completion("ok", "stop"))))
                       for b in backend.bases}
    msgs = [{"role": "user", "content": "Hi"}]
    with pytest.raises(InputError, match="reads enable_thinking.*give enable_thinking"):
        backend.answer(Request(messages=msgs, chat_template_kwargs={"reasoning_effort": "low"}))
    assert sent == []
    both = {"reasoning_effort": "low", "enable_thinking": True}  # said explicitly: sent, as vLLM renders it
    assert backend.answer(Request(messages=msgs, chat_template_kwargs=both)).content == "ok"
    assert sent[0]["extra_body"]["reasoning_effort"] == "low"
    check_effort_field(smollm2_tokenizer, {"reasoning_effort": "low"})  # ChatML reads no enable_thinking: fine
    params = {"max_tokens": 4, "extra_body": {}}
    assert "reasoning_effort" not in _with_template_kwargs(params, {"reasoning_effort": "low"}, "openai")["extra_body"]
