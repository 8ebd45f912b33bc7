#!/usr/bin/env bash
# Issue 49's long-sequence rows on one GPU: Qwen3-4B and Qwen3-0.6B at 16k / 64k tokens, Megatron
# (benchmarks/megatron_throughput.py) and FSDP2 (benchmarks/backend_throughput.py), one row per
# process under its own timeout, each row's JSON to $OUT/<row>.json and every row's log tail to
# $OUT/log.txt (the GPU machine brings back at most 8 files).
#
#   OUT=/tmp/out bash benchmarks/long_sequences.sh m4b-16k m4b-64k m06b-64k
#
# A row whose first setting runs out of memory tries the next one listed for it (more recompute).
#
# The full Qwen3-4B rows (issue 49) on one 80 GB H100 keep the optimizer state in host memory
# (--optimizer-offload cpu: 18 bytes per parameter, 67 GiB, leave the GPU's 6, 22.5 GiB); each row
# JSON records the MFU on 6N + attention FLOPs, the peak memory, the offload choice and `unirl
# check`'s memory plan. Estimated on one H100 from the measured rows (36-layer Megatron build
# 76 s, FSDP2 4B build 56-88 s, the 18-layer 64k step 10 s): m4b-64k-offload ~170 s,
# m4b-16k-offload ~130 s, f4b-64k-offload ~190 s, m4b-longest ~150-210 s per length (each length
# builds the model again): the three rows fit one call of <= 10 minutes, the search a second:
#
#   OUT=$OUT TOTAL=580 bash benchmarks/long_sequences.sh m4b-64k-offload m4b-16k-offload f4b-64k-offload
#   OUT=$OUT TOTAL=580 LIMIT=570 bash benchmarks/long_sequences.sh m4b-longest
#
# TOTAL (seconds) bounds the whole call: a setting is not started when its LIMIT would pass it
# (logged as skipped). A dry run of the plumbing on the CPU, every length / SHRINK and EXTRA
# appended to each command (tiny shapes):
#
#   OUT=/tmp/ls SHRINK=1024 EXTRA="--device cpu --layers 1 --hidden 64" \
#       bash benchmarks/long_sequences.sh m4b-64k-offload f4b-64k-offload m4b-longest
set -u
OUT=${OUT:?set OUT to the folder for the JSON}
mkdir -p "$OUT"
EXTRA=${EXTRA:-}
SHRINK=${SHRINK:-1}
MT="python benchmarks/megatron_throughput.py"
M="$MT --modes reuse"
LIMIT=${LIMIT:-240}
TOTAL=${TOTAL:-100000}
# the parent's own timeout ends its child engine process (a killed parent would leave it running)
F="python benchmarks/backend_throughput.py --engines fsdp2 --timeout-s $((LIMIT - 15))"
at() {
  local n=$(($1 / SHRINK))
  echo "--samples $2 --group $2 --min-len $n --max-len $n --tokens-per-microbatch $n"
}
# the longest single sequence that fits, each length in its own process (longest_sequence.py)
L="python benchmarks/longest_sequence.py --timeout-s $((LIMIT - 20)) --budget-s $((LIMIT - 10))"
lengths() { local o=""; for n in "$@"; do o="$o,$((n / SHRINK))"; done; echo "--lengths ${o#,}"; }

# row -> settings to try in turn, separated by '|'
declare -A ROWS=(
  [m4b-16k]="$M --model qwen3-4b $(at 16384 2) --fused-head --recompute-activations --recompute-layers 12 --steps 2 \
|$M --model qwen3-4b $(at 16384 2) --fused-head --recompute-activations --steps 2"
  [m4b-64k]="$M --model qwen3-4b $(at 65536 1) --recompute-activations --steps 1"
  [m06b-64k]="$M --model qwen3-0.6b $(at 65536 2) --steps 2 \
|$M --model qwen3-0.6b $(at 65536 2) --recompute-modules mlp --steps 2"
  [m06b-64k-mlp]="$M --model qwen3-0.6b $(at 65536 2) --recompute-modules mlp --steps 2"
  [f4b-16k]="$F --model qwen3-4b $(at 16384 2) --fused-head --recompute-activations --steps 2"
  [f4b-64k]="$F --model qwen3-4b $(at 65536 1) --recompute-activations --steps 1"
  [f06b-64k]="$F --model qwen3-0.6b $(at 65536 2) --steps 2 \
|$F --model qwen3-0.6b $(at 65536 2) --recompute-activations --steps 2"
  # Qwen3-4B's layer shape with 18 of its 36 layers (the head whole): fits one H100's 80 GB
  [m4b18-64k]="$M --model qwen3-4b --layers 18 $(at 65536 1) --recompute-activations --steps 1"
  [m4b18-16k]="$M --model qwen3-4b --layers 18 $(at 16384 2) --fused-head --recompute-activations --recompute-layers 6 --steps 2"
  # issue 45's LoRA rows: rank 16 on every decoder linear, the same settings as full fine-tuning
  [m4b18-16k-lora]="$M --model qwen3-4b --layers 18 $(at 16384 2) --fused-head --recompute-activations --recompute-layers 6 --steps 2 --lora-rank 16"
  [m4b-16k-lora]="$M --model qwen3-4b $(at 16384 2) --fused-head --recompute-activations --recompute-layers 12 --steps 2 --lora-rank 16 \
|$M --model qwen3-4b $(at 16384 2) --fused-head --recompute-activations --steps 2 --lora-rank 16"
  # LoRA holds no base gradients or Adam state: the activations may fit without recompute
  [m4b-16k-lora-norc]="$M --model qwen3-4b $(at 16384 2) --fused-head --steps 2 --lora-rank 16 \
|$M --model qwen3-4b $(at 16384 2) --fused-head --recompute-modules mlp --steps 2 --lora-rank 16"
  [m4b18-16k-lora-norc]="$M --model qwen3-4b --layers 18 $(at 16384 2) --steps 2 --lora-rank 16 \
|$M --model qwen3-4b --layers 18 $(at 16384 2) --fused-head --steps 2 --lora-rank 16"
  [f4b-16k-lora]="$F --model qwen3-4b $(at 16384 2) --fused-head --recompute-activations --steps 2 --lora-rank 16"
  [f4b-16k-lora-norc]="$F --model qwen3-4b $(at 16384 2) --fused-head --steps 2 --lora-rank 16"
  [f06b-64k-gc]="$F --model qwen3-0.6b $(at 65536 2) --recompute-activations --steps 2"
  [m4b-128k]="$M --model qwen3-4b $(at 131072 1) --recompute-activations --steps 1 --warmup 0"
  [f4b-128k]="$F --model qwen3-4b $(at 131072 1) --recompute-activations --steps 1 --warmup 0"
  # the full Qwen3-4B with its optimizer state in host memory (optimizer.offload: cpu)
  [m4b-64k-offload]="$M --model qwen3-4b $(at 65536 1) --recompute-activations --optimizer-offload cpu --steps 1"
  [m4b-16k-offload]="$M --model qwen3-4b $(at 16384 2) --fused-head --recompute-activations --recompute-layers 12 --optimizer-offload cpu --steps 2 \
|$M --model qwen3-4b $(at 16384 2) --fused-head --recompute-activations --optimizer-offload cpu --steps 2"
  [f4b-64k-offload]="$F --model qwen3-4b $(at 65536 1) --recompute-activations --optimizer-offload cpu --steps 1"
  # what the offload costs: the measured m4b18-64k / f4b-16k rows with their state offloaded
  [m4b18-64k-offload]="$M --model qwen3-4b --layers 18 $(at 65536 1) --recompute-activations --optimizer-offload cpu --steps 1"
  [f4b-16k-offload]="$F --model qwen3-4b $(at 16384 2) --fused-head --recompute-activations --optimizer-offload cpu --steps 2"
  # the recomputed layers keeping attention's output (--keep-attention: model.recompute_attention:
  # false, unirl.backends.kept_attention): attention's forward runs once. x2 / x8: that many
  # sequences per optimizer step (the host's Adam step paid once for all of them)
  [m4b-64k-keep]="$M --model qwen3-4b $(at 65536 1) --recompute-activations --keep-attention --optimizer-offload cpu --steps 1"
  [m4b-64k-keep-x2]="$M --model qwen3-4b $(at 65536 2) --recompute-activations --keep-attention --optimizer-offload cpu --steps 1"
  [m4b-16k-keep-x8]="$M --model qwen3-4b $(at 16384 8) --fused-head --recompute-activations --recompute-layers 8 --keep-attention --optimizer-offload cpu --steps 1 \
|$M --model qwen3-4b $(at 16384 8) --fused-head --recompute-activations --recompute-layers 12 --keep-attention --optimizer-offload cpu --steps 1"
  [f4b-64k-keep]="$F --model qwen3-4b $(at 65536 1) --recompute-activations --keep-attention --optimizer-offload cpu --liger-kernels --steps 1"
  [f4b-16k-keep]="$F --model qwen3-4b $(at 16384 2) --fused-head --recompute-activations --keep-attention --liger-kernels --steps 2 \
|$F --model qwen3-4b $(at 16384 2) --fused-head --recompute-activations --liger-kernels --steps 2"
  [m06b-64k-keep]="$M --model qwen3-0.6b $(at 65536 2) --recompute-activations --keep-attention --steps 2"
  [f06b-64k-keep]="$F --model qwen3-0.6b $(at 65536 2) --recompute-activations --keep-attention --liger-kernels --steps 2"
  # more sequences per optimizer step (an RL step trains many): the host's Adam step, a fixed
  # cost per optimizer step (its time is in each row's optimizer_s), shared by 4 x 64k / 16 x 16k
  [m4b-64k-keep-x4]="$M --model qwen3-4b $(at 65536 4) --recompute-activations --keep-attention --optimizer-offload cpu --steps 1"
  [m4b-16k-keep-x16]="$M --model qwen3-4b $(at 16384 16) --fused-head --recompute-activations --recompute-layers 12 --keep-attention --optimizer-offload cpu --steps 1"
  [f4b-64k-keep-x4]="$F --model qwen3-4b $(at 65536 4) --recompute-activations --keep-attention --optimizer-offload cpu --liger-kernels --steps 1"
  # reuse against recompute at 64k: the old log-probs from the training pass, or from a
  # forward-only pass first (the saved forward: attention is most of it at 64k)
  [m06b-64k-keep-modes]="$MT --modes reuse,recompute --model qwen3-0.6b $(at 65536 2) --recompute-activations --keep-attention --steps 2"
  [f06b-64k-keep-modes]="$F --modes reuse,recompute --model qwen3-0.6b $(at 65536 2) --recompute-activations --keep-attention --liger-kernels --steps 2"
  # the same on an H200 (141 GB): the state on the GPU (--optimizer-offload none), no host Adam
  # step; two sequences per step at 64k (one would have a zero loss: one sample in its group)
  [m4b-64k-keep-gpu]="$M --model qwen3-4b $(at 65536 2) --recompute-activations --keep-attention --optimizer-offload none --steps 1"
  [m4b-16k-keep-gpu]="$M --model qwen3-4b $(at 16384 8) --fused-head --recompute-activations --recompute-layers 8 --keep-attention --optimizer-offload none --steps 1 \
|$M --model qwen3-4b $(at 16384 8) --fused-head --recompute-activations --recompute-layers 12 --keep-attention --optimizer-offload none --steps 1"
  [f4b-64k-keep-gpu]="$F --model qwen3-4b $(at 65536 2) --recompute-activations --keep-attention --optimizer-offload none --liger-kernels --steps 1"
  # run with LIMIT=300 or more: the search's budget is LIMIT - 10 s, each length's LIMIT - 20 s
  [m4b-longest]="$L $(lengths 98304 131072 196608 262144) --out $OUT/m4b-longest.json -- \
$M --model qwen3-4b --recompute-activations --optimizer-offload cpu --steps 1 --warmup 0"
  [f4b-longest]="$L $(lengths 98304 131072 196608) --out $OUT/f4b-longest.json -- \
$F --model qwen3-4b --recompute-activations --optimizer-offload cpu --steps 1 --warmup 0"
)
# a row's JSON counts when it holds a measured step (backend_throughput writes one for a failed
# engine too)
measured() {
  python -c "import json,sys; d=json.load(open(sys.argv[1])); sys.exit(0 if d.get('table') or d.get('results') or d.get('largest') else 1)" "$1"
}

began=$(date +%s)
for row in "$@"; do
  [ -n "${ROWS[$row]:-}" ] || { echo "=== $row: no such row" >> "$OUT/log.txt"; continue; }
  IFS='|' read -ra tries <<< "${ROWS[$row]}"
  for cmd in "${tries[@]}"; do
    if [ $(( $(date +%s) - began + LIMIT )) -gt "$TOTAL" ]; then
      echo "=== $row: skipped, its LIMIT=$LIMIT s would pass TOTAL=$TOTAL s" >> "$OUT/log.txt"
      break
    fi
    # the search row names its own --out (its children write theirs)
    case "$cmd" in *longest_sequence.py*) dest="" ;; *) dest="--out $OUT/$row.json" ;; esac
    echo "=== $row: $cmd $EXTRA" >> "$OUT/log.txt"
    start=$(date +%s)
    timeout "$LIMIT" $cmd $EXTRA $dest > "$OUT/.row.log" 2>&1
    rc=$?
    tail -n 15 "$OUT/.row.log" | cut -c1-400 >> "$OUT/log.txt"
    echo "=== $row: exit $rc after $(( $(date +%s) - start )) s" >> "$OUT/log.txt"
    [ $rc -eq 0 ] && [ -s "$OUT/$row.json" ] && measured "$OUT/$row.json" && break
    rm -f "$OUT/$row.json"
  done
done
rm -f "$OUT/.row.log"
