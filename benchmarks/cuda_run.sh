#!/usr/bin/env bash
# One run on a lent NVIDIA GPU (the `device` tool), from the repository root there:
# the torch backend's tests on CUDA, then speed on full-size synthetic copies of the three
# models (benchmarks/synthetic_gguf.py: the real files' headers, random blocks), beside
# llama.cpp's CUDA llama-bench on the same files when one is carried.
#
# Carried in .device/ (git-ignored): whl/ (packages the machine lacks: gguf, cffi, ...),
# skel/*.skel.gz (synthetic_gguf.py skeleton of each model), llama/ (optional:
# llama-bench.xz, built with -DGGML_CUDA=ON against CUDA 13, and lib/libgomp.so.1).
#
# STEPS names the steps, run in that order (default: all; "a+b": a and b at once, for steps
# whose speed is not measured, such as the two test steps); PYTEST_K narrows the tests,
# MODEL_NAMES the per-model steps' models, ENGINE_S sets the engine step's seconds a run,
# ENGINE_STREAMS its request counts (default "1 2 4"), ENGINE_CHURN=K K x N requests N at a
# time (engine_one_stream.py --churn: the sets change, as a busy server's).
# BUDGET_S: the seconds the whole script may take (a lease is short): a step is cut to what
# is left, and skipped when too little is. Logs are gathered in $LOGS and packed into
# $OUT/logs.tgz after every step (the lease hands back 8 files at most, and a step cut
# short keeps what it wrote).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/edgellm-out}
STEPS=${STEPS:-"tests+plaintests llama bench anatomy pipeline pdl plainbench pdlprompt tune ab fusions qkv loops ctx sampling engine profile prefill mem memwhere memctx matvec sweep"}
START=$SECONDS
BUDGET_S=${BUDGET_S:-100000}
LOGS=/tmp/edgellm-logs
mkdir -p "$OUT" "$LOGS" /tmp/m
# kernel variants are timed once per card (backends/torch/tuning.py); every step shares the
# choices, which come back in logs.tgz (tuning/)
export EDGELLM_HOME=${EDGELLM_HOME:-/tmp/edgellm-home}
# the choices an earlier lease timed on its card (benchmarks/tuning/, from its logs.tgz):
# a fresh machine then spends no minutes timing them again (a file of another card, triton
# or kernel version is not read; one already there is kept)
mkdir -p "$EDGELLM_HOME/tuning" && cp -n benchmarks/tuning/*.json "$EDGELLM_HOME/tuning/"

left() { echo $((BUDGET_S - (SECONDS - START))); }
# limit N: N seconds, or what the budget leaves less 15 s to pack the logs
limit() { local l=$(($(left) - 15)); echo $((l < $1 ? l : $1)); }
# enough N WHAT: are more than N seconds left? (else say WHAT is skipped)
enough() { (($(left) > $1)) || { echo "== skipped ($(left) s left): ${*:2}"; false; }; }
pack() {
    [ -d "$EDGELLM_HOME/tuning" ] && cp -r "$EDGELLM_HOME/tuning" "$LOGS/"
    tar -czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null
    echo "   [$((SECONDS - START)) s]"
}
name() { basename "$1" .gguf; }

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .device/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
# the package layout of pyproject's package-dir, without installing: edgellm.backends etc.
for d in backends converters apps native tests; do ln -sfn "../$d" "edgellm/$d"; done
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

for s in .device/skel/*.skel.gz; do
    python3 benchmarks/synthetic_gguf.py fill "$s" "/tmp/m/$(basename "$s" .skel.gz).gguf" &
done
wait
ls -la /tmp/m
GEMMA=/tmp/m/gemma-3-270m-q4_k_m.gguf
SMALL=/tmp/m/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
LARGE=/tmp/m/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
MODELS=("$LARGE" "$GEMMA" "$SMALL")  # the goals' models first
# MODEL_NAMES narrows the per-model steps to some (file names without .gguf: a short lease)
if [ -n "${MODEL_NAMES:-}" ]; then
    MODELS=(); for n in $MODEL_NAMES; do MODELS+=("/tmp/m/$n.gguf"); done
fi

# cuda_pytest LOG -k EXPR FILE...: the tests (8 workers, no tuning but the tuning test's own)
cuda_pytest() {
    local log=$1
    EDGELLM_TUNE=0 timeout "$(limit ${PYTEST_S:-200})" python3 -m pytest -q -p no:cacheprovider -n 8 \
        "${@:2}" > "$LOGS/$log" 2>&1
    echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)" "$LOGS/$log" | head -n 20
    tail -n 2 "$LOGS/$log"
}

step_tests() {  # first: the kernels' results on this GPU, before any figure is believed
    echo "== tests on CUDA"
    enough 60 tests || return
    cuda_pytest pytest.log -k "${PYTEST_K:-torch and not teacher}" \
        tests/test_torch_kernels.py tests/test_torch_tuning.py tests/test_torch_models.py \
        tests/test_backend_conformance.py
}

# the kernel and model tests with plain launches: on Hopper `tests` runs every launch as a
# programmatic dependent launch (kernels._pdl's default, 2), so a failure in one and not
# the other points at a kernel that read the launch before's output before its wait
step_plaintests() {
    echo "== tests on CUDA, EDGELLM_PDL=0"
    enough 60 plaintests || return
    EDGELLM_PDL=0 cuda_pytest pytest-plain.log -k "${PYTEST_K:-not teacher}" \
        tests/test_torch_kernels.py tests/test_torch_models.py
}

LLAMA=""
step_llama() {  # unpack llama.cpp's CUDA llama-bench; `bench` runs it beside ours
    [ -f .device/llama/llama-bench.xz ] || return
    xz -dc .device/llama/llama-bench.xz > /tmp/llama-bench && chmod +x /tmp/llama-bench
    local libs
    libs=$(find /usr/local /opt -name 'libcublas.so.13' -o -name 'libcudart.so.13' 2>/dev/null \
           | xargs -r -n1 dirname | sort -u | tr '\n' ':')
    export LD_LIBRARY_PATH="${libs}$PWD/.device/llama/lib:${LD_LIBRARY_PATH:-}"
    /tmp/llama-bench --list-devices 2>&1 | tail -n 3 && LLAMA=/tmp/llama-bench
}

step_bench() {
    local m json off rc
    for m in "${MODELS[@]}"; do
        if [ -n "$LLAMA" ] && enough 40 llama-bench "$(name "$m")"; then
            echo "== llama-bench CUDA $(name "$m")"
            timeout "$(limit 100)" "$LLAMA" -m "$m" -p 512 -n 128 -r 3 -ngl 99 -o md 2>&1 \
                | tee -a "$LOGS/llama-bench.md" | grep -E "^\|" | tail -n 2
        fi
        echo "== edgellm bench --backend torch $(name "$m")"
        # (the first run on a card times kernel variants: tune_s)
        json="$LOGS/bench-$(name "$m").json"
        # on failure, again with fewer fusions: the newest launch fusions, then all of them
        for off in "" "EDGELLM_FUSE_LAUNCHES=0" "EDGELLM_FUSE_LAUNCHES=0 EDGELLM_FUSE_QUANTIZE=0"
        do
            enough 60 bench "$(name "$m")" $off || break
            [ -n "$off" ] && echo "== again with $off"
            bench_one "$m" "$json" 240 $off && break
        done
        pack
    done
}
# bench_one MODEL JSON SECONDS [VAR=VALUE...]: edgellm bench's pp512 and tg128 into JSON
# (its records summed up a line each); fails as the bench does
bench_one() {
    local rc
    env "${@:4}" timeout "$(limit "$3")" python3 -m edgellm.apps.cli bench -m "$1" \
        --backend torch -p 512 -n 128 -r 3 -o json > "$2" 2> "$LOGS/bench.err"
    rc=$?; echo "rc=$rc"; tail -n 3 "$LOGS/bench.err"
    [ -s "$2" ] && python3 -c "import json,sys; [print(r['test'], round(r['mean_ts'],1), 't/s', {k: r.get(k) for k in ('capture_s','tune_s','peak_device_memory','device_weight_bytes','kv_bytes','bandwidth','peak_bandwidth','ttft_ms')}) for r in json.load(open(sys.argv[1]))]" "$2"
    return $rc
}

# the bench again with plain launches (EDGELLM_PDL=0), beside the `bench` step's figures
# (on Hopper: programmatic dependent launches, prefetched weights) from the same card
step_plainbench() {
    local m
    for m in "${MODELS[@]}"; do
        enough 40 "bench EDGELLM_PDL=0 $(name "$m")" || return
        echo "== edgellm bench --backend torch, EDGELLM_PDL=0 $(name "$m")"
        bench_one "$m" "$LOGS/bench-plain-$(name "$m").json" 120 EDGELLM_PDL=0
    done
}

decode_ab() {  # decode_ab VAR VALUES MODEL...: torch_decode_ab.py in alternating processes
    local var=$1 values=$2 m v
    for m in "${@:3}"; do
        for v in $values; do
            enough 45 "decode A/B $var=$v $(name "$m")" || return
            env "$var=$v" timeout "$(limit 90)" python3 benchmarks/torch_decode_ab.py "$m" 2>&1 \
                | tee -a "$LOGS/decode_ab.txt" | tail -n 1
        done
    done
}
prompt_ab() {  # prompt_ab VAR VALUES MODEL: pp512 alone (edgellm bench -n 0) per value
    local var=$1 values=$2 m=$3 v
    for v in $values; do
        enough 45 "pp512 $var=$v $(name "$m")" || return
        echo -n "$(name "$m") $var=$v: "
        env "$var=$v" timeout "$(limit 90)" python3 -m edgellm.apps.cli bench -m "$m" \
            --backend torch -p 512 -n 0 -r 5 -o json 2>/dev/null | python3 -c "import json,sys; [print(r['test'], round(r['mean_ts']), '+-', round(r['std_ts'])) for r in json.load(sys.stdin)]" \
            | tee -a "$LOGS/prompt_ab.txt"
    done
}
# plain launches, programmatic dependent launches, and those with the mat-vecs' weights
# prefetched (kernels._pdl): decode of the 1.5B and Gemma, the modes taking turns in one
# process (each its own graphs); `pdlprompt`: Gemma's pp512 (modes 1 and 2 differ only in
# the mat-vecs, which a prompt does not run)
step_pdl() {
    local m
    for m in "$LARGE" "$GEMMA"; do
        enough 45 "decode PDL A/B $(name "$m")" || return
        timeout "$(limit 90)" python3 benchmarks/torch_decode_ab.py "$m" --pdl 0,1,2 2>&1 \
            | tee -a "$LOGS/decode_pdl.txt" | tail -n 3
    done
}
step_pdlprompt() { prompt_ab EDGELLM_PDL "${PDL_ORDER:-0 2 0 2}" "$GEMMA"; }
# decode: the tiles the card chose (the `bench` step saved them) against the defaults
step_tune() { decode_ab EDGELLM_TUNE "${TUNE_ORDER:-0 1 0 1}" "$LARGE" "$GEMMA"; }
# decode of the 1.5B with the mat-vecs' loops (kernels.matvec_pipeline) taking turns in one
# process: 0 plain, 1 loads in registers a step ahead (the default; the first run tunes
# each mode's tiles)
step_pipeline() {
    enough 60 "pipeline A/B" || return
    timeout "$(limit 240)" python3 benchmarks/torch_decode_ab.py "$LARGE" \
        --turns "EDGELLM_MATVEC_PIPELINE=${PIPELINE_MODES:-0,1}" 2>&1 \
        | tee -a "$LOGS/decode_pipeline.txt" | tail -n 3
}
# decode: launch fusions off/on; host vs device argmax
step_ab() { decode_ab EDGELLM_FUSE_LAUNCHES "${AB_ORDER:-0 1 0 1}" "$LARGE" "$GEMMA"; }
# decode: each of the newest fusions off alone (backend.FUSIONS), against all on (",")
step_fusions() {
    decode_ab EDGELLM_UNFUSE "${UNFUSE_ORDER:-, attention_blocks glu kv_write join rope ,}" \
        "$LARGE"
}
# decode: the Q+K+V launch's fusions off/on together: V of another block type joined to the
# Q+K stack's launch (the 1.5B's Q6_K V in 14 of its 28 layers) and RoPE in its epilogue
# (every Qwen layer); the 1.5B, and Gemma (its Q8_0 V joined in 9 of 18 layers; its RoPE
# stays a launch: its Q/K norms need whole heads)
step_qkv() {
    decode_ab EDGELLM_UNFUSE "${QKV_ORDER:-join,rope , join,rope ,}" "$LARGE" "$GEMMA"
}
# decode of the 1.5B with looping mat-vec tiles among those timed (the default: gate+up and
# the output projection, kernels.matvec_candidates) and without (EDGELLM_MATVEC_LOOPS=0),
# taking turns in one process (each mode's first turn tunes its own tiles)
step_loops() {
    enough 60 "loops A/B" || return
    timeout "$(limit 240)" python3 benchmarks/torch_decode_ab.py "$LARGE" \
        --turns "EDGELLM_MATVEC_LOOPS=${LOOP_MODES:-0,1}" 2>&1 \
        | tee -a "$LOGS/decode_loops.txt" | tail -n 3
}

# decode over a chat's cache (4096 slots: the default context) and a long one, against the
# bench's 144: a graph attends over its whole storage, the slots its mask hides included
step_ctx() {
    local c
    for c in ${CTX_ORDER:-0 4096 32768 0}; do
        enough 45 "decode ctx=$c" || return
        timeout "$(limit 90)" python3 benchmarks/torch_decode_ab.py "$LARGE" --ctx "$c" 2>&1 \
            | tee -a "$LOGS/decode_ctx.txt" | tail -n 1
    done
}

# the default chain, and a penalised one, drawn on the device (sampled_tokens) against the host
step_sampling() {
    enough 60 "sampling" || return
    timeout "$(limit 150)" python3 benchmarks/sampling_ab.py "$LARGE" --backend torch \
        --tokens 128 2>&1 | tee -a "$LOGS/sampling.txt" | tail -n 7
}

# requests through the engine (the server's path), graphs or not: one at a time, then 2 and
# 4 at once (their decode steps as one graph of the set, or each sequence's own in turn);
# ENGINE_STREAMS: other counts (past 8: several batch graphs a step); ENGINE_CHURN: --churn
step_engine() {
    local n
    for n in ${ENGINE_STREAMS:-1 2 4}; do
        enough 60 "engine, $n streams" || return
        timeout "$(limit "${ENGINE_S:-150}")" python3 benchmarks/engine_one_stream.py "$LARGE" \
            --tokens 128 --streams "$n" ${ENGINE_CHURN:+--churn "$ENGINE_CHURN"} 2>&1 |
            tee -a "$LOGS/engine.txt" | tail -n 3
        local rc=${PIPESTATUS[0]}
        ((rc == 0)) || echo "== engine, $n streams: rc=$rc (124: cut at its limit)"
    done
}

# per_model LABEL SCRIPT LINES MODEL...: SCRIPT on each model in turn (90 s each at most),
# its output in $LOGS/LABEL-<model>.txt and its last LINES lines shown
per_model() {
    local m
    for m in "${@:4}"; do
        enough 45 "$1 $(name "$m")" || return
        echo "== $1 $(name "$m")"
        timeout "$(limit 90)" python3 "$2" "$m" 2>&1 | tee "$LOGS/$1-$(name "$m").txt" \
            | tail -n "$3"
    done
}

# where a decode mat-vec's time goes (after `bench`, whose tuning it reuses): the 1.5B's
# largest mat-vecs against their loads alone, an empty grid and a plain stream of as many bytes
step_anatomy() {
    enough 45 "mat-vec anatomy" || return
    echo "== mat-vec anatomy"
    timeout "$(limit 150)" python3 benchmarks/matvec_anatomy.py 2>&1 | tee "$LOGS/anatomy.txt" \
        | tail -n 8
}

# kernels per prompt and decode step: the 1.5B's decode, Gemma's prefill
step_profile() { per_model profile benchmarks/torch_profile.py 40 "$LARGE" "$GEMMA"; }

step_prefill() {  # a prompt's GEMM variants (cast, f32 out, fused tiles) and ring rules
    local m
    for m in "$GEMMA" "$LARGE"; do
        enough 60 "prefill A/B $(name "$m")" || return
        echo "== prefill A/B $(name "$m")"
        timeout "$(limit 180)" python3 benchmarks/torch_prefill_ab.py "$m" \
            ${PREFILL_TILES:+--tiles "$PREFILL_TILES"} 2>&1 | tee -a "$LOGS/prefill_ab.txt" \
            | tail -n 12
    done
}

step_mem() {  # device memory at peak and pp512: cuBLAS's workspace 32 MiB against ours, 16
    local ws  # (Gemma: the model furthest over 1.2x at 32 MiB)
    for ws in ":4096:8" ":4096:4" ":4096:8" ":4096:4"; do
        enough 40 "mem $ws" || return
        echo "== CUBLAS_WORKSPACE_CONFIG=$ws $(name "$GEMMA")"
        CUBLAS_WORKSPACE_CONFIG=$ws timeout "$(limit 100)" python3 -m edgellm.apps.cli bench \
            -m "$GEMMA" --backend torch -p 512 -n 128 -r 5 -o json 2>/dev/null | python3 -c "import json,sys; [print(r['test'], round(r['mean_ts'],1), 't/s peak', r.get('peak_device_memory'), 'gguf', r.get('size'), 'kv', r.get('kv_bytes')) for r in json.load(sys.stdin)]"
    done
}

# where the peak device memory goes (allocation history grouped by our line; after `bench`,
# whose tuning it reuses): Gemma, the model furthest over 1.2x, then the 1.5B
step_memwhere() { per_model memory benchmarks/torch_memory.py 24 "$GEMMA" "$LARGE"; }

# the same at a chat's cache (4,096 tokens: the 1.5B's KV is 117 MB, where a cache held twice
# would show)
step_memctx() {
    enough 60 memctx || return
    echo "== memory at 4096 tokens $(name "$LARGE")"
    timeout "$(limit 90)" python3 benchmarks/torch_memory.py "$LARGE" --ctx 4096 2>&1 \
        | tee "$LOGS/memctx-$(name "$LARGE").txt" | tail -n 24
}

step_matvec() {
    echo "== mat-vec GB/s"
    enough 60 matvec && timeout "$(limit 60)" python3 benchmarks/torch_matvec.py 2>&1 | tail -n 20
}

step_sweep() {
    echo "== mat-vec tile sweep"
    enough 60 sweep && timeout "$(limit 120)" python3 benchmarks/torch_matvec.py --tiles 2>&1 \
        | tee "$LOGS/sweep.txt" | tail -n 14
}

for s in $STEPS; do
    if [[ $s == *+* ]]; then  # (in subshells: only for steps that set nothing for later)
        for part in ${s//+/ }; do "step_$part" & done
        wait
    else
        "step_$s"
    fi
    pack
done
