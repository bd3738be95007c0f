#!/usr/bin/env bash
# Regenerates docs/evaluation.md's numbers and figures: the LLM-Mesh Figure 12 grid, the
# Figure 13 ablations, the Figure 14 mixes, and a queue-rule sensitivity run.
#   scripts/evaluation.sh            # everything (about 30-40 min on 2 cores)
#   scripts/evaluation.sh fig13      # one part: fig12 | fig13 | fig14 | sensitivity | seeds | pace | capacity | live | figures
# (`live` runs a real service on this machine and is not part of `all`: 24 five-minute runs, about 2.5 h)
# JSON goes to docs/eval/, PNG figures to docs/figures/. Every run uses the shared Azure
# traces (../shared/data), seed 0, 30 minutes, 4 CPU + 4 GPU nodes, the defaults of
# `mesh replay` otherwise (0.1 rps per function, queue timeout 30 s, noise 5%).
set -euo pipefail
cd "$(dirname "$0")/.."
EVAL=docs/eval
FIG=docs/figures
mkdir -p "$EVAL" "$FIG"
PART="${1:-all}"
MESH="python -m mesh replay --no-progress --seed 0 --minutes 30"

run_fig12() {
  for model in llama-3.2-3b llama-2-7b llama-2-13b; do
    for n in 32 64 128; do
      $MESH --model "$model" --functions "$n" --policies mesh,sllm,sllm+cpu \
        --json "$EVAL/fig12_${model}_${n}.json" \
        $( [ "$n" = 128 ] && echo --plot "$FIG/fig12_${model}_${n}" )
    done
  done
}

run_fig13() {
  $MESH --model llama-2-7b --functions 64 --policies mesh,mesh-no-share,mesh-no-cpu,mesh-no-defrag \
    --json "$EVAL/fig13_llama-2-7b_64.json" --plot "$FIG/fig13_llama-2-7b_64"
}

run_fig14() {
  for mix in 4:1:1 1:1:4; do
    $MESH --mix "$mix" --functions 64 --policies mesh,sllm,sllm+cpu \
      --json "$EVAL/fig14_mix${mix//:/-}_64.json"
  done
}

run_sensitivity() {
  # The same 128 x 7B replay when every policy turns a waiting request away as soon as it
  # can no longer meet its SLO (an SLO-aware queue the baselines do not have).
  $MESH --model llama-2-7b --functions 128 --policies mesh,sllm,sllm+cpu --queue-timeout slo \
    --json "$EVAL/sensitivity_queue-slo_llama-2-7b_128.json"
  # ... and at twice the default load (0.2 rps per function).
  $MESH --model llama-2-7b --functions 128 --policies mesh,sllm,sllm+cpu --target-rps 25.6 \
    --json "$EVAL/sensitivity_load2x_llama-2-7b_128.json"
}

run_seeds() {
  # The highest-load 7B point with two more seeds (other functions, other arrivals).
  for seed in 1 2; do
    python -m mesh replay --no-progress --seed "$seed" --minutes 30 --model llama-2-7b --functions 128 \
      --policies mesh,sllm,sllm+cpu --json "$EVAL/seed${seed}_llama-2-7b_128.json"
  done
}

run_pace() {
  # The 128 x 7B replay under each deadline rule (docs/design.md), with the 30 s timeout and
  # with the `slo` queue rule, seed 0, and seed 1 with the 30 s timeout.
  for rule in eq1 pace; do
    $MESH --model llama-2-7b --functions 128 --policies mesh,sllm,sllm+cpu --deadlines "$rule" \
      --json "$EVAL/pace_llama-2-7b_128_${rule}.json"
    $MESH --model llama-2-7b --functions 128 --policies mesh,sllm,sllm+cpu --deadlines "$rule" --queue-timeout slo \
      --json "$EVAL/pace_llama-2-7b_128_slo_${rule}.json"
    python -m mesh replay --no-progress --seed 1 --minutes 30 --model llama-2-7b --functions 128 \
      --policies mesh,sllm,sllm+cpu --deadlines "$rule" --json "$EVAL/pace_llama-2-7b_128_seed1_${rule}.json"
  done
  # Mesh under pace at 128 x 3B and 13B (Eq. 1 and the baselines: the fig12 runs; the
  # baselines' numbers do not depend on the rule, as the 7B runs above show).
  for model in llama-3.2-3b llama-2-13b; do
    $MESH --model "$model" --functions 128 --policies mesh --deadlines pace --json "$EVAL/pace_${model}_128_pace.json"
  done
}

run_live() {
  # The live replays (docs/evaluation.md, "Live replay"): a real `mesh serve` on this machine
  # under each policy in turn, the trace through its OpenAI API, beside the same requests
  # simulated (the twin). Rigs: plain (two OpenVINO agents, each on its own share of the
  # cores) and mixed (those two beside one emulated A100 node). Seeds 0-2, two repeats each:
  # a fresh service and an empty data folder per run (no instance, learnt factor or cache
  # outlives its trace). The summary gives min / median / max, live and twin. Override with
  # LIVE_RIGS, LIVE_SEEDS, LIVE_REPEATS (LIVE_LOGS: keep the services' logs there). Figures are valid only on a machine nobody else uses.
  local rig seed rep policy
  for rig in ${LIVE_RIGS:-plain mixed}; do
    for seed in ${LIVE_SEEDS:-0 1 2}; do
      for rep in ${LIVE_REPEATS:-1 2}; do
        for policy in mesh sllm+cpu; do
          live_under "$rig" "$policy" "$seed" "$rep" || echo "live: $rig $policy seed $seed repeat $rep failed" >&2
        done
      done
    done
  done
  python -m mesh.bench.live_summary "$EVAL"/live_rig-*.json | tee "$EVAL/live_summary.md"
}

live_under() {
  local rig=$1 policy=$2 seed=$3 rep=$4 data port=8765 token pid nodes
  case "$rig" in
    plain) nodes="--cpu-nodes 2" ;;
    mixed) nodes="--cpu-nodes 2 --emulate a100-80gb:1" ;;
    *) echo "unknown rig $rig" >&2; return 2 ;;
  esac
  data=$(mktemp -d) token=$(python -c "import secrets; print(secrets.token_hex(16))")
  name="live_rig-${rig}_${policy/+/-}_s${seed}_r${rep}"
  # shellcheck disable=SC2086 # $nodes is several flags
  MESH_ADMIN_TOKEN=$token python -m mesh serve --port $port --data-dir "$data" $nodes \
    --policy "$policy" --log-level INFO > "$data/serve.log" 2>&1 &
  pid=$!
  # expanded now: the trap also fires when the caller returns, after these locals are gone;
  # LIVE_LOGS: a folder that keeps each run's service log (placements, parking, cold starts)
  trap "kill $pid 2>/dev/null; wait $pid 2>/dev/null; ${LIVE_LOGS:+cp '$data/serve.log' '$LIVE_LOGS/$name.log';} rm -rf '$data'; trap - RETURN" RETURN
  until grep -q "ready url=" "$data/serve.log"; do
    kill -0 $pid 2>/dev/null || { cat "$data/serve.log" >&2; return 1; }
    sleep 2
  done
  MESH_ADMIN_TOKEN=$token python -m mesh replay --no-progress --live "http://127.0.0.1:$port" --functions 4 \
    --minutes 5 --target-rps 0.4 --seed "$seed" --policies mesh,sllm+cpu \
    --json "$EVAL/$name.json"
}

run_capacity() {
  # Capacity (issue 13): per policy, the highest request rate (the trace's rate scaled) with
  # >= 90% SLO attainment under each reading, 128 functions, both queue rules. 5-minute
  # windows, a 10% bracket and growth 1.5 (runs deep in overload are the costly ones) keep
  # the search within about half an hour on 2 shared cores.
  for model in llama-3.2-3b llama-2-7b llama-2-13b; do
    for qt in 30 slo; do
      python -m mesh replay --no-progress --seed 0 --minutes 5 --model "$model" --functions 128 \
        --policies mesh,sllm,sllm+cpu --queue-timeout "$qt" --capacity --capacity-tol 0.1 --capacity-growth 1.5 \
        --json "$EVAL/capacity_${model}_128_q${qt}.json"
    done
  done
}

case "$PART" in
  fig12) run_fig12 ;;
  fig13) run_fig13 ;;
  fig14) run_fig14 ;;
  sensitivity) run_sensitivity ;;
  seeds) run_seeds ;;
  pace) run_pace ;;
  live) run_live ;;
  capacity) run_capacity ;;
  figures) ;;
  all) run_fig12; run_fig13; run_fig14; run_sensitivity; run_seeds; run_pace; run_capacity ;;
  *) echo "usage: $0 [all|fig12|fig13|fig14|sensitivity|seeds|pace|capacity|live|figures]" >&2; exit 2 ;;
esac
python scripts/evaluation_figures.py "$EVAL" "$FIG"
