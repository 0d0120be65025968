"""``extract --engine vllm`` against vLLM's own prefill of the same requests, in one run (issue 31).

Legend: T tokens of a request (one packed segment), K layer ids vLLM captures, H hidden size.

Every round runs both, in alternating order (ABBA: round r runs them as round r-1 did, reversed), so load
drift on the shared machine hits both:

- **prefill**: ``vllm.LLM`` started as the extraction starts it (:func:`runtime.vllm_runtime.start_llm`,
  the same dtype, eager mode, seed, no prefix caching, ``max_model_len``, KV cache and threads) but without
  the ``extract_hidden_states`` speculative config and the hidden-states connector; every packed block's
  segments as token-id prompts with ``max_tokens=1``, one ``generate`` per block as the extraction batches
  them (``prefill_s``), then all the prompts in one ``generate`` (``one_batch_s``: the engine with every
  request in flight at once);
- **extract**: :func:`peagle_data.extract.run.run_extract` with ``--engine vllm --context window`` into a
  new store (what ``peagle-data extract`` runs), whose summary's ``timings`` split the time: the engine's
  start, the store's creation, the requests (forward, capture, the connector's copy out of the cache),
  the files (waiting for each request's file to be written, reading it), the checks, the assembly (the
  final norm, bf16), the writer thread's writes with crc32c and the waits on it.

Besides, the connector's side of a request, which runs in vLLM's engine process where the summary cannot
see it, is timed here on tensors of the run's shapes (:func:`connector_costs`): the gather out of the
hidden-states cache ``[T, K, H]`` and the safetensors write of its file.

Usage (from the repository root; SmolLM2-135M, the demo's packing unless --packed):
    PYTHONPATH=$PWD .venv-vllm/bin/python bench/bench_vllm_extract.py --work /tmp/bench_vllm --rounds 2
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import psutil
import torch

from stores.features.feature_store import FeatureStore
from stores.tables.token_tables import TokenTable

REPO = Path(__file__).resolve().parents[1]


class CpuMeter:
    """CPU seconds (user + system) of this process and every process it started (vLLM's engine core and
    workers), sampled every ``every_s`` by a daemon thread; a process that ended counts with its last
    sample. CPU time, unlike wall time, does not grow when other jobs take the shared cores."""

    def __init__(self, every_s: float = 0.1):
        self.me = psutil.Process()
        self.last: dict[int, float] = {}
        self.lock = threading.Lock()
        self.every_s = every_s
        threading.Thread(target=self._run, daemon=True).start()

    def _sample(self) -> None:
        for p in [self.me, *self.me.children(recursive=True)]:
            try:
                t = p.cpu_times()
                with self.lock:
                    self.last[(p.pid, p.create_time())] = t.user + t.system
            except psutil.Error:  # ended between the listing and the read
                pass

    def _run(self) -> None:
        while True:
            self._sample()
            time.sleep(self.every_s)

    def total(self) -> float:
        """CPU seconds so far of every process seen (a fresh sample of the living ones)."""
        self._sample()
        with self.lock:
            return sum(self.last.values())


def segment_prompts(row: Mapping[str, Any]) -> list[list[int]]:
    """A packed row's non-empty segments as token-id prompts, in block order: the requests the ``vllm``
    engine sends for the row (one per segment)."""
    ids = np.asarray(row["input_ids"]).tolist()
    cu = np.asarray(row["cu_seqlens"]).tolist()
    return [ids[lo:hi] for lo, hi in zip(cu[:-1], cu[1:]) if hi > lo]


def abba(rounds: int) -> list[str]:
    """The order of the runs: ``["prefill", "extract", "extract", "prefill", ...]``, ``2 * rounds`` long."""
    order: list[str] = []
    for r in range(rounds):
        order += ["prefill", "extract"] if r % 2 == 0 else ["extract", "prefill"]
    return order


def breakdown(tokens: int, prefill_s: float, timings: Mapping[str, float]) -> dict[str, float]:
    """Where the extraction's time goes beyond the prefill of the same requests, in microseconds per token.

    Args:
        tokens: the tokens of the requests (both runs).
        prefill_s: seconds of the prefill's per-block ``generate`` calls.
        timings: an extraction summary's ``timings`` (``peagle_data.extract.run.run_extract``).

    Returns:
        ``prefill``, ``extract`` (its ``blocks_s``), ``extra`` (their difference) and its parts: ``capture``
        (``requests_s - prefill_s``: the engine's step with the capture and the connector's copy),
        ``files``, ``check``, ``assemble``, ``writer_wait``, ``other`` (the rest of ``blocks_s``: the
        loop, the progress bar); ``store_write`` (the writer thread, overlapping the others, not part of
        ``extra``); ``start_extract`` (``engine_open_s + store_open_s``), per token of this run.
    """
    us = 1e6 / tokens
    t = timings
    parts = {"capture": t["requests_s"] - prefill_s, "files": t["files_s"], "check": t["check_s"],
             "assemble": t["assemble_s"], "writer_wait": t["writer_wait_s"]}
    parts["other"] = t["blocks_s"] - prefill_s - sum(parts.values())
    out = {"prefill": prefill_s * us, "extract": t["blocks_s"] * us, "extra": (t["blocks_s"] - prefill_s) * us,
           **{k: v * us for k, v in parts.items()}, "store_write": t["store_write_s"] * us,
           "start_extract": (t["engine_open_s"] + t["store_open_s"]) * us}
    return {k: round(v, 2) for k, v in out.items()}


def ceiling(forward_us: float, host_us: float) -> float:
    """Tokens/s of an extraction whose client spends ``host_us`` µs per token in series with an engine
    forward of ``forward_us`` µs per token (``1e6 / (forward + host)``)."""
    return 1e6 / (forward_us + host_us)


def client_us(parts: Mapping[str, float]) -> float:
    """µs per token the extraction's own process spends in series with the engine (a :func:`breakdown`'s
    ``files``, ``check``, ``assemble``, ``writer_wait``, ``other``): what bounds it however fast the engine is."""
    return sum(parts[k] for k in ("files", "check", "assemble", "writer_wait", "other"))


def connector_costs(lengths: list[int], k: int, h: int, dtype, repeats: int = 3) -> dict[str, float]:
    """µs per token of the hidden-states connector's two steps on requests of ``lengths`` tokens (``[T, K, H]``
    of ``dtype``), as :class:`peagle_data.extract.vllm_connector.CpuHiddenStatesConnector` runs them: the
    gather out of a paged cache (vLLM's ``extract_from_kv_cache``, blocks of 16 slots, plus the clone) and
    the safetensors file write (with peagle's metadata), then the client's read and removal of it; CPU time of
    this thread (``time.thread_time``: other jobs on the shared cores do not count), best of ``repeats``."""
    from safetensors.torch import load_file, save_file
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import extract_from_kv_cache

    block = 16
    n_blocks = sum(-(-t // block) for t in lengths)
    cache = torch.randn(n_blocks, k, block, h, dtype=dtype)
    meta = {"peagle_capture_ids": json.dumps(list(range(k)))}
    tmp = Path(tempfile.mkdtemp(prefix="bench-connector-"))
    best = {"gather": float("inf"), "write": float("inf"), "read": float("inf")}
    try:
        for _ in range(repeats):
            spent = dict.fromkeys(best, 0.0)
            start = 0
            for j, t in enumerate(lengths):
                nb = -(-t // block)
                ids = torch.arange(start, start + nb)
                start += nb
                t0 = time.thread_time()
                slots = (torch.arange(block)[None, :] + ids[:, None] * block).flatten()
                rows = extract_from_kv_cache(cache, slots, t).clone()
                t1 = time.thread_time()
                path = str(tmp / f"{j}.safetensors")
                save_file({"hidden_states": rows, "token_ids": torch.zeros(t, dtype=torch.long)}, path, metadata=meta)
                t2 = time.thread_time()
                load_file(path)
                os.remove(path)
                t3 = time.thread_time()
                spent["gather"] += t1 - t0
                spent["write"] += t2 - t1
                spent["read"] += t3 - t2
            best = {key: min(best[key], spent[key]) for key in best}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    n = sum(lengths)
    return {key: round(v * 1e6 / n, 2) for key, v in best.items()}


def assemble_cost(lengths: list[int], k: int, h: int, dtype, repeats: int = 3) -> float:
    """CPU µs per token (``time.thread_time``, best of ``repeats``) of the ``vllm`` engine's assembly of one
    block from requests of ``lengths`` tokens (``[T, K, H]`` of ``dtype``): the concatenation, an RMS final
    norm of the last slot in ``dtype`` (transformers' Llama norm: float32 variance), the bf16 casts."""
    parts = [torch.randn(t, k, h).to(dtype) for t in lengths]
    weight = torch.ones(h, dtype=dtype)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.thread_time()
        hs = torch.cat(parts)
        x = hs[:, -1].float()
        final = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype) * weight
        hs[:, : k - 1].to(torch.bfloat16), final.to(torch.bfloat16)
        best = min(best, time.thread_time() - t0)
    return round(best * 1e6 / sum(lengths), 2)


def store_write_cost(path: Path) -> float:
    """CPU µs per token (``time.thread_time``) of writing every block of the store at ``path`` again as the
    extraction's writer thread does (``FeatureStore.write_features``: bf16 encoding, chunks with their
    crc32c); the store is left as it was (the same features)."""
    store = FeatureStore.open(path, mode="r+")
    spent, tokens = 0.0, 0
    for i in range(store.n_blocks):
        blk = store.read_block(i)
        t0 = time.thread_time()
        store.write_features(i, blk.aux_hidden, blk.final_hidden)
        spent += time.thread_time() - t0
        tokens += int(blk.input_ids.shape[0])
    return round(spent * 1e6 / tokens, 2)


def run_prefill(packed: str, verifier: str, kv_cache_gib: float | None, meter: CpuMeter) -> dict[str, Any]:
    """vLLM's prefill of the table's requests, no capture: start, per-block ``generate`` calls, one ``generate``."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.platforms import current_platform

    from peagle_data.extract.vllm import engine_dtype
    from runtime.model_cache import resolve_model
    from runtime.vllm_runtime import VllmMemory, VllmOutput, start_llm

    blocks = [segment_prompts(r) for r in TokenTable.open(packed).iter_rows(["input_ids", "cu_seqlens"])]
    longest = max(len(p) for b in blocks for p in b)
    accelerator = not current_platform.is_cpu()
    output = VllmOutput()
    t0 = time.perf_counter()
    llm, _ = start_llm(VllmMemory(kv_cache_gib=kv_cache_gib), output, model=str(resolve_model(verifier)),
                       skip_tokenizer_init=True, dtype=str(engine_dtype(accelerator)).removeprefix("torch."),
                       enforce_eager=not accelerator, seed=0, enable_prefix_caching=False, max_model_len=longest + 1)
    start_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    try:
        c0, t0 = meter.total(), time.perf_counter()
        for prompts in blocks:
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            assert len(outs) == len(prompts) and all(len(o.outputs[0].token_ids) == 1 for o in outs)
        prefill_s, prefill_cpu = time.perf_counter() - t0, meter.total() - c0
        every = [TokensPrompt(prompt_token_ids=p) for b in blocks for p in b]
        t0 = time.perf_counter()
        llm.generate(every, params, use_tqdm=False)
        one_batch_s = time.perf_counter() - t0
    finally:
        c0 = meter.total()
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        output.stop(wait_s=2.0)
        shutdown_cpu = meter.total() - c0
    tokens = sum(len(p) for b in blocks for p in b)
    return {"run": "prefill", "tokens": tokens, "requests": sum(len(b) for b in blocks), "start_s": round(start_s, 2),
            "prefill_s": round(prefill_s, 2), "one_batch_s": round(one_batch_s, 2),
            "tokens_per_s": round(tokens / prefill_s, 1), "one_batch_tokens_per_s": round(tokens / one_batch_s, 1),
            "cpu_s": round(prefill_cpu + shutdown_cpu, 2), "shutdown_cpu_s": round(shutdown_cpu, 2)}


def run_extraction(packed: str, verifier: str, output: str, kv_cache_gib: float | None,
                   meter: CpuMeter) -> dict[str, Any]:
    """``peagle-data extract --engine vllm --context window`` of the table into a new store: its timings, and
    the CPU seconds from the store's creation (logged right after the engine opened) to the end (the blocks,
    then the engine's shutdown)."""
    from peagle_data.extract.config import ExtractConfig
    from peagle_data.extract.run import run_extract

    cfg = ExtractConfig(packed=packed, verifier=verifier, output=output, engine="vllm", context="window", force=True,
                        vllm_kv_cache_gib=kv_cache_gib)
    opened: list[float] = []

    def log(message: str) -> None:
        if message.startswith("projected store size") and not opened:
            opened.append(meter.total())
        print(message, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    summary = run_extract(cfg, progress=False, log=log)
    wall, cpu = time.perf_counter() - t0, meter.total() - opened[0]
    t = summary["timings"]
    tokens = summary["verifier_tokens_this_run"]
    return {"run": "extract", "tokens": tokens, "wall_s": round(wall, 2), "timings": t,
            "stored_bytes": summary["stored_bytes"], "tokens_per_s": round(tokens / t["blocks_s"], 1),
            "cpu_s": round(cpu, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", required=True, help="a scratch directory (packed table, stores)")
    p.add_argument("--packed", help="a packed table (default: the demo's, 40 ShareGPT conversations)")
    p.add_argument("--verifier", default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="vLLM's OpenMP threads, bound to cores 0..N-1")
    p.add_argument("--kv-cache-gib", type=float, default=2.0)
    p.add_argument("--project-hidden", type=int, default=4096,
                   help="the host costs also at this hidden size in bf16 (a GPU verifier's: 4096 for Qwen3-8B)")
    args = p.parse_args()
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"  # both engines, before either starts
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    packed = args.packed
    if packed is None:
        packed = str(work / "packed")
        subprocess.run([sys.executable, "-m", "cli.data", "pack", "sharegpt", "--tokenizer", args.verifier, "--output",
                        packed, "--limit", "40", "--max-seq-len", "512", "--max-windows", "1", "--force"],
                       check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(REPO)})
    meter = CpuMeter()
    load = [os.getloadavg()[0]]
    runs: list[dict[str, Any]] = []
    for what in abba(args.rounds):
        print(f"[bench] {what} (load average {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
        if what == "prefill":
            runs.append(run_prefill(packed, args.verifier, args.kv_cache_gib, meter))
        else:
            runs.append(run_extraction(packed, args.verifier, str(work / "store.zarr"), args.kv_cache_gib, meter))
        load.append(os.getloadavg()[0])
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    pre = [r for r in runs if r["run"] == "prefill"]
    ext = [r for r in runs if r["run"] == "extract"]
    tokens = pre[0]["tokens"]
    assert all(r["tokens"] == tokens for r in runs), "both runs must prefill the same tokens"
    store = FeatureStore.open(work / "store.zarr")
    lengths = [len(s) for r in TokenTable.open(packed).iter_rows(["input_ids", "cu_seqlens"])
               for s in segment_prompts(r)]
    per_round = [breakdown(tokens, p_["prefill_s"], e["timings"]) for p_, e in zip(pre, ext)]
    k = len(store.attrs["engine"]["capture_ids"])
    conn = connector_costs(lengths, k, store.hidden_size, torch.float32)
    write_us = store_write_cost(work / "store.zarr")
    big = connector_costs(lengths[:10], k, args.project_hidden, torch.bfloat16)
    projection = {"hidden_size": args.project_hidden, "dtype": "bfloat16", "connector_cpu_us_per_token": big,
                  "assemble_cpu_us_per_token": assemble_cost(lengths[:10], k, args.project_hidden, torch.bfloat16),
                  "store_write_cpu_us_per_token": round(write_us * args.project_hidden / store.hidden_size, 2)}
    serial = big["write"] + big["read"] + projection["assemble_cpu_us_per_token"]  # in series with the forward
    projection["serial_host_us_per_token"] = round(serial, 2)
    projection["serial_host_ceiling_tokens_per_s"] = round(ceiling(0.0, projection["serial_host_us_per_token"]), 0)
    report = {"verifier": args.verifier, "packed": packed, "blocks": store.n_blocks, "tokens": tokens,
              "requests": pre[0]["requests"], "threads": args.threads, "load_average": [round(x, 1) for x in load],
              "runs": runs,
              "tokens_per_s": {"prefill": [r["tokens_per_s"] for r in pre], "extract": [r["tokens_per_s"] for r in ext],
                               "prefill_one_batch": [r["one_batch_tokens_per_s"] for r in pre]},
              "extract_over_prefill": [round(e["tokens_per_s"] / p_["tokens_per_s"], 3) for p_, e in zip(pre, ext)],
              "cpu_us_per_token": {"prefill": [round(r["cpu_s"] * 1e6 / tokens, 1) for r in pre],
                                   "extract": [round(r["cpu_s"] * 1e6 / tokens, 1) for r in ext]},
              "us_per_token": per_round, "connector_cpu_us_per_token": conn,
              "store_write_cpu_us_per_token": write_us,
              "assemble_cpu_us_per_token": assemble_cost(lengths, k, store.hidden_size, torch.float32),
              "projection": projection,
              "client_ceiling_tokens_per_s": [round(ceiling(0.0, client_us(b)), 1) for b in per_round],
              "capture_ids": k,
              "hidden_size": store.hidden_size}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
