#!/usr/bin/env bash
# Re-measure everything in results/speed/ (about 15 min on 2 idle cores), then render the tables from the JSON.
# One job at a time: the figures are ratios of interleaved runs and any other load distorts them.
set -euo pipefail
cd "$(dirname "$0")"
export OMP_NUM_THREADS=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000
LAYER=(--scheme absmax-fine --scheme absmax-moderate --scheme absmax-coarse --scheme absmax-w4a8
       --scheme absmax-w4a8-g32 --scheme absmax-w4a8:group=128 --scheme zeropoint-int4 --scheme zeropoint-int4-g128
       --scheme zeropoint-int4-g32 --scheme absmax-fine:a=none --scheme bnb-nf4 --scheme llm-int8)
MODEL=(--scheme absmax-fine --scheme absmax-fine:head=true --scheme zeropoint-int4 --scheme zeropoint-int4-g128
       --scheme absmax-w4a8 --scheme absmax-w4a8-g32 --scheme absmax-w4a8:head=true --scheme absmax-fine:a=none
       --scheme bnb-nf4)
qbench speed --tokens 1 --in-features 2048 --out-features 8192 --mode real --no-model --repeats 30 "${LAYER[@]}" \
    --json decode.json > /dev/null
qbench speed --tokens 512 --in-features 1024 --out-features 4096 --mode real --no-model --repeats 7 "${LAYER[@]}" \
    --json prefill.json > /dev/null
qbench speed --no-layer --model small --mode real --repeats 5 "${MODEL[@]}" --json small.json > /dev/null
qbench speed --no-layer --model small --mode real --repeats 3 --generate-via transformers --no-kv \
    --scheme absmax-fine --scheme absmax-w4a8:head=true --json small-via-transformers.json > /dev/null
qbench speed --no-layer --model gpt2-130m --mode real --repeats 3 --scheme absmax-fine --scheme absmax-fine:head=true \
    --scheme zeropoint-int4 --scheme absmax-w4a8 --scheme absmax-w4a8:head=true --scheme absmax-w4a8-g32:head=true \
    --json gpt2-130m.json > /dev/null
for f in decode prefill small small-via-transformers gpt2-130m; do  # (README.md is hand-written)
    qbench speed --from-json "$f.json" --format md > "$f.md.tmp" && mv "$f.md.tmp" "$f.md"  # atomic
done
