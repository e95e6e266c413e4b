#!/usr/bin/env bash
# Compile every SSD, glue and loss kernel launch for sm_90 with the GPU machine's Triton version, on this CPU machine, before
# spending device time: a kernel change that the interpreter's Triton accepts can still fail the GPU's compiler
# (2026-12-04: Triton 3.6's software pipeliner rejected a conditional store that 3.9 compiled). Prints each
# launch's registers and spill bytes (benchmarks/ssd_registers.py) and fails on any launch that does not compile.
#
#   make compile-check                 # Triton 3.6.0 (the H200 image's), unpacked once into .triton-3.6.0/
#   GPU_TRITON=3.5.1 make compile-check
set -euo pipefail
version="${1:-3.6.0}"
python="${PYTHON:-.venv/bin/python}"
dir=".triton-$version"
if [ ! -d "$dir/triton" ]; then
  tmp="$(mktemp -d)"
  echo "fetching triton==$version (no dependencies) into $dir"
  "$python" -m pip download -q --no-deps --only-binary=:all: "triton==$version" -d "$tmp"
  mkdir -p "$dir.partial"
  "$python" -m zipfile -e "$tmp"/triton-"$version"-*.whl "$dir.partial"
  chmod +x "$dir.partial"/triton/backends/nvidia/bin/*
  rm -rf "$tmp" "$dir" && mv "$dir.partial" "$dir"
fi
out="$(mktemp)"
trap 'rm -f "$out"' EXIT
for pass in auto fused; do
  for shape in 1.4b 1b_norm 410m_norm 160m_norm mamba2; do
    for dtype in bf16 fp16 fp32; do
      echo "== $shape $dtype (HMSCALE_SSD_PASS=$pass)"
      HMSCALE_SSD_PASS="$pass" PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" \
        "$python" benchmarks/ssd_registers.py --shape "$shape" --dtype "$dtype" | grep '^| _' \
        | tee -a "$out"
    done
  done
done
for op in conv fm-all ce; do  # the glue kernels (the feature map at every size it takes) and stage 2's loss
  for dtype in bf16 fp32; do
    echo "== $op $dtype"
    PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" "$python" benchmarks/ssd_registers.py --op "$op" --dtype "$dtype" \
      --seq 64 | grep '^| _' | tee -a "$out"
  done
done
if grep -q ERROR "$out"; then
  echo "FAIL: $(grep -c ERROR "$out") launch(es) did not compile with triton $version" >&2
  exit 1
fi
# a block may hold 227 KiB of shared memory on an H100 / H200: a launch that needs more compiles and then fails
big="$(awk -F'|' '{v = $8; gsub(/ /, "", v); if (v + 0 > 227) print}' "$out")"
if [ -n "$big" ]; then
  echo "FAIL: launch(es) needing more than the 227 KiB of shared memory a block may have:" >&2
  echo "$big" >&2
  exit 1
fi
echo "PASS: every launch compiled with triton $version ($(wc -l < "$out") launches)"
