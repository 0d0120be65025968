"""Who answers for ``peagle-data regenerate``: the verifier in this process, or OpenAI-compatible servers.

Both back ends take chat requests (OpenAI messages and tools, the history up to an assistant turn)
and return :class:`Answer` objects with the same fields, so the output does not depend on which
one ran (for greedy decoding the texts are equal; ``tests/peagle_data/test_regenerate.py``
checks the local back end against ``transformers serve``):

- :class:`LocalBackend` renders each request with the verifier's chat template
  (``add_generation_prompt``), sorts a wave of requests by prompt length, and generates in
  left-padded batches with transformers' ``generate`` (KV cache), on CPU or GPU. The answer text is
  the ``skip_special_tokens`` decode up to the first end-of-sequence token, as servers return it.
- :class:`ServerBackend` posts ``/v1/chat/completions`` with the ``openai`` client (its retries
  with exponential backoff on connection errors, 408/409/429 and 5xx), at most ``concurrency``
  requests in flight per server, any free server taking the next request.

Reasoning: a server's ``reasoning_content`` (vLLM, SGLang and ``transformers serve`` parse it) is
kept; locally, a tokenizer's ``response_template`` parses content, reasoning and tool calls
(``tokenizer.parse_response``). Otherwise a think block in the text (``<think>...</think>``, or a
text that ends one whose opening tag was in the prompt) is split off into ``reasoning_content``, and
a local answer holding special tokens that a plain decode would drop is refused (``unparsed answer
format``), never written with its structure lost.
"""

from __future__ import annotations

import json
import queue
import re
from dataclasses import dataclass
from typing import Any

from peagle_data.answer_text import REPLACEMENT, complete_prefix, split_reasoning
from peagle_data.chat_render import template_messages, template_tools
from stores.errors import InputError, MissingDependencyError

__all__ = ["Request", "Answer", "BackendConfig", "LocalBackend", "ServerBackend", "split_reasoning", "server_base_url",
           "complete_prefix", "prompt_tokens"]


@dataclass
class Request:
    """One assistant turn to generate: the conversation so far (OpenAI messages) and the tools."""

    messages: list[dict[str, Any]]
    tools: list[Any] | None = None


@dataclass
class Answer:
    """The verifier's answer to a :class:`Request`, or why there is none.

    Attributes:
        content: the answer text without its reasoning.
        reasoning: the reasoning (think block) or None.
        tool_calls: OpenAI ``tool_calls`` entries (``arguments`` a JSON string) or None.
        finish_reason: ``stop``, ``length`` or ``tool_calls``.
        prompt_tokens, completion_tokens: token counts of the request and the answer.
        error: None, or a reject reason (``prompt too long: ...``, ``server error: ...``).
        cut_partial_char: the answer was cut at the token limit inside a character, whose
            incomplete bytes were dropped from the text.
    """

    content: str = ""
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    finish_reason: str = "stop"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    cut_partial_char: bool = False


def prompt_tokens(tokenizer, request: Request) -> list[int]:
    """The token ids of ``request`` rendered with ``tokenizer``'s chat template and generation prompt, the
    content passed as vLLM passes it (:func:`peagle_data.chat_render.template_messages`)."""
    template = tokenizer.get_chat_template(None, request.tools)
    enc = tokenizer.apply_chat_template(template_messages(request.messages, template),
                                        tools=template_tools(request.tools),
                                        add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(enc["input_ids"])


def server_base_url(url: str) -> str:
    """``http://host:port`` or ``http://host:port/v1`` -> the ``.../v1`` base URL of the OpenAI API."""
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise InputError(f"--server {url!r}: expected an http:// or https:// address")
    return url if url.endswith("/v1") else url + "/v1"


def _wire_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the OpenAI API wants them: tool-call ``arguments`` as JSON strings, without the
    training-data keys (``weight``, ``finish_reason``) a strict server refuses."""
    out = []
    for msg in messages:
        msg = {k: v for k, v in msg.items() if k not in ("weight", "finish_reason")}
        if msg.get("tool_calls"):
            calls = []
            for call in msg["tool_calls"]:
                fn = dict(call.get("function") or {})
                if not isinstance(fn.get("arguments"), str):
                    fn["arguments"] = json.dumps(fn.get("arguments", {}), ensure_ascii=False)
                calls.append({**call, "type": call.get("type", "function"), "function": fn})
            msg = {**msg, "tool_calls": calls}
        out.append(msg)
    return out


@dataclass(frozen=True, kw_only=True)
class BackendConfig:
    """Which verifier answers ``peagle-data regenerate``'s requests: in this process (``verifier``) or
    OpenAI-compatible servers (``servers``), exactly one of them."""

    verifier: str | None = None
    """Generate in this process with this MODEL: smollm2-135m, a directory or a hub id (``--verifier``)."""
    servers: tuple[str, ...] = ()
    """OpenAI-compatible servers (vLLM, SGLang, transformers serve), http://host:port[/v1] (``--server``,
    repeated for several, used in parallel)."""
    served_model: str | None = None
    """Model name sent to the servers; None: their only model (``--served-model``)."""
    concurrency: int = 8
    """Requests in flight per server (``--concurrency``)."""
    batch_size: int = 16
    """Prompts per generate call of the local verifier, sorted by length, left-padded (``--batch-size``)."""
    device: str | None = None
    """Local verifier device (cpu, cuda, cuda:1); None: cuda if available (``--device``)."""
    retries: int = 5
    """Retries of a failed server request (exponential backoff) before the row is rejected (``--retries``)."""
    timeout: float = 600.0
    """Seconds a server request may take (``--timeout``)."""
    tokenizer: str | None = None
    """With --server: a tokenizer (MODEL, as --verifier) whose chat template checks each prompt for
    content it does not render, as the local back end does; None: the servers' templates are trusted
    (``--tokenizer``)."""

    def __post_init__(self) -> None:
        if bool(self.verifier) == bool(self.servers):
            raise ValueError("give exactly one of --verifier MODEL (local) and --server URL (OpenAI-compatible)")
        if self.verifier and self.served_model:
            raise ValueError("--served-model goes with --server, not --verifier")
        if self.verifier and self.tokenizer:
            raise ValueError("--tokenizer goes with --server; --verifier checks prompts with its own template")
        for name, value, least in (("--concurrency", self.concurrency, 1), ("--batch-size", self.batch_size, 1),
                                   ("--retries", self.retries, 0), ("--timeout", self.timeout, 1)):
            if not value >= least:
                raise ValueError(f"{name} must be >= {least}, got {value}")

    def make(self, max_new_tokens: int, temperature: float) -> LocalBackend | ServerBackend:
        """The back end (loads the local verifier, or connects to the servers)."""
        if self.verifier:
            return LocalBackend(self.verifier, max_new_tokens, temperature, batch_size=self.batch_size,
                                device=self.device)
        tokenizer = None
        if self.tokenizer:
            from stores.model_cache import load_tokenizer

            tokenizer = load_tokenizer(self.tokenizer)
        backend = ServerBackend(list(self.servers), self.served_model, max_new_tokens, temperature,
                                concurrency=self.concurrency, retries=self.retries, timeout=self.timeout,
                                tokenizer=tokenizer)
        if self.tokenizer:
            backend.record["tokenizer"] = self.tokenizer
        return backend


class LocalBackend:
    """Batched greedy or sampled generation with the verifier in this process.

    Args:
        verifier: MODEL (``smollm2-135m``, a directory or a hub id).
        max_new_tokens: most tokens per answer.
        temperature: 0 for greedy decoding, else sampling at this temperature.
        batch_size: requests per ``generate`` call (a wave is sorted by prompt length first).
        device: ``cpu``, ``cuda``...; default ``cuda`` when available.

    Raises:
        ModelNotFoundError, MissingDependencyError: the verifier cannot be loaded.
    """

    def __init__(self, verifier: str, max_new_tokens: int, temperature: float, batch_size: int = 16,
                 device: str | None = None):
        from stores.model_cache import load_tokenizer, load_verifier, model_fingerprint, resolve_model

        self.tokenizer = load_tokenizer(verifier)
        self.model = load_verifier(verifier, device=device)
        self.max_new_tokens, self.temperature, self.batch_size = max_new_tokens, temperature, batch_size
        self.record = {"backend": "local", "verifier": str(verifier),
                       "verifier_fingerprint": model_fingerprint(resolve_model(verifier)),
                       "device": str(self.model.device), "dtype": str(self.model.dtype).replace("torch.", ""),
                       "batch_size": batch_size}  # batches are padded: a resumed greedy run needs the same
        cfg = self.model.config.get_text_config()
        self.max_positions = getattr(cfg, "max_position_embeddings", None)
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)

    def prompt_ids(self, request: Request) -> list[int]:
        """The token ids of a request rendered with the chat template and the generation prompt."""
        return prompt_tokens(self.tokenizer, request)

    def generate(self, requests: list[Request]) -> list[Answer]:
        """Answers to ``requests`` in their order (batched by prompt length)."""
        prompts = [self.prompt_ids(r) for r in requests]
        answers: list[Answer | None] = [None] * len(requests)
        todo = []
        for i, ids in enumerate(prompts):
            if self.max_positions is not None and len(ids) + self.max_new_tokens > self.max_positions:
                answers[i] = Answer(error=f"prompt too long: {len(ids)} prompt tokens + --max-new-tokens "
                                          f"{self.max_new_tokens} exceed the verifier's {self.max_positions} positions",
                                    prompt_tokens=len(ids))
            else:
                todo.append(i)
        todo.sort(key=lambda i: (len(prompts[i]), i))
        for start in range(0, len(todo), self.batch_size):
            batch = todo[start:start + self.batch_size]
            for i, answer in zip(batch, self._generate_batch([prompts[i] for i in batch],
                                                             [requests[i].tools for i in batch])):
                answers[i] = answer
        return answers

    def _generation_config(self, pad: int):
        """The verifier's own generation config with this run's token limit and temperature (what
        ``transformers serve`` does with a request's ``max_tokens`` and ``temperature``)."""
        import copy

        gc = copy.deepcopy(self.model.generation_config)
        gc.max_new_tokens, gc.pad_token_id = self.max_new_tokens, pad
        gc.max_length = None
        if self.temperature > 0:
            gc.do_sample, gc.temperature = True, self.temperature
        else:
            gc.do_sample = False
        return gc

    def _generate_batch(self, prompts: list[list[int]], tools: list) -> list[Answer]:
        """One left-padded ``generate`` call; each row cut at its first end-of-sequence token."""
        import torch

        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id
        pad = pad if pad is not None else min(self.eos_ids)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        with torch.no_grad():
            out = self.model.generate(input_ids=ids.to(self.model.device), attention_mask=mask.to(self.model.device),
                                      generation_config=self._generation_config(pad))
        return [self.answer_of(out[row, width:].tolist(), p, t) for row, (p, t) in enumerate(zip(prompts, tools))]

    def answer_of(self, generated: list[int], prompt: list[int], tools: list | None = None) -> Answer:
        """The :class:`Answer` of ``generated`` ids (cut after the first end-of-sequence id).

        With a tokenizer that declares a ``response_template``, ``tokenizer.parse_response`` splits
        content, reasoning and tool calls (what ``transformers serve`` does). Otherwise the text is
        the ``skip_special_tokens`` decode with a think block split off (:func:`split_reasoning`);
        an answer holding other special tokens (e.g. gpt-oss's ``<|channel|>`` markup) is an error,
        not a decode that would silently drop its structure. An answer cut inside a character ends
        before it; one whose tokens are not UTF-8 is an error (:func:`complete_prefix`).
        """
        stop = next((k for k, t in enumerate(generated) if t in self.eos_ids), None)
        kept = generated if stop is None else generated[:stop + 1]
        done = {"finish_reason": "length" if stop is None else "stop", "prompt_tokens": len(prompt),
                "completion_tokens": len(kept)}
        n, error = complete_prefix(self.tokenizer, kept, cut=stop is None)
        if error is not None:
            return Answer(error=error, **done)
        done["cut_partial_char"], kept = n < len(kept), kept[:n]
        if getattr(self.tokenizer, "response_template", None) is not None:
            parsed = self.tokenizer.parse_response(kept, prefix=self.tokenizer.decode(prompt), tools=tools)
            calls = [{"type": "function", "function": {"name": c["function"]["name"], "arguments": json.dumps(
                c["function"].get("arguments", {}), ensure_ascii=False)}} for c in parsed.get("tool_calls") or []]
            reasoning = parsed.get("reasoning_content") or parsed.get("thinking")
            return Answer(content=parsed.get("content") or "", reasoning=reasoning, tool_calls=calls or None,
                          **{**done, **({"finish_reason": "tool_calls"} if calls else {})})
        special = set(self.tokenizer.all_special_ids) - self.eos_ids
        odd = sorted({t for t in kept if t in special})
        if odd:
            names = ", ".join(self.tokenizer.convert_ids_to_tokens(odd))
            return Answer(error=f"unparsed answer format: the answer holds special tokens ({names}) that a plain "
                                "decode drops, and the tokenizer declares no response_template to parse them; "
                                "use a --server that parses this model's output", **done)
        content, reasoning = split_reasoning(self.tokenizer.decode(kept, skip_special_tokens=True))
        return Answer(content=content, reasoning=reasoning, **done)


class ServerBackend:
    """Chat completions from one or more OpenAI-compatible servers (vLLM, SGLang, ``transformers serve``).

    Args:
        urls: server addresses (``http://host:port`` or ``.../v1``).
        model: the served model name sent with each request; None asks the first server's
            ``/v1/models`` and takes its only model.
        max_new_tokens, temperature: as :class:`LocalBackend` (sent as ``max_tokens``, ``temperature``).
        concurrency: requests in flight per server.
        retries: retries of one request (exponential backoff) before it becomes ``server error``.
        timeout: seconds one request may take.
        tokenizer: a loaded tokenizer whose chat template ``regenerate`` checks each prompt with
            (content the template does not render); None: the servers' templates are trusted.

    Raises:
        MissingDependencyError: the ``openai`` package is missing.
        InputError: no model name given and the server does not serve exactly one.
    """

    def __init__(self, urls: list[str], model: str | None, max_new_tokens: int, temperature: float,
                 concurrency: int = 8, retries: int = 5, timeout: float = 600.0, tokenizer=None):
        try:
            import openai
        except ImportError as e:  # pragma: no cover - a dependency of peagle
            raise MissingDependencyError("the server back end needs `pip install openai`") from e
        self.bases = [server_base_url(u) for u in urls]
        self.clients = {b: openai.OpenAI(base_url=b, api_key="EMPTY", max_retries=retries, timeout=timeout)
                        for b in self.bases}
        self.max_new_tokens, self.temperature, self.tokenizer = max_new_tokens, temperature, tokenizer
        self.slots: queue.Queue[str] = queue.Queue()
        for _ in range(concurrency):
            for b in self.bases:
                self.slots.put(b)
        self.workers = concurrency * len(self.bases)
        self.model = model or self._only_model()
        self.record = {"backend": "server", "servers": self.bases, "model": self.model,
                       "concurrency": concurrency, "retries": retries}

    def _only_model(self) -> str:
        import openai

        try:
            names = [m.id for m in self.clients[self.bases[0]].models.list()]
        except openai.OpenAIError as e:
            raise InputError(f"--server {self.bases[0]}: cannot list its models ({e}); pass --served-model") from None
        if len(names) != 1:
            raise InputError(f"--server {self.bases[0]} serves {len(names)} models ({', '.join(names)}); "
                             "name one with --served-model")
        return names[0]

    def answer(self, request: Request) -> Answer:
        """The answer of whichever server is free first (blocks while all are busy).

        Errors become ``Answer.error``: ``prompt too long: <server message>`` for a 400 that speaks of
        the context length, ``server error: ...`` for anything else once the retries are spent.
        """
        import openai

        base = self.slots.get()
        try:
            kwargs = {"tools": request.tools} if request.tools else {}
            resp = self.clients[base].chat.completions.create(
                model=self.model, messages=_wire_messages(request.messages), max_tokens=self.max_new_tokens,
                temperature=self.temperature, **kwargs)
        except openai.BadRequestError as e:
            text = str(e)
            key = "prompt too long" if re.search(r"context|too long|maximum", text, re.I) else "server error"
            return Answer(error=f"{key}: {base}: {text}")
        except openai.OpenAIError as e:
            return Answer(error=f"server error: {base}: {type(e).__name__}: {e}")
        finally:
            self.slots.put(base)
        return _answer_of(resp)


def _answer_of(resp) -> Answer:
    """An :class:`Answer` from an ``openai`` ChatCompletion.

    An answer cut at ``max_tokens`` (``finish_reason == "length"``) drops the U+FFFD its text ends
    with (a character the limit cut; from the content, or the reasoning when there is no content);
    any other U+FFFD makes it an error (``undecodable answer``): a server's text cannot be checked
    against the tokens it came from.
    """
    choice = resp.choices[0]
    msg = choice.message
    extra = msg.model_extra or {}
    reasoning = extra.get("reasoning_content") or extra.get("reasoning")
    content = msg.content or ""
    if reasoning is None:
        content, reasoning = split_reasoning(content)
    finish, usage = choice.finish_reason or "stop", resp.usage
    calls = [{"type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
             for c in (msg.tool_calls or [])] or None
    cut = False
    if finish == "length" and not calls:
        if content:
            content, cut = content.rstrip(REPLACEMENT), content.endswith(REPLACEMENT)
        elif reasoning:
            reasoning, cut = reasoning.rstrip(REPLACEMENT), reasoning.endswith(REPLACEMENT)
    done = {"finish_reason": finish, "prompt_tokens": getattr(usage, "prompt_tokens", 0) or 0,
            "completion_tokens": getattr(usage, "completion_tokens", 0) or 0}
    if REPLACEMENT in content + (reasoning or ""):
        return Answer(error="undecodable answer: the server's answer holds U+FFFD other than at a cut at "
                            "--max-new-tokens; its bytes cannot be checked against the verifier's tokens", **done)
    return Answer(content=content, reasoning=reasoning, tool_calls=calls, cut_partial_char=cut, **done)
