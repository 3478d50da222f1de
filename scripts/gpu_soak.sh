#!/usr/bin/env bash
# The drop-in soak (issue 13) in one device call on one GPU: INSTANCES copies of benchmarks/soak.py per rank count,
# side by side under one MPS daemon, each with its own seed and the same time budget, then one table of the rounds
# and mismatches per rank count (summed over instances). Ranks share the GPU: correctness only.
#   usage: SECONDS_EACH=500 bash scripts/gpu_soak.sh [RANKS ...]     (default: 4; INSTANCES=2, SEED0=from the clock)
# Run it alone: every rank's kernels spin on 24 SMs while they wait for peers, and beside other process groups a
# sender can find no free SM until the kernel timeout (tenth session: four test groups and two soaks). One 4-rank
# instance ran 4.9 rounds/s beside three test parts, two instances alone 2.4 each (tenth session, before the one-thread rule).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" gpu_soak
SECONDS_EACH=${SECONDS_EACH:-500}
INSTANCES=${INSTANCES:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # many ranks of small ops on one host: one intra-op thread each
SEED0=${SEED0:-$(( $(date +%s) % 100000 * 1000 ))}
ranks=("$@")
[ ${#ranks[@]} -gt 0 ] || ranks=(4)
python3 -c "from moe_ep_plugin.ops import library; r = library.unavailable_reason(); print('kernel library:', r or 'loads'); assert r is None" || exit 1
mps_on
for r in "${ranks[@]}"; do
    for i in $(seq 1 "$INSTANCES"); do
        seed=$(( SEED0 + r * 10000000 + i * 100000 ))
        python3 benchmarks/soak.py --transport nvlink --device cuda:0 --ranks "$r" --rounds 1000000 --seed "$seed" \
            --max-seconds "$SECONDS_EACH" > "$LOGS/soak_${r}_$i.log" 2>&1 &
    done
done
wait
mps_off
echo "| ranks | instances | rounds | mismatches | first seeds |"
echo "|---:|---:|---:|---:|---|"
for r in "${ranks[@]}"; do
    # each log ends with soak.py's table row: | transport | ranks | device | rounds | mismatches | seconds | seed |
    rows=$(grep -h "^| nvlink | $r |" "$LOGS"/soak_"${r}"_*.log)
    rounds=$(echo "$rows" | awk -F'|' '{s += $5} END {print s + 0}')
    bad=$(echo "$rows" | awk -F'|' '{s += $6} END {print s + 0}')
    seeds=$(echo "$rows" | awk -F'|' '{printf "%s%s", sep, $8; sep=","}' | tr -d ' ')
    echo "| $r | $(echo "$rows" | grep -c . ) | $rounds | $bad | $seeds |"
done
grep -h "MISMATCH\|Traceback\|Error" "$LOGS"/soak_*.log | head -n 20
