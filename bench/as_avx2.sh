#!/usr/bin/env bash
# Runs a command as if on an AVX2-only x86-64 CPU (Haswell's instruction set), on an AVX-512 host:
# numba compiles pagelm's kernels for Haswell's name *and* features (NUMBA_CPU_NAME alone keeps the
# host's AVX-512 instructions), torch and numpy dispatch their AVX2 code, and llama.cpp is the library
# in $AVX2_LLAMA_CPP_LIB_PATH when set: a build with -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON
# -DGGML_F16C=ON -DGGML_AVX512=OFF (docs/results.md). The numba cache is its own, so the host's stays.
# The memory system stays this host's: it emulates the instruction set, not an AVX2 machine.
#
#   bench/as_avx2.sh pagelm bench batch smollm2-135m --sizes 1,4,8 --tokens 8 --runs 3
set -euo pipefail
if [ $# -eq 0 ]; then
    echo "usage: bench/as_avx2.sh COMMAND [ARGS...]" >&2
    exit 2
fi
export NUMBA_CPU_NAME=haswell
export NUMBA_CPU_FEATURES=+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+cx8,+f16c,+fma,+fsgsbase,+fxsr,+invpcid,+lzcnt,+mmx,+movbe,+pclmul,+popcnt,+rdrnd,+sahf,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave,+xsaveopt
export NUMBA_CACHE_DIR="${NUMBA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pagelm/numba-haswell}"
export ATEN_CPU_CAPABILITY=avx2
export NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL AVX512_SPR"
if [ -n "${AVX2_LLAMA_CPP_LIB_PATH:-}" ]; then
    export LLAMA_CPP_LIB_PATH="$AVX2_LLAMA_CPP_LIB_PATH"
fi
exec "$@"
