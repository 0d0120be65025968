"""regenerate for reasoning verifiers (issue 32): question files as inputs, per-row mixtures of temperature
and template variables (reproducible, recorded, kept by --resume), answers parsed as served."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peagle_data.regenerate.backends import Answer, LocalBackend, Request, _answer_of, prompt_tokens
from runtime.chat.setting_mixtures import row_settings
from peagle_data.regenerate.run import RegenerateConfig, RegenerateRun, run_regenerate
from stores.errors import InputError
from tests.chat_templates import harmony_tokenizer, think_tokenizer


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


class Recording:
    """A local-style back end answering ``A<n>`` (n: messages in the request), recording each request."""

    record = {"backend": "recording"}
    tokenizer = None

    def __init__(self, die_at: int | None = None):
        self.requests: list[Request] = []
        self.calls, self.die_at = 0, die_at

    def generate(self, reqs):
        self.calls += 1
        if self.calls == self.die_at:
            raise KeyboardInterrupt
        self.requests += reqs
        return [Answer(content=f"A{len(r.messages)}", completion_tokens=1) for r in reqs]


MT_BENCH = [
    {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now in French."]},
    {"prompt": "Name a colour."},
    {"question": "What is 2+2?", "id": "q3"},
    {"question": ""},
    {"turns": "not a list"},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "old"}]},
]


def write(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_regenerate_answers_an_mt_bench_file(tmp_path):
    inp, out = write(tmp_path / "questions.jsonl", MT_BENCH), tmp_path / "out.jsonl"
    backend = Recording()
    summary = run_regenerate(RegenerateRun(inputs=[str(inp)], output=out), make_backend=lambda: backend)
    rows = lines(out)
    assert [r["id"] for r in rows] == ["81", "questions:2", "q3", "questions:6"]
    assert rows[0]["messages"] == [{"role": "user", "content": "Write a haiku."}, {"role": "assistant", "content": "A1"},
                                   {"role": "user", "content": "Now in French."}, {"role": "assistant", "content": "A3"}]
    assert rows[1]["messages"] == [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "A1"}]
    assert rows[3]["messages"][1] == {"role": "assistant", "content": "A1"}  # a conversation, as before
    # turn 2 was asked with the verifier's own turn-1 answer as history
    assert [r.messages for r in backend.requests if r.messages[0]["content"] == "Write a haiku."][1] == \
        rows[0]["messages"][:3]
    assert [(r["conversation_id"], r["reason"]) for r in lines(tmp_path / "out.rejects.jsonl")] == [
        ("questions:4", "bad question row: expected a non-empty string, got str"),
        ("questions:5", "bad question row: expected a non-empty list of strings")]
    assert summary["counts"]["written"] == 4 and "row_settings" not in summary["counts"]
    assert "temperature" not in rows[0] and "chat_template_kwargs" not in rows[0]  # one setting: in the manifest


def test_turns_last_refuses_multi_turn_question_rows(tmp_path):
    inp, out = write(tmp_path / "q.jsonl", MT_BENCH[:2]), tmp_path / "out.jsonl"
    run_regenerate(RegenerateRun(inputs=[str(inp)], output=out, settings=RegenerateConfig(turns="last")),
                   make_backend=Recording)
    assert [r["id"] for r in lines(out)] == ["q:2"]
    assert lines(tmp_path / "out.rejects.jsonl")[0]["reason"].startswith(
        "nothing to regenerate: --turns last keeps the earlier answers, and a question row has none")


MIXED = RegenerateConfig(temperature={"0.6": 0.3, "1.0": 0.7}, reasoning_effort={"low": 1, "high": 3},
                         enable_thinking="true", seed=5, chunk_rows=7)


def test_mixtures_are_drawn_per_row_recorded_and_reproducible(tmp_path):
    inp = write(tmp_path / "q.jsonl", [{"prompt": f"Question {i}?"} for i in range(60)])
    backend = Recording()
    summary = run_regenerate(RegenerateRun(inputs=[str(inp)], output=tmp_path / "a.jsonl", settings=MIXED),
                             make_backend=lambda: backend)
    rows = lines(tmp_path / "a.jsonl")
    temperature, variables = MIXED.settings_of()
    for row, request in zip(rows, backend.requests):
        expected = row_settings(temperature, variables, 5, row["id"])
        assert (row["temperature"], row["chat_template_kwargs"]) == (expected.temperature,
                                                                      expected.template_kwargs())
        assert (request.temperature, request.chat_template_kwargs) == (row["temperature"], row["chat_template_kwargs"])
        assert row["chat_template_kwargs"]["enable_thinking"] is True
    drawn = summary["counts"]["row_settings"]
    assert sum(drawn["temperature"].values()) == 60 and set(drawn["temperature"]) == {"0.6", "1.0"}
    assert set(drawn["reasoning_effort"]) == {'"low"', '"high"'} and drawn["enable_thinking"] == {"true": 60}
    manifest = json.loads((tmp_path / "a.manifest.json").read_text())
    assert manifest["generation"]["temperature"] == {"0.6": 0.3, "1.0": 0.7}
    assert manifest["generation"]["reasoning_effort"] == {"low": 0.25, "high": 0.75}
    assert manifest["counts"]["row_settings"] == drawn
    # the same run again writes the same file; another seed draws otherwise
    run_regenerate(RegenerateRun(inputs=[str(inp)], output=tmp_path / "b.jsonl", settings=MIXED),
                   make_backend=Recording)
    assert (tmp_path / "b.jsonl").read_bytes() == (tmp_path / "a.jsonl").read_bytes()
    other = RegenerateConfig(**{**MIXED.__dict__, "seed": 6})
    run_regenerate(RegenerateRun(inputs=[str(inp)], output=tmp_path / "c.jsonl", settings=other),
                   make_backend=Recording)
    assert [r["temperature"] for r in lines(tmp_path / "c.jsonl")] != [r["temperature"] for r in rows]


def test_resume_keeps_the_draws(tmp_path):
    inp = write(tmp_path / "q.jsonl", [{"prompt": f"Question {i}?"} for i in range(30)])
    full, out = tmp_path / "full.jsonl", tmp_path / "out.jsonl"
    run_regenerate(RegenerateRun(inputs=[str(inp)], output=full, settings=MIXED), make_backend=Recording)
    with pytest.raises(KeyboardInterrupt):
        run_regenerate(RegenerateRun(inputs=[str(inp)], output=out, settings=MIXED),
                       make_backend=lambda: Recording(die_at=3))
    assert len(lines(out.with_name("out.jsonl.partial"))) == 14
    with pytest.raises(InputError, match="--temperature was"):
        run_regenerate(RegenerateRun(inputs=[str(inp)], output=out, resume=True,
                                     settings=RegenerateConfig(**{**MIXED.__dict__, "temperature": 0.6})),
                       make_backend=Recording)
    resumed = Recording()
    run_regenerate(RegenerateRun(inputs=[str(inp)], output=out, settings=MIXED, resume=True),
                   make_backend=lambda: resumed)
    assert out.read_bytes() == full.read_bytes() and len(resumed.requests) == 16


def test_per_row_template_variables_reach_the_renderer(smollm2_tokenizer):
    tok = think_tokenizer(smollm2_tokenizer)
    msgs = [{"role": "user", "content": "Hi"}]
    on = tok.decode(prompt_tokens(tok, Request(messages=msgs)))
    off = tok.decode(prompt_tokens(tok, Request(messages=msgs, chat_template_kwargs={"enable_thinking": False})))
    assert on.endswith("<|im_start|>assistant\n") and off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def local_parser(tok, parser, eos):
    """A LocalBackend's answer parsing without a model (answer_of needs only these)."""
    backend = object.__new__(LocalBackend)
    backend.tokenizer, backend.eos_ids, backend.reasoning_parser = tok, set(eos), parser
    return backend


def test_local_answers_parsed_as_served(smollm2_tokenizer):
    tok = harmony_tokenizer(smollm2_tokenizer)
    ret = tok.convert_tokens_to_ids("<|return|>")
    ids = tok("<|channel|>analysis<|message|>Plan it.<|end|><|start|>assistant<|channel|>final<|message|>Done."
              "<|return|>", add_special_tokens=False)["input_ids"]
    answer = local_parser(tok, "openai_gptoss", [ret]).answer_of(ids + [7, 8], [1])
    assert (answer.content, answer.reasoning, answer.error, answer.token_ids) == ("Done.", "Plan it.", None, ids)
    refused = local_parser(tok, None, [ret]).answer_of(ids, [1])
    assert refused.error.startswith("unparsed answer format: the answer holds special tokens (<|start|>, <|channel|>")
    assert "pass --reasoning-parser NAME (openai_gptoss for Harmony channels)" in refused.error
    cut = local_parser(tok, "openai_gptoss", [ret]).answer_of(ids[:-6], [1])  # cut inside the final header
    assert cut.error.startswith("unparsed answer format: Harmony answer cut inside a header")
    think = think_tokenizer(smollm2_tokenizer)
    eos = think.convert_tokens_to_ids("<|im_end|>")
    ids = think("<think>\nPlan.\n</think>\n\nHi!", add_special_tokens=False)["input_ids"] + [eos]
    qwen = local_parser(think, "qwen3", [eos])
    assert (qwen.answer_of(ids, [1]).content, qwen.answer_of(ids, [1]).reasoning) == ("\n\nHi!", "\nPlan.\n")
    assert qwen.answer_of(ids, [1], None, {"enable_thinking": False}).content == "<think>\nPlan.\n</think>\n\nHi!"


def _completion(content, reasoning=None):
    from openai.types.chat import ChatCompletion

    message = {"role": "assistant", "content": content, **({"reasoning_content": reasoning} if reasoning else {})}
    return ChatCompletion.model_validate({"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                                          "choices": [{"index": 0, "finish_reason": "stop", "message": message}]})


def test_server_content_split_by_the_named_parser_when_the_server_did_not():
    resp = _completion("Plan.</think>\n\nHi!")
    assert (_answer_of(resp, None, "deepseek_r1").content, _answer_of(resp, None, "deepseek_r1").reasoning) == \
        ("\n\nHi!", "Plan.")
    assert _answer_of(_completion("Hi!"), None, "deepseek_r1").reasoning == "Hi!"  # vLLM: no </think>, all reasoning
    kept = _answer_of(_completion("Hi!", reasoning="Plan."), None, "deepseek_r1")  # the server's own split is kept
    assert (kept.content, kept.reasoning) == ("Hi!", "Plan.")


def test_fixed_template_variables_under_a_mixture_recorded_and_tokenized_per_row(tmp_path, smollm2_tokenizer):
    """--chat-template-kwargs (fixed, in the manifest) with a drawn --reasoning-effort: each request and row
    carries both; tokenize with the fixed variables renders each row in its mode and counts the modes; a
    variable given both ways is refused when the settings are read (before any back end is made)."""
    from peagle_data.prepare.config import TokenizeConfig, TokenizeRun
    from peagle_data.prepare.tokenizing import run_tokenize

    inp = write(tmp_path / "q.jsonl", [{"prompt": f"Question {i}?"} for i in range(8)])
    backend = Recording()
    settings = RegenerateConfig(chat_template_kwargs={"enable_thinking": False},
                                reasoning_effort={"low": 1, "high": 1}, seed=2)
    summary = run_regenerate(RegenerateRun(inputs=[str(inp)], output=tmp_path / "r.jsonl", settings=settings),
                             make_backend=lambda: backend)
    rows = lines(tmp_path / "r.jsonl")
    efforts = [r["chat_template_kwargs"]["reasoning_effort"] for r in rows]
    assert set(efforts) == {"low", "high"}
    assert [r["chat_template_kwargs"] for r in rows] == [{"enable_thinking": False, "reasoning_effort": e}
                                                         for e in efforts]
    assert [r.chat_template_kwargs for r in backend.requests] == [r["chat_template_kwargs"] for r in rows]
    assert summary["counts"]["row_settings"] == {  # the drawn settings, not the fixed one
        "temperature": {"0.0": 8}, "reasoning_effort": {json.dumps(e): efforts.count(e) for e in ("low", "high")}}
    manifest = json.loads((tmp_path / "r.manifest.json").read_text())["generation"]
    assert (manifest["chat_template_kwargs"], manifest["reasoning_effort"]) == ({"enable_thinking": False},
                                                                              {"low": 0.5, "high": 0.5})
    reads = tmp_path / "reads.jinja"  # SmolLM2's template, reading both variables (tokenize refuses unread ones)
    reads.write_text("{%- if enable_thinking is false and reasoning_effort == 'max' %}{%- endif %}"
                     + smollm2_tokenizer.chat_template)
    c = run_tokenize(TokenizeRun(inputs=[str(tmp_path / "r.jsonl")], tokenizer="smollm2-135m", output=tmp_path / "tok",
                                 settings=TokenizeConfig(chat_template=str(reads),
                                                         chat_template_kwargs={"enable_thinking": False})))["counts"]
    assert (c["read"], c["used"], c["conversations_with_own_template_kwargs"]) == (8, 8, 8)
    assert c["template_modes"] == {json.dumps({"enable_thinking": False, "reasoning_effort": e}): efforts.count(e)
                                   for e in ("high", "low")}
    for given in ({"reasoning_effort": "low"}, {"template_mixture": {"reasoning_effort": {"low": 1, "high": 1}}}):
        with pytest.raises(ValueError, match="reasoning_effort given both by --chat-template-kwargs"):
            RegenerateConfig(chat_template_kwargs={"reasoning_effort": "high"}, **given)


def test_server_requests_carry_the_rows_temperature_and_template_variables():
    """Each request states its row's drawn temperature and sends its template variables as vLLM's
    ``chat_template_kwargs`` request field."""
    import queue
    from types import SimpleNamespace

    from peagle_data.regenerate.backends import ServerBackend

    sent = []

    def create(**kwargs):
        sent.append(kwargs)
        return _completion("Hi!")

    backend = object.__new__(ServerBackend)
    backend.clients = {"u": SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)))}
    backend.slots, backend.kind, backend.max_new_tokens, backend.model = queue.Queue(), "vllm", 16, "m"
    backend.slots.put("u")
    backend.params, backend.tokenizer, backend.reasoning_parser = None, None, None
    backend.top_k, backend.top_p = 0, 1.0  # no truncation: the verifier's generation config sets neither
    answer = backend.answer(Request(messages=[{"role": "user", "content": "Hi"}], temperature=0.6,
                                    chat_template_kwargs={"enable_thinking": False}))
    assert answer.content == "Hi!" and sent[0]["temperature"] == 0.6
    assert sent[0]["extra_body"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert sent[0]["extra_body"]["top_k"] == 0 and sent[0]["max_tokens"] == 16


@pytest.fixture(scope="module")
def think_verifier_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A random 2-layer Llama saved with the think-style tokenizer and template (tests/chat_templates)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = think_tokenizer(smollm2_tokenizer)
    out = tmp_path_factory.mktemp("think_verifier")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                                 initializer_range=0.5)).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_cli_regenerates_questions_in_a_mode_mixture_parsed_as_served(tmp_path, think_verifier_dir):
    """The CLI end to end with the local back end: per-row enable_thinking rendered into the prompts and
    read by the qwen3 parser (a block-less answer is all reasoning when thinking, all content when not)."""
    from click.testing import CliRunner

    from cli.data import main as data_main

    inp, out = write(tmp_path / "q.jsonl", [{"prompt": f"Question {i}?"} for i in range(6)]), tmp_path / "o.jsonl"
    res = CliRunner().invoke(data_main, [
        "regenerate", str(inp), "--output", str(out), "--verifier", str(think_verifier_dir), "--device", "cpu",
        "--max-new-tokens", "5", "--seed", "3", "--temperature", '{"0": 1, "0.7": 1}',
        "--enable-thinking", '{"true": 1, "false": 1}', "--reasoning-parser", "qwen3"])
    assert res.exit_code == 0, res.output
    rows = lines(out)
    assert len(rows) == 6 and {r["temperature"] for r in rows} == {0.0, 0.7}
    n = sum(r["temperature"] == 0.0 for r in rows)
    assert f"  temperature per row: 0.0 {n}, 0.7 {6 - n}" in res.output or \
        f"  temperature per row: 0.7 {6 - n}, 0.0 {n}" in res.output
    modes = {r["chat_template_kwargs"]["enable_thinking"] for r in rows}
    assert modes == {True, False}
    for r in rows:
        answer = r["messages"][1]
        text = answer.get("reasoning_content", "") + answer["content"]
        assert text  # the verifier said something
        if r["chat_template_kwargs"]["enable_thinking"]:
            assert "</think>" in text or answer["content"] == ""  # no closing tag: all reasoning (vLLM's qwen3)
        else:
            assert "reasoning_content" not in answer  # thinking off: all content
    manifest = json.loads(out.with_name("o.manifest.json").read_text())
    assert manifest["generation"]["reasoning_parser"] == "qwen3"
    assert manifest["model"]["sampling"]["temperature"] == {"0": 0.5, "0.7": 0.5}
    assert sum(manifest["counts"]["row_settings"]["enable_thinking"].values()) == 6


# --------------------------------------------------------------------------------------------
# Harmony rows regenerated in a reasoning-effort mixture, through tokenize and pack (issue 32)

HARMONY_QUESTIONS = [{"question_id": 1, "turns": ["Name a colour.", "And another?"]},
                     *({"prompt": f"Question {i}?"} for i in range(2, 8))]


@pytest.fixture(scope="module")
def harmony_verifier_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A random 2-layer Llama saved with the Harmony tokenizer and template (tests/chat_templates), stopping at
    ``<|return|>`` and ``<|call|>`` as gpt-oss's generation config does."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = harmony_tokenizer(smollm2_tokenizer)
    stops = tok.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    out = tmp_path_factory.mktemp("harmony_verifier")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         max_position_embeddings=512, bos_token_id=1, eos_token_id=stops,
                                         pad_token_id=2))
    model.generation_config.eos_token_id = stops
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def harmony_answer(prompt_text: str) -> str:
    """What the scripted verifier generates after a Harmony prompt: at ``low`` effort the final channel only,
    else an analysis naming the effort and the question, then the final channel; the stop id ``<|return|>``."""
    import re

    effort = re.search(r"Reasoning: (\w+)", prompt_text).group(1)
    question = prompt_text.rsplit("<|start|>user<|message|>", 1)[1].split("<|end|>")[0]
    final = f"<|channel|>final<|message|>Answer to {question} at {effort}.<|return|>"
    return final if effort == "low" else f"<|channel|>analysis<|message|>{effort}: {question}<|end|><|start|>assistant" \
                                         + final


def scripted_generate(tok, seen: list[str]):
    """A ``generate`` for the verifier: each row's prompt followed by :func:`harmony_answer`'s ids (a random
    model does not write Harmony channels); pads with the pad id after the answer. Records the prompts."""
    import torch

    def generate(input_ids, attention_mask, generation_config):
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            prompt = tok.decode([t for t, m in zip(ids, mask) if m])
            seen.append(prompt)
            rows.append(ids + tok(harmony_answer(prompt), add_special_tokens=False)["input_ids"])
        width = max(len(r) for r in rows)
        return torch.tensor([r + [generation_config.pad_token_id] * (width - len(r)) for r in rows])

    return generate


def test_harmony_rows_regenerated_in_an_effort_mixture_train_on_what_the_verifier_generated(
        tmp_path, harmony_verifier_dir):
    """regenerate (local back end, Harmony template, --reasoning-effort mixture, --reasoning-parser openai_gptoss),
    then tokenize and pack: each row's loss mask covers exactly the ids the verifier generated after the prompt of
    its drawn effort (the analysis and final channels up to ``<|return|>``, turn by turn), and each row's context
    is that served prompt's ids."""
    from peagle_data.prepare.config import PackConfig, PackRun, TokenizeConfig, TokenizeRun
    from peagle_data.prepare.pack import run_pack
    from peagle_data.prepare.tokenizing import run_tokenize
    from stores.tables.token_tables import TokenTable

    inp, out = write(tmp_path / "q.jsonl", HARMONY_QUESTIONS), tmp_path / "regen.jsonl"
    backend = LocalBackend(str(harmony_verifier_dir), max_new_tokens=64, temperature=0.0, batch_size=3,
                           device="cpu", reasoning_parser="openai_gptoss")
    tok, seen = backend.tokenizer, []
    backend.model.generate = scripted_generate(tok, seen)
    settings = RegenerateConfig(reasoning_effort={"low": 1, "high": 1}, seed=4, reasoning_parser="openai_gptoss")
    summary = run_regenerate(RegenerateRun(inputs=[str(inp)], output=out, settings=settings),
                             make_backend=lambda: backend)
    rows = lines(out)
    assert len(rows) == 7 and summary["counts"]["written"] == 7
    efforts = {r["id"]: r["chat_template_kwargs"]["reasoning_effort"] for r in rows}
    assert set(efforts.values()) == {"low", "high"}
    served = {}  # (row id, assistant turn index) -> (served prompt ids, generated ids)
    for row in rows:
        effort, msgs = efforts[row["id"]], row["messages"]
        for k, msg in enumerate(msgs):
            if msg["role"] != "assistant":
                continue
            question = msgs[k - 1]["content"]
            # the parser's content and reasoning, and the generated ids the row keeps
            assert msg["content"] == f"Answer to {question} at {effort}."
            assert msg.get("reasoning_content") == (None if effort == "low" else f"{effort}: {question}")
            prompt = prompt_tokens(tok, Request(messages=msgs[:k], chat_template_kwargs={"reasoning_effort": effort}))
            assert msg["token_ids"] == tok(harmony_answer(tok.decode(prompt)), add_special_tokens=False)["input_ids"]
            served[(row["id"], k)] = (prompt, msg["token_ids"])
    # turn 2 of the question was asked with turn 1's final answer as history, its analysis dropped
    [turn2] = [p for p in seen if "And another?" in p]
    assert "Answer to Name a colour." in turn2 and f"{efforts['1']}: Name a colour." not in turn2
    assert len(seen) == 8

    tok_dir, pack_dir = tmp_path / "tok", tmp_path / "packed"
    counts = run_tokenize(TokenizeRun(inputs=[str(out)], tokenizer=str(harmony_verifier_dir), output=tok_dir,
                                      settings=TokenizeConfig()), tokenizer=tok)["counts"]
    assert (counts["read"], counts["used"], counts.get("rejected", 0)) == (7, 7, 0), counts
    assert counts["template_modes"] == {json.dumps({"reasoning_effort": e}): list(efforts.values()).count(e)
                                        for e in ("high", "low")}
    table_rows = [r for part in TokenTable.open(tok_dir).iter_batches() for r in part.to_pylist()]
    assert len(table_rows) == 8  # the two-turn question: one row per turn (the template drops earlier analysis)
    trained = []
    for r in table_rows:
        first = r["loss_mask"].index(1)
        masked = [t for t, m in zip(r["input_ids"], r["loss_mask"]) if m]
        trained.append((r["input_ids"][:first], masked))
        assert r["input_ids"][first:] == masked  # one supervised span, the row's end
    assert sorted(trained) == sorted(served.values())
    assert any(tok.decode(m).startswith("<|channel|>analysis<|message|>high: ") for _, m in trained)
    assert any(tok.decode(m).startswith("<|channel|>final<|message|>") for _, m in trained)

    packed = run_pack(PackRun(inputs=[tok_dir], tokenizer=str(harmony_verifier_dir), output=pack_dir,
                              settings=PackConfig(max_seq_len=256)), tokenizer=tok)
    assert packed["counts"]["used"] == 7  # conversations; their 8 rows become the windows below
    windows = []
    for part in TokenTable.open(pack_dir).iter_batches():
        for r in part.to_pylist():
            cu = r["cu_seqlens"]
            for a, b in zip(cu[:-1], cu[1:]):
                windows.append([t for t, m in zip(r["input_ids"][a:b], r["loss_mask"][a:b]) if m])
    assert sorted(windows) == sorted(m for _, m in served.values())
