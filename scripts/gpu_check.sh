#!/usr/bin/env bash
# The GPU checks in one command, for a session lent a GPU for a few minutes (no network there):
#   1. the device tests (tests/core/test_devices.py: every method on CUDA against float64 on the
#      CPU, bf16 state and autocast, CUDA-event stage times);
#   2. scripts/gram_blocks.py: each way of forming a factor against its bound, to choose
#      core.factors.GRAM_BLOCK for the device from data, and scripts/conv_gram.py: a stride-1
#      convolution's A from shifted views against its patches, to check on the device the
#      choice core.layers.SHIFTED_FLOP_FRACTION makes;
#   3. scripts/bench.py on CUDA (bf16 autocast, CUDA events), one workload at a time, each with
#      its own time limit and JSON file, so a slow one does not take the others' results with it
#      (each method's measurements are saved as they come: a workload cut off by its limit leaves
#      a partial record, which `scripts/bench.py --reamortize FILE` turns into tables).
# Everything lands in $OUT (the device tool's output folder) or ./gpu_check. Run from the
# repository root with a Python that has torch with CUDA, timm, transformers, scipy and pytest:
#   bash scripts/gpu_check.sh
# DEVICE, GRAM_ARGS, CONV_ARGS, WORKLOADS, BENCH_SECONDS and BENCH_ARGS override the defaults
# (the tests run the script on the CPU with a quick benchmark). The limits add up to 570 s, inside
# the device tool's 10-minute command (TESTS_SECONDS, GRAM_SECONDS, CONV_SECONDS and
# BENCH_SECONDS change them); a workload cut off by its limit can be run again alone
# (WORKLOADS=...).
set -uo pipefail

out=${OUT:-gpu_check}
python=${PYTHON:-python3}
device=${DEVICE:-cuda}
workloads=${WORKLOADS:-resnet18-32 bert-small resnet18-224}
bench_seconds=${BENCH_SECONDS:-120}
mkdir -p "$out"
# The repository first; anything already on PYTHONPATH (carried wheels, say) after it.
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1

{
    date -u
    git rev-parse HEAD 2>/dev/null || echo "no git checkout"
    "$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    if [ "$device" = cuda ]; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    fi
} >"$out/environment.txt" 2>&1

status=0
timeout "${TESTS_SECONDS:-100}" "$python" -m pytest -q -p no:cacheprovider \
    tests/core/test_devices.py >"$out/tests.log" 2>&1 || status=1
tail -n 3 "$out/tests.log"

# shellcheck disable=SC2086  # GRAM_ARGS is a list of options
timeout "${GRAM_SECONDS:-60}" "$python" -m scripts.gram_blocks --device "$device" ${GRAM_ARGS:-} \
    >"$out/gram_blocks.md" 2>&1 || status=1
tail -n 2 "$out/gram_blocks.md"

# shellcheck disable=SC2086  # CONV_ARGS is a list of options
timeout "${CONV_SECONDS:-50}" "$python" -m scripts.conv_gram --device "$device" ${CONV_ARGS:-} \
    >"$out/conv_gram.md" 2>&1 || status=1
tail -n 2 "$out/conv_gram.md"

for workload in $workloads; do
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
    timeout "$bench_seconds" "$python" scripts/bench.py --device "$device" \
        --workloads "$workload" --json "$out/bench_${device}_${workload}.json" ${BENCH_ARGS:-} \
        >>"$out/bench.log" 2>&1
    rc=$?
    [ "$rc" -eq 0 ] || status=1
    echo "bench $workload: exit $rc (124: cut off after ${bench_seconds} s)"
done
exit "$status"
