#!/usr/bin/env bash
# Long emergence runs: vanilla and the paper's recipe side by side (one thread each) on the tiny preset,
# time-sliced with --stop-at/--resume so that the model at every slice boundary is kept (snapshots/) for the
# quantisation curve of `qbench emergence --snapshots`. Interrupt it at any time (Ctrl-C stops both runs);
# re-running resumes and keeps the snapshots already taken.
#
# Usage: bash results/emergence/long_runs.sh ARCH STEPS [OUT_ROOT]
#   ARCH  gpt2  = the tiny preset as it is (LayerNorm, GELU, learned positions, biases, tied embeddings)
#         llama = the same size in Llama style (RMSNorm, SwiGLU d_ff 688, RoPE, no biases, untied embeddings)
#   STEPS the whole schedule (x 16 windows x 128 tokens); slices every 250 steps up to 1000, then every 500.
#         ~1.0-1.3 s per step and run on 2 cores.
set -euo pipefail
if [ $# -lt 2 ] || ! [[ $2 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: bash $0 gpt2|llama STEPS [OUT_ROOT]" >&2; exit 2
fi
arch=$1 steps=$2 root=${3:-ckpts/emergence-long/$1}
case $arch in
  gpt2) switches=() ;;
  llama) switches=(--set family=llama --set mlp=swiglu --set pos=rope --set bias=false
                   --set tie_embeddings=false --set d_ff=688) ;;
  *) echo "ARCH must be gpt2 or llama, got '$arch'" >&2; exit 2 ;;
esac
slices=$(python -c "s=$steps; print(*sorted({k for k in (250, 500, 750, 1000) if k < s} | set(range(1000, s, 500)) | {s}))")
train() {  # recipe, extra switches...
  local recipe=$1 out=$root/$1; shift
  for k in $slices; do
    local snap=$root/snapshots/$recipe/step-$(printf %05d "$k")
    [ -f "$snap/config.json" ] && continue  # kept by an earlier run of this script
    OMP_NUM_THREADS=1 python -m trainers --preset tiny --recipe "$recipe" ${switches[@]+"${switches[@]}"} "$@" \
      --out "$out" --steps "$steps" --probe-every 25 --eval-every 250 --ckpt-every 250 --stop-at "$k" --resume \
      --no-progress
    local at
    at=$(python -c "import json, sys; print(json.load(open(sys.argv[1]))['step'])" "$out/trainer_state.json")
    if [ "$at" != "$k" ]; then  # the run is already past this slice: its model at step k is gone
      echo "$out is at step $at, past slice $k: no snapshot for it" >&2; continue
    fi
    rm -rf "$snap.tmp" && mkdir -p "$snap.tmp"  # copy, then rename: a snapshot folder is always whole
    cp "$out"/model.safetensors "$out"/tokenizer.json "$out"/tokenizer_config.json "$out"/config.json "$snap.tmp"/
    mv "$snap.tmp" "$snap"
  done
}
vanilla_norm=()
[ "$arch" = llama ] && vanilla_norm=(--norm rmsnorm)  # the vanilla Llama keeps per-channel RMSNorm gains
mkdir -p "$root"
trap 'trap - INT TERM; kill 0' INT TERM  # background jobs ignore Ctrl-C in a script: stop the whole group
train vanilla ${vanilla_norm[@]+"${vanilla_norm[@]}"} >> "$root.vanilla.log" 2>&1 & vanilla=$!
train paper >> "$root.paper.log" 2>&1 & paper=$!
wait $vanilla && wait $paper
