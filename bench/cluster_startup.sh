#!/usr/bin/env bash
# `pagelm serve MODEL --replicas 2` start-up on a loaded machine: Ray's default worker niceness (15)
# against pagelm's (0), alternating, with two busy loops beside it the whole time. Prints the
# seconds to /health 200 and the phases the server reports (Ray, Serve, replicas healthy).
#   bench/cluster_startup.sh [MODEL] [RUNS]     (default smollm2-135m, 2)
set -uo pipefail
cd "$(dirname "$0")/.."
model=${1:-smollm2-135m}
runs=${2:-2}
python3 -c 'while True: pass' & busy1=$!
python3 -c 'while True: pass' & busy2=$!
trap 'kill $busy1 $busy2 2>/dev/null' EXIT
log=$(mktemp)
for run in $(seq 1 "$runs"); do
  for nice in 15 0; do
    port=$(.venv/bin/python -c 'from pagelm.bench.server import free_port; print(free_port())')
    start=$(date +%s.%N)
    .venv/bin/pagelm serve "$model" --replicas 2 --port "$port" --replica-niceness "$nice" >"$log" 2>&1 &
    server=$!
    state="not ready after 600 s"
    for _ in $(seq 1 300); do
      sleep 2
      if [ "$(curl -s -o /dev/null -w '%{http_code}' "localhost:$port/health")" = 200 ]; then
        state="ready after $(echo "$(date +%s.%N) - $start" | bc | cut -d. -f1) s"
        break
      fi
    done
    kill -INT "$server"
    wait "$server"
    phases=$(grep -E '^pagelm serve: (local Ray|Serve started|replicas healthy)' "$log" | sed 's/^pagelm serve: //' | paste -sd';')
    echo "run $run, replicas at nice $nice: $state; $phases"
  done
done
rm -f "$log"
