"""Extraction overhead and store read throughput, against baselines measured in the same run.

1. The bare verifier forward over the blocks of a packed table (segment mask, no lm_head, no
   store) against the whole ``run_extract`` over the same blocks (store creation, hooks, writes,
   done flags included; the verifier's load time, measured apart, is subtracted). Goal: ≤ 1.15×.
2. Reading every block back from the store (memory-mapped chunk files -> bf16 tensors) against a
   plain sequential read of the same chunk files' bytes, both from the page cache.

On CUDA (``--device cuda``) a second baseline is the forward with the features left on the GPU
(no device-to-host copy, one synchronize at the end): the GPU's busy time. ``extract`` close to it
means the pinned asynchronous copies and the writer thread leave the GPU no idle time; the plain
baseline (``to_host``: a blocking copy after every block) shows what a naive loop would cost.

Usage (from the repository root, inside .venv):
    python bench/bench_extract.py --packed demo/packed --verifier smollm2-135m --blocks 24
    python bench/bench_extract.py --packed demo/packed --blocks 64 --device cuda
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from peagle_data.extract.config import ExtractConfig
from peagle_data.extract.hf_forward import default_layers, language_model, verifier_features
from peagle_data.extract.run import run_extract
from stores.features.feature_store import FeatureStore
from runtime.model_cache import load_verifier
from stores.staging import prepare_output_dir
from stores.tables.token_tables import TableWriter, TokenTable, write_manifest


def subset_table(packed: Path, n_blocks: int, out: Path) -> Path:
    """The first ``n_blocks`` blocks of a packed table as a table of their own (without its conversations:
    extract it with ``--context window``)."""
    table = TokenTable.open(packed)
    prepare_output_dir(out, force=True)
    with TableWriter(out, "packed") as w:
        for i, row in enumerate(table.iter_rows()):
            if i == n_blocks:
                break
            w.write(row)
    write_manifest(out, {**{k: v for k, v in table.manifest.items() if k not in ("format_version", "created_at",
                                                                                   "library_versions")},
                         "bench_subset_of": str(packed), "bench_blocks": n_blocks})
    return out


def bare_forward_s(verifier, packed: Path, layers: list[int], to_host: bool = True) -> tuple[float, int]:
    """Seconds and tokens of the verifier forward over every block (no store); ``to_host=False``
    leaves the features on the device and synchronizes once at the end."""
    base = language_model(verifier)
    tokens = 0
    t0 = time.perf_counter()
    for row in TokenTable.open(packed).iter_rows(["input_ids", "position_ids", "cu_seqlens", "n_tokens"]):
        verifier_features(base, torch.tensor(row["input_ids"], dtype=torch.long),
                          torch.tensor(row["position_ids"], dtype=torch.long),
                          torch.tensor(row["cu_seqlens"], dtype=torch.long), layers, to_host=to_host)
        tokens += int(row["n_tokens"])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, tokens


def read_throughput(store_path: Path) -> dict[str, float]:
    store = FeatureStore.open(store_path)
    files = sorted((store_path / "aux_hidden" / "c").rglob("*")) + sorted((store_path / "final_hidden" / "c").rglob("*"))
    files = [f for f in files if f.is_file()]
    n_bytes = sum(f.stat().st_size for f in files)
    for f in files:  # warm the page cache for both readers
        f.read_bytes()
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb") as fh:
            fh.read()
    plain_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(store.n_blocks):
        store.read_block(i, via="mmap")
    mmap_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(store.n_blocks):
        store.read_block(i, via="zarr")
    zarr_s = time.perf_counter() - t0
    mb = n_bytes / 2**20
    return {"bytes_MiB": round(mb, 1), "plain_read_MiB_s": round(mb / plain_s, 1),
            "store_mmap_MiB_s": round(mb / mmap_s, 1), "store_zarr_MiB_s": round(mb / zarr_s, 1),
            "mmap_vs_plain": round(plain_s / mmap_s, 3), "zarr_vs_plain": round(plain_s / zarr_s, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--packed", required=True, type=Path)
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2, help="alternate bare/extract this many times; best kept")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--attn-implementation", default="auto",
                    help="extract's --attn-implementation (auto: flash_attention_2 on CUDA when installed)")
    args = ap.parse_args()
    cuda = args.device == "cuda"

    work = Path(tempfile.mkdtemp(prefix="peagle-bench-"))
    try:
        packed = subset_table(args.packed, args.blocks, work / "packed")
        t0 = time.perf_counter()
        impl = args.attn_implementation
        if impl == "auto":
            from peagle_data.extract.hf import has_flash_attn
            impl = "flash_attention_2" if cuda and has_flash_attn() else None  # transformers' choice
        verifier = load_verifier(args.verifier, device=args.device, attn_implementation=impl)
        if cuda:
            torch.cuda.synchronize()
        load_s = time.perf_counter() - t0
        layers = default_layers(len(language_model(verifier).layers))  # the language model's layers
        bare_forward_s(verifier, subset_table(args.packed, 1, work / "warm"), layers)  # warm-up
        bare, on_device, extract = [], [], []
        for r in range(args.repeats):
            s, tokens = bare_forward_s(verifier, packed, layers)
            bare.append(s)
            if cuda:
                on_device.append(bare_forward_s(verifier, packed, layers, to_host=False)[0])
            t0 = time.perf_counter()
            run_extract(ExtractConfig(packed=str(packed), verifier=args.verifier, output=str(work / "f.zarr"),
                                      device=args.device, attn_implementation=args.attn_implementation, force=True,
                                      context="window"),  # the packed blocks the bare forward runs (format 1)
                        progress=False, log=lambda m: None)
            extract.append(time.perf_counter() - t0 - load_s)
        result = {
            "device": args.device, "attn_implementation": impl,
            "blocks": args.blocks, "tokens": tokens, "layers": layers, "torch_threads": torch.get_num_threads(),
            "verifier_load_s": round(load_s, 2),
            "bare_forward_s": round(min(bare), 2), "extract_s": round(min(extract), 2),
            "extract_vs_bare": round(min(extract) / min(bare), 3),
            "bare_tokens_per_s": round(tokens / min(bare), 1),
        }
        if cuda:
            result.update({"forward_on_device_s": round(min(on_device), 2),
                           "extract_vs_on_device": round(min(extract) / min(on_device), 3)})
        result["read"] = read_throughput(work / "f.zarr")
        print(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
