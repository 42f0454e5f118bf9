#!/usr/bin/env bash
# guidellm against `autodeploy serve` of the demo model, started with no options: the benchmark must
# complete every request without an error. guidellm lives in its own virtual environment (it needs
# torch, datasets and sanic; the CPU build of torch is enough):
#
#     python -m venv /tmp/guidellm-venv
#     /tmp/guidellm-venv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
#     /tmp/guidellm-venv/bin/pip install guidellm
#     GUIDELLM=/tmp/guidellm-venv/bin/guidellm bash bench/probes/guidellm_check.sh
#
# guidellm takes the first model /v1/models lists (the demo's Hub id, HuggingFaceTB/SmolLM2-135M-Instruct)
# and loads that tokenizer to build its prompts: from the Hub, or from the local Hugging Face cache. Where
# neither has it (no network, HF_HUB_OFFLINE), the script says so and hands guidellm the demo checkpoint's
# own tokenizer (`--tokenizer kind=huggingface_auto,model=DIR`), the one flag guidellm then needs.
# Settings (environment): PORT (8731), REQUESTS (4), OUT (a new temporary directory), GUIDELLM (guidellm).
set -euo pipefail

PORT=${PORT:-8731}
REQUESTS=${REQUESTS:-4}
OUT=${OUT:-$(mktemp -d)}
GUIDELLM=${GUIDELLM:-guidellm}
URL="http://127.0.0.1:${PORT}"
GUIDELLM_PYTHON="$(dirname "$(command -v "$GUIDELLM")")/python"

autodeploy serve --port "$PORT" > "$OUT/serve.log" 2>&1 &
server=$!
trap 'kill -INT "$server" 2>/dev/null; wait "$server" 2>/dev/null || true' EXIT

for _ in $(seq 900); do  # the first start converts the GGUF (about a minute on a small CPU), then compiles
  if curl -sf "$URL/health" > /dev/null; then break; fi
  if ! kill -0 "$server" 2>/dev/null; then echo "autodeploy serve exited:"; tail -20 "$OUT/serve.log"; exit 1; fi
  sleep 1
done
curl -sf "$URL/health" > /dev/null || { echo "autodeploy serve did not become ready in 900 s"; exit 1; }

model=$(curl -sf "$URL/v1/models" | python -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
tokenizer=()
if "$GUIDELLM_PYTHON" -c "from transformers import AutoTokenizer; AutoTokenizer.from_pretrained('$model')" \
    > /dev/null 2>&1; then
  echo "guidellm finds the tokenizer of '$model' itself: no guidellm option beyond the target"
else
  local_dir=$(python -c "from autodeploy.demo import default_model_path; print(default_model_path())")
  echo "the tokenizer of '$model' is neither reachable on the Hub nor in the local cache: using $local_dir"
  tokenizer=(--tokenizer "kind=huggingface_auto,model=$local_dir")
fi

"$GUIDELLM" run --backend "kind=openai_http,target=$URL" --profile kind=synchronous \
  --constraint "kind=max_requests,count=$REQUESTS" --data kind=synthetic_text,prompt_tokens=32,output_tokens=8 \
  "${tokenizer[@]}" --output "kind=json,path=$OUT/guidellm.json" --disable-console-interactive \
  > "$OUT/guidellm.log" 2>&1 || { echo "guidellm failed:"; tail -30 "$OUT/guidellm.log"; exit 1; }

curl -sf "$URL/metrics" > "$OUT/metrics.txt"
# guidellm 0.8.1 may end a max_requests run before it counts its last request; the server's own count
# (requests finished by stop or length, none aborted or failed) says whether every request completed
python - "$OUT/guidellm.json" "$OUT/metrics.txt" "$REQUESTS" <<'EOF'
import json
import sys

from prometheus_client.parser import text_string_to_metric_families

totals = json.load(open(sys.argv[1]))["benchmarks"][0]["metrics"]["request_totals"]
finished: dict[str, float] = {}
for family in text_string_to_metric_families(open(sys.argv[2]).read()):
    for sample in family.samples:
        if sample.name in ("vllm:request_success_total", "vllm:request_failure_total"):
            key = sample.labels.get("finished_reason") or "failed " + sample.labels["status"]
            finished[key] = finished.get(key, 0) + sample.value
completed = finished.get("stop", 0) + finished.get("length", 0)
print(f"guidellm: {totals['successful']} requests completed, {totals['errored']} errored, "
      f"{totals['incomplete']} incomplete; the server: {finished}")
good = completed == int(sys.argv[3]) == sum(finished.values()) and totals["successful"] >= 1
sys.exit(0 if good and totals["errored"] == 0 and totals["incomplete"] == 0 else 1)
EOF
echo "ok: guidellm ran against autodeploy serve (logs and results in $OUT)"
