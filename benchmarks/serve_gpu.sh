#!/usr/bin/env bash
# Issue 47's one-GPU row of `unirl serve`: the Qwen3-4B-shape LoRA step (rank 16 on every decoder
# linear, one 16,384-token datum, cross-entropy + optim_step) through the official tinker SDK and
# an in-process server, against the same step through the backend directly, on Megatron and
# FSDP2 (benchmarks/serve_overhead.py --shape qwen3-4b --device cuda). Run from the repository
# root on the GPU machine, with the wheels (`unirl serve`'s set beside GPU.md's megatron-core /
# DeepSpeed set) in .whl/:
#
#   OUT=$OUT bash benchmarks/serve_gpu.sh
#
# 1. installs .whl/*.whl into .site (newest version of each project: benchmarks/wheel_set.py),
# 2. runs each backend in its own process under its own timeout (LIMIT_<backend> seconds; a
#    backend is skipped when its limit would pass TOTAL seconds since the start), one Hugging
#    Face folder of random bf16 weights shared by both (MODEL_DIR, made by the first run),
# 3. writes $OUT/serve-qwen3-4b-<backend>.json and $OUT/log.txt (each run's log tail), prints a
#    summary. Estimated on one H100 from the 4B rows (Megatron build ~80 s, FSDP2 ~60-90 s, the
#    LoRA step at 16k tokens 1.7 s / 2.6 s; 2 x (1 warm-up + 6) steps each; the 8 GB folder
#    ~20 s once): ~170 s + ~150 s, about 5.5 minutes in all; at most TOTAL=400 s of runs.
#    The GPU machine has no git: rename each JSON to benchmarks/results/serve_overhead/
#    <date>_<h100|h200>_<commit>_qwen3-4b-<backend>.json (benchmarks/result_files.py).
#
# A dry run on the CPU (no install, a shrunken shape, fp32):
#
#   SKIP_INSTALL=1 DEVICE=cpu EXTRA="--layers 1 --hidden 256 --vocab 1024 --tokens 256 --steps 1" \
#       OUT=/tmp/serve_gpu bash benchmarks/serve_gpu.sh
set -u
OUT=${OUT:?set OUT to the folder for the JSON}
mkdir -p "$OUT"
PY=${PY:-python3}
WHL=${WHL:-.whl}
SITE=${SITE:-$PWD/.site}
DEVICE=${DEVICE:-cuda}
EXTRA=${EXTRA:-}
STEPS=${STEPS:-6}
TOTAL=${TOTAL:-400}
LIMIT_megatron=${LIMIT_megatron:-210}
LIMIT_fsdp2=${LIMIT_fsdp2:-180}
MODEL_DIR=${MODEL_DIR:-/tmp/serve-qwen3-4b-$DEVICE}
began=$(date +%s)
log() { echo "$*" | tee -a "$OUT/log.txt"; }

if [ -z "${SKIP_INSTALL:-}" ]; then
  wheels=$($PY benchmarks/wheel_set.py "$WHL") || exit 1
  if ! $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" \
      $wheels > "$OUT/.install.log" 2>&1; then
    log "=== install failed"; tail -n 20 "$OUT/.install.log" | tee -a "$OUT/log.txt"; exit 1
  fi
  log "=== installed $(echo "$wheels" | wc -l) wheels into $SITE in $(( $(date +%s) - began )) s"
  export PYTHONPATH=$SITE:$PWD
else
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
fi
$PY -c "import tinker, fastapi, uvicorn, peft, torch; print('tinker', tinker.__version__, 'torch',
torch.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tee -a "$OUT/log.txt"

for backend in megatron fsdp2; do
  limit_var=LIMIT_$backend
  limit=${!limit_var}
  if [ $(( $(date +%s) - began + limit )) -gt "$TOTAL" ]; then
    log "=== $backend: skipped, its limit $limit s would pass TOTAL=$TOTAL s"
    continue
  fi
  json="$OUT/serve-qwen3-4b-$backend.json"
  cmd="$PY benchmarks/serve_overhead.py --shape qwen3-4b --device $DEVICE --backend $backend \
--steps $STEPS --repeats 1 --small 32 --model-dir $MODEL_DIR $EXTRA --out $json"
  log "=== $backend: $cmd"
  start=$(date +%s)
  timeout "$limit" $cmd > "$OUT/.run.log" 2>&1
  rc=$?
  grep -v "microbatches in" "$OUT/.run.log" | tail -n 15 | cut -c1-400 >> "$OUT/log.txt"
  log "=== $backend: exit $rc after $(( $(date +%s) - start )) s"
done
rm -f "$OUT/.run.log" "$OUT/.install.log"

# the summary: one line per backend
$PY - "$OUT" <<'EOF' 2>&1 | tee -a "$OUT/log.txt"
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("serve-qwen3-4b-*.json")):
    r = json.loads(path.read_text())
    peak = r.get("peak_memory_gib")
    print(
        f"{r['backend']:>8} on {r['device_name']}: step {r['server_step_median_s']:.3f} s "
        f"through the server, {r['direct_step_median_s']:.3f} s direct "
        f"({r['server_tokens_per_s']:,.0f} / {r['direct_tokens_per_s']:,.0f} tok/s); overhead "
        f"{r['overhead']:+.1%} (pairs {r['overhead_median_of_pairs']:+.1%}, fastest "
        f"{r['overhead_fastest']:+.1%}); build {r['server_build_s']:.0f} s; peak "
        + (f"{peak:.1f} GiB" if peak is not None else "n/a")
    )
EOF
log "=== done after $(( $(date +%s) - began )) s"
