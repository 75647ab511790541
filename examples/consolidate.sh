#!/usr/bin/env bash
# From training to a Hugging Face model: train on 2 ranks, save one shard file per rank, consolidate
# the shards offline with the `torchacc consolidate` CLI, export a Hugging Face directory, then reload
# it with transformers and generate a few tokens.
#
# It calls torchrun, torchacc and python, so activate torchacc's environment first (once per shell;
# `make setup` or `make demo` creates it):
#
#   . .venv/bin/activate
#   bash examples/consolidate.sh [OUT_DIR]           # OUT_DIR defaults to a new temporary directory
#   STEPS=4 bash examples/consolidate.sh /tmp/run    # quick mode, as the tests run it
#   OVERRIDES="memory.gc=true" bash examples/consolidate.sh   # more KEY=VALUE config overrides
#
# Nothing needs a GPU or the network.
set -euo pipefail
cd "$(dirname "$0")/.."

for command in torchrun torchacc; do
    if ! command -v "$command" > /dev/null; then
        echo "consolidate.sh: '$command' is not on PATH; activate torchacc's environment first: . .venv/bin/activate" >&2
        exit 1
    fi
done

OUT=${1:-$(mktemp -d)}
STEPS=${STEPS:-40}
NPROC=${NPROC:-2}
PYTHON=${PYTHON:-python}
read -r -a overrides <<< "${OVERRIDES:-}"

echo "== 1. train $STEPS steps on $NPROC ranks from the YAML config; every rank saves its shards"
torchrun --standalone --nproc_per_node="$NPROC" examples/train_gpt2.py \
    --config examples/train_gpt2.yaml --steps "$STEPS" --save_dir "$OUT/shards" --metrics_dir "$OUT/metrics" \
    dist.fsdp.size="$NPROC" ${overrides[@]+"${overrides[@]}"}
ls "$OUT/shards"

echo "== 2. consolidate the model and optimizer shards offline (one process, no GPU, no process group)"
torchacc consolidate --ckpt-dir "$OUT/shards" --type all --quiet

echo "== 3. export a Hugging Face directory (config.json + model.safetensors) from the same shards"
torchacc consolidate --ckpt-dir "$OUT/shards" --format hf --out "$OUT/hf" --quiet
ls "$OUT/hf"

echo "== 4. reload with transformers, compare with consolidated.pth, generate"
"$PYTHON" examples/generate.py "$OUT/hf" --tokenizer "$OUT/shards" --check "$OUT/shards/consolidated.pth"
