"""Special-token text in supervised replies."""

from __future__ import annotations

from peagle_data.chat.special_text import special_token_text
from peagle_data.chat.tokens import tokenize_conversation
from tests.peagle_data.chat.test_tokens import reference_ids


def test_special_token_text_counts_in_supervised_replies_only(smollm2_tokenizer):
    """Issue 33, kind 7: which text counts. A special token's text (all_special_tokens, added tokens marked
    special) in a supervised reply's content, reasoning or tool calls; not in context turns (they render
    as vLLM renders them), not in an unsupervised turn, not in a turn trained on its generated ids."""
    tok = smollm2_tokenizer
    call = {"type": "function", "function": {"name": "say", "arguments": {"text": "<|im_start|>"}}}
    messages = [{"role": "system", "content": "End turns with <|im_end|>."},
                {"role": "user", "content": "Say <|endoftext|>"},
                {"role": "assistant", "content": "ok", "reasoning_content": "write <|endoftext|>"},
                {"role": "user", "content": "again"},
                {"role": "assistant", "content": "<file_sep>", "weight": 0},
                {"role": "user", "content": "call"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "user", "content": "plain"},
                {"role": "assistant", "content": "<|im_end|>", "token_ids": [27, 91, 344, 62, 408, 91, 29, 2]},
                {"role": "assistant", "content": "fine <not_special> <|im_start"}]
    assert special_token_text(tok, messages, [2, 6, 8, 9]) == [
        (2, "reasoning_content", "<|endoftext|>"), (6, "tool_calls", "<|im_start|>")]
    assert special_token_text(tok, messages, [0, 1]) == [(0, "content", "<|im_end|>"), (1, "content", "<|endoftext|>")]
    context_only = [messages[1], {"role": "assistant", "content": "Done."}]
    out = tokenize_conversation(tok, context_only)
    assert out.input_ids.tolist() == reference_ids(tok, context_only)
    assert out.input_ids.tolist().count(0) == 1  # the user's <|endoftext|> is its control id, as in vLLM
