#!/usr/bin/env bash
# guidellm's load against a running server, as the serving section's hook:
#   python bench/full_table.py --sections serving --guidellm 'bash bench/guidellm_load.sh {url} {model_dir} {out}'
# Concurrency C (64) streams of P/O (128/128) synthetic-text requests, N (512) of them, the prompts built with the
# model directory's tokenizer, sent as text completions (REQUEST_FORMAT; the suite's model directories have no chat
# template, as `autodeploy bench serve` sends text too); the last line is the JSON the hook reads (output tok/s over the benchmark's
# duration, TTFT and ITL p99 in ms, requests completed and errored). GUIDELLM names the command (guidellm; e.g. "python3 -m guidellm").
set -euo pipefail
URL=$1 MODEL_DIR=$2 OUT=$3
C=${C:-64} P=${P:-128} O=${O:-128} N=${N:-512} GUIDELLM=${GUIDELLM:-guidellm} REQUEST_FORMAT=${REQUEST_FORMAT:-/v1/completions}
mkdir -p "$OUT"
$GUIDELLM run --backend "kind=openai_http,target=$URL,request_format=$REQUEST_FORMAT" --profile "kind=concurrent,streams=$C" \
  --constraint "kind=max_requests,count=$N" --data "kind=synthetic_text,prompt_tokens=$P,output_tokens=$O" \
  --tokenizer "kind=huggingface_auto,model=$MODEL_DIR" --output "kind=json,path=$OUT/guidellm.json" \
  --disable-console-interactive > "$OUT/guidellm.log" 2>&1 || { tail -30 "$OUT/guidellm.log"; exit 1; }
python3 - "$OUT/guidellm.json" <<'PY'
import json
import sys

bench = json.load(open(sys.argv[1]))["benchmarks"][0]
metrics = bench["metrics"]
done = metrics["output_token_count"]["successful"]["total_sum"]
p99 = lambda name: round(metrics[name]["successful"]["percentiles"]["p99"], 1)  # noqa: E731
print(json.dumps({"output_tok_s": round(done / bench["duration"], 1), "ttft_p99_ms": p99("time_to_first_token_ms"),
                  "itl_p99_ms": p99("inter_token_latency_ms"), "completed": metrics["request_totals"]["successful"],
                  "errored": metrics["request_totals"]["errored"]}))
PY
