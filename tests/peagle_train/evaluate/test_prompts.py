"""Evaluation prompts render as vLLM renders the same messages (issue 33, kind 3).

``peagle-eval`` rendered plain ``{"role", "content": str}`` dicts with ``apply_chat_template``; a template
that reads content only as a list of parts then rendered every prompt empty (9 tokens for a whole
question) and the run still reported ``identical_to_greedy: true``. It now renders with the renderer of
every stage (``runtime/chat/chat_template.py``). The tests marked ``vllm`` compare its ids with vLLM's own
message parsing and template application.
"""

from __future__ import annotations

import copy

import pytest

from peagle_train.evaluate.prompts import Prompt, render_turn, turn_messages
from peagle_train.generate.render import render_messages
from tests.chat_templates import qwen_tokenizer, template

# A template that reads message content only as a list of text parts (vLLM's "openai" content format):
# a plain string is iterated character by character, and renders nothing.
PARTS_ONLY = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
              "{% for p in m.content %}{% if p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}"
              "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

QUESTION = Prompt("81", ["Compose an engaging travel blog post about a recent trip to Hawaii.",
                         "Rewrite your previous response. Start every sentence with the letter A."])
WITH_PREFIX = Prompt("7", ["And in French?"], prefix=[
    {"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Answer in one line."},
    {"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello!"}])


@pytest.fixture(scope="module")
def parts_tokenizer(smollm2_tokenizer, tmp_path_factory):
    """SmolLM2's tokenizer with :data:`PARTS_ONLY` as its chat template, saved and loaded back (a verifier
    directory of its own, as peagle-eval and vLLM load it)."""
    from transformers import AutoTokenizer

    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = PARTS_ONLY
    directory = tmp_path_factory.mktemp("parts_only_tokenizer")
    tok.save_pretrained(directory)
    loaded = AutoTokenizer.from_pretrained(directory)
    assert loaded.chat_template == PARTS_ONLY
    return loaded


def test_a_parts_only_template_renders_the_question(parts_tokenizer):
    text = parts_tokenizer.decode(render_turn(parts_tokenizer, QUESTION, 1, ["Aloha! I went to Maui."]))
    assert text == ("<|im_start|>user\nCompose an engaging travel blog post about a recent trip to Hawaii.<|im_end|>\n"
                    "<|im_start|>assistant\nAloha! I went to Maui.<|im_end|>\n"
                    "<|im_start|>user\nRewrite your previous response. Start every sentence with the letter A."
                    "<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_developer_messages_reach_a_template_without_the_role_as_vllm_passes_them(smollm2_tokenizer):
    text = smollm2_tokenizer.decode(render_turn(smollm2_tokenizer, WITH_PREFIX, 0, []))
    assert text.startswith("<|im_start|>system\nBe brief.\n\nAnswer in one line.<|im_end|>\n<|im_start|>user\n"
                           "Say hello.<|im_end|>\n")


# --------------------------------------------------------------------------------------------
# Against vLLM's own rendering (vllm/renderers: parse_chat_messages, safe_apply_chat_template)


@pytest.fixture(scope="module")
def vllm_model_config(smollm2_tokenizer_dir):
    from vllm.config import ModelConfig

    return ModelConfig(model=str(smollm2_tokenizer_dir), tokenizer=str(smollm2_tokenizer_dir), dtype="float32")


def _vllm_prompt_ids(model_config, tokenizer, messages) -> tuple[str, list[int]]:
    """The content format vLLM detects for ``tokenizer``'s template and the prompt ids its chat endpoint
    renders for ``messages`` (``HfRenderer.render_messages``: parse, then apply the template)."""
    from vllm.renderers.chat_utils import parse_chat_messages
    from vllm.renderers.hf import resolve_chat_template_content_format, safe_apply_chat_template

    fmt = resolve_chat_template_content_format(None, None, "auto", tokenizer, model_config=model_config)
    conversation, _, _ = parse_chat_messages(messages, model_config, fmt)
    return fmt, list(safe_apply_chat_template(model_config, tokenizer, conversation, tokenize=True,
                                              add_generation_prompt=True))


@pytest.mark.vllm
@pytest.mark.parametrize("template", ["smollm2", "parts_only"])
def test_evaluation_prompt_ids_equal_vllms(vllm_model_config, smollm2_tokenizer, parts_tokenizer, template):
    tok = smollm2_tokenizer if template == "smollm2" else parts_tokenizer
    cases = [(QUESTION, 0, []), (QUESTION, 1, ["Aloha! I went to Maui.\n\nIt was  warm."]), (WITH_PREFIX, 0, [])]
    for prompt, turn, answers in cases:
        fmt, served = _vllm_prompt_ids(vllm_model_config, tok, turn_messages(prompt, turn, answers))
        assert fmt == {"smollm2": "string", "parts_only": "openai"}[template]
        ids = render_turn(tok, prompt, turn, answers)
        assert ids == served
        assert len(ids) > 20  # the question is in it (the bug rendered 9 tokens)


def test_a_template_that_does_not_render_the_question_is_refused(smollm2_tokenizer):
    """Before, such a prompt was decoded from the bare generation prompt and reported identical_to_greedy."""
    from stores.errors import InputError

    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = ("{% for m in messages %}{% if m.role == 'system' %}{{ m.content }}{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(InputError, match="prompt '81' turn 0: the verifier's chat template does not render user "
                                         "message 0 \\('Compose an engaging travel blog post abo'\\)"):
        render_turn(tok, QUESTION, 0, [])


# --------------------------------------------------------------------------------------------
# Template variables (--chat-template-kwargs): the evaluation prompt in the served mode, both engines


@pytest.fixture(scope="module")
def hybrid_tokenizer(smollm2_tokenizer):
    """SmolLM2's tokenizer with Qwen's think tokens and a Qwen3-style hybrid-thinking template."""
    tok = qwen_tokenizer(smollm2_tokenizer)
    tok.chat_template = template("qwen3_hybrid")
    return tok


def test_evaluation_turns_render_in_the_mode(hybrid_tokenizer):
    tok = hybrid_tokenizer
    on = tok.decode(render_turn(tok, QUESTION, 1, ["Aloha!"]))
    off = tok.decode(render_turn(tok, QUESTION, 1, ["Aloha!"], {"enable_thinking": False}))
    assert on.endswith("<|im_start|>user\n" + QUESTION.user_turns[1] + "<|im_end|>\n<|im_start|>assistant\n")
    assert off == on + "<think>\n\n</think>\n\n"
    # the engine's own prompt for chat messages (PEAGLEInference): the same renderer
    messages = turn_messages(QUESTION, 0, [])
    assert render_messages(tok, messages, {"enable_thinking": False}) == render_turn(
        tok, QUESTION, 0, [], {"enable_thinking": False})


@pytest.mark.vllm
def test_evaluation_prompt_ids_in_a_mode_equal_vllms(vllm_model_config, hybrid_tokenizer):
    """What a client of ``vllm serve`` sends with ``chat_template_kwargs`` is what both engines decode."""
    from tests.runtime.chat.test_chat_template import _vllm_request_ids

    for kwargs in ({}, {"enable_thinking": False}):
        for turn, answers in ((0, []), (1, ["Aloha!"])):
            served = _vllm_request_ids(vllm_model_config, hybrid_tokenizer, turn_messages(QUESTION, turn, answers),
                                       None, kwargs)
            assert render_turn(hybrid_tokenizer, QUESTION, turn, answers, kwargs) == served


@pytest.mark.vllm
@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_turn_2_prompt_is_what_a_client_of_vllm_serve_reasoning_parser_sends(vllm_model_config, smollm2_tokenizer,
                                                                              parser):
    """Issue 32: turn 2's history is the reasoning parser's content of the turn-1 answer, rendered as vLLM renders
    the client's next request (a client sends the content back; the template drops earlier reasoning)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.parser_manager import ParserManager

    from peagle_train.evaluate.prompts import history_message
    from tests.chat_templates import think_tokenizer

    tok = think_tokenizer(smollm2_tokenizer)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    prompt = Prompt("q", ["What is 2+2?", "And 3+3?"])
    answer = tok("<think>\nTwo and two.\n</think>\n\nIt is  4.", add_special_tokens=False)["input_ids"] + [eos]
    parser_cls = ParserManager.get_parser(reasoning_parser_name=parser, tokenizer=tok)
    request = ChatCompletionRequest(messages=turn_messages(prompt, 0, []), model="m")
    reasoning, content, _ = parser_cls(tok, None).parse(tok.decode(answer[:-1], skip_special_tokens=True), request,
                                                        model_output_token_ids=answer)
    assert (reasoning, content) == ("\nTwo and two.\n", "\n\nIt is  4.")
    client = [*turn_messages(prompt, 0, []), {"role": "assistant", "content": content},
              {"role": "user", "content": "And 3+3?"}]
    _, served = _vllm_prompt_ids(vllm_model_config, tok, client)
    ours = render_turn(tok, prompt, 1, [history_message(tok, answer, [eos], parser)])
    assert ours == served
    assert "Two and two" not in tok.decode(ours)
    # the old history, the flat decode, under a template that does not strip think blocks from content (SmolLM2's):
    # the reasoning stays in the prompt, which no served client sends
    flat = render_turn(smollm2_tokenizer, prompt, 1, [tok.decode(answer[:-1], skip_special_tokens=True)])
    _, smol_served = _vllm_prompt_ids(vllm_model_config, smollm2_tokenizer, client)
    assert "Two and two" in smollm2_tokenizer.decode(flat) and flat != smol_served
    assert render_turn(smollm2_tokenizer, prompt, 1, [history_message(tok, answer, [eos], parser)]) == smol_served


def test_prompt_modes_draw_as_regenerate_draws_rows():
    """Each prompt's mode: the fixed variables with its draws on top, the draw regenerate makes for a row of the
    same id and seed (runtime.chat.setting_mixtures.row_settings), so a drafter trained on a regenerated mixture is
    measured on the same kind of mixture."""
    from peagle_train.evaluate.prompts import prompt_modes
    from runtime.chat.setting_mixtures import parse_mixture, row_settings, template_value

    prompts = [Prompt(str(i), ["Hi"]) for i in range(40)]
    variables = {"reasoning_effort": parse_mixture({"low": 1, "high": 1}, "", template_value)}
    modes = prompt_modes(prompts, {"persona": "terse"}, variables, 3)
    assert modes == [row_settings(0.0, variables, 3, p.prompt_id, {"persona": "terse"}).template_kwargs()
                     for p in prompts]
    assert {m["reasoning_effort"] for m in modes} == {"low", "high"} and all(m["persona"] == "terse" for m in modes)
    assert modes == prompt_modes(prompts, {"persona": "terse"}, variables, 3)  # reproducible
    assert modes != prompt_modes(prompts, {"persona": "terse"}, variables, 4)
    assert prompt_modes(prompts[:2], {"a": 1}, {}, 3) == [{"a": 1}, {"a": 1}]
    # a drawn variable replaces a fixed one of the same name (a mismatch peagle-eval allowed)
    assert {m["reasoning_effort"] for m in prompt_modes(prompts, {"reasoning_effort": "medium"}, variables, 3)} == \
        {"low", "high"}
