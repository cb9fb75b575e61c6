// The `avx512` path: x86.inc compiled for AVX-512 (F, BW, VL, DQ) with VNNI beside AVX2 and FMA
// (Intel's server CPUs of recent generations, AMD since Zen 4): the integer formats' pairs of rows
// take the 512-bit VNNI kernels (bit for bit the avx2 path's results), the rest is the avx2 code.

#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include "kernels.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#endif

#define S2S_VNNI 1
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's own AVX-512 headers (_mm512_undefined_*)
#pragma GCC diagnostic ignored "-Wuninitialized"       // the same headers, through _mm512_castps512_ps256
#endif

namespace {
#include "x86.inc"
}  // namespace

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

extern "C" const s2s::Ops s2s_ops_avx512 = {"avx512", stream, blocked, widen, snake, stack};

#endif
