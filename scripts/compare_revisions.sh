#!/usr/bin/env bash
# Behaviour check for refactors: run the demo's commands at a small size with the code of two git
# revisions and compare what they write. Packed Parquet parts and every zarr chunk must be
# byte-identical, and the training losses and final weights equal (manifests and the store's
# zarr.json differ by created_at and the recorded config). Uses this checkout's .venv. Each revision
# extracts with its own default --context: a pair across the change of the default (window, then
# full: a format-2 store) differs in features.zarr by design; compare revisions on one side of it.
#   bash scripts/compare_revisions.sh REV_BEFORE [REV_AFTER=HEAD]
set -euo pipefail
cd "$(dirname "$0")/.."
before=$1; after=${2:-HEAD}; work=$(mktemp -d)
PY=$PWD/.venv/bin/python
run() {  # run REV OUT: the pipeline with the code of REV (first on PYTHONPATH)
  local src=$work/src-$2; mkdir -p "$src"; git archive "$1" | tar -x -C "$src"
  local out=$work/$2; mkdir -p "$out"
  ( export PYTHONPATH=$src OMP_NUM_THREADS=1; cd "$work"
    d() { "$PY" -c "import sys; from cli.data import main; sys.argv[0]='peagle-data'; main()" "$@"; }
    d pack sharegpt --tokenizer smollm2-135m --output "$out/packed" --limit 24 --max-seq-len 256 --max-windows 1 --force
    d extract "$out/packed" --verifier smollm2-135m --output "$out/features.zarr" --force
    "$PY" -c "import sys; from cli.train import main; sys.argv[0]='peagle-train'; main()" --store "$out/features.zarr" \
      --output "$out/drafter" --max-steps 12 --lr 1e-3 --num-depths 4 --draft-vocab-size 1024 \
      --attention-backend sdpa --force > "$out/train_summary.json" ) > "$work/$2.log" 2>&1 \
    || { echo "the $2 run ($1) failed; its log:" >&2; tail -n 20 "$work/$2.log" >&2; exit 1; }
}
run "$before" before; run "$after" after
"$PY" - "$work" <<'PY'
import hashlib, json, pathlib, sys
import numpy as np
from safetensors.numpy import load_file
w = pathlib.Path(sys.argv[1]); a, b = w / "before", w / "after"
def digests(root, sub):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((root / sub).rglob("*")) if p.is_file()}
ok = True
for sub in ("packed", "features.zarr"):
    da, db = digests(a, sub), digests(b, sub)
    differ = sorted(k for k in set(da) | set(db) if da.get(k) != db.get(k))
    print(f"{sub}: {len(da)} files, differ: {differ}")
    ok &= set(differ) <= {"packed/manifest.json", "features.zarr/zarr.json"}
def losses(root):
    rows = [json.loads(l) for l in (root / "drafter/metrics.jsonl").read_text().splitlines()]
    return [(r.get("split"), r.get("step"), r.get("loss", r.get("val_loss"))) for r in rows]
same_loss = losses(a) == losses(b)
wa, wb = (load_file(r / "drafter/final/model.safetensors") for r in (a, b))
same_w = sorted(wa) == sorted(wb) and all(np.array_equal(wa[k], wb[k]) for k in wa)
print(f"losses identical: {same_loss}  final weights identical: {same_w}")
sys.exit(0 if ok and same_loss and same_w else 1)
PY
