#!/usr/bin/env bash
# Re-measure results/speed/ for this machine's CPU class, then render the tables from the JSON:
#   bash results/speed/run.sh            # into results/speed/ (the Zen 3 / AVX2 tables were made this way)
#   bash results/speed/run.sh zen4       # into results/speed/zen4/ (keep each CPU class's tables apart)
#   bash results/speed/run.sh zen4 decode                            # the per-layer decode table alone
#   QBENCH_NATIVE_ISA=avx2 bash results/speed/run.sh zen4-avx2 decode # the AVX2-only build on a CPU with more
# The KV-cache figures are results/speed/kv/ (their own commands, README), so the model runs here skip them.
# About 15-25 min on 2 idle cores. One job at a time: the figures are ratios of interleaved runs and any other load
# distorts them.
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p "${1:-.}" && cd "${1:-.}"
export OMP_NUM_THREADS=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000
LAYER=(--scheme absmax-fine --scheme absmax-moderate --scheme absmax-coarse --scheme absmax-w4a8
       --scheme absmax-w4a8-g32 --scheme absmax-w4a8:group=128 --scheme zeropoint-int4 --scheme zeropoint-int4-g128
       --scheme zeropoint-int4-g32 --scheme zeropoint-int3-g128 --scheme zeropoint-int2-g64 --scheme absmax-fine:a=none
       --scheme bnb-nf4 --scheme llm-int8)
# The deployable formats of issue 24 (W8A8, W4A8, int4-g128, int3-g128, int2-g64) against fp32 and bf16 (always
# measured), plus the head-quantised variants and the NF4 peer.
MODEL=(--scheme absmax-fine --scheme absmax-fine:head=true --scheme absmax-w4a8 --scheme absmax-w4a8-g32
       --scheme absmax-w4a8:head=true --scheme zeropoint-int4 --scheme zeropoint-int4-g128
       --scheme zeropoint-int3-g128 --scheme zeropoint-int2-g64 --scheme absmax-fine:a=none --scheme bnb-nf4)
BIG=(--scheme absmax-fine --scheme absmax-fine:head=true --scheme absmax-w4a8 --scheme absmax-w4a8-g32:head=true
     --scheme zeropoint-int4-g128 --scheme zeropoint-int3-g128 --scheme zeropoint-int2-g64)
qbench speed --tokens 1 --in-features 2048 --out-features 8192 --mode real --no-model --repeats 30 "${LAYER[@]}" \
    --json decode.json > /dev/null
if [ "${2:-all}" = decode ]; then
    qbench speed --from-json decode.json --format md > decode.md.tmp && mv decode.md.tmp decode.md
    exit 0
fi
qbench speed --tokens 512 --in-features 1024 --out-features 4096 --mode real --no-model --repeats 7 "${LAYER[@]}" \
    --json prefill.json > /dev/null
qbench speed --no-layer --model small --mode real --repeats 5 --no-kv "${MODEL[@]}" --json small.json > /dev/null
qbench speed --no-layer --model small --mode real --repeats 3 --generate-via transformers --no-kv \
    --scheme absmax-fine --scheme absmax-w4a8:head=true --json small-via-transformers.json > /dev/null
qbench speed --no-layer --model gpt2-130m --mode real --repeats 3 --no-kv "${BIG[@]}" --json gpt2-130m.json > /dev/null
for f in decode prefill small small-via-transformers gpt2-130m; do  # (README.md is hand-written)
    qbench speed --from-json "$f.json" --format md > "$f.md.tmp" && mv "$f.md.tmp" "$f.md"  # atomic
done
