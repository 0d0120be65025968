"""``peagle-data regenerate``: the verifier rewrites the assistant turns of a conversation set (docs/design.md §1,
"regenerate").

Per conversation (read by :mod:`peagle_data.readers`): ``--turns all`` replaces every assistant turn, in order,
by the verifier's answer to the regenerated history before it; ``last`` only the last turn, given the original
history; ``first`` only the first, and the conversation ends after it. Tool-calling turns are kept; an answer
that calls a tool ends the conversation (``ended_at_verifier_tool_call``). A regenerated turn carries
``token_ids`` where the back end returns them (``turns_with_token_ids``), which ``tokenize`` trains on
(:func:`peagle_data.chat.generated_ids.on_generated_ids`).

Rejects (``OUT.rejects.jsonl``): the reader's reason, ``template drops <part>``, ``prompt too long``, ``server
error``, ``empty answer``, ``truncated answer`` (``--on-truncated drop``), ``invalid UTF-8`` / ``undecodable
answer``, ``nothing to regenerate``. Rows are written in input order per chunk; ``--resume`` continues after the
rows on disk (:mod:`stores.tables.conversation_files`).
"""

from __future__ import annotations

import itertools
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Sequence

from peagle_data.chat.dropped import dropped_reason, dropped_content
from runtime.chat.chat_template import ChatTemplate, ChatTemplateError, check_kwargs_names, loads_unique, render
from peagle_data.readers.conversations import read_conversations
from peagle_data.readers.inputs import resolve_inputs
from peagle_data.readers.rows import FORMATS, Conversation, Reject
from peagle_data.regenerate.backends import Answer, BackendConfig, Request, prompt_tokens
from runtime.chat.setting_mixtures import (Mixture, RowSettings, mode_options, normalised, parse_mixture, row_settings,
                                     temperature_value, template_variables)
from runtime.chat.answer_parsing import check_reasoning_parser
from stores.tables.conversation_files import ConversationWriter, check_output, read_regenerate_manifest
from stores.errors import InputError
from runtime.progress import progress

__all__ = ["RegenerateConfig", "RegenerateRun", "TURNS", "ON_DROPPED", "ON_TRUNCATED", "Regeneration",
           "prompt_drops", "run_regenerate"]

TURNS = ("all", "last", "first")
ON_DROPPED = ("reject", "keep")
ON_TRUNCATED = ("keep", "drop")


@dataclass(frozen=True, kw_only=True)
class RegenerateConfig:
    """Settings of one ``regenerate`` run (recorded in the manifest; ``--resume`` requires the same)."""

    max_new_tokens: int = 512
    """Most tokens per answer; an answer cut there is kept and counted (``--max-new-tokens``)."""
    temperature: float | dict[str, float] = 0.0
    """0 is greedy (reproducible, resumable to the same file); else sampling; or a mixture, a JSON object
    ``{"0.6": 0.3, "1.0": 0.7}``: each row draws one from --seed and its id (weights normalised; recorded
    per row) (``--temperature``)."""
    top_k: int | None = None
    """Sampling at T > 0: keep the verifier's k most likely tokens, as vLLM's ``top_k`` (0: off); None: the local
    verifier's ``generation_config.json`` value (with --server, the --tokenizer MODEL's), as a vLLM server applies it
    by default, else off; recorded in the manifest's ``sampling`` with its source (``--top-k``)."""
    top_p: float | None = None
    """Sampling at T > 0: keep the most likely tokens up to this probability mass, as vLLM's ``top_p`` (1: off);
    None: as --top-k, from the generation config (``--top-p``)."""
    turns: str = "all"
    """Regenerate every assistant turn (given the regenerated history), only the last one, or only the
    first one, ending the conversation after it (``--turns``)."""
    limit: int | None = None
    """Read at most this many input rows; None: all (``--limit``)."""
    format: str = "auto"
    """Conversation format of the input rows: auto (detected per row), openai or sharegpt (``--format``)."""
    chunk_rows: int = 64
    """Rows generated together before they are written (a local wave holds one request per
    unfinished row of the chunk)."""
    seed: int = 0
    """Torch seed of the local back end's sampling with ``--temperature`` > 0, and of the per-row draws of a
    mixture (``--seed``; recorded in the manifest: another seed, another draw). A server samples each request
    itself (no seed is sent)."""
    on_dropped_content: str = "reject"
    """A prompt with content the verifier's chat template does not render (tools, a tool call):
    reject the row, or keep regenerating it, counted (``--on-dropped-content``, as ``tokenize``)."""
    on_truncated: str = "keep"
    """An answer cut at --max-new-tokens: keep it (counted), or drop its row to the rejects (``--on-truncated``)."""
    max_prompt_tokens: int | None = None
    """Reject a row (``prompt too long``) whose rendered prompt has more tokens; None: no limit but the
    verifier's context (``--max-prompt-tokens``; with ``--server`` it needs ``--tokenizer`` to count)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """The chat template's variables the verifier is asked with, as vLLM's ``chat_template_kwargs``
    (``--chat-template-kwargs``, a JSON object such as ``{"enable_thinking": false}``): the fixed mode of every
    row, rendered into the local verifier's prompts and the prompts checked with ``--tokenizer``, sent to servers
    as the request's ``chat_template_kwargs``; recorded in the manifest. Pass the same to ``tokenize``/``pack`` of
    the output. A row's drawn variables (``--reasoning-effort``, ``--enable-thinking``, ``--template-mixture``)
    go on top of them; a variable given both ways is refused."""
    reasoning_effort: str | dict[str, float] | None = None
    """The chat template's ``reasoning_effort`` (gpt-oss: low, medium, high), or a mixture ``{"low": 0.2,
    "high": 0.8}`` drawn per row and recorded in the row; None: not drawn (``--reasoning-effort``)."""
    enable_thinking: bool | str | dict[str, float] | None = None
    """The chat template's ``enable_thinking`` (Qwen3 hybrid thinking: true/false), or a mixture ``{"true":
    0.5, "false": 0.5}`` drawn per row and recorded in the row; None: not drawn (``--enable-thinking``)."""
    template_mixture: dict[str, Any] | str | None = None
    """Other chat-template variables, each a value or a mixture drawn per row and recorded in the row: a JSON
    object ``{"thinking": {"true": 0.7, "false": 0.3}}`` (``--template-mixture``)."""
    reasoning_parser: str | None = None
    """How an answer becomes the row's assistant message, as ``vllm serve --reasoning-parser NAME`` returns
    it: deepseek_r1, deepseek_v3, qwen3 (think blocks), openai_gptoss (Harmony channels, --verifier only);
    content as ``content``, reasoning as ``reasoning_content``; an answer it cannot parse exactly is a
    reject. None: a think block is split off, other special tokens refused (``--reasoning-parser``)."""

    def __post_init__(self) -> None:
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0 (0: off), got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1] (1: off), got {self.top_p}")
        object.__setattr__(self, "chat_template_kwargs", check_kwargs_names(self.chat_template_kwargs or {}))
        object.__setattr__(self, "temperature", normalised(self.temperature, "--temperature", temperature_value))
        for name, value in zip(("reasoning_effort", "enable_thinking", "template_mixture"),
                               mode_options(self.reasoning_effort, self.enable_thinking, self.template_mixture)):
            object.__setattr__(self, name, value)
        template_variables(self.reasoning_effort, self.enable_thinking, self.template_mixture,
                           self.chat_template_kwargs)  # ValueError: a variable given twice
        check_reasoning_parser(self.reasoning_parser)
        if self.turns not in TURNS:
            raise ValueError(f"--turns must be one of {TURNS}, got {self.turns!r}")
        if self.format not in FORMATS:
            raise ValueError(f"--format must be one of {FORMATS}, got {self.format!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {self.chunk_rows}")
        if self.on_dropped_content not in ON_DROPPED:
            raise ValueError(f"--on-dropped-content must be one of {ON_DROPPED}, got {self.on_dropped_content!r}")
        if self.on_truncated not in ON_TRUNCATED:
            raise ValueError(f"--on-truncated must be one of {ON_TRUNCATED}, got {self.on_truncated!r}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1 rows, got {self.limit}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"--max-prompt-tokens must be >= 1, got {self.max_prompt_tokens}")

    def settings_of(self) -> tuple[float | Mixture, dict[str, Any]]:
        """``(temperature, template variables)``, each a value or a :class:`Mixture` (for :func:`row_settings`)."""
        temperature = self.temperature
        if isinstance(temperature, dict):
            temperature = parse_mixture(temperature, "", temperature_value)
        return temperature, template_variables(self.reasoning_effort, self.enable_thinking, self.template_mixture)

    @property
    def per_row(self) -> bool:
        """Whether rows record their drawn settings: a mixture or a template variable is given."""
        temperature, variables = self.settings_of()
        return isinstance(temperature, Mixture) or bool(variables)


@dataclass(frozen=True, kw_only=True)
class RegenerateRun:
    """One ``peagle-data regenerate`` run: inputs, output, the generation ``settings`` and the ``backend``."""

    inputs: Sequence[str]
    """Conversation files (.jsonl, .json, .parquet; globs allowed) or 'sharegpt'."""
    output: str
    """Regenerated conversations (OpenAI messages); OUT.manifest.json and OUT.rejects.jsonl beside it."""
    resume: bool = field(default=False, metadata={"action": True})
    """Continue an unfinished run of the same settings; only --device (same dtype), --concurrency, --server,
    --retries and --timeout may differ."""
    force: bool = field(default=False, metadata={"action": True})
    """Overwrite an existing output."""
    settings: RegenerateConfig = field(default_factory=RegenerateConfig)
    """How answers are generated."""
    backend: BackendConfig | None = None
    """Which verifier answers (in this process or servers); None: the caller of :func:`run_regenerate`
    passes ``make_backend``."""


class Regeneration:
    """The state of one conversation being regenerated: which request comes next, and the result.

    Args:
        conv: the normalised conversation.
        turns: ``all``, ``last`` or ``first`` (the conversation ends after the first assistant turn).
        on_truncated: ``keep`` an answer cut at the token limit, or ``drop`` (reject) its row.
        settings: the row's drawn temperature and chat-template variables, the run's fixed ones under them
            (its requests carry them, its row records them all); None: the back end's temperature, the fixed
            ``chat_template_kwargs``, nothing recorded in the row.
        chat_template_kwargs: the run's fixed template variables (--chat-template-kwargs).

    A question row (``conv.question``) has empty assistant turns to fill: ``--turns all`` answers every
    question in order, ``first`` the first; ``last`` is a reject (there are no earlier answers to keep).

    Use: while :meth:`next_request` returns a request, answer it and pass the answer to
    :meth:`feed`; then :attr:`reject` is None and :meth:`row` is the output row, or
    :attr:`reject` is the reason.
    """

    def __init__(self, conv: Conversation, turns: str, on_truncated: str = "keep", settings: RowSettings | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None):
        self.conv, self.on_truncated, self.settings = conv, on_truncated, settings
        self.chat_template_kwargs = dict(chat_template_kwargs or {})  # with settings: settings.template_kwargs()
        self.dropped_content = False  # a prompt had content the template drops (--on-dropped-content keep)
        msgs = conv.messages
        assistants = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        scope = {"all": assistants, "last": assistants[-1:], "first": assistants[:1]}[turns]
        self.end_after_scope = turns == "first"  # the turns after it answered what the verifier did not say
        self.todo = [i for i in scope if not msgs[i].get("tool_calls")]
        self.out: list[dict[str, Any]] = []
        self.pos = 0
        self.reject: str | None = None
        self.ended_at_tool_call = False
        self.answers: list[Answer] = []
        if not self.todo:
            self.reject = ("nothing to regenerate: every assistant turn calls tools" if turns == "all"
                           else f"nothing to regenerate: the {turns} assistant turn calls tools")
        if conv.question and turns == "last" and len(assistants) > 1:
            self.reject = ("nothing to regenerate: --turns last keeps the earlier answers, and a question row has "
                           "none; use --turns all (or first) for question files")

    def next_request(self) -> Request | None:
        """The next turn to generate, or None when the conversation is finished (or rejected)."""
        if self.reject is not None or self.ended_at_tool_call or not self.todo:
            return None
        turn = self.todo[0]
        self.out.extend(self.conv.messages[self.pos:turn])
        self.pos = turn
        if self.settings is None:
            return Request(messages=list(self.out), tools=self.conv.tools,
                           chat_template_kwargs=self.chat_template_kwargs)
        return Request(messages=list(self.out), tools=self.conv.tools,
                       chat_template_kwargs=self.settings.template_kwargs(), temperature=self.settings.temperature)

    def feed(self, answer: Answer) -> None:
        """Take the answer to the request :meth:`next_request` returned."""
        turn = self.todo.pop(0)
        self.answers.append(answer)
        if answer.error is not None:
            self.reject = answer.error
            return
        if not answer.content and not answer.reasoning and not answer.tool_calls:
            self.reject = f"empty answer: assistant turn {turn} (message {turn + 1})"
            return
        if answer.finish_reason == "length" and self.on_truncated == "drop":
            self.reject = (f"truncated answer: assistant turn {turn} (message {turn + 1}) was cut at "
                           "--max-new-tokens (--on-truncated drop)")
            return
        msg: dict[str, Any] = {"role": "assistant", "content": answer.content}
        if answer.finish_reason == "length":  # cut at --max-new-tokens: tokenize supervises no end-of-turn
            msg["finish_reason"] = "length"
        if answer.reasoning:
            msg["reasoning_content"] = answer.reasoning
        if answer.tool_calls:
            msg["tool_calls"] = answer.tool_calls
            self.ended_at_tool_call = True
        if answer.token_ids is not None:  # what the verifier generated: tokenize checks the text against it
            msg["token_ids"] = answer.token_ids
        self.out.append(msg)
        self.pos = turn + 1

    def row(self) -> dict[str, Any]:
        """The output row ``{"id", "messages", "tools"?, "temperature"?, "chat_template_kwargs"?}`` of a finished,
        not rejected conversation (the last two: its drawn settings, with per-row settings)."""
        assert self.reject is None and self.next_request() is None
        ended = self.ended_at_tool_call or self.end_after_scope
        messages = self.out if ended else self.out + self.conv.messages[self.pos:]
        return {"id": self.conv.conversation_id, "messages": messages,
                **({"tools": self.conv.tools} if self.conv.tools is not None else {}),
                **(self.settings.record() if self.settings is not None else {})}


_ADVICE = ("the verifier would answer without seeing it; regenerate with a verifier whose template renders it, "
           "or pass --on-dropped-content keep to regenerate the row anyway (counted in the manifest)")


def prompt_drops(tokenizer, request: Request) -> str | None:
    """Why the verifier cannot be asked ``request``: its chat template does not render part of it.

    The request's history (and tools) is rendered with ``tokenizer``'s chat template and checked as
    ``tokenize`` checks a row (:func:`~peagle_data.chat.dropped.dropped_content`, no supervised turn:
    the reasoning of earlier turns is not checked).

    Returns:
        None, or the reject reason (``template drops <part>: ...``, ``template error: ...``).
    """
    try:
        template = ChatTemplate(None, request.chat_template_kwargs)
        text = render(tokenizer, request.messages, request.tools, template)
        dropped = dropped_content(tokenizer, request.messages, text, {}, request.tools, template)
    except ChatTemplateError as e:
        return str(e)
    if not dropped:
        return None
    i, part, _ = dropped[0]
    return dropped_reason(request.messages, i, part, len(dropped), advice=_ADVICE)


def _screen(job: Regeneration, req: Request, tokenizer, cfg: RegenerateConfig) -> Answer | None:
    """The error answer of a prompt ``tokenizer``'s template does not render whole (unless
    ``cfg.on_dropped_content`` is ``keep``: then the job is marked), cannot render, or renders to
    more than ``cfg.max_prompt_tokens``; None: ask the verifier."""
    reason = None if tokenizer is None else prompt_drops(tokenizer, req)
    if reason is not None and not (cfg.on_dropped_content == "keep" and reason.startswith("template drops")):
        return Answer(error=reason)
    job.dropped_content |= reason is not None
    if cfg.max_prompt_tokens is not None and tokenizer is not None:
        n = len(prompt_tokens(tokenizer, req))
        if n > cfg.max_prompt_tokens:
            return Answer(error=f"prompt too long: {n} prompt tokens exceed --max-prompt-tokens "
                                f"{cfg.max_prompt_tokens}", prompt_tokens=n)
    return None


def _run_local(jobs: list[Regeneration], backend, cfg: RegenerateConfig) -> None:
    """Drive a chunk through the local back end in waves: one request per unfinished conversation."""
    while True:
        pending = [(job, req) for job in jobs if (req := job.next_request()) is not None]
        if not pending:
            return
        asked = []
        for job, req in pending:
            refused = _screen(job, req, getattr(backend, "tokenizer", None), cfg)
            if refused is not None:
                job.feed(refused)
            else:
                asked.append((job, req))
        if asked:
            for (job, _), answer in zip(asked, backend.generate([req for _, req in asked])):
                job.feed(answer)


def _run_one(job: Regeneration, backend, cfg: RegenerateConfig) -> None:
    while (req := job.next_request()) is not None:
        refused = _screen(job, req, getattr(backend, "tokenizer", None), cfg)
        job.feed(refused if refused is not None else backend.answer(req))


def _run_server(jobs: list[Regeneration], backend, pool: ThreadPoolExecutor, cfg: RegenerateConfig) -> None:
    """Drive a chunk through the server back end: each conversation in a thread, turns in order."""
    for f in [pool.submit(_run_one, job, backend, cfg) for job in jobs]:
        f.result()


def _chunks(items: Iterator, size: int) -> Iterator[list]:
    """Lists of ``size`` items of the iterator ``items`` (the last one shorter): Python 3.12's ``batched``."""
    while chunk := list(itertools.islice(items, size)):
        yield chunk


def _settings(inputs, files, cfg: RegenerateConfig, backend) -> dict[str, Any]:
    """The manifest fields a resumed run must share with the run it continues."""
    gen = {k: v for k, v in asdict(cfg).items() if k != "chunk_rows"}
    return {"inputs": [str(i) for i in inputs], "files": [str(f) for f in files], "generation": gen,
            "model": backend.record}


RESUME_MAY_CHANGE = ("--device", "--concurrency", "--server", "--retries", "--timeout")
"""The ``regenerate`` options a ``--resume`` may change (they change no answer; ``--device`` only to one
that computes in the recorded dtype); every other setting is compared with the manifest's."""

_MODEL_OPTIONS = {"backend": "--verifier/--server", "verifier": "--verifier", "verifier_fingerprint":
                  "--verifier (its content fingerprint)", "dtype": "--device (the dtype it decides)",
                  "batch_size": "--batch-size", "model": "--served-model", "tokenizer": "--tokenizer"}
"""The option behind each key of a back end's ``record``."""


def _check_resume(manifest: dict[str, Any] | None, settings: dict[str, Any], output,
                  legacy_fingerprint: str | None = None) -> None:
    """Raise when the output to continue was written with other settings (names the first option that
    differs, with its recorded and its given value). ``legacy_fingerprint``: the local verifier's
    whole-file fingerprint (:func:`runtime.model_identity.legacy_model_fingerprint`), which an
    output begun before the verifier's identity was recorded holds as its ``verifier_fingerprint``."""
    if manifest is None:
        return
    model = manifest.get("model")
    if isinstance(model, dict) and legacy_fingerprint is not None \
            and model.get("verifier_fingerprint") == legacy_fingerprint:
        manifest = {**manifest, "model": {**model, "verifier_fingerprint": settings["model"].get("verifier_fingerprint")}}
    for key in ("inputs", "files", "generation", "model"):
        old, new = manifest.get(key), settings[key]
        if key == "model" and isinstance(old, dict):  # RESUME_MAY_CHANGE
            old, new = ({k: v for k, v in d.items() if k not in ("device", "concurrency", "servers", "retries")}
                        for d in (old, new))
            new = _without_unrecorded_sources(old, new)
        if key == "generation" and isinstance(old, dict):  # a setting added since, left unset (None, or {}: no
            new = {k: v for k, v in new.items() if k in old or v not in (None, {})}  # template variables)
        if old == new:
            continue
        option, was, now = {"inputs": "INPUT", "files": "INPUT (the files it names)"}.get(key, key), old, new
        if isinstance(old, dict) and isinstance(new, dict):
            inner = next(k for k in sorted(old.keys() | new.keys(), key=str) if old.get(k) != new.get(k))
            option = (_MODEL_OPTIONS.get(inner, inner) if key == "model" else "--" + inner.replace("_", "-"))
            was, now = old.get(inner), new.get(inner)
        raise InputError(f"--resume: {output} was written with other settings: {option} was {was!r}, now {now!r} "
                         f"({key}); rerun with the same settings, or with --force to start over (a resume may "
                         f"change only {', '.join(RESUME_MAY_CHANGE)})")


def _without_unrecorded_sources(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new`` without the sampling keys an output begun before they were recorded lacks (``top_k_from`` /
    ``top_p_from``, which only say where equal ``top_k`` / ``top_p`` values came from)."""
    was, now = old.get("sampling"), new.get("sampling")
    if not isinstance(was, dict) or not isinstance(now, dict):
        return new
    return {**new, "sampling": {k: v for k, v in now.items() if k in was or k not in ("top_k_from", "top_p_from")}}


def _base_counts() -> dict[str, Any]:
    return {"read": 0, "written": 0, "rejected": 0, "rejected_by_reason": {}, "turns_regenerated": 0, "turns_truncated": 0,
            "turns_cut_mid_character": 0, "turns_with_reasoning": 0, "turns_with_token_ids": 0,
            "conversations_with_dropped_content": 0,
            "ended_at_verifier_tool_call": 0, "prompt_tokens": 0, "completion_tokens": 0}


def _record(job: Regeneration | Reject, writer: ConversationWriter, counts: dict[str, Any]) -> None:
    """Write one finished item (row or reject) and add it to the counts."""
    counts["read"] += 1
    reason = job.reason if isinstance(job, Reject) else job.reject
    if isinstance(job, Regeneration):
        for a in job.answers:
            counts["prompt_tokens"] += a.prompt_tokens
            counts["completion_tokens"] += a.completion_tokens
            if a.error is None:
                counts["turns_regenerated"] += 1
                counts["turns_truncated"] += a.finish_reason == "length"
                counts["turns_cut_mid_character"] += a.cut_partial_char
                counts["turns_with_reasoning"] += bool(a.reasoning)
                counts["turns_with_token_ids"] += a.token_ids is not None
    if reason is not None:
        src, cid = (job.source, job.conversation_id) if isinstance(job, Reject) else (job.conv.source,
                                                                                      job.conv.conversation_id)
        writer.write_reject(src, reason, cid)
        counts["rejected"] += 1
        key = reason.split(":")[0]
        counts["rejected_by_reason"][key] = counts["rejected_by_reason"].get(key, 0) + 1
        return
    if job.settings is not None:  # the drawn settings of the rows written: {setting: {value (JSON): rows}}
        drawn = counts.setdefault("row_settings", {})
        for name, value in {"temperature": job.settings.temperature, **job.settings.drawn}.items():
            per_value = drawn.setdefault(name, {})
            per_value[json.dumps(value)] = per_value.get(json.dumps(value), 0) + 1
    counts["ended_at_verifier_tool_call"] += job.ended_at_tool_call
    counts["conversations_with_dropped_content"] += job.dropped_content
    writer.write_row(job.row())
    counts["written"] += 1


def _skip_done(items: Iterator[Conversation | Reject], done: list[str], output) -> Iterator[Conversation | Reject]:
    """The input items after the ``len(done)`` already written; their ids must be ``done``'s.

    Raises:
        InputError: the first ``len(done)`` input rows are not the rows written (checked before any
            new row is yielded).
    """
    it = iter(items)
    seen = [item.conversation_id for item in itertools.islice(it, len(done))]
    if sorted(map(str, seen)) != sorted(map(str, done)):
        raise InputError(f"--resume: the rows in {output} are not the first {len(done)} input rows; "
                         "the inputs changed since; rerun with --force")
    yield from it


def _generate_chunk(chunk: list[Conversation | Reject], cfg: RegenerateConfig, backend, pool) -> list:
    """Regenerate the conversations of one chunk; readers' rejects pass through."""
    temperature, variables = cfg.settings_of()
    per_row = cfg.per_row

    def job(conv: Conversation) -> Regeneration:
        settings = (row_settings(temperature, variables, cfg.seed, conv.conversation_id, cfg.chat_template_kwargs)
                    if per_row else None)
        return Regeneration(conv, cfg.turns, cfg.on_truncated, settings, cfg.chat_template_kwargs)

    jobs = [item if isinstance(item, Reject) else job(item) for item in chunk]
    live = [j for j in jobs if isinstance(j, Regeneration)]
    if pool is None:
        _run_local(live, backend, cfg)
    else:
        _run_server(live, backend, pool, cfg)
    return jobs


def run_regenerate(run: RegenerateRun, make_backend: Callable[[], Any] | None = None,
                   config: dict[str, Any] | None = None) -> dict[str, Any]:
    """``peagle-data regenerate``: write ``run.output`` (OpenAI-messages JSONL) with the verifier's answers.

    Args:
        run: the inputs (conversation files, globs or ``sharegpt``, as ``tokenize`` reads them), the
            output ``OUT.jsonl`` (``OUT.manifest.json`` and ``OUT.rejects.jsonl`` are written beside
            it), ``force`` (overwrite) or ``resume`` (continue an unfinished run of the same
            settings), the generation ``settings`` and the ``backend``.
        make_backend: returns a :class:`~peagle_data.regenerate.backends.LocalBackend` (``generate``)
            or :class:`~peagle_data.regenerate.backends.ServerBackend` (``answer``); None:
            ``run.backend.make`` (then ``run.backend`` must be set: ValueError). Called after the inputs and the output are checked, so a bad
            argument fails before weights load.
        config: the command's resolved options (``--print-config``), recorded as the manifest's
            ``config`` so that ``--config`` can repeat the run (not compared on resume).

    Returns:
        ``{"output", "counts", "resumed_rows", "not_sent"}`` (``not_sent``: the sampling settings
        the server could not be told, see :data:`~peagle_data.regenerate.backends.SERVER_KINDS`).

    Raises:
        OutputExistsError: the output exists and neither ``force`` nor ``resume`` is set.
        InputError: bad inputs; ``resume`` of an output written with other settings or inputs.
    """
    inputs, output, cfg, force, resume = run.inputs, run.output, run.settings, run.force, run.resume
    files = resolve_inputs(inputs)
    check_output(output, force, resume)
    if make_backend is None and run.backend is None:
        raise ValueError("run_regenerate needs run.backend or make_backend")
    backend = make_backend() if make_backend is not None else run.backend.make(cfg.max_new_tokens, cfg.temperature,
                                                                                cfg.reasoning_parser, cfg.top_k, cfg.top_p)
    if cfg.max_prompt_tokens is not None and getattr(backend, "tokenizer", None) is None:
        raise InputError("--max-prompt-tokens needs a tokenizer to count prompt tokens: with --server, "
                         "pass --tokenizer MODEL (the servers' model)")
    settings = {**_settings(inputs, files, cfg, backend), **({"config": config} if config is not None else {})}
    manifest = read_regenerate_manifest(output) if resume and not force else None
    _check_resume(manifest, settings, output, getattr(backend, "legacy_fingerprint", None))
    writer = ConversationWriter(output, force=force, resume=resume)
    if manifest is not None and manifest.get("complete") and writer.paths["rows"].exists():
        return {"output": str(output), "counts": manifest["counts"], "resumed_rows": manifest["counts"]["read"],
                "not_sent": backend.record.get("not_sent", [])}
    ckpt = (manifest or {}).get("checkpoint", {"rows": 0, "rejects": 0})
    done = writer.resume_at(ckpt["rows"], ckpt["rejects"]) if manifest is not None else []
    counts = {**_base_counts(), **((manifest or {}).get("counts") or {})}
    if manifest is None:
        writer.resume_at(0, 0)  # --resume of nothing: start from empty files
    _regenerate_into(writer, inputs, cfg, backend, settings, counts, done, output)
    return {"output": str(output), "counts": counts, "resumed_rows": len(done),
            "not_sent": backend.record.get("not_sent", [])}


def _regenerate_into(writer: ConversationWriter, inputs, cfg: RegenerateConfig, backend, settings, counts,
                     done: list[str], output) -> None:
    """The chunk loop: generate, write in input order, checkpoint the manifest; rename at the end."""
    import torch

    torch.manual_seed(cfg.seed)
    items = read_conversations(inputs, fmt=cfg.format, limit=cfg.limit, questions=True)
    pool = ThreadPoolExecutor(backend.workers) if hasattr(backend, "answer") else None
    start, tokens0 = time.monotonic(), counts["completion_tokens"]
    writer.open()

    def checkpoint(complete: bool) -> None:
        writer.write_manifest({**settings, "counts": counts, "complete": complete,
                               "checkpoint": {"rows": counts["written"], "rejects": counts["rejected"]}})

    checkpoint(False)
    try:
        with progress(total=cfg.limit, initial=len(done), unit="row", desc="regenerate") as bar:
            for chunk in _chunks(_skip_done(items, done, output), cfg.chunk_rows):
                for job in _generate_chunk(chunk, cfg, backend, pool):
                    _record(job, writer, counts)
                checkpoint(False)
                bar.update(len(chunk))
                rate = (counts["completion_tokens"] - tokens0) / max(time.monotonic() - start, 1e-9)
                bar.set_postfix(tok_s=f"{rate:,.1f}", rejected=counts["rejected"])
        writer.finish()
        checkpoint(True)
    finally:
        writer.close()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
