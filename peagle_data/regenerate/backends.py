"""Who answers for ``peagle-data regenerate``: the verifier in this process, or OpenAI-compatible servers.

Both back ends take chat requests (OpenAI messages and tools, the history up to an assistant turn)
and return :class:`Answer` objects with the same fields, so the output does not depend on which
one ran (for greedy decoding the texts are equal; ``tests/peagle_data/regenerate/test_regenerate.py``
checks the local back end against ``transformers serve`` and vLLM's server):

- :class:`LocalBackend` renders each request with the verifier's chat template
  (``add_generation_prompt``), sorts a wave of requests by prompt length, and generates in
  left-padded batches with transformers' ``generate`` (KV cache), on CPU or GPU (hybrid verifiers too:
  their linear-attention / state-space layers mask the pads out of the recurrent state, so a padded
  prompt's answer is its answer alone; tested on the five hybrid families). The answer text is
  the ``skip_special_tokens`` decode up to the first end-of-sequence token, as servers return it,
  never with ``clean_up_tokenization_spaces`` (which rewrites ``x != y`` as ``x!= y``: a text that
  re-tokenizes to other ids than the verifier generated).
- :class:`ServerBackend` posts ``/v1/chat/completions`` with the ``openai`` client (its retries
  with exponential backoff on connection errors, 408/409/429 and 5xx), at most ``concurrency``
  requests in flight per server, any free server taking the next request.

Sampling means one thing in every back end (:func:`sampling_parameters`): ``softmax(z / T)`` truncated by
top-k and top-p as vLLM's sampler truncates it (``--top-k`` / ``--top-p``; locally unset: the verifier's
``generation_config.json`` values, as a vLLM server applies them by default; off where neither sets them), argmax
at T = 0, as ``peagle-eval``'s reference decoder (:func:`peagle_train.generate.speculative.plain_generate`): no
min-p or repetition penalties. The rest of the verifier's ``generation_config.json`` (``repetition_penalty
1.3``...) is not applied: the local back end generates with a generation config holding only the verifier's
special token ids and the top-k / top-p (the fields it did not apply are recorded), and every request to a server
states the values (:data:`SERVER_KINDS`: vLLM applies the model's generation config to any field a request leaves
out). What a server cannot be told is recorded in the manifest (``not_sent``); a top-k it cannot be told is
refused.

Token ids: the local back end and vLLM (``return_token_ids``) return the ids the verifier
generated (``Answer.token_ids``, end-of-sequence id included); ``regenerate`` writes them beside
the text (``token_ids`` of the assistant message) and ``tokenize`` trains on exactly those ids
(:func:`peagle_data.chat.masks.on_generated_ids`).

Reasoning: with ``--reasoning-parser NAME`` a local answer is the message ``vllm serve
--reasoning-parser NAME`` returns (:mod:`runtime.chat.answer_parsing`: think blocks, Harmony channels; what it
cannot parse exactly is a reject), and a server's content is split by that parser when the server
returned no reasoning of its own. A server's ``reasoning_content`` (vLLM, SGLang and ``transformers
serve`` parse it) is kept; locally, without a parser, a tokenizer's ``response_template`` parses
content, reasoning and tool calls (``tokenizer.parse_response``). Otherwise a think block in the text (``<think>...</think>``, or a
text that ends one whose opening tag was in the prompt) is split off into ``reasoning_content``, and
a local answer holding special tokens that a plain decode would drop is refused (``unparsed answer
format``), never written with its structure lost.
"""

from __future__ import annotations

import json
import queue
import re
from dataclasses import dataclass, field
from typing import Any

from runtime.chat.answer_parsing import AnswerFormatError, check_reasoning_parser, parse_answer, parse_think
from runtime.chat.chat_template import ChatTemplate, prompt_ids
from stores.errors import InputError, MissingDependencyError
from runtime.model_cache import load_generation_config, load_tokenizer, load_verifier, resolve_model
from runtime.model_identity import legacy_model_fingerprint, model_fingerprint

__all__ = ["Request", "Answer", "BackendConfig", "LocalBackend", "ServerBackend", "split_reasoning", "server_base_url",
           "complete_prefix", "prompt_opens_think", "REPLACEMENT", "prompt_tokens", "sampling_parameters",
           "sampling_record", "SERVER_KINDS"]

SERVER_KINDS = ("auto", "vllm", "transformers", "openai")
"""What a ``--server`` is told: ``vllm`` (OpenAI fields plus vLLM's ``top_k``, ``min_p``,
``repetition_penalty`` and ``return_token_ids``), ``transformers`` (``transformers serve``: a
whole ``generation_config``), ``openai`` (only the OpenAI API's own fields: ``temperature``,
``top_p``, ``presence_penalty``, ``frequency_penalty``), ``auto``: ``vllm`` when the server's
``/v1/models`` says ``owned_by: vllm``, else ``openai``."""

_NOT_SENT = {
    "vllm": [],
    "transformers": ["bad_words_ids", "suppress_tokens", "begin_suppress_tokens", "sequence_bias",
                     "forced_bos_token_id", "forced_eos_token_id", "exponential_decay_length_penalty"],
    "openai": ["top_k", "min_p", "repetition_penalty", "every other default of the server's generation config"],
}
"""Per server kind, the sampling settings a request cannot state (``transformers serve`` fills a
null field of the sent ``generation_config`` from the model's file): the server's own defaults apply."""


def sampling_parameters(temperature: float, top_k: int = 0, top_p: float = 1.0) -> dict[str, Any]:
    """The effective sampling parameters of every back end at ``temperature`` (recorded in the
    manifest): ``softmax(z / T)`` over the tokens top-k and top-p keep (vLLM's rule; greedy at 0), nothing else.

    ``top_k`` 0 is off (vLLM's and transformers' value for it), ``top_p`` 1 is off."""
    return {"temperature": float(temperature), "top_p": float(top_p), "top_k": int(top_k), "min_p": 0.0,
            "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def sampling_record(temperature: float | dict[str, float], top_k: int = 0, top_p: float = 1.0,
                    sources: dict[str, str] | None = None) -> dict[str, Any]:
    """The manifest's ``sampling``: :func:`sampling_parameters`, with a temperature mixture (``{"0.6":
    0.3, ...}``, drawn per row) as its ``temperature``, and where top-k and top-p came from (``sources``:
    ``top_k_from`` / ``top_p_from``: ``option``, ``generation_config`` or ``off``)."""
    out = sampling_parameters(1.0 if isinstance(temperature, dict) else temperature, top_k, top_p)
    if isinstance(temperature, dict):
        out["temperature"] = dict(temperature)
    return {**out, **(sources or {})}


def _truncation(given: dict[str, Any], served: dict[str, Any]) -> tuple[int, float, dict[str, str]]:
    """``(top_k, top_p, sources)``: each given value (not None), else the ``served`` generation config's (its
    non-default fields), else off; vLLM's top_k -1 is 0 (off).

    Raises:
        InputError: top_k < 0 or top_p outside (0, 1]."""
    values, sources = {}, {}
    for name, off in (("top_k", 0), ("top_p", 1.0)):
        value, source = (given.get(name), "option") if given.get(name) is not None else \
            (served.get(name), "generation_config") if served.get(name) is not None else (off, "off")
        values[name], sources[f"{name}_from"] = value, source
    raw_k, top_p = int(values["top_k"]), float(values["top_p"])
    if raw_k < -1 or not 0 < top_p <= 1:
        raise InputError(f"top_k {raw_k} / top_p {top_p}: top_k must be >= 0 (0: off) and top_p in (0, 1] (1: off)",
                         field="--top-k" if raw_k < -1 else "--top-p")
    return max(raw_k, 0), top_p, sources


def _neutral_generation_config(temperature: float, max_new_tokens: int, top_k: int = 0,
                               top_p: float = 1.0) -> dict[str, Any]:
    """transformers ``GenerationConfig`` fields for :func:`sampling_parameters`: every logits
    processor a model's generation config can switch on, set to its neutral value but top-k / top-p (the sampling
    warpers only at T > 0: greedy decoding does not use them; transformers' temperature, top-k and top-p warpers
    apply vLLM's rule in vLLM's order)."""
    out: dict[str, Any] = {
        "do_sample": temperature > 0, "num_beams": 1, "num_beam_groups": 1, "diversity_penalty": 0.0,
        "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
        "encoder_no_repeat_ngram_size": 0, "length_penalty": 1.0, "min_new_tokens": 0, "renormalize_logits": False,
        "remove_invalid_values": False, "max_new_tokens": max_new_tokens}
    if temperature > 0:
        out.update(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), min_p=0.0, typical_p=1.0,
                   epsilon_cutoff=0.0, eta_cutoff=0.0)
    return out


@dataclass
class Request:
    """One assistant turn to generate: the conversation so far (OpenAI messages), the tools, the chat
    template's variables it is asked with (vLLM's ``chat_template_kwargs``: rendered into the local
    prompt, sent to servers as that request field) and its sampling ``temperature`` (None: the back end's)."""

    messages: list[dict[str, Any]]
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    temperature: float | None = None


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
        token_ids: the ids the verifier generated for this answer (end-of-sequence id included,
            a cut character's ids left out), or None when the back end does not return them.
    """

    content: str = ""
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    finish_reason: str = "stop"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    cut_partial_char: bool = False
    token_ids: list[int] | None = None


def prompt_tokens(tokenizer, request: Request) -> list[int]:
    """The token ids of ``request`` rendered with ``tokenizer``'s chat template and generation prompt, the
    content passed as vLLM passes it (:func:`runtime.chat.chat_template.prompt_ids`, the renderer of every stage),
    with the request's template variables."""
    return prompt_ids(tokenizer, request.messages, request.tools, ChatTemplate(None, request.chat_template_kwargs))


def server_base_url(url: str) -> str:
    """``http://host:port`` or ``http://host:port/v1`` -> the ``.../v1`` base URL of the OpenAI API."""
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise InputError(f"--server {url!r}: expected an http:// or https:// address")
    return url if url.endswith("/v1") else url + "/v1"


def _wire_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the OpenAI API wants them: tool-call ``arguments`` as JSON strings, without the
    training-data keys (``weight``, ``finish_reason``, ``token_ids``) a strict server refuses."""
    out = []
    for msg in messages:
        msg = {k: v for k, v in msg.items() if k not in ("weight", "finish_reason", "token_ids")}
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
    server_kind: str = "auto"
    """With --server: how requests state the sampling parameters: vllm, transformers (transformers
    serve), openai (only the OpenAI API's fields; the rest is the server's default, recorded as
    ``not_sent``), auto: vllm when the server says so, else openai (``--server-kind``)."""

    def __post_init__(self) -> None:
        if bool(self.verifier) == bool(self.servers):
            raise ValueError("give exactly one of --verifier MODEL (local) and --server URL (OpenAI-compatible)")
        if self.verifier and self.served_model:
            raise ValueError("--served-model goes with --server, not --verifier")
        if self.verifier and self.tokenizer:
            raise ValueError("--tokenizer goes with --server; --verifier checks prompts with its own template")
        if self.server_kind not in SERVER_KINDS:
            raise ValueError(f"--server-kind must be one of {SERVER_KINDS}, got {self.server_kind!r}")
        if self.verifier and self.server_kind != "auto":
            raise ValueError("--server-kind goes with --server, not --verifier")
        for name, value, least in (("--concurrency", self.concurrency, 1), ("--batch-size", self.batch_size, 1),
                                   ("--retries", self.retries, 0), ("--timeout", self.timeout, 1)):
            if not value >= least:
                raise ValueError(f"{name} must be >= {least}, got {value}")

    def make(self, max_new_tokens: int, temperature: float | dict[str, float],
             reasoning_parser: str | None = None, top_k: int | None = None,
             top_p: float | None = None) -> LocalBackend | ServerBackend:
        """The back end (loads the local verifier, or connects to the servers); ``temperature`` a float or
        a mixture (each request then states its own); ``reasoning_parser``: how answers are parsed
        (:mod:`runtime.chat.answer_parsing`); ``top_k`` / ``top_p``: None: the local verifier's generation config
        (with ``--tokenizer``, that MODEL's for servers), else off."""
        if self.verifier:
            return LocalBackend(self.verifier, max_new_tokens, temperature, batch_size=self.batch_size,
                                device=self.device, reasoning_parser=reasoning_parser, top_k=top_k, top_p=top_p)
        tokenizer = None
        if self.tokenizer:
            tokenizer = load_tokenizer(self.tokenizer)
        served = load_generation_config(self.tokenizer).to_diff_dict() if self.tokenizer else {}
        backend = ServerBackend(list(self.servers), self.served_model, max_new_tokens, temperature,
                                concurrency=self.concurrency, retries=self.retries, timeout=self.timeout,
                                tokenizer=tokenizer, kind=self.server_kind, reasoning_parser=reasoning_parser,
                                truncation=_truncation({"top_k": top_k, "top_p": top_p}, served))
        if self.tokenizer:
            backend.record["tokenizer"] = self.tokenizer
        return backend


class LocalBackend:
    """Batched greedy or sampled generation with the verifier in this process.

    Args:
        verifier: MODEL (``smollm2-135m``, a directory or a hub id).
        max_new_tokens: most tokens per answer.
        temperature: 0 for greedy decoding, else sampling at this temperature.
        batch_size: requests per ``generate`` call (a wave is sorted by temperature and prompt length first).
        device: ``cpu``, ``cuda``...; default ``cuda`` when available.
        reasoning_parser: vLLM's ``--reasoning-parser`` name the answers are parsed with
            (:func:`runtime.chat.answer_parsing.parse_answer`); None: see :meth:`answer_of`.
        top_k, top_p: the truncation at T > 0 (vLLM's rule); None: the verifier's ``generation_config.json`` value,
            as a vLLM server applies it by default, else off (recorded with its source).

    Raises:
        ModelNotFoundError, MissingDependencyError: the verifier cannot be loaded.
        InputError: top_k / top_p out of range.
    """

    def __init__(self, verifier: str, max_new_tokens: int, temperature: float | dict[str, float], batch_size: int = 16,
                 device: str | None = None, reasoning_parser: str | None = None, top_k: int | None = None,
                 top_p: float | None = None):
        from transformers import GenerationConfig

        check_reasoning_parser(reasoning_parser)
        self.reasoning_parser = reasoning_parser

        self.tokenizer = load_tokenizer(verifier)
        self.model = load_verifier(verifier, device=device)
        self.max_new_tokens, self.temperature, self.batch_size = max_new_tokens, temperature, batch_size
        own = self.model.generation_config
        self.top_k, self.top_p, sources = _truncation({"top_k": top_k, "top_p": top_p}, own.to_diff_dict())
        # generate() fills every field a call leaves unset from model.generation_config: keep only
        # the verifier's special token ids there, so none of its other sampling settings can apply
        self.model.generation_config = GenerationConfig(**{k: getattr(own, k, None) for k in _SPECIAL_FIELDS})
        ignored = {k: v for k, v in own.to_diff_dict().items()
                   if k not in _SPECIAL_FIELDS and k not in _NOT_SAMPLING and k not in ("top_k", "top_p")}
        directory = resolve_model(verifier)
        # the whole-file fingerprint an output begun before the verifier's identity was recorded holds
        self.legacy_fingerprint = legacy_model_fingerprint(directory)
        self.record = {"backend": "local", "verifier": str(verifier),
                       "verifier_fingerprint": model_fingerprint(directory),
                       "device": str(self.model.device), "dtype": str(self.model.dtype).replace("torch.", ""),
                       "batch_size": batch_size,  # batches are padded: a resumed greedy run needs the same
                       "sampling": sampling_record(temperature, self.top_k, self.top_p, sources), "not_sent": [],
                       "verifier_generation_config_ignored": ignored, "token_ids": True}
        cfg = self.model.config.get_text_config()
        self.max_positions = getattr(cfg, "max_position_embeddings", None)
        eos = own.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)

    def prompt_ids(self, request: Request) -> list[int]:
        """The token ids of a request rendered with the chat template and the generation prompt."""
        return prompt_tokens(self.tokenizer, request)

    def _temperature(self, request: Request) -> float:
        if request.temperature is not None:
            return float(request.temperature)
        if isinstance(self.temperature, dict):
            raise ValueError("a temperature mixture needs each request's temperature")
        return float(self.temperature)

    def generate(self, requests: list[Request]) -> list[Answer]:
        """Answers to ``requests`` in their order (batched by temperature, then prompt length)."""
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
        temps = [self._temperature(r) for r in requests]
        todo.sort(key=lambda i: (temps[i], len(prompts[i]), i))
        for t in sorted({temps[i] for i in todo}):
            group = [i for i in todo if temps[i] == t]
            for start in range(0, len(group), self.batch_size):
                batch = group[start:start + self.batch_size]
                for i, answer in zip(batch, self._generate_batch([prompts[i] for i in batch], [requests[i] for i in batch],
                                                                 t)):
                    answers[i] = answer
        return answers

    def _generation_config(self, pad: int, temperature: float | None = None):
        """The generation config of :func:`sampling_parameters` at ``temperature`` (None: this run's) and this
        run's token limit, stopping at the verifier's end-of-sequence ids (none of its own sampling settings)."""
        from transformers import GenerationConfig

        if temperature is None:
            temperature = self._temperature(Request(messages=[]))
        return GenerationConfig(**_neutral_generation_config(temperature, self.max_new_tokens, self.top_k, self.top_p),
                                pad_token_id=pad, eos_token_id=sorted(self.eos_ids))

    def _generate_batch(self, prompts: list[list[int]], requests: list[Request], temperature: float) -> list[Answer]:
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
                                      generation_config=self._generation_config(pad, temperature))
        return [self.answer_of(out[row, width:].tolist(), p, r.tools, r.chat_template_kwargs)
                for row, (p, r) in enumerate(zip(prompts, requests))]

    def answer_of(self, generated: list[int], prompt: list[int], tools: list | None = None,
                  chat_template_kwargs: dict[str, Any] | None = None) -> Answer:
        """The :class:`Answer` of ``generated`` ids (cut after the first end-of-sequence id).

        With ``reasoning_parser``, the answer as ``vllm serve --reasoning-parser NAME`` returns it
        (:func:`runtime.chat.answer_parsing.parse_answer`, with the request's ``chat_template_kwargs``); an
        answer it cannot parse exactly is an error (``unparsed answer format``), as is, for a think
        parser, one holding other special tokens than the tags. Else, with a tokenizer that declares a ``response_template``, ``tokenizer.parse_response`` splits
        content, reasoning and tool calls (what ``transformers serve`` does). Otherwise the text is
        the ``skip_special_tokens`` decode with a think block split off (:func:`split_reasoning`; text
        before a ``</think>`` is reasoning only when the answer or the prompt opened the block);
        an answer holding other special tokens (e.g. gpt-oss's ``<|channel|>`` markup) is an error,
        not a decode that would silently drop its structure. An answer cut inside a character ends
        before it; one whose tokens are not UTF-8 is an error (:func:`complete_prefix`). Texts are
        decoded without ``clean_up_tokenization_spaces``; ``token_ids`` are the kept ids.
        """
        stop = next((k for k, t in enumerate(generated) if t in self.eos_ids), None)
        kept = generated if stop is None else generated[:stop + 1]
        done = {"finish_reason": "length" if stop is None else "stop", "prompt_tokens": len(prompt),
                "completion_tokens": len(kept)}
        n, error = complete_prefix(self.tokenizer, kept, cut=stop is None)
        if error is not None:
            return Answer(error=error, **done)
        done["cut_partial_char"], kept = n < len(kept), kept[:n]
        done["token_ids"] = list(kept)
        if self.reasoning_parser is not None:
            return self._parsed(kept, chat_template_kwargs, done)
        if getattr(self.tokenizer, "response_template", None) is not None:
            # decoded here: parse_response's own decode of ids would clean up tokenization spaces
            parsed = self.tokenizer.parse_response(
                self.tokenizer.decode(kept, clean_up_tokenization_spaces=False),
                prefix=self.tokenizer.decode(prompt, clean_up_tokenization_spaces=False), tools=tools)
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
                                "pass --reasoning-parser NAME (openai_gptoss for Harmony channels) or use a --server "
                                "that parses this model's output", **done)
        opened = prompt_opens_think(self.tokenizer.decode(prompt, clean_up_tokenization_spaces=False))
        content, reasoning = split_reasoning(self.tokenizer.decode(kept, skip_special_tokens=True,
                                                                   clean_up_tokenization_spaces=False), opened)
        return Answer(content=content, reasoning=reasoning, **done)

    def _parsed(self, kept: list[int], chat_template_kwargs: dict[str, Any] | None, done: dict[str, Any]) -> Answer:
        """The answer of the kept ids through ``self.reasoning_parser`` (:meth:`answer_of`)."""
        if self.reasoning_parser != "openai_gptoss":
            special = set(self.tokenizer.all_special_ids) - self.eos_ids
            odd = sorted({t for t in kept if t in special})
            if odd:
                names = ", ".join(self.tokenizer.convert_ids_to_tokens(odd))
                return Answer(error=f"unparsed answer format: the answer holds special tokens ({names}) that "
                                    f"--reasoning-parser {self.reasoning_parser}'s decode drops", **done)
        try:
            parsed = parse_answer(self.tokenizer, kept, self.reasoning_parser, self.eos_ids, chat_template_kwargs)
        except AnswerFormatError as e:
            return Answer(error=str(e), **done)
        calls = parsed.tool_calls
        return Answer(content=parsed.content, reasoning=parsed.reasoning, tool_calls=calls,
                      **{**done, **({"finish_reason": "tool_calls"} if calls and done["finish_reason"] == "stop" else {})})


_SPECIAL_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
_NOT_SAMPLING = ("transformers_version", "_from_model_config", "use_cache", "output_attentions",
                 "output_hidden_states", "max_length", "max_new_tokens")


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
        kind: one of :data:`SERVER_KINDS`: which fields state :func:`sampling_parameters` (and
            ask for the generated token ids) in each request.
        reasoning_parser: a think parser (:data:`runtime.chat.answer_parsing.THINK_PARSERS`) splitting the
            content of a server that returned no reasoning of its own (one started without
            ``--reasoning-parser``), as vLLM's parser of that name would; None: :func:`split_reasoning`.
            ``openai_gptoss`` is refused: a server's text has no Harmony tokens left to parse.
        truncation: ``(top_k, top_p, sources)`` stated in every request (:func:`sampling_parameters`).

    Raises:
        MissingDependencyError: the ``openai`` package is missing.
        InputError: no model name given and the server does not serve exactly one; ``auto`` kind
            and the models cannot be listed.
    """

    def __init__(self, urls: list[str], model: str | None, max_new_tokens: int, temperature: float | dict[str, float],
                 concurrency: int = 8, retries: int = 5, timeout: float = 600.0, tokenizer=None,
                 kind: str = "auto", reasoning_parser: str | None = None,
                 truncation: tuple[int, float, dict[str, str]] = (0, 1.0, {})):
        try:
            import openai
        except ImportError as e:  # pragma: no cover - a dependency of peagle
            raise MissingDependencyError("the server back end needs `pip install openai`") from e
        if kind not in SERVER_KINDS:
            raise ValueError(f"--server-kind must be one of {SERVER_KINDS}, got {kind!r}")
        check_reasoning_parser(reasoning_parser)
        if reasoning_parser == "openai_gptoss":
            raise ValueError("--reasoning-parser openai_gptoss goes with --verifier: a server's answer text has no "
                             "Harmony tokens left; serve gpt-oss with vLLM, which returns its channels parsed")
        self.reasoning_parser = reasoning_parser
        self.bases = [server_base_url(u) for u in urls]
        self.clients = {b: openai.OpenAI(base_url=b, api_key="EMPTY", max_retries=retries, timeout=timeout)
                        for b in self.bases}
        self.max_new_tokens, self.temperature, self.tokenizer = max_new_tokens, temperature, tokenizer
        self.slots: queue.Queue[str] = queue.Queue()
        for _ in range(concurrency):
            for b in self.bases:
                self.slots.put(b)
        self.workers = concurrency * len(self.bases)
        listed = self._models(required=model is None) if model is None or kind == "auto" else []
        self.model = model or self._only_model(listed)
        if kind == "auto":  # a server that cannot be asked is told only the OpenAI fields (recorded)
            owners = {getattr(m, "owned_by", None) for m in listed}
            kind = "vllm" if owners == {"vllm"} else "openai"
        self.kind = kind
        self.top_k, self.top_p, sources = truncation
        if kind == "openai" and self.top_k:
            raise InputError(f"top_k {self.top_k} cannot be sent to an OpenAI-API server (the API has no top_k field): "
                             "give --server-kind vllm or transformers, or --top-k 0", field="--top-k")
        self.params = None if isinstance(temperature, dict) else _request_params(kind, temperature, max_new_tokens,
                                                                                  self.top_k, self.top_p)
        self.record = {"backend": "server", "servers": self.bases, "model": self.model,
                       "concurrency": concurrency, "retries": retries, "server_kind": kind,
                       "sampling": sampling_record(temperature, self.top_k, self.top_p, sources),
                       "not_sent": list(_NOT_SENT[kind]),
                       "token_ids": kind == "vllm"}

    def _models(self, required: bool) -> list:
        """The first server's ``/v1/models`` entries; [] when they cannot be listed and not ``required``."""
        import openai

        try:
            return list(self.clients[self.bases[0]].models.list())
        except openai.OpenAIError as e:
            if not required:
                return []
            raise InputError(f"--server {self.bases[0]}: cannot list its models ({e}); pass --served-model") from None

    def _only_model(self, listed: list) -> str:
        names = [m.id for m in listed]
        if len(names) != 1:
            raise InputError(f"--server {self.bases[0]} serves {len(names)} models ({', '.join(names)}); "
                             "name one with --served-model")
        return names[0]

    def answer(self, request: Request) -> Answer:
        """The answer of whichever server is free first (blocks while all are busy).

        Errors become ``Answer.error``: ``prompt too long: <server message>`` for a 400 that speaks of
        the context length, ``server error: ...`` for anything else once the retries are spent.

        Raises:
            InputError: :func:`check_effort_field` (a vLLM server, before anything is sent).
        """
        import openai

        if self.kind == "vllm":
            check_effort_field(self.tokenizer, request.chat_template_kwargs)
        base = self.slots.get()
        try:
            kwargs = {"tools": request.tools} if request.tools else {}
            params = self.params if request.temperature is None else _request_params(
                self.kind, request.temperature, self.max_new_tokens, self.top_k, self.top_p)
            params = _with_template_kwargs(params, request.chat_template_kwargs, self.kind)
            resp = self.clients[base].chat.completions.create(
                model=self.model, messages=_wire_messages(request.messages), **params, **kwargs)
        except openai.BadRequestError as e:
            text = str(e)
            key = "prompt too long" if re.search(r"context|too long|maximum", text, re.I) else "server error"
            return Answer(error=f"{key}: {base}: {text}")
        except openai.OpenAIError as e:
            return Answer(error=f"server error: {base}: {type(e).__name__}: {e}")
        finally:
            self.slots.put(base)
        opened = None  # unknown without the tokenizer: the prompt is the server's
        if self.tokenizer is not None:
            opened = prompt_opens_think(self.tokenizer.decode(prompt_tokens(self.tokenizer, request),
                                                              clean_up_tokenization_spaces=False))
        answer = _answer_of(resp, opened, self.reasoning_parser, request.chat_template_kwargs)
        if answer.token_ids is not None and answer.finish_reason == "length":
            # a cut character's bytes left the text: its ids go too (counted with the tokenizer; none
            # can be kept without one)
            if self.tokenizer is not None:
                n = complete_prefix(self.tokenizer, answer.token_ids, cut=True)[0]
                answer.cut_partial_char |= n < len(answer.token_ids)
                answer.token_ids = answer.token_ids[:n]
            elif answer.cut_partial_char:
                answer.token_ids = None
        return answer


def _with_template_kwargs(params: dict[str, Any], template_kwargs: dict[str, Any], kind: str) -> dict[str, Any]:
    """``params`` with the chat template's variables as the request field ``chat_template_kwargs`` (vLLM's
    and SGLang's name; the ``openai`` client sends it in ``extra_body``); unchanged when there are none.

    To a ``vllm`` server a ``reasoning_effort`` variable also goes as the request's own ``reasoning_effort``
    field: vLLM 0.32 renders a gpt-oss model's requests with openai_harmony, which reads only that field
    (``_make_request_with_harmony``), while for a chat template it passes the field on as the same variable
    (``ChatCompletionRequest.build_chat_params``), so both paths render the row's effort. vLLM then also
    sets ``enable_thinking = effort != "none"`` unless the variables give it; :func:`check_effort_field`
    refuses the templates that read it.
    """
    if not template_kwargs:
        return params
    extra = {**params.get("extra_body", {}), "chat_template_kwargs": dict(template_kwargs)}
    if kind == "vllm" and "reasoning_effort" in template_kwargs:
        extra["reasoning_effort"] = template_kwargs["reasoning_effort"]
    return {**params, "extra_body": extra}


def check_effort_field(tokenizer, template_kwargs: dict[str, Any]) -> None:
    """Refuse a ``reasoning_effort`` sent to a vLLM server with a chat template that reads ``enable_thinking``
    while the variables do not set it: vLLM would render ``enable_thinking = effort != "none"``
    (``build_chat_params``), a prompt the row's recorded variables do not give to ``tokenize``.

    Args:
        tokenizer: the ``--tokenizer`` of the run (its chat template is searched); None: not checked (the
            servers' templates are trusted, as for every other check of a server run).
        template_kwargs: one row's template variables.

    Raises:
        InputError: the case above, naming the fix.
    """
    if tokenizer is None or "reasoning_effort" not in template_kwargs or "enable_thinking" in template_kwargs:
        return
    template = getattr(tokenizer, "chat_template", None) or ""
    sources = template.values() if isinstance(template, dict) else [template]
    if any("enable_thinking" in t for t in sources):
        raise InputError(
            "reasoning_effort sent to a vLLM server with a chat template that reads enable_thinking: vLLM sets "
            f"enable_thinking = (reasoning_effort != 'none') for it, which the row's variables "
            f"{json.dumps(template_kwargs, sort_keys=True)} do not say; give enable_thinking in "
            "--chat-template-kwargs (or --enable-thinking) too")


def _request_params(kind: str, temperature: float, max_new_tokens: int, top_k: int = 0,
                    top_p: float = 1.0) -> dict[str, Any]:
    """The ``chat.completions.create`` arguments that state :func:`sampling_parameters` to a
    server of ``kind`` (fields beyond the OpenAI API go in ``extra_body``)."""
    p = sampling_parameters(temperature, top_k, top_p)
    params: dict[str, Any] = {"max_tokens": max_new_tokens, "temperature": p["temperature"], "top_p": p["top_p"]}
    if kind == "vllm":
        params.update(presence_penalty=p["presence_penalty"], frequency_penalty=p["frequency_penalty"],
                      extra_body={"top_k": p["top_k"], "min_p": p["min_p"],
                                  "repetition_penalty": p["repetition_penalty"], "return_token_ids": True})
    elif kind == "transformers":  # it refuses unknown fields, maps frequency_penalty onto repetition_penalty
        params["extra_body"] = {"generation_config": json.dumps(_neutral_generation_config(temperature, max_new_tokens,
                                                                                           top_k, top_p))}
    else:
        params.update(presence_penalty=p["presence_penalty"], frequency_penalty=p["frequency_penalty"])
    return params


def _answer_of(resp, prompt_opened: bool | None = None, reasoning_parser: str | None = None,
               chat_template_kwargs: dict[str, Any] | None = None) -> Answer:
    """An :class:`Answer` from an ``openai`` ChatCompletion.

    An answer cut at ``max_tokens`` (``finish_reason == "length"``) drops the U+FFFD its text ends
    with (a character the limit cut; from the content, or the reasoning when there is no content);
    any other U+FFFD makes it an error (``undecodable answer``): a server's text cannot be checked
    against the tokens it came from. ``token_ids``: the choice's ``token_ids`` (vLLM's
    ``return_token_ids``), else None. ``prompt_opened``: whether the prompt ends inside an open think
    block (:func:`split_reasoning`; None: unknown). A server that returned no reasoning field has its
    content split by ``reasoning_parser`` (a think parser, as vLLM's of that name) when given, else by
    :func:`split_reasoning`.
    """
    choice = resp.choices[0]
    msg = choice.message
    extra = msg.model_extra or {}
    reasoning = extra.get("reasoning_content") or extra.get("reasoning")
    content = msg.content or ""
    if reasoning is None and reasoning_parser is not None:
        reasoning, parsed = parse_think(content, reasoning_parser, chat_template_kwargs)
        content = parsed or ""
    elif reasoning is None:
        content, reasoning = split_reasoning(content, prompt_opened)
    finish, usage = choice.finish_reason or "stop", resp.usage
    calls = [{"type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
             for c in (msg.tool_calls or [])] or None
    cut = False
    if finish == "length" and not calls:
        if content:
            content, cut = content.rstrip(REPLACEMENT), content.endswith(REPLACEMENT)
        elif reasoning:
            reasoning, cut = reasoning.rstrip(REPLACEMENT), reasoning.endswith(REPLACEMENT)
    ids = (getattr(choice, "model_extra", None) or {}).get("token_ids")
    done = {"finish_reason": finish, "prompt_tokens": getattr(usage, "prompt_tokens", 0) or 0,
            "completion_tokens": getattr(usage, "completion_tokens", 0) or 0,
            "token_ids": [int(t) for t in ids] if ids is not None else None}
    if REPLACEMENT in content + (reasoning or ""):
        return Answer(error="undecodable answer: the server's answer holds U+FFFD other than at a cut at "
                            "--max-new-tokens; its bytes cannot be checked against the verifier's tokens", **done)
    return Answer(content=content, reasoning=reasoning, tool_calls=calls, cut_partial_char=cut, **done)


# The text of a generated answer: a think block split off into the reasoning, and an answer cut at the
# token limit kept only up to its last complete character (never a U+FFFD the verifier did not say).

REPLACEMENT = "\ufffd"
"""U+FFFD, what a lossy UTF-8 decode writes for bytes that are not a complete character."""


_THINK = re.compile(r"^\s*(?:<think>)?(.*?)</think>\s*(.*)$", re.DOTALL)


def split_reasoning(text: str, prompt_opened: bool | None = None) -> tuple[str, str | None]:
    """``(content, reasoning)`` of a decoded answer: a leading ``<think>...</think>`` block (or text
    up to ``</think>`` when the prompt opened the block) becomes the reasoning, stripped; the rest is
    the content with leading whitespace removed. A text without ``</think>`` is all content, except
    one that opens ``<think>`` and never closes it (cut by the token limit): all reasoning.

    Args:
        prompt_opened: whether the prompt ends inside an open ``<think>`` block (its last ``<think>``
            after its last ``</think>``). False: only a text that opens its own block has reasoning
            (``"The tag </think> closes it."`` stays content); None (a server's prompt, unknown):
            text up to a ``</think>`` is reasoning.
    """
    if prompt_opened is False and not text.lstrip().startswith("<think>"):
        return text, None
    m = _THINK.match(text)
    if m:
        return m.group(2), m.group(1).strip()
    if text.lstrip().startswith("<think>"):
        return "", text.lstrip()[len("<think>"):].strip()
    return text, None


def prompt_opens_think(prompt_text: str) -> bool:
    """Whether ``prompt_text`` ends inside an open think block (a generation prompt ending ``<think>\n``,
    DeepSeek-R1 style): its last ``<think>`` comes after its last ``</think>``."""
    return prompt_text.rfind("<think>") > prompt_text.rfind("</think>")


def _byte_level(tokenizer) -> bool:
    """Whether the tokenizer's decoder is byte-level BPE (GPT-2 style: every token is bytes)."""
    from tokenizers import decoders

    dec = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return isinstance(dec, decoders.ByteLevel)


def _token_bytes(tokenizer, ids: list[int]) -> bytes | None:
    """The bytes of ``ids`` (special tokens left out) for a byte-level BPE tokenizer; None otherwise."""
    if not _byte_level(tokenizer):
        return None
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    inverse = {c: b for b, c in bytes_to_unicode().items()}
    special = set(tokenizer.all_special_ids)
    out = bytearray()
    for tok in tokenizer.convert_ids_to_tokens([i for i in ids if i not in special]):
        if any(c not in inverse for c in tok):
            return None
        out += bytes(inverse[c] for c in tok)
    return bytes(out)


def complete_prefix(tokenizer, ids: list[int], cut: bool) -> tuple[int, str | None]:
    """How many of the generated ``ids`` an answer keeps, and why it cannot be kept at all.

    An answer ``cut`` at the token limit drops its last ids while their ``skip_special_tokens``
    decode ends in U+FFFD: the bytes of a character the limit cut (at most 3 ids for a 4-byte
    character; a trailing U+FFFD the verifier itself wrote goes too, the kept text is still a prefix
    of its answer). A U+FFFD left in the text must be the verifier's own character: for a
    byte-level BPE tokenizer the ids' bytes must be valid UTF-8 (else ``invalid UTF-8``); for other
    tokenizers the bytes cannot be read back and the answer is refused (``undecodable answer``).

    Returns:
        ``(n, error)``: keep ``ids[:n]``; ``error`` None or the reject reason.
    """
    n = len(ids)
    text = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    while cut and n and text.endswith(REPLACEMENT):
        n -= 1
        text = tokenizer.decode(ids[:n], skip_special_tokens=True, clean_up_tokenization_spaces=False)
    if REPLACEMENT not in text:
        return n, None
    raw = _token_bytes(tokenizer, ids[:n])
    if raw is None:
        return n, ("undecodable answer: the answer decodes to U+FFFD and this tokenizer's bytes cannot be "
                   "checked to tell the verifier's own U+FFFD from bytes that are not UTF-8")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return n, (f"invalid UTF-8: the answer's tokens hold bytes that are not UTF-8 (byte {e.start} of "
                   f"{len(raw)}: {raw[e.start:e.end]!r}); their decode would write U+FFFD the verifier did not say")
    return n, None
