"""Progress bars print token counts as readable integers (issue 16: ``tokens=2e+4``)."""

from __future__ import annotations

import io

import pyarrow.parquet as pq
from tqdm import tqdm

import peagle_data.extract.run as extract
from tests.peagle_data.extract.test_run import write_packed


def test_tqdm_prints_a_round_count_as_2e_4():  # why counts are passed as formatted strings
    for value, shown in ((20000, "tokens=2e+4"), ("20,000", "tokens=20,000")):
        stream = io.StringIO()
        with tqdm(total=1, file=stream, mininterval=0) as bar:
            bar.set_postfix(tokens=value)
        assert shown in stream.getvalue()


def test_extract_bar_shows_the_whole_token_count(tmp_path, tiny_verifier_dir, monkeypatch):
    postfixes = []

    class Bar(tqdm):
        def set_postfix(self, ordered_dict=None, refresh=True, **kwargs):
            postfixes.append(kwargs)
            super().set_postfix(ordered_dict, refresh, **kwargs)

    monkeypatch.setattr(extract, "progress_bar", lambda *a, **kw: Bar(*a, **{**kw, "file": io.StringIO()}))
    packed = write_packed(tmp_path / "packed", n_blocks=2, block_size=48)
    extract.run_extract(extract.ExtractConfig(packed=str(packed), verifier=str(tiny_verifier_dir),
                                              output=str(tmp_path / "f.zarr"), layers=[1], context="window"))
    n = pq.read_table(next(packed.glob("part-*.parquet")), columns=["n_tokens"]).column("n_tokens").to_pylist()
    assert postfixes == [{"tokens": f"{n[0]:,}"}, {"tokens": f"{n[0] + n[1]:,}"}]


def test_extract_in_a_log_ends_with_its_final_line(tmp_path, tiny_verifier_dir, capsys):
    # issue 34 item 6: a short run ended at 19/20 with no final line; now one line at the end
    packed = write_packed(tmp_path / "packed", n_blocks=3, block_size=48)
    extract.run_extract(extract.ExtractConfig(packed=str(packed), verifier=str(tiny_verifier_dir),
                                              output=str(tmp_path / "f.zarr"), layers=[1], context="window"),
                        log=lambda m: None)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("extract")]
    assert len(lines) == 1 and lines[0].startswith("extract: done: 3/3 block in ") and ", tokens=" in lines[0]
