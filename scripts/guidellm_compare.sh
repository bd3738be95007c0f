#!/usr/bin/env bash
# Mesh against vLLM-CPU with guidellm, on one model and on three (docs/benchmarking.md, issue 33).
#
#   scripts/guidellm_compare.sh OUT [ROUNDS]      (after `make setup`; vLLM in .venv-vllm)
#
# Each round starts a fresh server on a fresh data folder, sends it one request, then runs
# guidellm at 1, 4, 8 and 16 concurrent streams (prompt 128, output 64 tokens, ignore_eos):
# Mesh (`mesh serve --demo`, its default admission), then vLLM-CPU (`vllm serve` of the same
# model converted to a Hugging Face folder, its defaults: OpenMP on core 0, core 1 reserved),
# alternating which goes first, so that neighbouring runs share the machine's conditions.
# Then three models: Mesh with two more copies of the demo model registered beside it (one
# node), against three vLLM-CPU servers (one per model; their OpenMP threads on cores 0, 1,
# 0), each driven by its own guidellm at 4 streams, all at once. Every guidellm report and
# server log lands in OUT (PARTS="sweep mesh3 vllm3" chooses what runs); `python scripts/guidellm_table.py` turns them into tables.
# Run it on an otherwise idle machine, and say so if it was not.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${1:?usage: scripts/guidellm_compare.sh OUT [ROUNDS]}")
ROUNDS=${2:-2}
SWEEP=${SWEEP:-"1:16 4:24 8:48 16:64"}   # streams:requests
GL=.venv/bin/guidellm MESH=.venv/bin/mesh VPY=.venv-vllm/bin/python
M=${MESH_DATA_DIR:-$HOME/.local/share/mesh}/models
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
TOK="kind=huggingface_auto,model=$M,load_kwargs.gguf_file=$GGUF"
mkdir -p "$OUT"
for exe in "$GL" "$MESH" "$VPY"; do
    [ -x "$exe" ] || { echo "guidellm_compare: $exe is missing (make setup; vLLM: scripts/setup.sh with MESH_VLLM=1)" >&2; exit 2; }
done
[ -f "$OUT/hf/config.json" ] || "$VPY" -m mesh.modelfiles.convert gguf-to-hf "$M/$GGUF" "$OUT/hf" >"$OUT/convert.log" 2>&1

PIDS=()
stop_all() {
    for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do timeout 60 tail --pid="$p" -f /dev/null 2>/dev/null || kill -KILL "$p" 2>/dev/null || true; done
    PIDS=()
}
trap stop_all EXIT

load() { awk '{print $1}' /proc/loadavg; }

guide() {  # url model key streams count report
    local backend="kind=openai_http,target=$1,model=$2"
    [ -n "$3" ] && backend="$backend,api_key=$3"
    echo "$(date -u +%H:%M:%S) load $(load): $6" >>"$OUT/runs.log"
    "$GL" run --backend "$backend" --profile "kind=concurrent,streams=$4" --constraint "kind=max_requests,count=$5" \
        --data kind=synthetic_text,prompt_tokens=128,output_tokens=64 --tokenizer "$TOK" \
        --output "kind=json,path=$6" --disable-console-interactive >"$6.log" 2>&1 || echo "guidellm failed: $6.log" >&2
    echo "$(date -u +%H:%M:%S) load $(load): done" >>"$OUT/runs.log"
}

warm() {  # url model key
    curl -sf -m 300 "$1/v1/completions" ${3:+-H "Authorization: Bearer $3"} -H 'Content-Type: application/json' \
        -d "{\"model\": \"$2\", \"prompt\": \"Hello\", \"max_tokens\": 8}" >/dev/null
}

start_mesh() {  # log; sets URL KEY
    local data; data=$(mktemp -d "$OUT/mesh-data.XXXX")
    mkdir -p "$OUT/allowed"
    MESH_ADMIN_TOKEN=compare "$MESH" serve --demo --port 0 --data-dir "$data" --allowed-dir "$OUT/allowed" \
        >"$1" 2>&1 &
    PIDS+=($!)
    for _ in $(seq 600); do
        if grep -q "ready url=" "$1"; then
            URL=$(grep -o "ready url=[^ ]*" "$1" | cut -d= -f2); URL=${URL%/}
            KEY=$(grep -o "api_key=[^ ]*" "$1" | cut -d= -f2)
            return 0
        fi
        sleep 1
    done
    echo "mesh serve did not start: $1" >&2; return 1
}

start_vllm() {  # port name bind log
    env VLLM_CPU_KVCACHE_SPACE=2 VLLM_USE_AOT_COMPILE=0 ${3:+VLLM_CPU_OMP_THREADS_BIND=$3} \
        "$VPY" -m vllm.entrypoints.openai.api_server --model "$OUT/hf" --served-model-name "$2" \
        --host 127.0.0.1 --port "$1" --max-model-len 2048 >"$4" 2>&1 &
    PIDS+=($!)
}

wait_health() {  # url
    for _ in $(seq 900); do curl -sf -m 2 "$1/health" >/dev/null && return 0; sleep 1; done
    echo "no /health at $1" >&2; return 1
}

mesh_round() {  # round
    local t0=$SECONDS
    start_mesh "$OUT/mesh-r$1.log"
    echo "mesh ready in $((SECONDS - t0)) s (round $1)" >>"$OUT/runs.log"
    warm "$URL" demo/smollm2 "$KEY"
    for sc in $SWEEP; do guide "$URL" demo/smollm2 "$KEY" "${sc%%:*}" "${sc##*:}" "$OUT/mesh-r$1-c${sc%%:*}.json"; done
    stop_all
}

vllm_round() {  # round
    local t0=$SECONDS
    start_vllm 8301 smollm2 "" "$OUT/vllm-r$1.log"
    wait_health http://127.0.0.1:8301
    echo "vllm ready in $((SECONDS - t0)) s (round $1)" >>"$OUT/runs.log"
    warm http://127.0.0.1:8301 smollm2 ""
    for sc in $SWEEP; do guide http://127.0.0.1:8301 smollm2 "" "${sc%%:*}" "${sc##*:}" "$OUT/vllm-r$1-c${sc%%:*}.json"; done
    stop_all
}

PARTS=${PARTS:-"sweep mesh3 vllm3"}   # which parts run
[[ " $PARTS " == *" sweep "* ]] && for r in $(seq "$ROUNDS"); do
    if [ $((r % 2)) = 1 ]; then mesh_round "$r"; vllm_round "$r"; else vllm_round "$r"; mesh_round "$r"; fi
done

# Three models, 4 streams and 16 requests each, all at once.
wait_guides() { for j in $(jobs -p); do case " ${PIDS[*]} " in *" $j "*) ;; *) wait "$j";; esac; done; }
if [[ " $PARTS " == *" mesh3 "* ]]; then
    cp "$M/$GGUF" "$OUT/allowed/m2.gguf"; cp "$M/$GGUF" "$OUT/allowed/m3.gguf"
    start_mesh "$OUT/mesh-three.log"
    for m in m2 m3; do
        curl -sf -X POST "$URL/admin/tenants/demo/models" -H "Authorization: Bearer compare" \
            -H 'Content-Type: application/json' -d "{\"name\": \"$m\", \"path\": \"$m.gguf\"}" >/dev/null
    done
    for m in demo/smollm2 m2 m3; do warm "$URL" "$m" "$KEY"; done
    for m in demo/smollm2 m2 m3; do guide "$URL" "$m" "$KEY" 4 16 "$OUT/mesh-three-${m##*/}.json" & done
    wait_guides
    stop_all
fi
if [[ " $PARTS " == *" vllm3 "* ]]; then
    start_vllm 8301 smollm2 0 "$OUT/vllm-three-1.log"
    start_vllm 8302 m2 1 "$OUT/vllm-three-2.log"
    start_vllm 8303 m3 0 "$OUT/vllm-three-3.log"
    t0=$SECONDS
    for p in 8301 8302 8303; do wait_health "http://127.0.0.1:$p"; done
    echo "three vllm servers ready in $((SECONDS - t0)) s" >>"$OUT/runs.log"
    for p in 8301:smollm2 8302:m2 8303:m3; do warm "http://127.0.0.1:${p%%:*}" "${p##*:}" ""; done
    for p in 8301:smollm2 8302:m2 8303:m3; do
        guide "http://127.0.0.1:${p%%:*}" "${p##*:}" "" 4 16 "$OUT/vllm-three-${p##*:}.json" &
    done
    wait_guides
    stop_all
fi
echo "reports in $OUT; python scripts/guidellm_table.py LABEL=REPORT.json ..." >&2
