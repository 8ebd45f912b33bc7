#!/usr/bin/env bash
# Issue 49's long-sequence rows on one GPU: Qwen3-4B and Qwen3-0.6B at 16k / 64k tokens, Megatron
# (benchmarks/megatron_throughput.py) and FSDP2 (benchmarks/backend_throughput.py), one row per
# process under its own timeout, each row's JSON to $OUT/<row>.json and every row's log tail to
# $OUT/log.txt (the GPU machine brings back at most 8 files).
#
#   OUT=/tmp/out bash benchmarks/long_sequences.sh m4b-16k m4b-64k m06b-64k
#
# A row whose first setting runs out of memory tries the next one listed for it (more recompute).
set -u
OUT=${OUT:?set OUT to the folder for the JSON}
mkdir -p "$OUT"
M="python benchmarks/megatron_throughput.py --modes reuse"
LIMIT=${LIMIT:-240}
# the parent's own timeout ends its child engine process (a killed parent would leave it running)
F="python benchmarks/backend_throughput.py --engines fsdp2 --timeout-s $((LIMIT - 15))"
at() { echo "--samples $2 --group $2 --min-len $1 --max-len $1 --tokens-per-microbatch $1"; }

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
  [f06b-64k-gc]="$F --model qwen3-0.6b $(at 65536 2) --recompute-activations --steps 2"
  [m4b-128k]="$M --model qwen3-4b $(at 131072 1) --recompute-activations --steps 1 --warmup 0"
  [f4b-128k]="$F --model qwen3-4b $(at 131072 1) --recompute-activations --steps 1 --warmup 0"
)
# a row's JSON counts when it holds a measured step (backend_throughput writes one for a failed
# engine too)
measured() {
  python -c "import json,sys; d=json.load(open(sys.argv[1])); sys.exit(0 if d.get('table') or d.get('results') else 1)" "$1"
}

for row in "$@"; do
  IFS='|' read -ra tries <<< "${ROWS[$row]}"
  for cmd in "${tries[@]}"; do
    echo "=== $row: $cmd" >> "$OUT/log.txt"
    start=$(date +%s)
    timeout "$LIMIT" $cmd --out "$OUT/$row.json" > "$OUT/.row.log" 2>&1
    rc=$?
    tail -n 15 "$OUT/.row.log" | cut -c1-400 >> "$OUT/log.txt"
    echo "=== $row: exit $rc after $(( $(date +%s) - start )) s" >> "$OUT/log.txt"
    [ $rc -eq 0 ] && [ -s "$OUT/$row.json" ] && measured "$OUT/$row.json" && break
    rm -f "$OUT/$row.json"
  done
done
rm -f "$OUT/.row.log"
