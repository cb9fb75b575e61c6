// The `avx2` path: x86.inc compiled for AVX2 and FMA (Intel since Haswell, AMD since Zen 1).
// Only this unit's own functions carry the target (the pragma follows every header): the library
// still loads, and runs its generic path, on an x86-64 CPU without AVX2.

#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include "kernels.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

#define S2S_VNNI 0

namespace {
#include "x86.inc"
}  // namespace

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

extern "C" const s2s::Ops s2s_ops_avx2 = {"avx2", stream, blocked, widen, snake, stack};

#endif
