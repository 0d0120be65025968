"""A feature store given where a token table is read, and a token table where a store is read: every
command says what the path is and which command takes it (never "not a peagle table" about a store)."""

from __future__ import annotations

from click.testing import CliRunner

from tests.peagle_data.extract.test_run import write_packed

STORE_HINT = ("is a feature store (zarr.json), not a token table: this command reads tokenize or pack outputs. A "
              "feature store is read by `peagle-data inspect`, `verify` and `stats`, and by `peagle-train --store` "
              "and `peagle-eval --store`")


def _store(path) -> str:
    from stores.features.feature_store import FeatureStore

    FeatureStore.create(str(path), n_blocks=1, block_size=8, max_segments=1, layers=[1, 2, 3], hidden_size=64,
                        vocab_size=49152, verifier={"name_or_path": "tiny"})
    return str(path)


def _error(result) -> str:
    return " ".join(result.stderr.split())


def test_a_store_where_a_table_is_read_says_it_is_a_feature_store(tmp_path):
    from cli.data import main

    store = _store(tmp_path / "features.zarr")
    for args in (["show", store], ["extract", store, "--verifier", "tiny", "--output", str(tmp_path / "x.zarr")]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code != 0 and f"Error: {store} {STORE_HINT}" in _error(result), (args, result.output)
    result = CliRunner().invoke(main, ["pack", store, "--tokenizer", "smollm2-135m", "--output", str(tmp_path / "p")])
    assert result.exit_code != 0 and (
        f"input {store!r} is a feature store (zarr.json), not a conversation file or a tokenize output; feature "
        "stores are read by `peagle-data inspect`, `verify`, `stats` and `peagle-train --store`") in _error(result)


def test_a_packed_table_where_a_store_is_read_points_to_extract(tmp_path, tiny_verifier):
    from cli.eval import main as eval_main
    from cli.train import main as train_main
    from peagle_train.model.checkpoint import save_drafter
    from tests.peagle_train.generate.test_speculative import tiny_drafter

    packed = str(write_packed(tmp_path / "packed", n_blocks=1, block_size=24))
    hint = (f"{packed} is a packed token table (manifest.json), not a feature store: extract its features first "
            f"with `peagle-data extract {packed} --verifier MODEL --output STORE`, then pass STORE")
    result = CliRunner().invoke(train_main, ["--store", packed, "--output", str(tmp_path / "out")])
    assert result.exit_code == 2 and f"Error: {hint}" in _error(result), result.output
    save_drafter(tiny_drafter(tiny_verifier), tmp_path / "drafter")
    result = CliRunner().invoke(eval_main, ["--drafter", str(tmp_path / "drafter"), "--store", packed])
    assert result.exit_code == 2 and f"Error: {hint}" in _error(result), result.output
