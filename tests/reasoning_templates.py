"""Chat templates and tokenizers of reasoning verifiers, written for the tests (no hub download).

- :data:`THINK_TEMPLATE`: a Qwen3-style hybrid-thinking ChatML template: earlier turns' reasoning is
  dropped, the assistant turn after the last user query renders its ``<think>`` block; the generation
  prompt is ``<|im_start|>assistant\\n``, with ``enable_thinking: false`` followed by an empty
  ``<think>\\n\\n</think>\\n\\n`` (Qwen3's template does the same).
- :data:`HARMONY_TEMPLATE`: a gpt-oss-style Harmony template: a system message naming
  ``reasoning_effort``, user turns ``<|start|>user<|message|>...<|end|>``, earlier assistant answers as
  their final channel only (gpt-oss drops earlier analysis), the last assistant turn with its
  ``analysis`` then ``final``; the generation prompt is ``<|start|>assistant``.

:func:`think_tokenizer` and :func:`harmony_tokenizer` add the tags as tokens of SmolLM2's tokenizer
(``<think>``/``</think>`` plain added tokens as in Qwen3; the Harmony markers special, as in gpt-oss).
"""

from __future__ import annotations

import copy

from stores.answer_parsing import HARMONY_TOKENS

THINK_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query_index=messages|length - 1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query_index = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set content = m.content or '' %}{%- set reasoning = m.reasoning_content or '' %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}"
    "{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- content.lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

HARMONY_TEMPLATE = (
    "{{- '<|start|>system<|message|>You are a model.\\nReasoning: ' + (reasoning_effort | default('medium'))"
    " + '\\n# Valid channels: analysis, commentary, final.<|end|>' }}"
    "{%- set ns = namespace(last_user=0) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '<|start|>user<|message|>' + m.content + '<|end|>' }}"
    "{%- elif m.role == 'system' %}{{- '<|start|>developer<|message|># Instructions\\n\\n' + m.content + '<|end|>' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- if loop.index0 > ns.last_user and m.reasoning_content %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.reasoning_content + '<|end|>' }}{%- endif %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + (m.content or '') + '<|end|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)


def think_tokenizer(base):
    """A copy of ``base`` with ``<think>``/``</think>`` as added (not special) tokens and :data:`THINK_TEMPLATE`."""
    tok = copy.deepcopy(base)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = THINK_TEMPLATE
    return tok


def harmony_tokenizer(base):
    """A copy of ``base`` with the Harmony markers as special tokens, ``<|return|>`` its end of sequence,
    and :data:`HARMONY_TEMPLATE`."""
    tok = copy.deepcopy(base)
    tok.add_special_tokens({"additional_special_tokens": list(HARMONY_TOKENS)})
    tok.chat_template = HARMONY_TEMPLATE
    return tok
