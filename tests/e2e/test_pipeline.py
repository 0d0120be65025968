"""The whole pipeline through the CLI: pack -> extract -> verify -> train -> eval, on a tiny
random Llama (4 layers, hidden 64) with the real SmolLM2 tokenizer."""

from __future__ import annotations

import json
import shutil

from click.testing import CliRunner

from cli.data import main as data_main
from cli.eval import main as eval_main
from cli.train import main as train_main

CONVERSATIONS = [
    {"id": f"conv{i}", "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": f"Count from {i} to {i + 12}."},
        {"role": "assistant", "content": " ".join(str(k) for k in range(i, i + 13))},
        {"role": "user", "content": "Now backwards."},
        {"role": "assistant", "content": " ".join(str(k) for k in range(i + 12, i - 1, -1))},
    ]}
    for i in range(10)
] + [
    {"conversations": [{"from": "human", "value": "Say hi"}, {"from": "gpt", "value": "hi " * 150}]},
]

PROMPTS = [
    {"question_id": 1, "turns": ["Count from 3 to 9.", "And back."]},
    {"messages": [{"role": "user", "content": "Say hi"}]},
]


def _run(cmd, args):
    result = CliRunner().invoke(cmd, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


def test_cli_pipeline_end_to_end(tmp_path, tiny_verifier_dir):
    data = tmp_path / "convs.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    # a template variable (the served mode), which this copy of the verifier's template reads (it renders
    # nothing more: the rows are the same); every stage records it and peagle-eval renders in it. SmolLM2's own
    # template reads no variable: a variable it never reads is refused (it would record a mode never rendered)
    model = tmp_path / "verifier"
    shutil.copytree(tiny_verifier_dir, model)
    template = model / "chat_template.jinja"
    template.write_text("{%- if reasoning_effort == 'max' %}{%- endif %}" + template.read_text())
    model = str(model)
    mode = {"reasoning_effort": "low"}
    refused = CliRunner().invoke(data_main, ["pack", str(data), "--tokenizer", str(tiny_verifier_dir), "--output",
                                             str(tmp_path / "refused"), "--chat-template-kwargs", json.dumps(mode)])
    assert refused.exit_code != 0 and "the chat template never reads 'reasoning_effort'" in refused.output
    out = _run(data_main, ["pack", data, "--tokenizer", model, "--output", tmp_path / "packed",
                           "--max-seq-len", 128, "--chat-template-kwargs", json.dumps(mode)])
    assert "used 11" in out
    manifest = json.loads((tmp_path / "packed" / "manifest.json").read_text())
    assert manifest["kind"] == "packed"

    _run(data_main, ["extract", tmp_path / "packed", "--verifier", model, "--output", tmp_path / "f.zarr",
                     "--layers", "1,2,3"])
    verify = json.loads(_run(data_main, ["verify", tmp_path / "f.zarr", "--packed", tmp_path / "packed"]))
    assert verify["ok"] and verify["blocks_done"] == verify["n_blocks"] > 1
    assert "bytes_per_token" in _run(data_main, ["inspect", tmp_path / "f.zarr"])

    summary = json.loads(_run(train_main, ["--store", tmp_path / "f.zarr", "--output", tmp_path / "drafter",
                                           "--max-steps", 6, "--num-depths", 3, "--draft-vocab-size", 64]))
    final = tmp_path / "drafter" / "final"
    assert (final / "config.json").is_file() and (final / "model.safetensors").is_file()
    assert len(summary["per_depth_accuracy_last_steps"]) == 3
    config = json.loads((final / "config.json").read_text())
    assert config["architectures"] == ["PEagleSpeculator"] and config["draft_vocab_size"] == 64
    assert manifest["tokenizer"]["chat_template_kwargs"] == mode  # packed -> store -> checkpoint
    assert config["peagle_training"]["tokenizer"]["chat_template_kwargs"] == mode
    other = CliRunner().invoke(eval_main, ["--drafter", final, "--verifier", model, "--prompts", prompts,
                                           "--chat-template-kwargs", "{}"])
    assert other.exit_code == 2 and "was trained on data rendered with chat template kwargs " \
        '{"reasoning_effort": "low"}, but --chat-template-kwargs gives none' in " ".join(other.output.split())

    report_path = tmp_path / "eval.json"
    report = json.loads(_run(eval_main, ["--drafter", final, "--verifier", model, "--prompts", prompts,
                                         "--store", tmp_path / "f.zarr", "--max-new-tokens", 12,
                                         "--all-anchor", "--output", report_path]))
    for key in ("acceptance_length", "acceptance_rate", "per_position_acceptance", "identical_to_greedy",
                "tokens_per_second", "baseline_tokens_per_second"):
        assert key in report
    assert report["identical_to_greedy"] is True
    assert 1.0 <= report["acceptance_length"] <= 4.0
    assert len(report["per_position_acceptance"]) == 3
    assert report["offline"]["positions_scored"] > 0
    assert report["template_mode"] == {"chat_template_kwargs": mode, "trained_chat_template_kwargs": mode,
                                       "store_chat_template_kwargs": mode, "mismatches": [], "mismatch_allowed": False}
    assert json.loads(report_path.read_text())["acceptance_length"] == report["acceptance_length"]
