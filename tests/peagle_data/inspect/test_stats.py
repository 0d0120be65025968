"""peagle-data stats: exact totals, percentiles, windows per conversation, sources, efficiency."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from cli.data import main
from peagle_data.extract.config import ExtractConfig
from peagle_data.extract.run import run_extract
from peagle_data.prepare.packing import make_packed_row
from peagle_data.inspect.stats import collect_stats, format_stats, percentiles_from_counts
from peagle_data.inspect.stats_plot import plot_stats
from stores.features.feature_store import FeatureStore
from stores.tables.token_tables import TableWriter, TokenTable, write_manifest

from tests.peagle_data.extract.test_run import pack_conversations, window_ends


def _tokenized_table(path, rows):
    """rows: (source, n_tokens, n_loss, system_len)."""
    path.mkdir()
    with TableWriter(path, "tokenized", batch_rows=2) as w:  # several row groups
        for i, (source, n, m, s) in enumerate(rows):
            mask = np.zeros(n, np.uint8)
            mask[n - m:] = 1
            w.write({"conversation_id": f"c{i}", "source": source, "input_ids": np.arange(n, dtype=np.int32),
                     "loss_mask": mask, "system_len": s, "n_tokens": n, "n_loss_tokens": m})
    write_manifest(path, {"kind": "tokenized", "counts": {"read": len(rows) + 1, "used": len(rows), "rejected": 1}})
    return path


def test_percentiles_from_counts_are_nearest_rank():
    values = np.array([30, 10, 20])
    counts = np.array([1, 2, 7])  # 10 10 20 20 20 20 20 20 20 30
    p = percentiles_from_counts(values, counts, (10, 20, 21, 90, 91, 100))
    assert (p["p10"], p["p20"], p["p21"], p["p90"], p["p91"], p["p100"]) == (10, 10, 20, 20, 30, 30)
    assert (p["min"], p["max"], p["mean"]) == (10, 30, 19.0)
    full = np.repeat(values, counts)
    for q in (1, 37, 50, 99):  # numpy's inverted_cdf is nearest rank
        assert percentiles_from_counts(values, counts, (q,))[f"p{q}"] == np.percentile(full, q, method="inverted_cdf")
    assert percentiles_from_counts(np.array([]), np.array([]))["p50"] is None


def test_tokenized_stats_totals_sources_and_windows(tmp_path):
    rows = [("a.jsonl:1", 10, 5, 0), ("a.jsonl:2", 20, 20, 2), ("b.parquet:1", 30, 3, 0), ("a.jsonl:3", 10, 0, 0)]
    table = _tokenized_table(tmp_path / "tok", rows)
    s = collect_stats(table, max_seq_len=12, overlap=0.5)
    assert s["kind"] == "tokenized"
    assert s["totals"] == {"rows": 4, "tokens": 70, "loss_tokens": 28, "supervised_fraction": round(28 / 70, 6)}
    assert s["lengths"]["values"] == [10, 20, 30] and s["lengths"]["counts"] == [2, 1, 1]
    assert s["lengths"]["percentiles"]["p50"] == 10 and s["lengths"]["percentiles"]["p99"] == 30
    hist = s["supervised_fraction"]["histogram"]
    assert hist[25] == 1 and hist[49] == 1 and hist[5] == 1 and hist[0] == 1 and sum(hist) == 4
    by_source = {x["source"]: x for x in s["sources"]}
    assert by_source["a.jsonl"]["rows"] == 3 and by_source["a.jsonl"]["tokens"] == 40
    assert by_source["b.parquet"]["loss_tokens"] == 3 and by_source["b.parquet"]["token_share"] == round(30 / 70, 6)
    from peagle_data.prepare.windows import count_windows
    expect = {}
    for _, n, _, sl in rows:
        k = count_windows(n, sl, 12, 0.5)
        expect[k] = expect.get(k, 0) + 1
    assert s["windows_per_conversation"]["histogram"] == expect
    assert s["manifest_counts"] == {"read": 5, "used": 4, "rejected": 1}


def test_packed_stats_windows_from_segment_ids_and_efficiency(tmp_path):
    out = tmp_path / "packed"
    out.mkdir()
    segs = [[("x#0", 6, 2), ("y#0", 2, 1)], [("x#1", 6, 6)], [("x#2", 4, 0), ("y#1", 3, 3)], [("z#0", 5, 5)],
            [("w#0", 4, 4), ("w#2", 4, 4)]]  # w's window 1 was dropped (no supervised token)
    with TableWriter(out, "packed", batch_rows=1) as w:
        for b, block in enumerate(segs):
            w.write(make_packed_row(b, [(sid, np.ones(n, np.int32), np.r_[np.zeros(n - m), np.ones(m)].astype(np.uint8))
                                        for sid, n, m in block]))
    write_manifest(out, {"kind": "packed", "parameters": {"block_size": 8}, "counts": {}})
    s = collect_stats(out)
    assert s["totals"]["rows"] == 5 and s["totals"]["tokens"] == 34 and s["totals"]["loss_tokens"] == 25
    assert s["packing"] == {"blocks": 5, "block_size": 8, "efficiency": round(34 / 40, 6)}
    assert dict(zip(s["lengths"]["values"], s["lengths"]["counts"])) == {2: 1, 3: 1, 4: 3, 5: 1, 6: 2}
    # x has 3 windows, y 2, w 2 (indices 0 and 2), z 1
    assert s["windows_per_conversation"]["histogram"] == {1: 1, 2: 2, 3: 1}
    assert s["windows_per_conversation"]["conversations"] == 4
    assert s["supervised_fraction"]["histogram"][int(3 * 50 // 8)] == 1  # block 0: 3 of 8


def test_store_stats_and_cli_json_and_png(tmp_path):
    store = FeatureStore.create(tmp_path / "s.zarr", n_blocks=2, block_size=8, max_segments=3, layers=[1],
                                hidden_size=4, vocab_size=16, verifier={"name_or_path": "tiny"})
    store.write_tokens(0, np.arange(7), [0, 1, 1, 0, 0, 1, 1], [0, 1, 2, 0, 1, 2, 3], [0, 3, 7])
    store.write_tokens(1, np.arange(8), [1] * 8, np.arange(8), [0, 8])
    store.write_all_n_tokens(np.array([7, 8]))
    s = collect_stats(tmp_path / "s.zarr")
    assert s["totals"]["tokens"] == 15 and s["totals"]["loss_tokens"] == 12 and s["totals"]["blocks_done"] == 0
    assert dict(zip(s["lengths"]["values"], s["lengths"]["counts"])) == {3: 1, 4: 1, 8: 1}
    assert s["segments_per_block"] == {1: 1, 2: 1} and s["packing"]["efficiency"] == round(15 / 16, 6)
    png = tmp_path / "s.png"
    r = CliRunner().invoke(main, ["stats", str(tmp_path / "s.zarr"), "--json", "--png", str(png)])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["totals"]["loss_tokens"] == 12
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_text_and_bad_path(tmp_path):
    table = _tokenized_table(tmp_path / "tok", [("a:1", 4, 2, 0)])
    r = CliRunner().invoke(main, ["stats", str(table)])
    assert r.exit_code == 0 and "conversations 1  tokens 4  supervised tokens 2" in r.output
    (tmp_path / "empty").mkdir()
    r = CliRunner().invoke(main, ["stats", str(tmp_path / "empty")])
    assert r.exit_code == 2 and "not a token table" in r.output
    s = collect_stats(table)
    plot_stats(s, tmp_path / "t.png")  # no windows, one source: still a picture
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_stats_plot_draws_no_empty_or_one_bar_panel(tmp_path, monkeypatch):
    # issue 34 item 4: stats.png showed an empty "sources" panel and a one-bar windows panel
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from peagle_data.inspect.stats_plot import panels

    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    one = collect_stats(_tokenized_table(tmp_path / "one", [("a.jsonl:1", 4, 2, 0), ("a.jsonl:2", 6, 3, 0)]))
    one["windows_per_conversation"] = {"histogram": {1: 2}}
    drawn, notes = panels(one)
    assert [f.__name__ for f in drawn] == ["_plot_lengths", "_plot_fractions"]
    assert notes == ["windows per conversation: 1 for all 2", "one source: a.jsonl"]
    plot_stats(one, tmp_path / "one.png")
    assert len(figs[-1].axes) == 2 and "one source: a.jsonl" in figs[-1]._suptitle.get_text()
    two = collect_stats(_tokenized_table(tmp_path / "two", [("a.jsonl:1", 4, 2, 0), ("b.jsonl:1", 6, 3, 0)]))
    two["windows_per_conversation"] = {"histogram": {1: 1, 3: 1}}
    drawn, notes = panels(two)
    assert [f.__name__ for f in drawn] == ["_plot_lengths", "_plot_fractions", "_plot_windows", "_plot_sources"]
    plot_stats(two, tmp_path / "two.png")
    assert [ax.get_title() for ax in figs[-1].axes][2:] == ["windows", "sources"]


def test_stats_plot_title_repeats_no_word(tmp_path):
    # a new user's pack output named "packed" was titled "packed (packed)"
    from peagle_data.inspect.stats_plot import plot_title

    s = collect_stats(_tokenized_table(tmp_path / "tokenized", [("a.jsonl:1", 4, 2, 0), ("a.jsonl:2", 6, 3, 0)]))
    assert plot_title(s) == "tokenized (tokenize output): 2 conversations, 10 tokens, 50.0% supervised"
    assert plot_title({**s, "path": str(tmp_path / "packed"), "kind": "packed"}).startswith(
        "packed (pack output): 2 blocks, ")
    assert format_stats(s).splitlines()[0] == f"{tmp_path / 'tokenized'}  (tokenize output)"  # the text alike


def test_per_turn_rows_of_a_split_conversation_are_one_conversation(tmp_path):
    # A history-rewriting template's per-turn rows (source a.jsonl:1 twice) each hold the history:
    # one conversation of 30 tokens (its longest row) supervising 4 + 6 tokens, not two conversations.
    rows = [("a.jsonl:1", 12, 4, 0), ("a.jsonl:1", 30, 6, 0), ("a.jsonl:2", 8, 8, 0)]
    table = _tokenized_table(tmp_path / "tok", rows)
    manifest = json.loads((table / "manifest.json").read_text())
    manifest["counts"]["history_rewrite_rows"] = 2
    (table / "manifest.json").write_text(json.dumps(manifest))
    s = collect_stats(table)
    assert s["totals"] == {"rows": 2, "tokens": 50, "loss_tokens": 18, "supervised_fraction": round(18 / 50, 6),
                           "table_rows": 3}
    assert s["lengths"]["values"] == [8, 30] and s["lengths"]["counts"] == [1, 1]
    hist = s["supervised_fraction"]["histogram"]
    assert hist[49] == 1 and hist[10 * 50 // 30] == 1 and sum(hist) == 2
    assert s["sources"] == [{"source": "a.jsonl", "rows": 2, "tokens": 50, "loss_tokens": 18, "token_share": 1.0,
                             "loss_share": 1.0}]
    r = CliRunner().invoke(main, ["stats", str(table)])
    assert "conversations 2  tokens 50" in r.output and "(in 3 per-turn rows" in r.output
    empty = _tokenized_table(tmp_path / "empty", [])
    r = CliRunner().invoke(main, ["stats", str(empty)])
    assert r.exit_code == 0 and "tokens per conversation: none (the table is empty)" in r.output


def test_full_context_store_stats_report_the_context_part(tmp_path, smollm2_tokenizer, tiny_verifier_dir):
    packed = pack_conversations(tmp_path, smollm2_tokenizer)
    base = dict(packed=str(packed), verifier=str(tiny_verifier_dir), layers=[1], device="cpu", context="full",
                max_context=128)
    run_extract(ExtractConfig(**base, output=str(tmp_path / "f.zarr")), progress=False, log=lambda m: None)
    run_extract(ExtractConfig(**base, output=str(tmp_path / "s1.zarr"), num_shards=2, shard_index=1), progress=False,
                log=lambda m: None)
    counts = TokenTable.open(packed).manifest["counts"]
    # the verifier runs each conversation of at most 128 tokens once (up to the last token a window reads),
    # the one of 145 as two pieces of 128
    lengths = sorted(window_ends(packed).values())
    assert lengths[-2:] == [127, 145]
    extracted = sum(n for n in lengths if n <= 128) + 2 * 128
    r = CliRunner().invoke(main, ["stats", str(tmp_path / "f.zarr"), "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.output)
    assert (s["totals"]["rows"], s["totals"]["tokens"], s["totals"]["loss_tokens"], s["totals"]["blocks_done"]) == \
        (counts["n_blocks"], counts["tokens"], counts["loss_tokens"], counts["n_blocks"])  # the training blocks
    assert s["contexts"] == {
        "blocks": 7, "blocks_done": 7, "block_size": 128, "tokens_extracted": extracted,
        "tokens_extracted_per_supervised_token": round(extracted / counts["loss_tokens"], 6),
        "packing_efficiency": round(extracted / (7 * 128), 6), "max_context": 128, "conversations": 8,
        "conversations_split": 1}
    r = CliRunner().invoke(main, ["stats", str(tmp_path / "f.zarr")])
    assert r.exit_code == 0 and (
        f"full context: 7 context blocks x 128 (7 done)  tokens extracted {extracted:,} "
        f"({round(extracted / counts['loss_tokens'], 6)} per supervised token)  conversations 8 (1 longer than "
        "--max-context 128, split)") in r.output, r.output
    s = collect_stats(tmp_path / "s1.zarr")
    assert s["totals"]["blocks_done"] is None and s["totals"]["tokens"] == counts["tokens"]
    assert s["contexts"]["shard"] == {"num_shards": 2, "shard_index": 1, "context_blocks": 7}
    assert (s["contexts"]["blocks"], s["contexts"]["tokens_extracted_per_supervised_token"]) == (3, None)
    assert s["contexts"]["tokens_extracted"] == int(FeatureStore.open(tmp_path / "s1.zarr").contexts.n_tokens)
    assert "3 context blocks x 128 (3 done; shard 1 of 2, 7 in the run)" in format_stats(s)
