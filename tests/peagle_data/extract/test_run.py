"""run_extract on a packed table: store contents, resume after SIGKILL, mismatch errors, 2 ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from peagle_data.extract.config import ExtractConfig, check_layers, resolve_layers
from peagle_data.extract.run import run_extract
from peagle_data.prepare.config import PackConfig, PackRun
from peagle_data.prepare.pack import run_pack
from stores.errors import DiskSpaceError, InputError, OutputExistsError, StoreMismatchError
from stores.features.feature_repair import verify_store
from stores.features.feature_store import FeatureStore
from runtime.model_identity import model_fingerprint, model_identity
from stores.staging import prepare_output_dir
from stores.tables.token_tables import TableWriter, write_manifest
from tests.peagle_data.prepare.test_mixtures import conv, write_jsonl

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests"))
from families import hidden_states_as_stored  # noqa: E402
from processes import kill_runs  # noqa: E402


def write_packed(directory: Path, n_blocks: int, block_size: int, seed: int = 0) -> Path:
    """A packed table of random blocks (2-3 segments each, each its own conversation key) written through
    stores.tables.token_tables, without a conversations sub-table: extract it with ``--context window`` (format 1; the default, full, refuses it)."""
    rng = np.random.default_rng(seed)
    prepare_output_dir(directory, force=True)
    with TableWriter(directory, "packed") as w:
        for b in range(n_blocks):
            lengths = rng.integers(4, block_size // 3, size=rng.integers(2, 4))
            ids = rng.integers(3, 49152, size=int(lengths.sum()), dtype=np.int32)
            mask = (rng.random(int(lengths.sum())) < 0.6).astype(np.uint8)
            pos = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
            cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            w.write({"block_id": b, "input_ids": ids, "loss_mask": mask, "position_ids": pos,
                     "cu_seqlens": cu, "segment_ids": [f"c{b}#{k}" for k in range(len(lengths))],
                     "n_tokens": int(lengths.sum()),
                     "segment_keys": [1000 * seed + 10 * b + k for k in range(len(lengths))]})
    write_manifest(directory, {"kind": "packed", "inputs": [f"random-seed-{seed}"],
                               "parameters": {"block_size": block_size},
                               "tokenizer": {"name_or_path": "smollm2-135m"}})
    return directory


def pack_conversations(directory: Path, tokenizer, max_seq_len: int = 64) -> Path:
    """A packed table (``pack --max-seq-len 64``, SmolLM2 chat template) of 8 conversations of 40-145
    tokens, 5 of them cut into windows (20 blocks), with its conversations sub-table (``--context full``)."""
    directory.mkdir(parents=True, exist_ok=True)
    rows = [conv(i, "s", answer=("long answer " * (i % 7) * 9) or None) for i in range(8)]
    inputs = write_jsonl(directory / "conversations.jsonl", rows)
    run_pack(PackRun(inputs=[inputs], tokenizer="smollm2-135m", output=directory / "packed",
                     settings=PackConfig(max_seq_len=max_seq_len)), tokenizer=tokenizer)
    return directory / "packed"


def window_ends(packed: Path) -> dict[str, int]:
    """Conversation id -> the end of its windows' last token in it (``segment_starts + n - prefix_len``,
    the most over its windows): the tokens ``--context full`` runs of it."""
    from stores.tables.token_tables import TokenTable

    ends: dict[str, int] = {}
    for r in TokenTable.open(packed).iter_rows(["cu_seqlens", "segment_ids", "segment_prefix_lens", "segment_starts"]):
        for k, sid in enumerate(r["segment_ids"]):
            cid, n = sid.rpartition("#")[0], int(r["cu_seqlens"][k + 1] - r["cu_seqlens"][k])
            ends[cid] = max(ends.get(cid, 0), int(r["segment_starts"][k]) + n - int(r["segment_prefix_lens"][k]))
    return ends


def chunk_bytes(store: Path) -> dict[str, bytes]:
    """Every file of the store, byte for byte; the group's zarr.json without the ``config`` attribute,
    the record of the command line that made the store (another --output, --resume: another record)."""
    import json

    files = {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("*")) if p.is_file()}
    meta = json.loads(files["zarr.json"])
    meta["attributes"]["peagle"].pop("config", None)
    files["zarr.json"] = json.dumps(meta, sort_keys=True).encode()
    return files


def test_store_matches_packed_table_and_verifies(tmp_path, tiny_verifier_dir, tiny_verifier):
    packed = write_packed(tmp_path / "packed", n_blocks=3, block_size=48)
    summary = run_extract(ExtractConfig(packed=str(packed), verifier=str(tiny_verifier_dir), context="window",
                                        output=str(tmp_path / "f.zarr"), layers=[1, 2, 3]), progress=False)
    assert summary["complete"] and summary["training_blocks_done_this_run"] == 3
    # the verifier ran the training blocks themselves: no context block counts (issue 34 finding: the JSON mixed them)
    assert {k: summary[k] for k in ("context", "training_blocks", "training_blocks_done", "context_blocks",
                                    "context_blocks_done", "context_blocks_done_this_run")} == {
        "context": None, "training_blocks": 3, "training_blocks_done": 3, "context_blocks": None,
        "context_blocks_done": None, "context_blocks_done_this_run": None}
    assert summary["verifier_tokens_this_run"] == summary["training_tokens"] > 0
    t = summary["timings"]  # the hf engine splits nothing of its own
    assert set(t) == {"engine_open_s", "store_open_s", "blocks_s", "engine_s", "store_write_s", "writer_wait_s"}
    assert t["engine_open_s"] > 0 and t["store_write_s"] > 0 and t["engine_s"] > 0
    assert t["engine_s"] + t["writer_wait_s"] <= t["blocks_s"] + 1e-3  # both within the blocks' time (rounding)
    store = FeatureStore.open(tmp_path / "f.zarr")
    assert store.layers == [1, 2, 3] and store.attrs["layer_convention"] == "vllm_aux"
    assert store.attrs["verifier"]["num_hidden_layers"] == 4
    identity = model_identity(tiny_verifier_dir)  # the store records the verifier's identity by part
    assert store.attrs["verifier"]["identity"] == identity and set(identity) == {"weights", "config", "tokenizer",
                                                                              "chat_template"}
    assert store.attrs["verifier"]["fingerprint"] == model_fingerprint(tiny_verifier_dir)
    b = store.read_block(1)
    with torch.no_grad():  # first segment alone through the verifier
        lo, hi = int(b.cu_seqlens[0]), int(b.cu_seqlens[1])
        out = tiny_verifier(b.input_ids[lo:hi][None], output_hidden_states=True)
    torch.testing.assert_close(b.aux_hidden[lo:hi, 0].float(), out.hidden_states[1][0].to(torch.bfloat16).float(),
                               atol=2e-2, rtol=2e-2)
    freq = store.token_freq()
    assert freq.sum() == sum(int(store.read_block(i).loss_mask.sum()) for i in range(3))
    assert verify_store(tmp_path / "f.zarr")["ok"]
    with pytest.raises(OutputExistsError):
        run_extract(ExtractConfig(packed=str(packed), verifier=str(tiny_verifier_dir), context="window",
                                  output=str(tmp_path / "f.zarr")), progress=False)


def test_resume_refuses_other_layers_or_table(tmp_path, tiny_verifier_dir):
    packed = write_packed(tmp_path / "packed", n_blocks=2, block_size=32)
    out = str(tmp_path / "f.zarr")
    run_extract(ExtractConfig(packed=str(packed), verifier=str(tiny_verifier_dir), output=out, layers=[1, 2],
                              max_blocks=1, context="window"), progress=False)
    with pytest.raises(StoreMismatchError, match="layers"):
        run_extract(ExtractConfig(packed=str(packed), verifier=str(tiny_verifier_dir), output=out, layers=[1, 3],
                                  resume=True, context="window"), progress=False)
    other = write_packed(tmp_path / "other", n_blocks=2, block_size=32, seed=1)
    with pytest.raises(StoreMismatchError, match="packed table"):
        run_extract(ExtractConfig(packed=str(other), verifier=str(tiny_verifier_dir), output=out, layers=[1, 2],
                                  resume=True, context="window"), progress=False)
    s = run_extract(ExtractConfig(packed=str(packed), verifier=str(tiny_verifier_dir), output=out, layers=[1, 2],
                                  resume=True, context="window"), progress=False)
    assert s["training_blocks_done_this_run"] == 1 and s["complete"]  # the done block is not recomputed


def test_resume_compares_the_verifier_by_part_or_an_older_stores_whole_file_fingerprint(tmp_path, tiny_verifier_dir):
    """A resume with the store's verifier name but other content is refused naming the part; a store that
    records no identity (made before it was recorded) resumes with the directory it was extracted with."""
    import shutil

    from runtime.model_identity import legacy_model_fingerprint

    v = shutil.copytree(tiny_verifier_dir, tmp_path / "v")
    packed = write_packed(tmp_path / "packed", n_blocks=2, block_size=32)
    cfg = dict(packed=str(packed), verifier=str(v), output=str(tmp_path / "f.zarr"), layers=[1, 2], context="window")
    run_extract(ExtractConfig(**cfg, max_blocks=1), progress=False)
    template = (v / "chat_template.jinja").read_text()
    (v / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    with pytest.raises(StoreMismatchError, match=r"another model than .* \(differs in chat template \(default\)"):
        run_extract(ExtractConfig(**cfg, resume=True), progress=False)
    (v / "chat_template.jinja").write_text(template)
    store = FeatureStore.open(cfg["output"], mode="r+")
    older = {k: x for k, x in store.attrs["verifier"].items() if k != "identity"}
    store.update_attrs(verifier={**older, "fingerprint": legacy_model_fingerprint(v)})
    s = run_extract(ExtractConfig(**cfg, resume=True), progress=False)
    assert s["training_blocks_done_this_run"] == 1 and s["complete"]


def test_resume_keeps_every_option_the_store_fixes(tmp_path, tiny_verifier_dir):
    """A zstd store resumes with --compressor zstd into the store an uninterrupted run writes; without
    it (the default, none) the resume is refused naming the option and both values, never continued
    with the store's codec in silence."""
    from stores.errors import InputError

    packed = write_packed(tmp_path / "packed", n_blocks=3, block_size=32)
    base = dict(packed=str(packed), verifier=str(tiny_verifier_dir), layers=[1, 2], device="cpu", compressor="zstd",
                context="window")
    run_extract(ExtractConfig(**base, output=str(tmp_path / "whole.zarr")), progress=False, log=lambda m: None)
    out = str(tmp_path / "f.zarr")
    run_extract(ExtractConfig(**base, output=out, max_blocks=1), progress=False, log=lambda m: None)
    with pytest.raises(InputError) as e:
        run_extract(ExtractConfig(**{**base, "compressor": None}, output=out, resume=True), progress=False,
                    log=lambda m: None)
    assert "which a resume cannot change: --compressor: the store's zstd, given none." in str(e.value)
    s = run_extract(ExtractConfig(**base, output=out, resume=True, max_blocks=5), progress=False, log=lambda m: None)
    assert s["training_blocks_done_this_run"] == 2 and s["complete"]
    a, b = FeatureStore.open(out), FeatureStore.open(tmp_path / "whole.zarr")
    assert a.attrs["compressor"] == "zstd" and not a.raw_chunks
    for i in range(3):
        x, y = a.read_block(i), b.read_block(i)
        assert torch.equal(x.aux_hidden, y.aux_hidden) and torch.equal(x.final_hidden, y.final_hidden)


def _extract_cmd(packed, verifier, out, *extra):
    return [sys.executable, "-m", "cli.data_extract", str(packed), "--verifier", str(verifier),
            "--output", str(out), "--layers", "1,2,3", "--device", "cpu", *extra]


@pytest.mark.slow  # several subprocesses, each importing torch and transformers
def test_sigkill_then_resume_is_byte_identical(tmp_path, tiny_verifier_dir):
    packed = write_packed(tmp_path / "packed", n_blocks=40, block_size=256)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    ref = tmp_path / "ref.zarr"
    run_extract(ExtractConfig(packed=str(packed), verifier=str(tiny_verifier_dir), output=str(ref),
                              layers=[1, 2, 3], device="cpu", context="window"), progress=False)
    out = tmp_path / "out.zarr"
    kills = kill_runs(lambda resume: _extract_cmd(packed, tiny_verifier_dir, out, "--context", "window",
                                                  *(["--resume"] if resume else [])),
                      env, out / "done", out)
    assert kills >= 2
    done_before = int(FeatureStore.open(out).done_mask().sum()) if (out / "zarr.json").exists() else 0
    res = subprocess.run(_extract_cmd(packed, tiny_verifier_dir, out, "--context", "window", "--resume"), check=True,
                         env=env,
                         capture_output=True, text=True)
    assert f'"training_blocks_done_this_run": {40 - done_before}' in res.stdout
    assert chunk_bytes(out) == chunk_bytes(ref)
    assert verify_store(out)["ok"]


def _one_and_two_ranks(tmp_path, packed, verifier_dir, *extra) -> list[dict]:
    """Extract ``packed`` in one process (``one.zarr``) and in two CPU ranks (``two.zarr``); returns the
    two ranks' summaries, rank 0 first."""
    import json

    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    one = tmp_path / "one.zarr"
    subprocess.run(_extract_cmd(packed, verifier_dir, one, *extra), check=True, env=env, capture_output=True)
    two = tmp_path / "two.zarr"
    # `accelerate launch --cpu --num_processes 2` would start ONE process; torchrun (what accelerate's
    # --multi_gpu runs) starts two, and PartialState(cpu=True) joins them on gloo; each rank's stdout
    # goes to its own file under logs/
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
              "--redirects", "1", "--log-dir", str(tmp_path / "logs"), "-m",
              *_extract_cmd(packed, verifier_dir, two, *extra)[2:]]
    res = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    logs = sorted((tmp_path / "logs").rglob("stdout.log"))
    summaries = sorted((json.loads(p.read_text()[p.read_text().index("{"):]) for p in logs), key=lambda s: s["rank"])
    assert [(s["rank"], s["world_size"]) for s in summaries] == [(0, 2), (1, 2)]
    assert all(s["complete"] for s in summaries)
    return summaries


def _without_config(store: Path) -> dict[str, bytes]:
    """:func:`chunk_bytes` of the store and its ``contexts`` sub-store (the record of the command line
    that made them left out of both)."""
    files = chunk_bytes(store)
    files.update({f"contexts/{k}": v for k, v in chunk_bytes(store / "contexts").items()})
    return files


@pytest.mark.slow  # two gloo ranks, each importing torch and transformers
def test_two_cpu_ranks_equal_one_process(tmp_path, tiny_verifier_dir):
    packed = write_packed(tmp_path / "packed", n_blocks=6, block_size=64)
    summaries = _one_and_two_ranks(tmp_path, packed, tiny_verifier_dir, "--context", "window")
    assert [s["training_blocks_done_this_run"] for s in summaries] == [3, 3]  # round-robin: 0, 2, 4 and 1, 3, 5
    assert chunk_bytes(tmp_path / "two.zarr") == chunk_bytes(tmp_path / "one.zarr")


@pytest.mark.slow  # two gloo ranks, each importing torch and transformers
def test_two_cpu_ranks_of_a_full_context_extraction_equal_one_process(tmp_path, smollm2_tokenizer,
                                                                      tiny_verifier_dir):
    """Rank 0 creates the full-context store; the ranks split its 7 context blocks round-robin."""
    packed = pack_conversations(tmp_path, smollm2_tokenizer)
    summaries = _one_and_two_ranks(tmp_path, packed, tiny_verifier_dir, "--max-context", "128")  # the default: full
    assert [s["context_blocks_done_this_run"] for s in summaries] == [4, 3]  # context blocks 0, 2, 4, 6 and 1, 3, 5
    assert [(s["context_blocks"], s["training_blocks_done"], s["training_blocks"]) for s in summaries] == [(7, 20, 20)] * 2
    assert _without_config(tmp_path / "two.zarr") == _without_config(tmp_path / "one.zarr")
    assert verify_store(tmp_path / "two.zarr")["ok"]


def test_bad_device_and_wrong_verify_table_are_clear_errors(tmp_path, tiny_verifier_dir):
    from click.testing import CliRunner

    from cli.data_extract import extract, verify
    from stores.errors import InputError

    packed = write_packed(tmp_path / "packed", n_blocks=2, block_size=32)
    with pytest.raises(InputError, match="--device"):
        run_extract(ExtractConfig(packed=str(packed), verifier=str(tiny_verifier_dir),
                                  output=str(tmp_path / "x.zarr"), device="tpu"), progress=False)
    res = CliRunner().invoke(extract, [str(packed), "--verifier", str(tiny_verifier_dir), "--output",
                                       str(tmp_path / "y.zarr"), "--layers", ""])
    assert res.exit_code == 2 and "comma-separated integers" in res.output
    run_extract(ExtractConfig(packed=str(packed), verifier=str(tiny_verifier_dir), output=str(tmp_path / "f.zarr"),
                              layers=[1], context="window"), progress=False)
    other = write_packed(tmp_path / "other", n_blocks=2, block_size=32, seed=3)
    res = CliRunner().invoke(verify, [str(tmp_path / "f.zarr"), "--packed", str(other)])
    assert res.exit_code == 2 and "another packed table" in res.output


def test_model_fingerprint_tells_same_shape_models_apart(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from runtime.model_identity import model_fingerprint

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    for name, seed in (("a", 0), ("b", 1)):
        torch.manual_seed(seed)
        LlamaForCausalLM(cfg).save_pretrained(tmp_path / name)
    assert model_fingerprint(tmp_path / "a") != model_fingerprint(tmp_path / "b")
    assert model_fingerprint(tmp_path / "a") == model_fingerprint(tmp_path / "a")


def test_refuses_when_disk_is_short_unless_forced(tmp_path, tiny_verifier_dir, monkeypatch):
    import collections
    import shutil

    packed = write_packed(tmp_path / "packed", n_blocks=2, block_size=32)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 100, 100))
    with pytest.raises(DiskSpaceError) as e:
        run_extract(ExtractConfig(packed=str(packed), verifier=str(tiny_verifier_dir), context="window",
                                  output=str(tmp_path / "f.zarr"), layers=[1]), progress=False)
    assert "already exists" not in str(e.value)  # not an "output exists" error (it does not)
    assert str(e.value).startswith(f"{tmp_path / 'f.zarr'}: the store needs about ")
    assert str(e.value).endswith(" GiB but only 0.00 GiB are free; free disk or pass --force")
    assert not (tmp_path / "f.zarr").exists()
    s = run_extract(ExtractConfig(packed=str(packed), verifier=str(tiny_verifier_dir), context="window",
                                  output=str(tmp_path / "f.zarr"), layers=[1], force=True), progress=False)
    assert s["complete"]


@pytest.mark.slow  # converts the real SmolLM2-135M once (~45 s) into the cache
def test_real_smollm2_segments_equal_segments_alone():
    from runtime.model_cache import load_verifier

    verifier = load_verifier("smollm2-135m", device="cpu")
    torch.manual_seed(0)
    lengths = [9, 14, 6]
    segs = [torch.randint(10, 49152, (n,)) for n in lengths]
    cu = torch.tensor([0] + lengths).cumsum(0)
    from peagle_data.extract.hf_forward import verifier_features

    aux, final = verifier_features(verifier.model, torch.cat(segs), torch.cat([torch.arange(n) for n in lengths]),
                                   cu, [2, 15, 27, 30])
    for k, seg in enumerate(segs):
        hidden, out = hidden_states_as_stored(verifier, input_ids=seg[None])  # [30]: before the final norm
        lo, hi = int(cu[k]), int(cu[k + 1])
        for j, layer in enumerate([2, 15, 27, 30]):
            want = hidden[layer][0].to(torch.bfloat16).float()
            torch.testing.assert_close(aux[lo:hi, j].float(), want, atol=0.05 * float(want.abs().max()), rtol=0.02)
        logits = verifier.lm_head(final[lo:hi].float())
        assert torch.equal(logits.argmax(-1), out.logits[0].argmax(-1))


def test_layers_out_of_increasing_order_are_refused_naming_the_order_vllm_feeds():
    """vLLM captures the aux layers as sorted(set(ids)): a store of 15,2,27 would train the drafter's fc on
    inputs in another order than vLLM serves them."""
    with pytest.raises(InputError) as e:
        check_layers([15, 2, 27], 30)
    assert str(e.value) == ("field '--layers': --layers: 15,2,27 is not increasing; vLLM feeds the aux layers in "
                            "increasing order: give --layers 2,15,27")
    assert check_layers([2, 15, 27], 30) == [2, 15, 27]


WHAT = (" (0 the embedding output, the first decoder layer's input; k the output of decoder layer k counted from 1, "
        "so 30 the last one's, before the final norm)")
"""What the indices mean (docs/design.md "Layers"; issue 44 item 11: the message once gave 0..30 alone)."""


@pytest.mark.parametrize("given, L, message", [
    ([2, 15, -1], 30, "layers [-1] out of range: the verifier has 30 decoder layers, valid indices are 0..30" + WHAT + " (indices count "
                      "from 0, not from the end: -1 would be 30): give --layers 2,15,30"),
    ([-1, 2, 15], 30, "layers [-1] out of range: the verifier has 30 decoder layers, valid indices are 0..30" + WHAT + " (indices count "
                      "from 0, not from the end: -1 would be 30): give --layers 2,15,30"),
    ([2, 30, -1], 30, "layers [-1] out of range: the verifier has 30 decoder layers, valid indices are 0..30" + WHAT + " (indices count "
                      "from 0, not from the end: -1 would be 30)"),  # 30 twice: no --layers fixes it for the user
    ([40, 2], 30, "layers [40] out of range: the verifier has 30 decoder layers, valid indices are 0..30" + WHAT),
    ([5, 2, -40], 30, "layers [-40] out of range: the verifier has 30 decoder layers, valid indices are 0..30" + WHAT),
])
def test_every_layers_suggestion_is_accepted(given, L, message):
    """Issue 33, kind 9: ``--layers 2,15,-1`` once said "give --layers -1,2,15", which the range check then
    refused. A message names a --layers only when that one passes every check."""
    with pytest.raises(InputError) as e:
        check_layers(given, L)
    assert str(e.value) == f"field '--layers': {message}"
    if "give --layers" in message:
        assert check_layers([int(x) for x in message.rsplit(" ", 1)[1].split(",")], L)
    assert ExtractConfig(packed="p", verifier="v", output="o", layers=given).layers == given  # checked once L is known


def _extract_cli(packed: Path, verifier: Path, out: Path, *extra):
    """``peagle-data extract`` in this process (sys.argv set as the console script's, for the resume command)."""
    from unittest import mock

    from click.testing import CliRunner

    from cli.data_extract import extract

    args = [str(a) for a in (packed, "--verifier", verifier, "--output", out, "--context", "window",
                             "--layers", "1,2,3", *extra)]
    with mock.patch.object(sys, "argv", ["peagle-data extract", *args]):
        return CliRunner().invoke(extract, args, prog_name="peagle-data extract")


def _leftovers(store: Path) -> list[str]:
    """zarr's temporary files and the empty directories in ``store``."""
    return sorted(str(p.relative_to(store)) for p in store.rglob("*")
                  if p.name.endswith(".partial") or (p.is_dir() and not any(p.iterdir())))


def test_a_full_disk_mid_extraction_is_one_line_and_leaves_nothing_half_written(tmp_path, tiny_verifier_dir,
                                                                               monkeypatch):
    """Issue 44 item 9: a full disk in the middle of the writes ended in a raw OSError traceback and left an empty
    temporary file in the store. Fault injection on zarr's local write (ENOSPC from block 3's aux_hidden chunk,
    with the empty NAME.<uuid>.partial zarr opened for it left behind): one error line naming the disk, its free
    bytes and the resume command; exit code 2; the failed block's files removed; --resume then finishes."""
    import errno
    import uuid

    import zarr.storage._local as local

    packed = write_packed(tmp_path / "packed", n_blocks=6, block_size=48)
    out = tmp_path / "f.zarr"
    real_put = local._put

    def full_disk_put(path, value, exclusive=False):
        if f"aux_hidden{os.sep}c{os.sep}3{os.sep}" in str(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.with_suffix(f".{uuid.uuid4().hex}.partial").touch()  # as zarr's open leaves it
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_put(path, value, exclusive=exclusive)

    monkeypatch.setattr(local, "_put", full_disk_put)
    result = _extract_cli(packed, tiny_verifier_dir, out)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("Error")]
    mount = Path(out)
    while not os.path.ismount(mount):
        mount = mount.parent
    assert len(lines) == 1 and lines[0].startswith(f"Error: disk full: no space left on {mount} ("), lines
    assert " bytes free) while writing " in lines[0] and f"; kept: {out}: " in lines[0]
    assert lines[0].endswith(f"free space on {mount}, then resume with: peagle-data extract {packed} --verifier "
                             f"{tiny_verifier_dir} --output {out} --context window --layers 1,2,3 --resume"), lines[0]
    store = FeatureStore.open(out)
    assert not store.is_done(3) and _leftovers(out) == []
    assert not any(p.exists() for p in store.feature_chunk_paths(3))  # the failed block's chunks are gone
    monkeypatch.setattr(local, "_put", real_put)
    resumed = _extract_cli(packed, tiny_verifier_dir, out, "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert verify_store(out)["ok"] and FeatureStore.open(out).done_mask().all()


def test_a_full_tmpfs_mid_extraction(tmp_path, tiny_verifier_dir):
    """Item 9 on a real full disk: a 2 MiB tmpfs, full after about 22 of 40 blocks (skipped where this process
    may not mount one)."""
    import subprocess

    packed = write_packed(tmp_path / "packed", n_blocks=40, block_size=64)
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {(mounted.stderr or mounted.stdout).strip()}")
    try:
        out = disk / "f.zarr"
        result = _extract_cli(packed, tiny_verifier_dir, out, "--force")  # --force: past the projected size check
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert f"Error: disk full: no space left on {disk} (" in result.output, result.output
        assert result.output.rstrip().endswith(" --resume") and _leftovers(out) == [], result.output
        assert 0 < FeatureStore.open(out).done_mask().sum() < 40
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_resume_reads_the_verifier_config_and_opens_the_store_once(tmp_path, tiny_verifier_dir, monkeypatch):
    """The plan (plan_extract) keeps what it resolved and the later stages take it: one read of the verifier's
    config, one open of the store --resume continues, one read of the verifier's identity (docs/design.md §2)."""
    import peagle_data.extract.run as run_module
    from tests.peagle_data.extract.test_full_context import synthetic_conversations, write_packed_conversations

    packed = write_packed_conversations(tmp_path / "packed", synthetic_conversations(49152), 16, 32, "smollm2-135m")
    out = str(tmp_path / "f.zarr")
    base = dict(packed=str(packed), verifier=str(tiny_verifier_dir), output=out, layers=[1, 2], device="cpu",
                context="full", max_context=48)
    run_extract(ExtractConfig(**base, max_blocks=1), progress=False, log=lambda m: None)
    reads, opens, identities = [], [], []
    load, open_store, identity = run_module.load_model_config, FeatureStore.open.__func__, run_module.model_identity
    monkeypatch.setattr(run_module, "load_model_config", lambda name: reads.append(name) or load(name))
    monkeypatch.setattr(run_module, "model_identity", lambda d: identities.append(str(d)) or identity(d))
    monkeypatch.setattr(FeatureStore, "open", classmethod(
        lambda cls, path, mode="r": opens.append(str(path)) or open_store(cls, path, mode)))
    s = run_extract(ExtractConfig(**base, resume=True), progress=False, log=lambda m: None)
    assert s["complete"] and s["layers"] == [1, 2]
    assert reads == [str(tiny_verifier_dir)] and opens.count(out) == 1 and identities == [str(tiny_verifier_dir)]
    assert FeatureStore.open(out).attrs["verifier"]["identity"] == identity(tiny_verifier_dir)


def test_force_decides_once_what_it_replaces(tmp_path, tiny_verifier_dir, monkeypatch):
    """--force: whose the output is is decided once, before the weights load (stores.staging.ownership), and the
    store is then replaced without a second look at its files; without --force an existing output, an empty
    directory too, is refused before the weights load."""
    import transformers

    import stores.staging as staging
    from peagle_data.extract.run import plan_extract

    packed = write_packed(tmp_path / "packed", n_blocks=2, block_size=32)
    out = tmp_path / "f.zarr"
    base = dict(packed=str(packed), verifier=str(tiny_verifier_dir), output=str(out), layers=[1, 2], context="window")
    run_extract(ExtractConfig(**base), progress=False, log=lambda m: None)
    scans = []
    foreign_entries = staging.foreign_entries
    monkeypatch.setattr(staging, "foreign_entries", lambda path, *a: scans.append(Path(path)) or foreign_entries(path, *a))
    s = run_extract(ExtractConfig(**base, force=True), progress=False, log=lambda m: None)
    assert s["complete"] and scans == [out]
    empty = tmp_path / "empty"
    empty.mkdir()

    def no_weights(cls, *a, **k):
        raise AssertionError("the weights loaded before the output was refused")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(no_weights))
    with pytest.raises(OutputExistsError) as e:
        plan_extract(ExtractConfig(**{**base, "output": str(empty)}), log=lambda m: None)
    assert str(e.value) == f"output {empty} already exists; pass --resume to continue it or --force to overwrite it"


def test_resolve_layers_is_the_one_place_of_the_default():
    """``--layers`` checked against the verifier's L layers, or EAGLE-3's ``[2, L//2, L-3]`` when not given."""
    assert resolve_layers(None, 32) == [2, 16, 29] and resolve_layers(None, 36) == [2, 18, 33]
    assert resolve_layers([1, 3], 4) == [1, 3]
    with pytest.raises(InputError, match="layers \\[5\\] out of range: the verifier has 4 decoder layers"):
        resolve_layers([1, 5], 4)
