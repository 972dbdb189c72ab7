#!/usr/bin/env bash
# Per-step losses of the four quickstarts (LLM, VLM, diffusion, video), in fp32, for a few
# steps each: run it on two checkouts on the same machine and compare the JSON lines, to show
# that a restructuring changed no number. Usage: bash scripts/same_losses.sh OUT_DIR [STEPS]
# (the checkout is the one this script lies in; its src/ is put first on PYTHONPATH).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "$1"); steps=${2:-8}
mkdir -p "$out"
python=${PYTHON:-.venv/bin/python}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
for example in quickstart vlm-quickstart diffusion-quickstart video-quickstart; do
    "$python" -m zeropipe train "examples/$example.yaml" "run.output_dir=$out/runs" "run.name=$example" \
        deepspeed.precision=fp32 "train.max_steps=$steps" train.log_every=1 train.save_every=null \
        generate.sample_every=null "data.cache.dir=$out/cache-$example" > "$out/$example.log" 2>&1 \
        || { echo "$example failed: see $out/$example.log" >&2; exit 1; }
    "$python" - "$out/runs/$example/metrics.jsonl" "$example" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
print(json.dumps({"example": sys.argv[2], "losses": [(row["step"], row["loss"]) for row in rows if "loss" in row]}))
PY
done | tee "$out/losses.jsonl"
