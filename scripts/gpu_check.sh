#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, in phases, each with its own log and time limit:
#   kernels  FlashInfer's paged prefill/decode against the torch_native oracle (tests/cuda/test_flashinfer.py
#            without the model; the first run JIT-compiles FlashInfer's kernels with nvcc: minutes)
#   engine   every test marked `cuda`: the kernels again (compiled by now), SmolLM2 end to end on CUDA
#            (flashinfer vs torch_native, CUDA graphs on/off, overlap on/off, retraction with chunking, KV pool
#            sizing) and our model vs transformers on CUDA
#   bench    a short benchmarks/bench_gpu.py run (decode against the HBM roofline, prefill), JSON beside the logs
# Needs the 'serve' and 'gpu' extras and a CUDA toolkit's nvcc (see docs/ARCHITECTURE.md, the CUDA path).
#
# Usage: scripts/gpu_check.sh [PHASE ...]     (default: kernels engine bench)
#   GPU_CHECK_DIR   where the logs go (default: gpu-check)
#   GPU_CHECK_LIMIT seconds each phase may run (default: 900)
#   GPU_BENCH_ARGS  arguments for bench_gpu.py (default: a quick run over the default model and random:llama3-8b)
set -uo pipefail
cd "$(dirname "$0")/.."
dir=${GPU_CHECK_DIR:-gpu-check}
limit=${GPU_CHECK_LIMIT:-900}
bench_args=${GPU_BENCH_ARGS:---models default,random:llama3-8b --batches 1,16,64 --skip-hf --skip-torch-native}
mkdir -p "$dir"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # benchmarks/ import runtime/ without an editable install
failed=()

run_phase() {  # name, command...: runs it under the time limit, keeps its output, remembers a failure
    local name=$1
    shift
    echo "== $name: $*"
    timeout "$limit" "$@" 2>&1 | tee "$dir/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc"
    [ "$rc" -eq 0 ] || failed+=("$name")
}

python3 -c "import torch; assert torch.cuda.is_available(), 'CUDA is not available'; print(torch.__version__, \
torch.version.cuda, torch.cuda.get_device_name())" || exit 1

phases=("$@")
[ ${#phases[@]} -gt 0 ] || phases=(kernels engine bench)
for p in "${phases[@]}"; do
    case $p in
        kernels) run_phase kernels python3 -m pytest -q -rs -p no:cacheprovider tests/cuda/test_flashinfer.py \
                     -k "not smollm2" ;;
        engine) run_phase engine python3 -m pytest -q -rs -p no:cacheprovider -m cuda tests/cuda tests/model ;;
        # shellcheck disable=SC2086  # the arguments are meant to split
        bench) run_phase bench python3 benchmarks/bench_gpu.py $bench_args --out "$dir/bench_gpu.json" ;;
        *) echo "unknown phase $p (kernels, engine, bench)"; exit 2 ;;
    esac
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "failed: ${failed[*]}"
    exit 1
fi
echo "all GPU checks passed"
