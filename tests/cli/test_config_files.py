"""``--config FILE`` and ``--print-config`` (cli/options.py): precedence, unknown keys, round trip,
and the help text generated from the config fields' docstrings."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from click.testing import CliRunner

from cli.options import field_docs
from cli.train import main as train_main
from peagle_train.train.config import GROUPS, ModelConfig, TrainConfig


def invoke(command, args):
    return CliRunner().invoke(command, [str(a) for a in args])


def printed(command, args) -> dict:
    result = invoke(command, [*args, "--print-config"])
    assert result.exit_code == 0, result.output
    return yaml.safe_load(result.stdout)


def test_the_command_line_overrides_the_file_and_the_file_the_defaults(tmp_path):
    cfg = tmp_path / "train.yaml"
    cfg.write_text("store: [a.zarr, b.zarr]\noutput: run\nnum_depths: 4\nlr: 0.01\nlazy-embedding: false\n")
    resolved = printed(train_main, ["--config", cfg, "--lr", "0.02", "--seed", "7"])
    data, model, optim, run = (resolved[g] for g in ("data", "model", "optim", "run"))
    assert data["store"] == ["a.zarr", "b.zarr"] and run["output"] == "run"
    assert model["num_depths"] == 4  # the file
    assert optim["lr"] == 0.02 and run["seed"] == 7  # the command line
    assert optim["lazy_embedding"] is False  # the file, by its option name
    assert optim["grad_clip"] == 1.0 and model["attention_backend"] == "auto"  # the defaults
    assert list(resolved) == list(GROUPS)  # printed by group
    assert {g: set(v) for g, v in resolved.items()} == {
        g: {f.name for f in dataclasses.fields(klass)} - {"resume", "force"} for g, klass in GROUPS.items()}


def test_a_toml_file_and_a_single_store(tmp_path):
    cfg = tmp_path / "train.toml"
    cfg.write_text('store = "one.zarr"\noutput = "run"\nmax_steps = 3\n')
    resolved = printed(train_main, ["--config", cfg])
    assert resolved["data"]["store"] == ["one.zarr"] and resolved["optim"]["max_steps"] == 3


def test_an_unknown_key_names_the_key_and_the_file(tmp_path):
    cfg = tmp_path / "train.yaml"
    cfg.write_text("store: a.zarr\noutput: run\nnum_depth: 4\n")
    result = invoke(train_main, ["--config", cfg])
    assert result.exit_code == 2
    assert f"{cfg}: unknown key 'num_depth'" in result.stderr and "num_depths" in result.stderr


@pytest.mark.parametrize("text,why", [("- a\n- b\n", "expected a mapping"), ("a: [\n", "while parsing")])
def test_a_bad_file_names_the_file(tmp_path, text, why):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    result = invoke(train_main, ["--config", cfg])
    assert result.exit_code == 2 and str(cfg) in result.stderr and why in result.stderr


def test_a_bad_value_in_the_file_is_a_usage_error(tmp_path):
    cfg = tmp_path / "train.yaml"
    cfg.write_text("store: a.zarr\noutput: run\nnum_depths: many\n")
    result = invoke(train_main, ["--config", cfg])
    assert result.exit_code == 2 and "--num-depths" in result.stderr and "many" in result.stderr


def test_print_config_round_trips(tmp_path):
    first = invoke(train_main, ["--store", "a.zarr", "--store", "b.zarr", "--output", "run", "--max-anchors", "5",
                                "--dense-embedding", "--report-to", "tensorboard", "--print-config"])
    assert first.exit_code == 0, first.output
    (tmp_path / "again.yaml").write_text(first.stdout)
    second = invoke(train_main, ["--config", tmp_path / "again.yaml", "--print-config"])
    assert second.exit_code == 0, second.output
    assert second.stdout == first.stdout
    assert yaml.safe_load(first.stdout)["data"]["max_anchors"] == 5


def test_the_file_reaches_the_run(tmp_path, monkeypatch):
    import cli.train

    seen = []
    monkeypatch.setattr(cli.train, "run_train", lambda cfg: seen.append(cfg) or {"rank": 0})
    cfg = tmp_path / "train.yaml"
    cfg.write_text("store: a.zarr\noutput: run\nnum_depths: 3\n")
    result = invoke(train_main, ["--config", cfg, "--seed", "5"])
    assert result.exit_code == 0, result.output
    assert seen == [TrainConfig.from_flat(store="a.zarr", output="run", num_depths=3, seed=5)]  # one store: its path


def test_help_is_the_field_docstring():
    docs = field_docs(ModelConfig)
    assert docs["num_layers"] == "Drafter decoder layers (``--num-layers``)."
    out = invoke(train_main, ["--help"]).output
    assert "Drafter decoder layers." in " ".join(out.split())


def test_extract_config_round_trip_with_its_converted_options(tmp_path, monkeypatch):
    """``--layers 2,5`` is a list in the file, ``--compressor none`` is None; both read back the same."""
    import cli.data_extract
    from cli.data import main as data_main
    from peagle_data.extract.config import ExtractConfig

    (tmp_path / "packed").mkdir()
    args = ["extract", tmp_path / "packed", "--verifier", "m", "--output", tmp_path / "s.zarr", "--layers", "2,5"]
    first = invoke(data_main, [*args, "--print-config"])
    assert first.exit_code == 0, first.output
    assert yaml.safe_load(first.stdout) == {
        "packed": str(tmp_path / "packed"), "verifier": "m", "output": str(tmp_path / "s.zarr"), "layers": [2, 5],
        "storage_dtype": "bf16", "compressor": None, "device": None,
        "attn_implementation": "auto", "num_shards": 1, "shard_index": 0, "engine": "hf",
        "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "server": None, "shared_storage": None,
        "concurrency": 16, "vllm_kv_cache_gib": None, "vllm_gpu_memory_utilization": None, "context": "full",
        "max_context": None, "context_packing": None}
    (tmp_path / "x.yaml").write_text(first.stdout)
    assert invoke(data_main, ["extract", "--config", tmp_path / "x.yaml", "--print-config"]).stdout == first.stdout
    seen = []
    monkeypatch.setattr(cli.data_extract, "run_extract", lambda cfg, log, config: seen.append((cfg, config)) or {})
    result = invoke(data_main, ["extract", "--config", tmp_path / "x.yaml", "--compressor", "zstd"])
    assert result.exit_code == 0, result.output
    assert seen == [(ExtractConfig(packed=str(tmp_path / "packed"), verifier="m", output=str(tmp_path / "s.zarr"),
                                   layers=[2, 5], compressor="zstd"),
                     {**yaml.safe_load(first.stdout), "compressor": "zstd"})]  # recorded in the store's attrs


def test_regenerate_config_round_trip_and_its_back_end_check(tmp_path):
    from cli.data import main as data_main

    args = ["regenerate", "in.jsonl", "--output", tmp_path / "o.jsonl", "--server", "http://a:1", "--server",
            "http://b:2", "--turns", "last"]
    first = invoke(data_main, [*args, "--print-config"])
    assert first.exit_code == 0, first.output
    resolved = yaml.safe_load(first.stdout)
    assert resolved["inputs"] == ["in.jsonl"] and resolved["server"] == ["http://a:1", "http://b:2"]  # the option name
    assert resolved["turns"] == "last" and resolved["concurrency"] == 8 and "chunk_rows" not in resolved
    (tmp_path / "r.toml").write_text('inputs = "in.jsonl"\nserver = ["http://a:1", "http://b:2"]\nturns = "last"\n'
                                     f'output = "{tmp_path / "o.jsonl"}"\n')
    assert invoke(data_main, ["regenerate", "--config", tmp_path / "r.toml", "--print-config"]).stdout == first.stdout
    both = invoke(data_main, ["regenerate", "--config", tmp_path / "r.toml", "--verifier", "m"])
    assert both.exit_code == 2 and "give exactly one of --verifier MODEL" in both.stderr


@pytest.mark.parametrize("command,args,option", [
    ("tokenize", ["--limit", "0"], "--limit"),
    ("tokenize", ["--num-workers", "0"], "--num-workers"),
    ("tokenize", ["--max-tokens", "0"], "--max-tokens"),
    ("tokenize", ["--min-loss-tokens", "0"], "--min-loss-tokens"),
    ("tokenize", ["--num-shards", "2", "--shard-index", "2"], "--shard-index"),
    ("pack", ["--max-windows", "0"], "--max-windows"),
    ("pack", ["--overlap", "1"], "--overlap"),
    ("regenerate", ["--server", "http://a:1", "--concurrency", "0"], "--concurrency"),
    ("regenerate", ["--server", "http://a:1", "--batch-size", "0"], "--batch-size"),
    ("regenerate", ["--server", "http://a:1", "--retries", "-1"], "--retries"),
    ("regenerate", ["--server", "http://a:1", "--timeout", "0.5"], "--timeout"),
    ("regenerate", ["--server", "http://a:1", "--limit", "0"], "--limit"),
    ("regenerate", ["--server", "http://a:1", "--max-new-tokens", "0"], "--max-new-tokens"),
    ("regenerate", ["--server", "http://a:1", "--temperature", "-1"], "--temperature"),
    ("extract", ["--shard-index", "-1"], "--shard-index"),
])
def test_a_value_out_of_range_is_refused_by_its_config(tmp_path, command, args, option):
    """The options' ranges are the config dataclasses' checks (no second copy in click types):
    exit code 2 and a message naming the option, before any input is read."""
    from cli.data import main as data_main

    common = {"tokenize": ["in.jsonl", "--tokenizer", "m", "--output", tmp_path / "o"],
              "pack": ["in.jsonl", "--tokenizer", "m", "--output", tmp_path / "o"],
              "regenerate": ["in.jsonl", "--output", tmp_path / "o.jsonl"],
              "extract": [tmp_path / "packed", "--verifier", "m", "--output", tmp_path / "s.zarr"]}[command]
    (tmp_path / "packed").mkdir()
    result = invoke(data_main, [command, *common, *args])
    assert result.exit_code == 2 and option in result.stderr, result.output


def test_a_train_config_file_by_group_or_flat(tmp_path, monkeypatch):
    """peagle-train's file holds the settings by TrainConfig group (what --print-config writes) or flat (the
    files written before the grouping), or both; a key under another group than its own is refused."""
    import cli.train

    seen = []
    monkeypatch.setattr(cli.train, "run_train", lambda cfg: seen.append(cfg) or {"rank": 0})
    grouped, flat, mixed, wrong = (tmp_path / f"{n}.yaml" for n in ("grouped", "flat", "mixed", "wrong"))
    grouped.write_text("data: {store: a.zarr}\nmodel: {num_depths: 3}\noptim: {lr: 0.01}\nrun: {output: run}\n")
    flat.write_text("store: a.zarr\nnum_depths: 3\nlr: 0.01\noutput: run\n")
    mixed.write_text("data: {store: a.zarr}\nnum-depths: 3\noptim: {lr: 0.01}\noutput: run\n")
    for cfg in (grouped, flat, mixed):
        result = invoke(train_main, ["--config", cfg])
        assert result.exit_code == 0, result.output
    want = TrainConfig.from_flat(store="a.zarr", output="run", num_depths=3, lr=0.01)
    assert seen == [want] * 3 and want.model.num_depths == 3 and want.optim.lr == 0.01
    assert printed(train_main, ["--config", flat]) == printed(train_main, ["--config", grouped])
    wrong.write_text("data: {store: a.zarr, lr: 0.01}\nrun: {output: run}\n")
    result = invoke(train_main, ["--config", wrong])
    assert result.exit_code == 2
    assert f"{wrong}: data.lr: lr is a setting of optim, not of data; write it under optim" in result.stderr


def test_a_config_file_does_not_set_an_action(tmp_path, monkeypatch):
    """Issue 22 item 8: ``force``/``resume`` in a file (as train_config.json held them before actions were
    left out of records) are dropped, with a warning for a set one; the run gets the command line's."""
    import cli.train

    seen = []
    monkeypatch.setattr(cli.train, "run_train", lambda cfg: seen.append(cfg) or {"rank": 0})
    cfg = tmp_path / "train_config.json"
    cfg.write_text('{"store": "a.zarr", "output": "run", "num_depths": 3, "force": true, "resume": false}')
    warning = (f"warning: {cfg}: ignoring force: True; --force is an action of one invocation, not a setting "
               "of the run: give it on the command line\n")
    printed = invoke(train_main, ["--config", cfg, "--print-config"])
    assert printed.exit_code == 0 and printed.stderr == warning
    assert not {"force", "resume"} & set(yaml.safe_load(printed.stdout)["run"])
    result = invoke(train_main, ["--config", cfg, "--resume"])
    assert result.exit_code == 0, result.output
    assert seen == [TrainConfig.from_flat(store="a.zarr", output="run", num_depths=3, resume=True)]
    assert "force" not in seen[0].to_dict()["run"] and "resume" not in seen[0].to_dict()["run"]


def test_verify_repair_is_an_action_of_the_command_line(tmp_path, monkeypatch):
    import peagle_data.inspect.verify
    from cli.data import main as data_main

    seen = []
    monkeypatch.setattr(peagle_data.inspect.verify, "verify_output", lambda store, packed, repair: seen.append(repair)
                        or ({}, None))
    cfg = tmp_path / "v.yaml"
    cfg.write_text(f"store: {tmp_path}\nrepair: true\n")
    result = invoke(data_main, ["verify", "--config", cfg])
    assert result.exit_code == 0 and seen == [False] and "ignoring repair: True; --repair is an action" in result.stderr
    assert invoke(data_main, ["verify", "--config", cfg, "--repair"]).exit_code == 0 and seen == [False, True]
