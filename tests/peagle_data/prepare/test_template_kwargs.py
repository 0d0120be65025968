"""tokenize / pack with chat template variables (``--chat-template-kwargs``): rows in the mode, the
variables recorded in each manifest, a pack of a tokenize output made in another mode refused."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from cli.data_prepare import pack, tokenize
from peagle_data.prepare.config import PackConfig, PackRun, TokenizeConfig, TokenizeRun
from peagle_data.prepare.pack import run_pack
from peagle_data.prepare.tokenizing import run_tokenize
from runtime.chat.chat_template import ChatTemplateError
from stores.errors import StoreMismatchError
from stores.tables.token_tables import TokenTable
from tests.chat_templates import qwen_tokenizer, template, template_path
from tests.peagle_data.prepare.test_runs import rejects_of, write_rows

ROWS = [
    {"id": "plain", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
    {"id": "reasoned", "messages": [{"role": "user", "content": "2+2?"},
                                    {"role": "assistant", "content": "4.", "reasoning_content": "Add."}]},
]
OFF = {"enable_thinking": False}


@pytest.fixture(scope="module")
def qwen_tok(smollm2_tokenizer):
    return qwen_tokenizer(smollm2_tokenizer)


def _supervised(tok, table) -> dict[str, str]:
    """Per row id, the decoded supervised tokens."""
    out = {}
    for part in table.iter_batches():
        for cid, ids, mask in zip(part.column("conversation_id").to_pylist(), part.column("input_ids").to_pylist(),
                                  part.column("loss_mask").to_pylist()):
            out[cid] = tok.decode([i for i, m in zip(ids, mask) if m])
    return out


def _tokenize(tmp_path, tok, name, kwargs, out="tok"):
    src = write_rows(tmp_path / "rows.jsonl", ROWS)
    settings = TokenizeConfig(chat_template=str(template_path(name)), chat_template_kwargs=kwargs)
    summary = run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / out,
                                       settings=settings), tokenizer=tok)
    return summary, TokenTable.open(tmp_path / out)


def test_tokenize_rows_in_each_mode_and_the_variables_recorded(tmp_path, qwen_tok):
    summary, on = _tokenize(tmp_path, qwen_tok, "qwen35_open_think", {}, "on")
    # a reply without reasoning after the served "<think>\n": tokenized whole, its "\n</think>" would merge the
    # prompt's last newline into "\n\n"; built as served (the prompt alone, then the reply), counted
    assert _supervised(qwen_tok, on) == {"reasoned": "Add.\n</think>\n\n4.<|im_end|>",
                                         "plain": "\n</think>\n\nHello!<|im_end|>"}
    assert summary["counts"]["served_prompt_rows"] == 1 and summary["counts"]["rejected"] == 0
    assert on.manifest["tokenizer"]["chat_template_kwargs"] == {}
    summary, off = _tokenize(tmp_path, qwen_tok, "qwen35_open_think", OFF, "off")
    assert _supervised(qwen_tok, off) == {"plain": "Hello!<|im_end|>"}
    assert off.manifest["tokenizer"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert off.manifest["parameters"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert summary["counts"]["rejected_by_reason"] == {"generation prompt mismatch": 1}
    [reject] = rejects_of(tmp_path / "off")
    assert reject["conversation_id"] == "reasoned"
    assert "closes an empty think block" in reject["reason"] and '{"enable_thinking": false}' in reject["reason"]


def test_pack_records_the_variables_and_refuses_a_tokenize_output_of_another_mode(tmp_path, qwen_tok):
    _tokenize(tmp_path, qwen_tok, "qwen3_hybrid", OFF)
    template = str(template_path("qwen3_hybrid"))
    with pytest.raises(StoreMismatchError) as info:
        run_pack(PackRun(inputs=[tmp_path / "tok"], tokenizer="smollm2-135m", output=tmp_path / "p",
                         settings=PackConfig(tokenize=TokenizeConfig(chat_template=template))), tokenizer=qwen_tok)
    assert str(info.value) == (
        f"the tokenize output {tmp_path / 'tok'} was rendered with chat template kwargs {{\"enable_thinking\": false}}, "
        "but --chat-template-kwargs gives none (the template's defaults): the verifier answers another prompt in "
        "each mode; pass the --chat-template-kwargs it was tokenized with, or re-run tokenize in this mode")
    assert not (tmp_path / "p").exists()
    run_pack(PackRun(inputs=[tmp_path / "tok"], tokenizer="smollm2-135m", output=tmp_path / "p",
                     settings=PackConfig(tokenize=TokenizeConfig(chat_template=template, chat_template_kwargs=OFF))),
             tokenizer=qwen_tok)
    assert TokenTable.open(tmp_path / "p").manifest["tokenizer"]["chat_template_kwargs"] == {"enable_thinking": False}
    # raw conversations packed in a mode: the same record
    run_pack(PackRun(inputs=[tmp_path / "rows.jsonl"], tokenizer="smollm2-135m", output=tmp_path / "raw",
                     settings=PackConfig(tokenize=TokenizeConfig(chat_template=template, chat_template_kwargs=OFF))),
             tokenizer=qwen_tok)
    raw = TokenTable.open(tmp_path / "raw")
    assert raw.manifest["tokenizer"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert raw.manifest["counts"]["used"] == 1


def test_the_option_takes_a_json_object(tmp_path):
    src = write_rows(tmp_path / "rows.jsonl", ROWS[:1])
    mode_line = tmp_path / "mode_line.jinja"  # a system line in one mode; the rest as SmolLM2's template
    mode_line.write_text("{% if enable_thinking is false %}<|im_start|>system\nno thinking<|im_end|>\n{% endif %}"
                         "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    ok = CliRunner().invoke(tokenize, [str(src), "--tokenizer", "smollm2-135m", "--output", str(tmp_path / "t"),
                                       "--chat-template", str(mode_line),
                                       "--chat-template-kwargs", '{"enable_thinking": false}'])
    assert ok.exit_code == 0, ok.output
    assert TokenTable.open(tmp_path / "t").manifest["tokenizer"]["chat_template_kwargs"] == {"enable_thinking": False}
    bad = CliRunner().invoke(pack, [str(src), "--tokenizer", "smollm2-135m", "--output", str(tmp_path / "p"),
                                    "--chat-template-kwargs", "enable_thinking=false"])
    assert bad.exit_code == 2
    assert "expected a JSON object such as '{\"enable_thinking\": false}', got 'enable_thinking=false'" in bad.output
    reserved = CliRunner().invoke(pack, [str(src), "--tokenizer", "smollm2-135m", "--output", str(tmp_path / "p"),
                                         "--chat-template-kwargs", json.dumps({"add_generation_prompt": True})])
    assert reserved.exit_code == 2
    assert "--chat-template-kwargs may not set 'add_generation_prompt'" in reserved.output


def _tokenize_and_pack(tmp_path, src, settings: TokenizeConfig, tok):
    """``tokenize`` (into ``tmp_path/t``) and ``pack`` (into ``tmp_path/p``) of ``src`` with ``settings``, to call."""
    return (lambda: run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "t",
                                             settings=settings), tokenizer=tok),
            lambda: run_pack(PackRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "p",
                                     settings=PackConfig(tokenize=settings)), tokenizer=tok))


def test_a_regenerate_output_of_another_mode_is_refused(tmp_path, qwen_tok):
    """Answers regenerated from prompts in one mode are not tokenized in another."""
    src = write_rows(tmp_path / "regen.jsonl", ROWS[:1])
    manifest = {"generation": {"temperature": 0.0, "chat_template_kwargs": {"enable_thinking": False}},
                "model": {"backend": "local"}}
    (tmp_path / "regen.manifest.json").write_text(json.dumps(manifest))
    settings = TokenizeConfig(chat_template=str(template_path("qwen3_hybrid")))
    for run in _tokenize_and_pack(tmp_path, src, settings, qwen_tok):
        with pytest.raises(StoreMismatchError) as info:
            run()
        assert str(info.value) == (
            f"{src} (a regenerate output: the prompts its answers were generated from) was rendered with chat "
            "template kwargs {\"enable_thinking\": false}, but --chat-template-kwargs gives none (the template's "
            "defaults): the verifier answers another prompt in each mode; pass the --chat-template-kwargs it was "
            "regenerated with, or regenerate it in this mode")
    assert not (tmp_path / "t").exists() and not (tmp_path / "p").exists()
    ok = run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "t", settings=TokenizeConfig(
        chat_template=str(template_path("qwen3_hybrid")), chat_template_kwargs={"enable_thinking": False})),
        tokenizer=qwen_tok)
    assert ok["counts"]["used"] == 1
    manifest["generation"].pop("chat_template_kwargs")  # regenerated before peagle recorded them: none
    (tmp_path / "regen.manifest.json").write_text(json.dumps(manifest))
    assert run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "t2", settings=settings),
                        tokenizer=qwen_tok)["counts"]["used"] == 1


MIXED = [
    {"id": "on", "chat_template_kwargs": {"enable_thinking": True, "style": "terse"},
     "messages": [{"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet."}]},
    {"id": "off", "chat_template_kwargs": {"enable_thinking": False, "style": "terse"},
     "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
    {"id": "fixed", "messages": [{"role": "user", "content": "Hey"}, {"role": "assistant", "content": "Yo!"}]},
]


def _styled(tmp_path):
    """qwen35_open_think with a ``style`` variable of its own (read; it renders nothing more)."""
    path = tmp_path / "styled.jinja"
    path.write_text("{%- if style is defined and style == 'verbose' %}{%- endif %}" + template("qwen35_open_think"))
    return str(path)
# the row without variables is rendered with the template's default (thinking on, an open think block): it reasons
MIXED_REASONED = MIXED[:2] + [{"id": "fixed", "messages": [
    {"role": "user", "content": "Hey"}, {"role": "assistant", "content": "Yo!", "reasoning_content": "Reply."}]}]


def test_rows_of_a_mode_mixture_render_each_in_its_recorded_mode(tmp_path, qwen_tok):
    """regenerate's per-row variables (a mixture): each row trains on the prompt the verifier answered, the
    fixed --chat-template-kwargs under them; the manifest says the table is a mixture and counts each mode."""
    src = write_rows(tmp_path / "regen.jsonl", MIXED_REASONED)
    manifest = {"generation": {"temperature": 0.0, "chat_template_kwargs": {"style": "terse"},
                               "enable_thinking": {"true": 0.5, "false": 0.5}}, "model": {"backend": "local"}}
    (tmp_path / "regen.manifest.json").write_text(json.dumps(manifest))
    settings = TokenizeConfig(chat_template=_styled(tmp_path), chat_template_kwargs={"style": "terse"})
    summary = run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "t",
                                       settings=settings), tokenizer=qwen_tok)
    table = TokenTable.open(tmp_path / "t")
    assert _supervised(qwen_tok, table) == {"on": "Greet.\n</think>\n\nHello!<|im_end|>", "off": "Hello!<|im_end|>",
                                            "fixed": "Reply.\n</think>\n\nYo!<|im_end|>"}
    counts = summary["counts"]
    assert (counts["used"], counts["conversations_with_own_template_kwargs"]) == (3, 2)
    assert counts["template_modes"] == {'{"enable_thinking": false, "style": "terse"}': 1,
                                        '{"enable_thinking": true, "style": "terse"}': 1, '{"style": "terse"}': 1}
    assert table.manifest["tokenizer"]["chat_template_kwargs"] == {"style": "terse"}  # the fixed ones
    # the regenerate manifest's fixed variables are still checked, naming the mixture
    with pytest.raises(StoreMismatchError) as info:
        run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "t2",
                                 settings=TokenizeConfig(chat_template=str(template_path("qwen35_open_think")))),
                     tokenizer=qwen_tok)
    assert "its rows also record the variables drawn per row from" in str(info.value)
    assert '{"enable_thinking": {"false": 0.5, "true": 0.5}}' in str(info.value)
    # a plain table (no row records variables) has no template_modes
    _, plain = _tokenize(tmp_path, qwen_tok, "qwen3_hybrid", OFF, "plain")
    assert "template_modes" not in plain.manifest["counts"]


def test_a_row_recording_a_variable_the_run_fixes_otherwise_is_a_reject(tmp_path, qwen_tok):
    src = write_rows(tmp_path / "rows.jsonl", MIXED)
    settings = TokenizeConfig(chat_template=_styled(tmp_path), chat_template_kwargs=OFF)
    summary = run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "t",
                                       settings=settings), tokenizer=qwen_tok)
    assert summary["counts"]["rejected_by_reason"] == {"template variables": 1}
    [reject] = rejects_of(tmp_path / "t")
    assert reject["conversation_id"] == "on"
    assert reject["reason"] == (
        'template variables: the row was answered with chat_template_kwargs {"enable_thinking": true, "style": '
        '"terse"} and --chat-template-kwargs gives {"enable_thinking": false} (enable_thinking differ); pass the '
        "fixed variables the rows were regenerated with")
    assert _supervised(qwen_tok, TokenTable.open(tmp_path / "t")) == {"off": "Hello!<|im_end|>",
                                                                      "fixed": "Yo!<|im_end|>"}


@pytest.mark.parametrize("name, kwargs, reads", [
    ("qwen3_hybrid", {"enable_thinkng": False}, "the template reads enable_thinking, reasoning_content"),
    (None, {"enable_thinking": False}, "the template reads no variables"),  # SmolLM2's own template has no mode
])
def test_a_variable_the_template_never_reads_is_refused(tmp_path, qwen_tok, name, kwargs, reads):
    """A misspelt (or foreign) variable changes no prompt: vLLM drops it, the template renders its default mode, and
    the run would record a mode it never rendered. Refused before any row is read, for tokenize and pack alike."""
    src = write_rows(tmp_path / "rows.jsonl", ROWS)
    settings = TokenizeConfig(chat_template=str(template_path(name)) if name else None,
                              chat_template_kwargs=kwargs)
    for run in _tokenize_and_pack(tmp_path, src, settings, qwen_tok):
        with pytest.raises(ChatTemplateError) as info:
            run()
        assert str(info.value).startswith(f"--chat-template-kwargs: the chat template never reads "
                                          f"'{next(iter(kwargs))}', so it would change no prompt")
        assert reads in str(info.value)
    assert not (tmp_path / "t").exists() and not (tmp_path / "p").exists()


def test_a_row_recording_a_variable_the_template_never_reads_is_a_reject(tmp_path, qwen_tok):
    """A regenerated row's own variables (a mixture) are checked as the option's are: that row is a reject."""
    rows = [ROWS[0], {**ROWS[1], "chat_template_kwargs": {"enable_thinkng": False}}]
    src = write_rows(tmp_path / "rows.jsonl", rows)
    settings = TokenizeConfig(chat_template=str(template_path("qwen3_hybrid")))
    summary = run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "t",
                                       settings=settings), tokenizer=qwen_tok)
    assert summary["counts"]["used"] == 1
    [reject] = rejects_of(tmp_path / "t")
    assert reject["conversation_id"] == "reasoned" and "never reads 'enable_thinkng'" in reject["reason"]


def test_thinking_off_rows_are_built_as_served_and_counted(tmp_path, smollm2_tokenizer):
    """Issue 44 item 5: thinking off (``</think>\\n\\n`` ends the prompt) with SmolLM2's split, which cuts a newline
    run before a letter, rejected every plain row. Each row is now its served prompt tokenized alone, then the
    reply (``served_prompt_rows``); a conversation no one sequence serves exactly has a row per turn
    (``served_turn_conversations`` / ``served_turn_rows``), each turn's context its prompt tokenized alone."""
    import copy

    from tests.peagle_data.chat.test_served import NEWLINE_PROMPT
    from tests.peagle_data.chat.test_tokens import MULTI_TURN

    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_tokens(["<think>", "</think>"])
    plain = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"Question {i}?"},
                                          {"role": "assistant", "content": f"Answer {i}."}]} for i in range(3)]
    src = write_rows(tmp_path / "plain.jsonl", plain)
    settings = TokenizeConfig(chat_template=str(template_path("qwen3_hybrid")), chat_template_kwargs=OFF)
    summary = run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "off",
                                       settings=settings), tokenizer=tok)
    counts = summary["counts"]
    assert (counts["used"], counts["rejected"], counts["served_prompt_rows"]) == (3, 0, 3)
    table = TokenTable.open(tmp_path / "off")
    assert table.manifest["counts"]["served_prompt_rows"] == 3
    assert _supervised(tok, table) == {f"r{i}": f"Answer {i}.<|im_end|>" for i in range(3)}
    (tmp_path / "newline.jinja").write_text(NEWLINE_PROMPT)
    src = write_rows(tmp_path / "multi.jsonl", [{"id": "m", "messages": MULTI_TURN}])
    summary = run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "multi",
                                       settings=TokenizeConfig(chat_template=str(tmp_path / "newline.jinja"))),
                           tokenizer=smollm2_tokenizer)
    counts = summary["counts"]
    assert (counts["used"], counts["served_turn_conversations"], counts["served_turn_rows"]) == (1, 1, 2)
    assert counts.get("history_rewrite_conversations") in (None, 0)
    assert _supervised(smollm2_tokenizer, TokenTable.open(tmp_path / "multi")) == {
        "m@1": "2+2 is 4.<|im_end|>", "m@3": "It is 6.<|im_end|>"}
