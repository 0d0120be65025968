"""Evaluation prompts: MT-Bench / OpenAI-messages JSONL, rendered turn by turn (docs/design.md §9)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peagle_train.generate.render import check_messages
from runtime.chat.answer_parsing import AnswerFormatError, answer_message, parse_answer
from runtime.chat.chat_template import ChatTemplate, prompt_ids, render
from stores.errors import InputError
from stores.files import json_line_problem
from stores.tables.question_rows import QUESTION_FIELDS, QuestionRowError, question_id, question_turns
from runtime.chat.setting_mixtures import row_settings


@dataclass(frozen=True)
class Prompt:
    """One evaluation prompt: fixed leading messages, then user turns answered by the verifier.

    Turn i is rendered as ``prefix + [user_0, answer_0, ..., user_i]`` where ``answer_j`` is the
    verifier's own greedy answer to turn j (MT-Bench's multi-turn protocol).
    """

    prompt_id: str
    user_turns: list[str]
    prefix: list[dict[str, str]] = field(default_factory=list)


def _parse_prompt(obj: Any, file: str, row: int) -> Prompt:
    if not isinstance(obj, dict):
        raise InputError(f"expected a JSON object, got {type(obj).__name__}", file=file, row=row)
    pid = question_id(obj) or str(row)
    if "turns" in obj or ("messages" not in obj and any(k in obj for k in QUESTION_FIELDS)):
        try:
            return Prompt(pid, question_turns(obj) or [])
        except QuestionRowError as e:
            raise InputError(e.reason, file=file, row=row, field=e.field) from None
    if "messages" in obj:
        msgs = obj["messages"]
        check_messages(msgs, file, row)
        users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
        if not users:
            raise InputError("no user message to answer", file=file, row=row, field="messages")
        last = users[-1]
        prefix = [{"role": m["role"], "content": m["content"]} for m in msgs[:last]]
        return Prompt(pid, [msgs[last]["content"]], prefix)
    raise InputError("expected an MT-Bench line with 'turns', a 'prompt' or 'question' line, or an OpenAI line "
                     "with 'messages'", file=file, row=row)


def read_prompts(path: str | Path, limit: int | None = None) -> list[Prompt]:
    """Read prompts from a JSONL file (blank lines skipped).

    Lines are question rows (:mod:`stores.tables.question_rows`, as ``regenerate`` reads them): MT-Bench
    ``{"question_id", "turns": [str, ...]}`` (every turn is evaluated, with the verifier's earlier answers
    as history), ``{"prompt": str}`` or ``{"question": str}``; or OpenAI ``{"messages": [...]}``: only the last user turn
    is evaluated, with the messages before it (their assistant turns as written, not the verifier's)
    as history; messages after it (a reference answer) are not used. Messages are plain
    ``{"role", "content": str}``: tool calls, tool results and content-part lists are refused. The id
    is ``question_id``, else ``id``, else the row number (1-based).

    Raises:
        InputError: missing file, bad JSON or a line of neither form (names file, row and field).
    """
    path = Path(path)
    if not path.is_file():
        raise InputError("prompts file not found", file=str(path), field="--prompts")
    prompts: list[Prompt] = []
    with path.open(encoding="utf-8") as f:
        for row, line in enumerate(f, start=1):
            if limit is not None and len(prompts) >= limit:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(json_line_problem(line, e, row), file=str(path), row=row) from None
            prompts.append(_parse_prompt(obj, str(path), row))
    if not prompts:
        raise InputError("no prompts in the file", file=str(path), field="--prompts")
    return prompts


def turn_messages(prompt: Prompt, turn: int, answers: Sequence[str | dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages of turn ``turn`` of ``prompt``: its prefix, then user turns ``0..turn`` with the
    verifier's answers to turns ``0..turn-1`` (``answers``: assistant messages as :func:`history_message`
    makes them, or plain texts) between them."""
    messages = list(prompt.prefix)
    for i in range(turn + 1):
        messages.append({"role": "user", "content": prompt.user_turns[i]})
        if i < turn:
            answer = answers[i]
            messages.append(dict(answer) if isinstance(answer, dict) else {"role": "assistant", "content": answer})
    return messages


def render_turn(tokenizer, prompt: Prompt, turn: int, answers: Sequence[str | dict[str, Any]],
                chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of turn ``turn`` of ``prompt`` (:func:`turn_messages`) with the verifier's chat template
    and a generation prompt, rendered as vLLM's chat endpoint renders the same messages and as
    ``tokenize`` and ``regenerate`` render them (:func:`runtime.chat.chat_template.prompt_ids`: content as text
    parts for a template that loops over content, developer messages as vLLM passes them).

    Args:
        answers: the verifier's answers to turns ``0..turn-1`` (:func:`history_message`, or texts).
        chat_template_kwargs: the template's variables (vLLM's ``chat_template_kwargs``, --chat-template-kwargs).

    Raises:
        ChatTemplateError: the template fails on the messages (an InputError naming the error).
        InputError: the render does not hold a user turn's text: the template drops or rewrites it, so
            the verifier would answer, and the drafter be measured on, another prompt than the file's.
    """
    messages = turn_messages(prompt, turn, answers)
    template = ChatTemplate(None, dict(chat_template_kwargs or {}))
    text = render(tokenizer, messages, None, template, add_generation_prompt=True)
    for i, m in enumerate(messages):
        if m["role"] == "user" and m["content"].strip() and m["content"].strip() not in text:
            raise InputError(f"prompt {prompt.prompt_id!r} turn {turn}: the verifier's chat template does not render "
                             f"user message {i} ({m['content'].strip()[:40]!r}): its render of the prompt is "
                             f"{text[:80]!r}; evaluate with a verifier whose template renders plain chat messages",
                             field="--prompts")
    return prompt_ids(tokenizer, messages, None, template)


def prompt_modes(prompts: Sequence[Prompt], fixed: dict[str, Any] | None, variables: dict[str, Any] | None,
                 seed: int) -> list[dict[str, Any]]:
    """Each prompt's chat template variables: the run's ``fixed`` ones (the mode, ``--chat-template-kwargs``
    or the drafter's) with the ones it draws from ``variables`` (``EvalConfig.mode_variables``: a value or a
    :class:`~runtime.chat.setting_mixtures.Mixture` each) on top, drawn as ``regenerate`` draws a row's
    (:func:`runtime.chat.setting_mixtures.row_settings`, from ``seed`` and the prompt id; a variable of both is
    the drawn one's). Every turn of a prompt is rendered, and its answers parsed, in the prompt's mode."""
    fixed = dict(fixed or {})
    if not variables:
        return [dict(fixed) for _ in prompts]
    kept = {k: v for k, v in fixed.items() if k not in variables}
    return [row_settings(0.0, variables, seed, p.prompt_id, kept).template_kwargs() for p in prompts]


def answer_text(tokenizer, tokens: Sequence[int], eos: Iterable[int]) -> str:
    """The text of generated ``tokens`` without EOS ids and special tokens, not cleaned up (it is
    rendered into the next turn's prompt and re-tokenized: ``x != y`` must stay ``x != y``)."""
    eos = set(eos)
    return tokenizer.decode([t for t in tokens if t not in eos], skip_special_tokens=True,
                            clean_up_tokenization_spaces=False)


def history_message(tokenizer, tokens: Sequence[int], eos: Iterable[int], reasoning_parser: str | None = None,
                    chat_template_kwargs: dict[str, Any] | None = None, where: str = "") -> dict[str, Any]:
    """The assistant message a client of ``vllm serve --reasoning-parser reasoning_parser`` sends back for
    generated ``tokens``: the parser's content, and its reasoning as ``reasoning_content`` (rendered only
    where the chat template renders earlier reasoning) (:func:`runtime.chat.answer_parsing.parse_answer`; no
    parser: the ``skip_special_tokens`` decode, as :func:`answer_text`, vLLM without a reasoning parser).

    Args:
        tokens: int ids ``[N]`` the verifier generated (EOS and what follows it left out).
        chat_template_kwargs: the template variables the turn was rendered with (``qwen3`` and
            ``deepseek_v3`` read ``enable_thinking``/``thinking``, as vLLM's parsers do).
        where: the prompt and turn, for the error message.

    Raises:
        InputError: the answer cannot be parsed exactly (Harmony channels without ``--reasoning-parser
            openai_gptoss``, a Harmony answer cut in a header...), or it calls a tool (evaluation prompts
            are plain chat).
    """
    try:
        parsed = parse_answer(tokenizer, list(tokens), reasoning_parser, eos, chat_template_kwargs)
    except AnswerFormatError as e:
        raise InputError(f"{where}: the verifier's answer cannot become the next turn's history: {e}",
                         field="--reasoning-parser") from None
    if parsed.tool_calls:
        raise InputError(f"{where}: the verifier answered with a tool call "
                         f"({parsed.tool_calls[0]['function']['name']}); evaluation prompts are plain chat and "
                         "a later turn would need its result", field="--prompts")
    return answer_message(parsed)


