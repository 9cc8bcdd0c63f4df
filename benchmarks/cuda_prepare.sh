#!/usr/bin/env bash
# Prepare .device/ (git-ignored) for benchmarks/cuda_run.sh on a lent GPU, on this machine:
# wheels the GPU machine lacks, the three models' skeletons, and (when LLAMA_BENCH names a
# llama-bench built with CUDA) that binary compressed, with the libgomp it links.
#
#     benchmarks/cuda_prepare.sh            # then: device run "bash benchmarks/cuda_run.sh"
#
# llama-bench with CUDA, built here without a GPU (CUDA 13 toolkit; cuBLAS headers and
# libraries from the nvidia-cublas wheel copied into it), outside the repository:
#     cmake -S llama.cpp -B bcuda -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
#         -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DBUILD_SHARED_LIBS=OFF \
#         -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
#         -DLLAMA_BUILD_SERVER=OFF -DGGML_CUDA_NCCL=OFF -DGGML_CUDA_NO_VMM=ON
#     cmake --build bcuda --target llama-bench -j2    # ~20 min on 2 cores
# (NO_VMM: no libcuda stub to link here; llama.cpp then pools device memory without VMM.)
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.device/" .git/info/exclude 2>/dev/null || echo "/.device/" >> .git/info/exclude
mkdir -p .device/whl .device/skel
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .device/whl gguf cffi pycparser prompt_toolkit wcwidth
for name in qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct gemma-3-270m; do
    file=$(.venv/bin/python -c "import edgellm.store as s; print(s.resolve_model('$name'))")
    .venv/bin/python benchmarks/synthetic_gguf.py skeleton "$file" \
        ".device/skel/$(basename "$file" .gguf).skel.gz"
done
if [ -n "${LLAMA_BENCH:-}" ]; then
    mkdir -p .device/llama/lib
    strip -o /tmp/llama-bench.stripped "$LLAMA_BENCH"
    xz -T2 -6 -c /tmp/llama-bench.stripped > .device/llama/llama-bench.xz
    cp "$(ldconfig -p | awk '/libgomp.so.1 /{print $NF; exit}')" .device/llama/lib/
fi
du -sh .device
