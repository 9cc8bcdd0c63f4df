#!/usr/bin/env bash
# One run on a lent NVIDIA GPU (the `device` tool), from the repository root there:
# the torch backend's tests on CUDA, then speed on full-size synthetic copies of the three
# models (benchmarks/synthetic_gguf.py: the real files' headers, random blocks), beside
# llama.cpp's CUDA llama-bench on the same files when one is carried.
#
# Carried in .device/ (git-ignored): whl/ (packages the machine lacks: gguf, cffi, ...),
# skel/*.skel.gz (synthetic_gguf.py skeleton of each model), llama/ (optional:
# llama-bench.xz, built with -DGGML_CUDA=ON against CUDA 13, and lib/libgomp.so.1).
# Logs go to $OUT. STEPS picks what runs (default: all); PYTEST_K narrows the tests.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/edgellm-out}
STEPS=${STEPS:-"llama bench tests profile prefill ab mem matvec sweep"}
mkdir -p "$OUT" /tmp/m
# kernel variants are timed once per card (backends/torch/tuning.py); every step shares the
# choices, which come back in $OUT/home/tuning
export EDGELLM_HOME=${EDGELLM_HOME:-$OUT/home}
has() { [[ " $STEPS " == *" $1 "* ]]; }

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
MODELS=(/tmp/m/gemma-3-270m-q4_k_m.gguf /tmp/m/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
        /tmp/m/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf)
LLAMA=""
if has llama && [ -f .device/llama/llama-bench.xz ]; then  # built with CUDA elsewhere
    xz -dc .device/llama/llama-bench.xz > /tmp/llama-bench && chmod +x /tmp/llama-bench
    libs=$(find /usr/local /opt -name 'libcublas.so.13' -o -name 'libcudart.so.13' 2>/dev/null \
           | xargs -r -n1 dirname | sort -u | tr '\n' ':')
    export LD_LIBRARY_PATH="${libs}$PWD/.device/llama/lib:${LD_LIBRARY_PATH:-}"
    /tmp/llama-bench --list-devices 2>&1 | tail -n 3 && LLAMA=/tmp/llama-bench
fi
if has bench; then
    for m in "${MODELS[@]}"; do
        if [ -n "$LLAMA" ]; then
            echo "== llama-bench CUDA $(basename "$m")"
            timeout 100 "$LLAMA" -m "$m" -p 512 -n 128 -r 3 -ngl 99 -o md 2>&1 \
                | tee -a "$OUT/llama-bench.md" | grep -E "^\|" | tail -n 2
        fi
        echo "== edgellm bench --backend torch $(basename "$m")"
        # (the first run on a card times kernel variants: tune_s)
        timeout 240 python3 -m edgellm.apps.cli bench -m "$m" \
            --backend torch -p 512 -n 128 -r 3 -o json \
            > "$OUT/bench-$(basename "$m" .gguf).json" 2> "$OUT/bench.err"
        rc=$?; echo "rc=$rc"; tail -n 3 "$OUT/bench.err"
        if [ $rc != 0 ]; then  # the fusions off, to have figures at all
            echo "== again with EDGELLM_FUSE_QUANTIZE=0"
            EDGELLM_FUSE_QUANTIZE=0 timeout 100 python3 -m edgellm.apps.cli bench -m "$m" \
                --backend torch -p 512 -n 128 -r 3 -o json \
                > "$OUT/bench-$(basename "$m" .gguf).json" 2> "$OUT/bench.err"
            echo "rc=$?"; tail -n 3 "$OUT/bench.err"
        fi
        python3 -c "import json,sys; [print(r['test'], round(r['mean_ts'],1), 't/s', {k: r.get(k) for k in ('capture_s','tune_s','peak_device_memory','device_weight_bytes','kv_bytes','bandwidth','peak_bandwidth','ttft_ms')}) for r in json.load(open(sys.argv[1]))]" "$OUT/bench-$(basename "$m" .gguf).json"
    done
fi
if has tests; then  # (after the speed runs: a hung test cannot cost their figures)
    echo "== tests on CUDA"  # (no tuning but the tuning test's own: 8 workers compiling)
    EDGELLM_TUNE=0 timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_torch_kernels.py \
        tests/test_torch_models.py tests/test_backend_conformance.py -k "${PYTEST_K:-torch and not teacher}" \
        > "$OUT/pytest.log" 2>&1
    echo "pytest rc=$?"; tail -n 25 "$OUT/pytest.log"
fi
if has profile; then  # kernels per prompt and decode step: the 1.5B's decode, Gemma's prefill
    for m in "${MODELS[2]}" "${MODELS[0]}"; do
        name=$(basename "$m" .gguf)
        echo "== profile ($name)"
        timeout 90 python3 benchmarks/torch_profile.py "$m" 2>&1 | tee "$OUT/profile-$name.txt" \
            | tail -n 40
    done
fi
if has prefill; then  # a prompt's GEMM variants (cast, f32 out, fused tiles) and ring rules
    for m in "${MODELS[0]}" "${MODELS[2]}"; do
        echo "== prefill A/B $(basename "$m")"
        timeout 180 python3 benchmarks/torch_prefill_ab.py "$m" ${PREFILL_TILES:+--tiles "$PREFILL_TILES"} \
            2>&1 | tee -a "$OUT/prefill_ab.txt" | tail -n 12
    done
fi
if has ab; then  # decode: launch fusions off/on (alternating processes), host vs device argmax
    for m in "${MODELS[2]}" "${MODELS[0]}"; do
        for fuse in ${AB_ORDER:-0 1 0 1}; do
            EDGELLM_FUSE_LAUNCHES=$fuse timeout 90 python3 benchmarks/torch_decode_ab.py "$m" \
                2>&1 | tail -n 1
        done
    done
fi
if has mem; then  # device memory at peak and pp512: cuBLAS's workspace 32 MiB against ours, 16
    for m in "${MODELS[0]}"; do  # (the model furthest over 1.2x at 32 MiB)
        for ws in ":4096:8" ":4096:4" ":4096:8" ":4096:4"; do
            echo "== CUBLAS_WORKSPACE_CONFIG=$ws $(basename "$m")"
            CUBLAS_WORKSPACE_CONFIG=$ws timeout 100 python3 -m edgellm.apps.cli bench -m "$m" \
                --backend torch -p 512 -n 128 -r 5 -o json 2>/dev/null | python3 -c "import json,sys; [print(r['test'], round(r['mean_ts'],1), 't/s peak', r.get('peak_device_memory'), 'gguf', r.get('size'), 'kv', r.get('kv_bytes')) for r in json.load(sys.stdin)]"
        done
    done
fi
if has matvec; then
    echo "== mat-vec GB/s"
    timeout 60 python3 benchmarks/torch_matvec.py 2>&1 | tail -n 20
fi
if has sweep; then
    echo "== mat-vec tile sweep"
    timeout 120 python3 benchmarks/torch_matvec.py --tiles 2>&1 | tee "$OUT/sweep.txt" | tail -n 14
fi

