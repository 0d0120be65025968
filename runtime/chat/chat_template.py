"""The effective chat template and one render of a conversation through it (docs/design.md §3, §6 "Message
content as vLLM passes it").

The one renderer of every stage (``tokenize``/``pack``, ``regenerate``, ``peagle-eval``'s :func:`prompt_ids`): a
prompt has the same ids in each, and the ids vLLM's chat endpoint renders. :func:`content_format` detects the
template's content format as vLLM does (``vllm/renderers/hf.py``, ``_detect_content_format``): **openai** (the
template loops over ``message.content``: every content a list of ``{"type": "text", "text"}`` parts) or
**string** (text parts joined with ``"\n"``); :func:`template_messages` converts the messages
(``vllm/renderers/chat_utils.py``: tool messages a string in both, ``developer`` kept only where the template
names the role), :func:`template_tools` the tools as vLLM's request model dumps them.

Template variables (``--chat-template-kwargs JSON``, :func:`parse_chat_template_kwargs`) travel with the text in a
:class:`ChatTemplate`; each output records them (:func:`chat_template_kwargs_record`) and a later stage whose
variables differ from its input's is refused (:func:`check_chat_template_kwargs`).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

import jinja2.ext
import jinja2.meta
import jinja2.nodes as jn
import jinja2.sandbox

from stores.errors import InputError, StoreMismatchError

__all__ = ["ChatTemplateError", "CONTENT_FORMATS", "effective_chat_template", "chat_template_sha256",
           "content_format", "supports_developer_role", "template_messages", "template_tools", "render",
           "prompt_ids", "content_texts", "content_text", "ChatTemplate", "as_chat_template", "RESERVED_KWARGS",
           "parse_chat_template_kwargs", "check_kwargs_names", "chat_template_kwargs_record",
           "check_chat_template_kwargs", "describe_kwargs", "template_variables", "check_kwargs_read",
           "loads_unique"]

RESERVED_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
"""Names ``--chat-template-kwargs`` may not set: ``apply_chat_template``'s own arguments, which each
render sets itself (vLLM refuses ``chat_template`` and ``tokenize`` in a request's kwargs and sets the
others from the request)."""


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template as a stage renders it: the template text and the variables it is rendered with.

    Every renderer function takes one (or, as before, the template text alone: no variables)."""

    text: str | None = None
    """The template text replacing the tokenizer's own (--chat-template), or None: the tokenizer's."""
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    """The template's variables, vLLM's ``chat_template_kwargs`` (--chat-template-kwargs); JSON values."""

    def key(self) -> str:
        """A canonical string of the text and variables (a cache key)."""
        return json.dumps([self.text, self.kwargs], sort_keys=True)


def as_chat_template(chat_template: "str | ChatTemplate | None") -> ChatTemplate:
    """``chat_template`` as a :class:`ChatTemplate` (a text or None: that text, no variables)."""
    return chat_template if isinstance(chat_template, ChatTemplate) else ChatTemplate(chat_template)


def check_kwargs_names(kwargs: Mapping[str, Any], option: str = "--chat-template-kwargs") -> dict[str, Any]:
    """``kwargs`` as a plain dict, checked: string keys, none of :data:`RESERVED_KWARGS`, JSON values.

    Raises:
        ValueError: a non-object, a reserved name, or a value JSON cannot hold (names ``option``).
    """
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"{option} must be a JSON object such as '{{\"enable_thinking\": false}}', "
                         f"got {type(kwargs).__name__}")
    reserved = sorted(k for k in kwargs if k in RESERVED_KWARGS)
    if reserved:
        raise ValueError(f"{option} may not set {', '.join(map(repr, reserved))}: each stage sets "
                         f"{'it' if len(reserved) == 1 else 'them'} per render (vLLM refuses or overrides "
                         "these names too); give only the template's own variables")
    bad = [k for k in kwargs if not isinstance(k, str) or not k.isidentifier()]
    if bad:
        raise ValueError(f"{option}: {bad[0]!r} is not a template variable name")
    try:
        return json.loads(json.dumps(dict(kwargs)))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{option}: the values must be JSON ({e})") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} is given twice (JSON keeps the last silently)")
        out[key] = value
    return out


def loads_unique(text: str) -> Any:
    """``json.loads(text)``, refusing an object that gives a key twice (``{"a": 1, "a": 2}``, which ``json``
    reads as ``{"a": 2}``: the first value dropped without a word).

    Raises:
        json.JSONDecodeError: not JSON. ValueError: a key given twice (names it).
    """
    return json.loads(text, object_pairs_hook=_unique_keys)


def parse_chat_template_kwargs(text: str | None, option: str = "--chat-template-kwargs") -> dict[str, Any]:
    """The template variables of a ``--chat-template-kwargs`` value: a JSON object, as vLLM's option
    and request field take it (``'{"enable_thinking": false}'``); None or ``""``: none (``{}``).

    Raises:
        ValueError: not JSON, a key given twice, not an object, or a reserved name (:func:`check_kwargs_names`).
    """
    if text is None or not text.strip():
        return {}
    try:
        value = loads_unique(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{option} is not JSON ({e.msg} at character {e.pos}): {text!r}") from None
    except ValueError as e:
        raise ValueError(f"{option}: {e}") from None
    return check_kwargs_names(value, option)


def chat_template_kwargs_record(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The variables as recorded in manifests and store attributes: a dict with sorted keys ({} for none)."""
    return {k: kwargs[k] for k in sorted(kwargs or {})}


def describe_kwargs(kwargs: Mapping[str, Any] | None) -> str:
    """``kwargs`` for a message: their JSON, or ``none (the template's defaults)``."""
    return json.dumps(chat_template_kwargs_record(kwargs)) if kwargs else "none (the template's defaults)"


def check_chat_template_kwargs(recorded: Mapping[str, Any], made: str, kwargs: Mapping[str, Any] | None,
                               label: str = "--chat-template-kwargs", fix: str = "") -> None:
    """Raise unless ``kwargs`` equal the variables ``recorded`` (a manifest's or store's ``tokenizer``
    record, whose ``chat_template_kwargs`` is absent in outputs made before peagle recorded them: none).

    Args:
        made: what was made with the recorded variables, e.g. ``the tokenize output PATH``.
        label: where ``kwargs`` come from, e.g. ``--chat-template-kwargs``.
        fix: the sentence that says what to do (a default names both ways out).

    Raises:
        StoreMismatchError: ``{made} was rendered with chat template kwargs A, but {label} gives B; FIX``.
    """
    have = chat_template_kwargs_record(recorded.get("chat_template_kwargs"))
    want = chat_template_kwargs_record(kwargs)
    if have != want:
        raise StoreMismatchError(
            f"{made} was rendered with chat template kwargs {describe_kwargs(have)}, but {label} gives "
            f"{describe_kwargs(want)}: the verifier answers another prompt in each mode; "
            + (fix or f"pass --chat-template-kwargs '{json.dumps(have)}', or make the input again in this mode"))


class _GenerationTag(jinja2.ext.Extension):
    """Parses the ``{% generation %}`` blocks some templates hold (transformers' ``AssistantTracker``), so that
    such a template's variables can be listed; never rendered."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jn.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)


@functools.lru_cache(maxsize=64)
def template_variables(template: str) -> frozenset[str] | None:
    """The variables a chat template's text reads (jinja2's undeclared variables), listed as vLLM lists them
    to decide which ``chat_template_kwargs`` reach the template (``vllm/renderers/hf.py``,
    ``_resolve_chat_template_kwargs``: a variable the template does not read is dropped). None: the text does
    not parse (rendering it fails with its own error)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateSyntaxError:
        return None


def check_kwargs_read(template: str, kwargs: Mapping[str, Any] | None, option: str = "--chat-template-kwargs") -> None:
    """Refuse template variables the template's text never reads: they change no prompt (vLLM drops them
    from a request too), so a misspelt mode (``enable_thinkng``) would render, record and train the template's
    default mode under the name of another.

    Raises:
        ChatTemplateError: naming the unread variables and those the template reads (``option``).
    """
    names = template_variables(template)
    unread = sorted(k for k in (kwargs or {}) if names is not None and k not in names)
    if unread:
        reads = sorted(n for n in names if n not in RESERVED_KWARGS and n != "messages")
        raise ChatTemplateError(
            f"{option}: the chat template never reads {', '.join(map(repr, unread))}, so it would change no "
            f"prompt (vLLM drops it too) and the rows would be rendered in the template's default mode; the "
            f"template reads {', '.join(reads) or 'no variables'}: check the name, or leave it out")


CONTENT_FORMATS = ("string", "openai")
"""How message content is passed to a chat template: joined text, or a list of text parts."""


def content_texts(content: Any) -> list[str]:
    """The text parts of normalised content: a string is one part, None none, a list its parts' texts."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    return [part["text"] for part in content]


def content_text(content: Any) -> str:
    """Normalised content as one string: its text parts joined with ``"\n"``, as vLLM joins them for a
    string-content template (None: ``""``)."""
    return "\n".join(content_texts(content))


class ChatTemplateError(InputError):
    """A conversation cannot be rendered or masked exactly with this chat template (a reject reason)."""


def effective_chat_template(tokenizer, chat_template: str | None = None) -> str:
    """The template text actually used (the override, else the tokenizer's own).

    Raises:
        InputError: the tokenizer has no chat template and none is given.
    """
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if template is None:
        raise InputError("the tokenizer has no chat template; pass one with --chat-template FILE")
    return template if isinstance(template, str) else json.dumps(template, sort_keys=True)


def chat_template_sha256(tokenizer, chat_template: str | None = None) -> str:
    """sha256 hex digest of the effective chat template text (recorded in manifests)."""
    import hashlib

    return hashlib.sha256(effective_chat_template(tokenizer, chat_template).encode("utf-8")).hexdigest()


def _loads(node: jn.Node, name: str, key: str | None = None) -> bool:
    """Whether ``node`` reads the variable ``name`` (``key`` given: its item ``key``, as ``name.key`` or
    ``name['key']``), possibly through filters, tests and slices (``messages[1:] | selectattr(...)``)."""
    while True:
        if isinstance(node, (jn.Filter, jn.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, jn.Getitem) and isinstance(node.arg, jn.Slice):
            node = node.node
        else:
            break
    if key is None:
        return isinstance(node, jn.Name) and node.ctx == "load" and node.name == name
    if isinstance(node, jn.Getattr):
        return node.attr == key and _loads(node.node, name) if isinstance(node.node, jn.Name) else False
    if isinstance(node, jn.Getitem):
        return (isinstance(node.arg, jn.Const) and node.arg.value == key and isinstance(node.node, jn.Name)
                and _loads(node.node, name))
    return False


def _loops_over_content(tree: jn.Template) -> bool:
    """Whether a template iterates over a message's content: vLLM's rule for the openai format.

    Messages lists are ``messages`` and every variable set from one (``{% set loop_messages =
    messages[1:] %}``, transitively); messages are the targets of loops over those. Content is looped
    over by a loop over ``message.content`` / ``message['content']``, by a loop inside a macro over a
    parameter that a call passes ``message.content``, or by a loop outside macros over a variable named
    ``content``.
    """
    lists, todo = {"messages"}, ["messages"]
    while todo:
        name = todo.pop()
        for assign in tree.find_all(jn.Assign):
            if isinstance(assign.target, jn.Name) and _loads(assign.node, name) and assign.target.name not in lists:
                lists.add(assign.target.name)
                todo.append(assign.target.name)
    loops = list(tree.find_all(jn.For))
    items = {loop.target.name for loop in loops if isinstance(loop.target, jn.Name)
             and any(_loads(loop.iter, name) for name in lists)}

    def passes_content(arg: jn.Node) -> bool:
        return any(_loads(arg, item, "content") for item in items)

    in_macros: dict[int, set[str]] = {}  # loop id -> parameters of its macro that receive content
    for macro in tree.find_all(jn.Macro):
        params = [a.name for a in macro.args]
        fed = set()
        for call in tree.find_all(jn.Call):
            if isinstance(call.node, jn.Name) and call.node.name == macro.name:
                fed |= {params[k] for k, arg in enumerate(call.args[:len(params)]) if passes_content(arg)}
                fed |= {kw.key for kw in call.kwargs if kw.key in params and passes_content(kw.value)}
        for loop in macro.find_all(jn.For):
            in_macros[id(loop)] = fed
    for loop in loops:
        if passes_content(loop.iter):
            return True
        if isinstance(loop.iter, jn.Name):
            fed = in_macros.get(id(loop))
            if (fed is None and loop.iter.name == "content") or (fed and loop.iter.name in fed):
                return True
    return False


@functools.lru_cache(maxsize=64)
def content_format(template: str) -> str:
    """The content format (:data:`CONTENT_FORMATS`) vLLM detects for a chat template's text.

    ``openai`` when the template loops over a message's content (see :func:`_loops_over_content`),
    else ``string``; a template that does not parse is ``string`` (vLLM's default; rendering it then
    fails with its own error).
    """
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        tree = _compile_jinja_template(template).environment.parse(template)
    except Exception:  # noqa: BLE001 - jinja syntax errors; vLLM falls back to "string" alike
        return "string"
    return "openai" if _loops_over_content(tree) else "string"


def supports_developer_role(template: str) -> bool:
    """Whether a chat template names the ``developer`` role (vLLM's test: the quoted word appears)."""
    return '"developer"' in template or "'developer'" in template


def _as_system_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's handling of ``developer`` messages under a template without that role: they become
    ``system`` messages, and when a system message is then not first, or not alone, all of them are
    merged into one first system message, their texts (parts joined with ``"\n"``) joined with
    ``"\n\n"``, empty ones left out. vLLM does this to messages already in the template's content
    format, and the merged content is a string in either format (``_consolidate_system_messages``)."""
    out = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
    systems = [k for k, m in enumerate(out) if m["role"] == "system"]
    if systems in ([], [0]):
        return out
    texts = [t for t in (content_text(out[k].get("content")) for k in systems) if t]
    return [{"role": "system", "content": "\n\n".join(texts)}] + [m for m in out if m["role"] != "system"]


def template_messages(messages, template: str) -> list[dict[str, Any]]:
    """Normalised messages as vLLM's chat endpoint passes them to ``template`` (the template's text).

    Content, by the template's :func:`content_format`: ``string``, the text parts joined with ``"\n"``
    (no content: ``""``); ``openai``, a list of ``{"type": "text", "text": ...}`` parts (a string is
    one part, no content none); tool messages get the joined string in both formats. An assistant's
    ``reasoning_content`` is passed as ``reasoning`` too, as vLLM passes it. ``developer``
    messages stay so when the template names that role, else become system messages
    (:func:`_as_system_messages`).
    """
    fmt = content_format(template)
    out = []
    for msg in messages:
        texts = content_texts(msg.get("content"))
        if fmt == "string" or msg.get("role") == "tool":
            content: Any = "\n".join(texts)
        else:
            content = [{"type": "text", "text": t} for t in texts]
        out.append({**msg, "content": content})
        if msg.get("role") == "assistant" and msg.get("reasoning_content") is not None:
            out[-1]["reasoning"] = msg["reasoning_content"]  # vLLM passes both names
    if any(m.get("role") == "developer" for m in out) and not supports_developer_role(template):
        out = _as_system_messages(out)  # after the content: vLLM merges parsed messages, into a string
    return out


def template_tools(tools: list | None) -> list | None:
    """Tool definitions as vLLM passes them to a template: each as its request model dumps it
    (``ChatCompletionToolsParam.model_dump()``), ``{"type": "function", "function": {"name",
    "description", "parameters"}}`` in that order, a missing description or parameters as None,
    ``strict`` and ``defer_loading`` only when set, other keys left out. The readers accept only tools
    of this shape (:func:`peagle_data.readers.normalize.normalize_record`)."""
    if tools is None:
        return None
    out = []
    for tool in tools:
        fn = tool["function"]
        function = {key: fn.get(key) for key in ("name", "description", "parameters")}
        defer = fn.get("defer_loading") if fn.get("defer_loading") is not None else tool.get("defer_loading")
        function.update({key: value for key, value in (("strict", fn.get("strict")), ("defer_loading", defer))
                         if value is not None})
        out.append({"type": "function", "function": function,
                    **({"defer_loading": tool["defer_loading"]} if tool.get("defer_loading") is not None else {})})
    return out


def render(tokenizer, messages, tools, chat_template: "str | ChatTemplate | None",
           add_generation_prompt=False) -> str:
    """``messages`` (and ``tools``) rendered as text by ``chat_template`` (a :class:`ChatTemplate`: its
    text, None the tokenizer's own, with its variables; a plain text: no variables), passed as vLLM
    passes them (:func:`template_messages`; the variables over the tokenizer's special tokens).

    Raises:
        ChatTemplateError: the template fails on this conversation (names the error), or a variable it never
            reads (:func:`check_kwargs_read`).
    """
    spec = as_chat_template(chat_template)
    if spec.kwargs:
        check_kwargs_read(tokenizer.get_chat_template(spec.text, template_tools(tools)), spec.kwargs)
    kwargs: dict[str, Any] = {**spec.kwargs, "tokenize": False, "add_generation_prompt": add_generation_prompt}
    tools = template_tools(tools)
    if tools is not None:
        kwargs["tools"] = tools
    if spec.text is not None:
        kwargs["chat_template"] = spec.text
    try:
        if not messages:  # apply_chat_template refuses an empty history; the renderer does not
            from transformers.utils.chat_template_utils import render_jinja_template

            rendered, _ = render_jinja_template(
                conversations=[[]], tools=tools, chat_template=tokenizer.get_chat_template(spec.text, tools),
                add_generation_prompt=add_generation_prompt, **{**tokenizer.special_tokens_map, **spec.kwargs})
            return rendered[0]
        return tokenizer.apply_chat_template(
            template_messages(messages, tokenizer.get_chat_template(spec.text, tools)), **kwargs)
    except Exception as e:  # jinja errors, raise_exception() in templates, type errors on content
        raise ChatTemplateError(f"template error: {type(e).__name__}: {e}") from None


def prompt_ids(tokenizer, messages, tools=None, chat_template: "str | ChatTemplate | None" = None) -> list[int]:
    """Token ids of ``messages`` (and ``tools``) rendered with the generation prompt, as vLLM's chat
    endpoint builds a prompt: :func:`render` (content passed as vLLM passes it), then the text tokenized
    without adding special tokens (``apply_chat_template(tokenize=True)`` does the same), so special-token
    text in a message becomes its control id, as in vLLM.

    Returns:
        int token ids ``[T]``.

    Raises:
        ChatTemplateError: the template fails on these messages (names the error).
    """
    text = render(tokenizer, messages, tools, chat_template, add_generation_prompt=True)
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
