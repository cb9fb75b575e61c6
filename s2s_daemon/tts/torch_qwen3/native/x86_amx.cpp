// The `amx` path: the avx512 path (x86.inc compiled for AVX-512 with VNNI) whose prompt products of
// int8 and 4-bit weights run on AMX's bfloat16 tiles (Intel's server CPUs with tile instructions; amx_prompt
// in x86.inc). Decoding's products are the avx512 path's, bit for bit. A compiler without AMX (GCC
// before 11, clang before 12) or another OS than Linux builds this unit without the path:
// s2s_ops_amx is then null and the library carries no amx path (tts.torch.isa: amx runs the avx512
// path then, and says so).

#include "kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
// Linux alone offers the tile state (api.cpp's cpu_has); no Mac has AMX.
#if defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))

#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,amx-tile,amx-bf16"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,amx-tile,amx-bf16")
#endif

#define S2S_VNNI 1
#define S2S_AMX 1
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

namespace {
const s2s::Ops kAmx = {"amx", stream, blocked, widen, snake, stack};
}  // namespace
extern "C" const s2s::Ops* const s2s_ops_amx = &kAmx;

#else
extern "C" const s2s::Ops* const s2s_ops_amx = nullptr;
#endif
#endif
