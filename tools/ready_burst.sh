#!/usr/bin/env bash
# Readiness under a burst, as benchmark tools meet it on a fresh machine: start
# `radixserve up`, poll GET /v1/models until it answers 200 (the answers counted by
# status), then send N requests at once with vLLM's `bench serve` client (set up per
# ../shared/peers/vllm.md: VLLM_SITE holds it) and report its completed and failed.
#
#   source tools/device_carry.sh --env
#   bash tools/ready_burst.sh MODEL_DIR OUT_DIR [N]    # N: 1000 by default
set -euo pipefail
model=$1 out=$2 n=${3:-1000} port=${PORT:-8000}
mkdir -p "$out"
python3 -m radixserve.cli up --model "$model" --load-format dummy --dtype bfloat16 \
  --port "$port" --ready-timeout-s 900 --log-dir "$out/logs" >"$out/up.log" 2>&1 &
up=$!
# TERM, not INT: a background job of a script starts with SIGINT ignored.
trap 'kill -TERM $up 2>/dev/null; wait $up 2>/dev/null || true' EXIT
python3 - "$port" "$out/poll.json" <<'EOF'
import collections, json, sys, time, urllib.error, urllib.request
port, path = sys.argv[1], sys.argv[2]
seen, started = collections.Counter(), time.monotonic()
while time.monotonic() - started < 900:
    try:
        code = urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).status
    except urllib.error.HTTPError as exc:
        code = exc.code
    except OSError:
        code = 0  # not listening yet
    seen[code] += 1
    if code == 200:
        break
    time.sleep(0.25)
result = {"answers": dict(seen), "ready_after_s": round(time.monotonic() - started, 1)}
json.dump(result, open(path, "w"))
print("poll:", result, flush=True)
EOF
(
  export PYTHONPATH=$VLLM_SITE VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  python3 -m vllm.entrypoints.cli.main bench serve --backend openai \
    --base-url "http://127.0.0.1:$port" --endpoint /v1/completions --model "$(basename "$model")" \
    --tokenizer "$model" --dataset-name random --random-input-len 512 --random-output-len 256 \
    --ignore-eos --num-prompts "$n" --request-rate inf --seed 0 \
    --save-result --result-dir "$out" --result-filename burst.json >"$out/client.log" 2>&1
) || echo "the client exited $?" >&2
python3 - "$out/burst.json" "$n" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
errors = [e for e in r.get("errors", []) if e]
print(f"burst: {r.get('completed')} of {sys.argv[2]} completed, {len(errors)} failed;",
      f"output tok/s {r.get('output_throughput', 0):.0f}; first errors: {errors[:3]}")
EOF
