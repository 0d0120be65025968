"""``peagle-data show``: the supervised tokens of a row or block, bracketed, coloured or in HTML."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from cli.data import main
from peagle_data.prepare.config import PackConfig, PackRun, TokenizeConfig, TokenizeRun
from peagle_data.prepare.pack import run_pack
from peagle_data.prepare.tokenizing import run_tokenize
from peagle_data.inspect.show import render_text, select_items, supervised_spans
from stores.tables.token_tables import TokenTable

ROWS = [
    {"id": "a", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
    {"id": "b", "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."},
                             {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6."}]},
]
SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@pytest.fixture(scope="module")
def tables(tmp_path_factory, smollm2_tokenizer):
    root = tmp_path_factory.mktemp("show")
    src = root / "c.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=root / "tok", settings=TokenizeConfig()),
                             tokenizer=smollm2_tokenizer)
    run_pack(PackRun(inputs=[root / "tok"], tokenizer="smollm2-135m", output=root / "packed",
                     settings=PackConfig(max_seq_len=64, block_size=128)), tokenizer=smollm2_tokenizer)
    return root


def test_supervised_spans():
    import numpy as np

    assert supervised_spans(np.array([0, 1, 1, 0, 1], dtype=np.uint8)) == [(1, 3), (4, 5)]
    assert supervised_spans(np.zeros(3, dtype=np.uint8)) == []


def test_a_tokenized_row_bracketed(tables, smollm2_tokenizer):
    (item,) = select_items(TokenTable.open(tables / "tok"), row=0)
    text = render_text(item, smollm2_tokenizer)
    assert text.startswith(f"row 0: a ({tables / 'c.jsonl'}:1): 35 tokens, 3 supervised, 2 segment(s)\n")
    assert (f"--- segment system prefix (loss 0): tokens 0-20 ---\n{SYSTEM}\n"
            "--- segment conversation: tokens 21-34 ---\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
            "[[Hello!<|im_end|>]]\n") in text
    assert text.endswith('supervised spans (1):\n  1. tokens 31-33 (3) in conversation: "Hello!<|im_end|>"')


def test_a_packed_block_by_conversation_id_on_the_cli(tables):
    result = CliRunner().invoke(main, ["show", str(tables / "packed"), "--id", "b", "--html",
                                       str(tables / "b.html")])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert out.startswith("block 0: 90 tokens, 9 supervised, 2 segment(s)\n")
    assert f"--- segment b#0: tokens 0-54 ---\n{SYSTEM}<|im_start|>user\n2+2?<|im_end|>\n" in out
    assert "\n--- segment a#0: tokens 55-89 ---\n" in out
    assert "[[4.<|im_end|>]]" in out and "[[6.<|im_end|>]]" in out and "\x1b[" not in out  # not a terminal
    assert out.endswith('supervised spans (3):\n  1. tokens 34-36 (3) in b#0: "4.<|im_end|>"\n'
                        '  2. tokens 51-53 (3) in b#0: "6.<|im_end|>"\n'
                        '  3. tokens 86-88 (3) in a#0: "Hello!<|im_end|>"\n')
    page = (tables / "b.html").read_text()
    assert "<mark>4.&lt;|im_end|&gt;</mark>" in page and page.count("<mark>") == 4  # 3 spans + the legend
    assert '<span class="seg">segment a#0: tokens 55-89</span>' in page
    again = CliRunner().invoke(main, ["show", str(tables / "packed"), "--html", str(tables / "b.html")])
    assert again.exit_code == 2 and "pass --force" in again.output


def test_colour_per_turn_ids_and_errors(tables):
    run = CliRunner().invoke
    coloured = run(main, ["show", str(tables / "tok"), "--id", "b", "--color", "always"])
    assert coloured.exit_code == 0 and "\x1b[30m\x1b[42m4.<|im_end|>\x1b[0m" in coloured.output
    assert "[[" not in coloured.output
    out = run(main, ["show", str(tables / "tok"), "--block", "0"])
    assert out.exit_code == 2 and "--block needs a packed table" in out.output
    out = run(main, ["show", str(tables / "tok"), "--row", "2"])
    assert out.exit_code == 2 and "row 2 is out of range: the table has 2 rows (0..1)" in out.output
    out = run(main, ["show", str(tables / "packed"), "--id", "zz"])
    assert out.exit_code == 2 and "no block holds id 'zz'" in out.output


def test_show_of_an_empty_table_says_it_is_empty(tmp_path):
    from stores.tables.token_tables import TableWriter, write_manifest

    (tmp_path / "empty").mkdir()
    with TableWriter(tmp_path / "empty", "tokenized"):
        pass
    write_manifest(tmp_path / "empty", {"kind": "tokenized", "counts": {"read": 1, "used": 0, "rejected": 1}})
    out = CliRunner().invoke(main, ["show", str(tmp_path / "empty")])
    assert out.exit_code == 2 and "the table has no rows (see its rejects.jsonl for why)" in out.output


def test_show_names_the_template_mode_the_rows_were_rendered_in(tmp_path, smollm2_tokenizer):
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps(ROWS[0]) + "\n")
    reads = tmp_path / "reads.jinja"  # SmolLM2's template, reading the variable (tokenize refuses an unread one)
    reads.write_text("{%- if reasoning_effort == 'max' %}{%- endif %}" + smollm2_tokenizer.chat_template)
    run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "tok",
                             settings=TokenizeConfig(chat_template=str(reads),
                                                     chat_template_kwargs={"reasoning_effort": "low"})),
                 tokenizer=smollm2_tokenizer)
    result = CliRunner().invoke(main, ["show", str(tmp_path / "tok")])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith('rendered with chat template kwargs {"reasoning_effort": "low"}\n\nrow 0: a (')
