#!/usr/bin/env bash
# The sm_90 compile checks under the triton a lent GPU runs, on this machine, before a lease:
# tests/test_torch_sm90.py and the register table of `python -m tests.offline_sm90` with
# EDGELLM_SM90_TRITON pointing at that triton (installed once, outside the repository, into
# triton-VERSION in edgellm's home, ~/.cache/edgellm by default). The lent GPUs have run
# triton 3.6, this machine 3.9, and their code generation differs (registers, spills), so
# a kernel that spills only there shows here first.
#
#     benchmarks/sm90_preflight.sh                          # triton 3.6.0
#     benchmarks/sm90_preflight.sh 3.6.0 --tuning FILE      # also a tuning file's tiles
set -uo pipefail
cd "$(dirname "$0")/.."
version=${1:-3.6.0}
home=$(.venv/bin/python -c "import edgellm.store as s; print(s.edgellm_home())") || exit 1
site=$home/triton-$version
if [ ! -d "$site/triton" ]; then
    .venv/bin/python -m pip install -q --no-deps --target "$site" "triton==$version" || exit 1
fi
export EDGELLM_SM90_TRITON=$site
TRITON_INTERPRET=1 .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_torch_sm90.py
status=$?
.venv/bin/python -m tests.offline_sm90 || status=1
if [ "${2:-}" = "--tuning" ]; then
    .venv/bin/python -m tests.offline_sm90 --tuning "$3" || status=1
fi
exit $status
