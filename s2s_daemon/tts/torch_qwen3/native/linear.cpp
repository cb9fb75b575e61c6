// Weight-streaming linear layers for decoding on x86-64 CPUs with AVX2 and FMA.
//
// Decoding a codec frame is ~400 matrix-vector products over ~1.6 billion weights: the time is
// the time it takes to stream the weights from memory. torch's CPU BLAS streams float32 weights
// for one row well below the memory's bandwidth and has no 4-bit kernel that is not compute bound
// on AVX2 (scripts/bench_wide.py, scripts/bench_torch.py). Weight formats:
//
//   f32   float32 [N, K]
//   bf16  bfloat16 [N, K]                      (bits << 16 is the float32)
//   i8    int8 [N * K], float32 scale [N]       w = scale[n] * q
//   i4    uint8 [N * K/2], float32 scale/min [N * K/G]   w = scale * q + min, q in 0..15;
//         each 32-weight block is 16 bytes: low nibbles weights 0..15, high nibbles 16..31
//
// The integer formats store output rows in pairs, interleaved block by block (pair_offset): block
// b of row 2p, block b of row 2p + 1, block b + 1 of row 2p, ... (an odd last row stands alone);
// i4's scales and mins likewise per group. A pair of rows is then one sequential stream: with two
// rows 1-2 KiB apart, the unpacking kept too few loads in flight and one core read int8 at 8-9 GB/s
// against 13-15 for one stream (two threads: 13-15 against 19-23 GB/s).
//
// Three paths by the number of input rows M:
//   M <= kMaxRows (decoding): each weight is read once; float formats are widened in registers,
//     i8/i4 multiply in integers against the input quantized to int8 per block of 32 (GGML's
//     Q8_0 scheme), with float32 accumulation; where the CPU has AVX-512 VNNI (checked at run
//     time; the rest of the file is AVX2 code), a pair of integer rows takes one 512-bit kernel
//     (i8q_pair_wide, i4q_pair_wide) that gives the same bits with fewer instructions: with
//     several input rows these products are compute bound;
//   M <= kBlockedMaxRows (a prompt): a register-blocked product, weights widened in registers
//     and reused for 6 input rows, float32 input;
//   larger M: blocks of weight rows widened into a 4 MiB buffer for at::mm.
// Stack runs one to kMaxRows positions through a whole Qwen3 decoder with these products, of one
// sequence (a prompt's last rows) or of several (run_rows: one decoding step of several requests).
// Threads: at::parallel_for, i.e. torch's own intra-op pool (no second pool spinning beside it).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#include <pybind11/stl.h>

namespace {

constexpr int kF32 = 0;
constexpr int kBF16 = 1;
constexpr int kI8 = 2;
constexpr int kI4 = 3;
constexpr int64_t kMaxRows = 4;
// Software prefetch distance of the integer kernels, ahead in the pair's stream. Their unpacking
// keeps too few loads in flight for the hardware prefetcher alone, so they read ahead; 1-4 KiB do
// alike, and the float kernels do without (they got slower with it). scripts/bench_wide.py.
constexpr int64_t kPrefetchBytes = 2048;

inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// Eight consecutive weights as float32.
struct LoadF32 {
  using T = float;
  static __m256 at(const float* p) { return _mm256_loadu_ps(p); }
};
struct LoadBF16 {
  using T = uint16_t;
  static __m256 at(const uint16_t* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
};
struct LoadI8 {
  using T = int8_t;
  static __m256 at(const int8_t* p) {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  }
};

// y[m, n] = sum_k w[n, k] x[m, k] (* scale[n]) (+ bias[n]) for n in [n0, n1); K % 32 == 0.
// A accumulators per input row keep enough FMA chains in flight for one row.
template <class L, int M>
void dense_rows(const typename L::T* w, const float* x, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1,
                const float* scale, const float* bias) {
  constexpr int A = M == 1 ? 4 : (M == 2 ? 2 : 1);
  for (int64_t n = n0; n < n1; ++n) {
    const typename L::T* row = w + n * K;
    __m256 acc[M][A];
    for (int m = 0; m < M; ++m)
      for (int a = 0; a < A; ++a) acc[m][a] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      __m256 wv[4];
      for (int j = 0; j < 4; ++j) wv[j] = L::at(row + k + 8 * j);
      for (int m = 0; m < M; ++m) {
        const float* xm = x + m * K + k;
        for (int j = 0; j < 4; ++j) acc[m][j % A] = _mm256_fmadd_ps(wv[j], _mm256_loadu_ps(xm + 8 * j), acc[m][j % A]);
      }
    }
    for (int m = 0; m < M; ++m) {
      __m256 s = acc[m][0];
      for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, acc[m][a]);
      float v = hsum(s);
      if (scale) v *= scale[n];
      if (bias) v += bias[n];
      y[m * N + n] = v;
    }
  }
}

// Widen the 32 weights of one 4-bit block (16 bytes) to float32 (no scale, no min).
inline void unpack_i4(const uint8_t* p, __m256 out[4]) {
  const __m128i mask = _mm_set1_epi8(0x0F);
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m128i lo = _mm_and_si128(b, mask);
  __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  out[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  out[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

// The quantized formats multiply in integers: each input row is quantized per block of 32 to
// int8 (xq, with float32 scales xs[m * K/32 + b]), as GGML's Q8_0 does, and every 32 weights
// cost one vpmaddubsw + vpmaddwd instead of widening each weight to float32.
inline __m256 block_dot(__m256i u8, __m256i s8) {
  // u8: unsigned bytes, s8: signed bytes -> 8 int32 sums of 4 products, as float32.
  const __m256i ones = _mm256_set1_epi16(1);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), ones));
}
// Offset, in units of `unit` elements, of block b of row n in the pair-interleaved layout of an
// [N, blocks * unit] matrix (see the header).
// Rows interleaved in row n's pair: 2, or 1 for an odd last row.
inline int64_t pair_rows(int64_t n, int64_t N) { return (n | 1) < N ? 2 : 1; }
inline int64_t pair_offset(int64_t n, int64_t N, int64_t blocks, int64_t b, int64_t unit) {
  return ((n & ~int64_t{1}) * blocks + b * pair_rows(n, N) + (n & 1)) * unit;
}

// int8, R (2, or 1 for an odd last row) interleaved rows from row n against M input rows:
// y = scale[n] * sum_b xs[b] * sum_{k in b} q[n, k] xq[k]. `p` is the pair's first byte.
template <int M, int R>
inline void i8q_group(const int8_t* p, const float* scale, const int8_t* xq, const float* xs, float* y, int64_t K,
                      int64_t N, int64_t n, const float* bias) {
  constexpr int A = M == 1 ? 2 : 1;  // independent accumulation chains per (row, input)
  const int64_t blocks = K / 32;
  __m256 acc[R][M][A];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m)
      for (int a = 0; a < A; ++a) acc[r][m][a] = _mm256_setzero_ps();
  auto step = [&](int64_t b, int a) {
    __m256i xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + b * 32));
    for (int r = 0; r < R; ++r) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + (b * R + r) * 32));
      const __m256i aw = _mm256_sign_epi8(wv, wv);
      for (int m = 0; m < M; ++m)
        acc[r][m][a] = _mm256_fmadd_ps(block_dot(aw, _mm256_sign_epi8(xv[m], wv)),
                                       _mm256_broadcast_ss(xs + m * blocks + b), acc[r][m][a]);
    }
  };
  int64_t b = 0;
  for (; b + A <= blocks; b += A) {
    for (int64_t off = 0; off < A * R * 32; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p + b * R * 32 + off + kPrefetchBytes), _MM_HINT_T0);
    for (int a = 0; a < A; ++a) step(b + a, a);
  }
  for (; b < blocks; ++b) step(b, 0);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      __m256 s = acc[r][m][0];
      for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, acc[r][m][a]);
      // One rounding, explicitly (as i8q_pair_wide): contraction is the compiler's choice otherwise.
      y[m * N + n + r] = std::fma(hsum(s), scale[n + r], bias ? bias[n + r] : 0.f);
    }
}

// The same int8 product for a pair of rows on CPUs with AVX-512 VNNI (compiled for them alone and
// chosen at run time, `g_wide`): block b of both rows is one 64-byte load, and vpdpbusd makes the
// 8 sums of 4 products per row that vpmaddubsw + vpmaddwd make, in one instruction for both rows.
// With the accumulation chains, their order and the final sums as i8q_group<M, 2>'s, the result is
// bit for bit the same. Several input rows are where it tells: there the AVX2 form is compute
// bound; scripts/bench_wide.py measures the two forms side by side on a model.
#define S2S_WIDE __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma")))

template <int M>
S2S_WIDE void i8q_pair_wide(const int8_t* p, const float* scale, const int8_t* xq, const float* xs, float* y,
                            int64_t K, int64_t N, int64_t n, const float* bias) {
  constexpr int A = M == 1 ? 2 : 1;  // as i8q_group
  const int64_t blocks = K / 32;
  __m512 acc[M][A];  // lanes 0-7: row n, 8-15: row n + 1
  for (int m = 0; m < M; ++m)
    for (int a = 0; a < A; ++a) acc[m][a] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  auto step = [&](int64_t b, int a) S2S_WIDE {
    const __m512i wv = _mm512_loadu_si512(p + b * 64);
    const __mmask64 negative = _mm512_movepi8_mask(wv);
    const __m512i aw = _mm512_abs_epi8(wv);
    for (int m = 0; m < M; ++m) {
      const __m512i xv =
          _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + b * 32)));
      const __m512i sx = _mm512_mask_sub_epi8(xv, negative, zero, xv);  // x with the weight's sign
      const __m512 d = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, aw, sx));
      acc[m][a] = _mm512_fmadd_ps(d, _mm512_set1_ps(xs[m * blocks + b]), acc[m][a]);
    }
  };
  int64_t b = 0;
  for (; b + A <= blocks; b += A) {
    for (int64_t off = 0; off < A * 64; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p + b * 64 + off + kPrefetchBytes), _MM_HINT_T0);
    for (int a = 0; a < A; ++a) step(b + a, a);
  }
  for (; b < blocks; ++b) step(b, 0);
  for (int m = 0; m < M; ++m) {
    __m512 s = acc[m][0];
    for (int a = 1; a < A; ++a) s = _mm512_add_ps(s, acc[m][a]);
    y[m * N + n] = std::fma(hsum(_mm512_castps512_ps256(s)), scale[n], bias ? bias[n] : 0.f);
    y[m * N + n + 1] = std::fma(hsum(_mm512_extractf32x8_ps(s, 1)), scale[n + 1], bias ? bias[n + 1] : 0.f);
  }
}

bool wide_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni");
}

const bool g_wide_supported = wide_supported();
bool g_wide = g_wide_supported;
// Whether i8q_pair_wide and i4q_pair_wide run (tests compare both paths; `set_wide`).

// 32 4-bit weights (16 bytes, low nibbles first) as 32 unsigned bytes in order.
inline __m256i nibbles(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// 4-bit, R interleaved rows from row n: y = sum_g scale[g] * sum_{b in g} xs[b] * sum_k q xq
// + sum_g min[g] * sum_{k in g} x. `p`, `sc`, `mn`: the pair's first byte, scale and min.
template <int M, int R>
inline void i4q_group(const uint8_t* p, const float* sc, const float* mn, const int8_t* xq, const float* xs,
                      const float* xsum, float* y, int64_t K, int64_t N, int64_t G, int64_t n, const float* bias) {
  const int64_t groups = K / G;
  const int64_t blocks = K / 32;
  const int64_t per_group = G / 32;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  __m256 out[R][M];
  float off[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      out[r][m] = _mm256_setzero_ps();
      off[r][m] = 0.f;
    }
  for (int64_t g = 0; g < groups; ++g) {
    __m256 acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      const uint8_t* blk = p + b * R * 16;
      if (((b * R * 16) & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes), _MM_HINT_T0);
      __m256i q[R];
      if constexpr (R == 2) {
        // Both rows' blocks in one load: lane 0 row 2p, lane 1 row 2p + 1.
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk));
        const __m256i lo = _mm256_and_si256(raw, mask);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
        q[0] = _mm256_permute2x128_si256(lo, hi, 0x20);
        q[R - 1] = _mm256_permute2x128_si256(lo, hi, 0x31);
      } else {
        q[0] = nibbles(blk);
      }
      for (int m = 0; m < M; ++m) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + b * 32));
        const __m256 sb = _mm256_broadcast_ss(xs + m * blocks + b);
        for (int r = 0; r < R; ++r) acc[r][m] = _mm256_fmadd_ps(block_dot(q[r], xv), sb, acc[r][m]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 s = _mm256_broadcast_ss(sc + g * R + r);
      const float mv = mn[g * R + r];
      for (int m = 0; m < M; ++m) {
        out[r][m] = _mm256_fmadd_ps(s, acc[r][m], out[r][m]);
        off[r][m] = std::fma(mv, xsum[m * groups + g], off[r][m]);  // explicitly, as i4q_pair_wide
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) y[m * N + n + r] = hsum(out[r][m]) + off[r][m] + (bias ? bias[n + r] : 0.f);
}

// 4-bit weights for a pair of rows with AVX-512 VNNI: the pair's two 16-byte blocks (one 32-byte
// load) become both rows' 32 unsigned weights in one register, and vpdpbusd multiplies them by the
// input's signed bytes directly. Bit for bit i4q_group<M, 2>'s result (same chains and order).
template <int M>
S2S_WIDE void i4q_pair_wide(const uint8_t* p, const float* sc, const float* mn, const int8_t* xq, const float* xs,
                            const float* xsum, float* y, int64_t K, int64_t N, int64_t G, int64_t n,
                            const float* bias) {
  const int64_t groups = K / G;
  const int64_t blocks = K / 32;
  const int64_t per_group = G / 32;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  const __m512i zero = _mm512_setzero_si512();
  __m512 out[M];
  float off[2][M];
  for (int m = 0; m < M; ++m) {
    out[m] = _mm512_setzero_ps();
    off[0][m] = off[1][m] = 0.f;
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      const uint8_t* blk = p + b * 32;
      if (((b * 32) & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes), _MM_HINT_T0);
      // [row 2p: 16 bytes | row 2p + 1: 16 bytes] -> low nibbles, high nibbles -> in lanes of 128 bits
      // (row 2p low, row 2p high, row 2p+1 low, row 2p+1 high): weights 0..31 of each row in order.
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk));
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1);
      const __m512i q = _mm512_and_si512(_mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0)), mask);
      for (int m = 0; m < M; ++m) {
        const __m512i xv =
            _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + b * 32)));
        const __m512 d = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, q, xv));
        acc[m] = _mm512_fmadd_ps(d, _mm512_set1_ps(xs[m * blocks + b]), acc[m]);
      }
    }
    const __m512 s = _mm512_insertf32x8(_mm512_set1_ps(sc[g * 2]), _mm256_set1_ps(sc[g * 2 + 1]), 1);
    for (int m = 0; m < M; ++m) {
      out[m] = _mm512_fmadd_ps(s, acc[m], out[m]);
      for (int r = 0; r < 2; ++r) off[r][m] = std::fma(mn[g * 2 + r], xsum[m * groups + g], off[r][m]);
    }
  }
  for (int m = 0; m < M; ++m) {
    y[m * N + n] = hsum(_mm512_castps512_ps256(out[m])) + off[0][m] + (bias ? bias[n] : 0.f);
    y[m * N + n + 1] = hsum(_mm512_extractf32x8_ps(out[m], 1)) + off[1][m] + (bias ? bias[n + 1] : 0.f);
  }
}

// Each row of x [M, K] as int8 per block of 32 (round to nearest, scale = max |x| / 127).
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* xs) {
  const int64_t blocks = K / 32;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* src = x + m * K + b * 32;
      float amax = 0.f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::abs(src[i]));
      const float scale = amax / 127.f;
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* dst = xq + m * K + b * 32;
      for (int i = 0; i < 32; ++i) dst[i] = static_cast<int8_t>(std::nearbyint(src[i] * inv));
      xs[m * blocks + b] = scale;
    }
  }
}

// Rows [n0, n1) of the weight as float32 into dst ([n1 - n0, K], row-major).
void widen_rows(int fmt, const torch::Tensor& w, const float* scales, const float* mins, int64_t N, int64_t K,
                int64_t G, int64_t n0, int64_t n1, float* dst) {
  const int64_t blocks = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    float* d = dst + (n - n0) * K;
    if (fmt == kF32) {
      std::copy_n(w.data_ptr<float>() + n * K, K, d);
    } else if (fmt == kBF16) {
      const uint16_t* r = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()) + n * K;
      for (int64_t k = 0; k < K; k += 8) _mm256_storeu_ps(d + k, LoadBF16::at(r + k));
    } else if (fmt == kI8) {
      const int8_t* base = w.data_ptr<int8_t>();
      const __m256 s = _mm256_set1_ps(scales[n]);
      for (int64_t b = 0; b < blocks; ++b) {
        const int8_t* blk = base + pair_offset(n, N, blocks, b, 32);
        for (int j = 0; j < 4; ++j) _mm256_storeu_ps(d + b * 32 + 8 * j, _mm256_mul_ps(s, LoadI8::at(blk + 8 * j)));
      }
    } else {
      const uint8_t* base = w.data_ptr<uint8_t>();
      const int64_t groups = K / G;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t g = b * 32 / G;
        const int64_t gi = pair_offset(n, N, groups, g, 1);
        const __m256 s = _mm256_set1_ps(scales[gi]);
        const __m256 mn = _mm256_set1_ps(mins[gi]);
        __m256 wv[4];
        unpack_i4(base + pair_offset(n, N, blocks, b, 16), wv);
        for (int j = 0; j < 4; ++j) _mm256_storeu_ps(d + b * 32 + 8 * j, _mm256_fmadd_ps(s, wv[j], mn));
      }
    }
  }
}

// Rows [n0, n1) (n0 even; n1 even or N) against M <= kMaxRows input rows.
template <int M>
void stream_rows(int fmt, const torch::Tensor& w, const float* scales, const float* mins, const float* x,
                 const int8_t* xq, const float* xs, const float* xsum, float* y, int64_t K, int64_t N, int64_t G,
                 int64_t n0, int64_t n1, const float* bias) {
  switch (fmt) {
    case kF32:
      dense_rows<LoadF32, M>(w.data_ptr<float>(), x, y, K, N, n0, n1, nullptr, bias);
      break;
    case kBF16:
      dense_rows<LoadBF16, M>(reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), x, y, K, N, n0, n1,
                              nullptr, bias);
      break;
    case kI8:
      for (int64_t n = n0; n < n1; n += 2) {
        const int8_t* p = w.data_ptr<int8_t>() + n * K;
        if (pair_rows(n, N) == 2 && g_wide)
          i8q_pair_wide<M>(p, scales, xq, xs, y, K, N, n, bias);
        else if (pair_rows(n, N) == 2)
          i8q_group<M, 2>(p, scales, xq, xs, y, K, N, n, bias);
        else
          i8q_group<M, 1>(p, scales, xq, xs, y, K, N, n, bias);
      }
      break;
    default: {
      const int64_t groups = K / G;
      for (int64_t n = n0; n < n1; n += 2) {
        const uint8_t* p = w.data_ptr<uint8_t>() + n * (K / 2);
        if (pair_rows(n, N) == 2 && g_wide)
          i4q_pair_wide<M>(p, scales + n * groups, mins + n * groups, xq, xs, xsum, y, K, N, G, n, bias);
        else if (pair_rows(n, N) == 2)
          i4q_group<M, 2>(p, scales + n * groups, mins + n * groups, xq, xs, xsum, y, K, N, G, n, bias);
        else
          i4q_group<M, 1>(p, scales + n * groups, mins + n * groups, xq, xs, xsum, y, K, N, G, n, bias);
      }
    }
  }
}

void check_weight(int fmt, const torch::Tensor& w, const c10::optional<torch::Tensor>& scales,
                  const c10::optional<torch::Tensor>& mins, int64_t N, int64_t K, int64_t G) {
  TORCH_CHECK(w.device().is_cpu() && w.is_contiguous(), "weight must be a contiguous CPU tensor");
  TORCH_CHECK(K % 32 == 0, "in_features must be a multiple of 32, got ", K);
  static const at::ScalarType kTypes[] = {at::kFloat, at::kBFloat16, at::kChar, at::kByte};
  TORCH_CHECK(fmt >= kF32 && fmt <= kI4, "unknown weight format ", fmt);
  TORCH_CHECK(w.scalar_type() == kTypes[fmt], "weight dtype ", w.scalar_type(), " does not match format ", fmt);
  TORCH_CHECK(w.numel() == (fmt == kI4 ? N * K / 2 : N * K), "weight has ", w.numel(), " elements for ", N, "x", K);
  if (fmt == kI8) {
    TORCH_CHECK(scales && scales->scalar_type() == at::kFloat && scales->is_contiguous() && scales->numel() == N,
                "int8 weights need float32 scales [out_features]");
  }
  if (fmt == kI4) {
    TORCH_CHECK(G >= 32 && G % 32 == 0 && K % G == 0, "group size must be a multiple of 32 dividing ", K);
    for (const auto* t : {&scales, &mins}) {
      TORCH_CHECK(*t && (*t)->scalar_type() == at::kFloat && (*t)->is_contiguous() && (*t)->numel() == N * (K / G),
                  "4-bit weights need float32 scales and mins [out_features, in_features / group]");
    }
  }
}

// ------------------------------------------------------------------------------------------
// A prompt's rows (kMaxRows < M <= kBlockedMaxRows): a register-blocked product that widens each
// weight in registers (2 weight rows x 6 input rows = 12 float32 accumulators) and reuses it for
// 6 input rows, so a prefill runs at FMA speed without writing widened weights to memory. Widening
// a block of rows into a buffer for at::mm (the path for longer inputs) makes MKL pack it again:
// 47-67 GFLOP/s for 30 rows of a 6144x1024 weight here, against ~140 for 64 rows.
constexpr int64_t kBlockedMaxRows = 64;

// row(n): where row n's weights lie; at(row, k): eight of them from column k as float32 (i8:
// unscaled; the row scale is applied at the end).
struct WF32 {
  const float* w;
  int64_t K;
  const float* row(int64_t n) const { return w + n * K; }
  static __m256 at(const float* r, int64_t k) { return _mm256_loadu_ps(r + k); }
  float post(int64_t) const { return 1.f; }
};
struct WBF16 {
  const uint16_t* w;
  int64_t K;
  const uint16_t* row(int64_t n) const { return w + n * K; }
  static __m256 at(const uint16_t* r, int64_t k) { return LoadBF16::at(r + k); }
  float post(int64_t) const { return 1.f; }
};
struct WI8 {
  const int8_t* w;
  const float* scale;
  int64_t K, N;
  struct Row {
    const int8_t* p;  // block 0 of the row
    int64_t stride;   // bytes from one of its blocks to the next (32 or 64: pairs interleave)
  };
  Row row(int64_t n) const {
    return {w + pair_offset(n, N, K / 32, 0, 32), pair_rows(n, N) * 32};
  }
  static __m256 at(const Row& r, int64_t k) { return LoadI8::at(r.p + (k >> 5) * r.stride + (k & 31)); }
  float post(int64_t n) const { return scale[n]; }
};
struct WI4 {
  const uint8_t* w;
  const float* scales;
  const float* mins;
  int64_t K, G, N;
};

template <class W, int NR, int MR>
inline void blocked_tile(const W& wt, const float* x, float* y, int64_t K, int64_t N, int64_t n, int64_t m,
                         const float* bias) {
  __m256 acc[NR][MR];
  for (int a = 0; a < NR; ++a)
    for (int b = 0; b < MR; ++b) acc[a][b] = _mm256_setzero_ps();
  decltype(wt.row(0)) rows[NR];
  for (int a = 0; a < NR; ++a) rows[a] = wt.row(n + a);
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NR];
    for (int a = 0; a < NR; ++a) wv[a] = W::at(rows[a], k);
    for (int b = 0; b < MR; ++b) {
      const __m256 xv = _mm256_loadu_ps(x + (m + b) * K + k);
      for (int a = 0; a < NR; ++a) acc[a][b] = _mm256_fmadd_ps(wv[a], xv, acc[a][b]);
    }
  }
  for (int a = 0; a < NR; ++a) {
    const float post = wt.post(n + a);
    const float add = bias ? bias[n + a] : 0.f;
    for (int b = 0; b < MR; ++b) y[(m + b) * N + n + a] = hsum(acc[a][b]) * post + add;
  }
}

template <class W, int NR>
inline void blocked_rows(const W& wt, const float* x, float* y, int64_t M, int64_t K, int64_t N, int64_t n,
                         const float* bias) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) blocked_tile<W, NR, 6>(wt, x, y, K, N, n, m, bias);
  switch (M - m) {
    case 5: blocked_tile<W, NR, 5>(wt, x, y, K, N, n, m, bias); break;
    case 4: blocked_tile<W, NR, 4>(wt, x, y, K, N, n, m, bias); break;
    case 3: blocked_tile<W, NR, 3>(wt, x, y, K, N, n, m, bias); break;
    case 2: blocked_tile<W, NR, 2>(wt, x, y, K, N, n, m, bias); break;
    case 1: blocked_tile<W, NR, 1>(wt, x, y, K, N, n, m, bias); break;
    default: break;
  }
}

template <class W>
void blocked(const W& wt, const float* x, float* y, int64_t M, int64_t K, int64_t N, const float* bias) {
  at::parallel_for(0, (N + 1) / 2, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n = 2 * p;
      if (n + 2 <= N)
        blocked_rows<W, 2>(wt, x, y, M, K, N, n, bias);
      else
        blocked_rows<W, 1>(wt, x, y, M, K, N, n, bias);
    }
  });
}

// 4-bit weights: one weight row against MR input rows, 32 weights (one 16-byte block) per step,
// widened one vector at a time from the block held in a register (two rows of 4-bit weights and
// their scales would spill the 12 accumulators of the generic tile).
template <int MR>
inline void i4_tile(const WI4& wt, const float* x, float* y, int64_t K, int64_t N, int64_t n, int64_t m,
                    const float* bias) {
  const __m128i mask = _mm_set1_epi8(0x0F);
  const int64_t r = pair_rows(n, N);
  const uint8_t* row = wt.w + pair_offset(n, N, K / 32, 0, 16);
  const int64_t gi0 = pair_offset(n, N, K / wt.G, 0, 1);
  __m256 acc[MR];
  for (int b = 0; b < MR; ++b) acc[b] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + (k >> 5) * r * 16));
    const __m128i lo = _mm_and_si128(raw, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    const int64_t gi = gi0 + (k / wt.G) * r;
    const __m256 s = _mm256_broadcast_ss(wt.scales + gi);
    const __m256 mv = _mm256_broadcast_ss(wt.mins + gi);
    for (int j = 0; j < 4; ++j) {
      const __m128i src = j == 0 ? lo : j == 1 ? _mm_srli_si128(lo, 8) : j == 2 ? hi : _mm_srli_si128(hi, 8);
      const __m256 wv = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(src)), s, mv);
      for (int b = 0; b < MR; ++b)
        acc[b] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (m + b) * K + k + 8 * j), acc[b]);
    }
  }
  const float add = bias ? bias[n] : 0.f;
  for (int b = 0; b < MR; ++b) y[(m + b) * N + n] = hsum(acc[b]) + add;
}

void i4_blocked(const WI4& wt, const float* x, float* y, int64_t M, int64_t K, int64_t N, const float* bias) {
  at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      int64_t m = 0;
      for (; m + 6 <= M; m += 6) i4_tile<6>(wt, x, y, K, N, n, m, bias);
      switch (M - m) {
        case 5: i4_tile<5>(wt, x, y, K, N, n, m, bias); break;
        case 4: i4_tile<4>(wt, x, y, K, N, n, m, bias); break;
        case 3: i4_tile<3>(wt, x, y, K, N, n, m, bias); break;
        case 2: i4_tile<2>(wt, x, y, K, N, n, m, bias); break;
        case 1: i4_tile<1>(wt, x, y, K, N, n, m, bias); break;
        default: break;
      }
    }
  });
}

void blocked_linear(int f, const torch::Tensor& w, const float* sp, const float* mp, const float* bp, int64_t N,
                    int64_t K, int64_t group, const float* xp, int64_t M, float* yp) {
  switch (f) {
    case kF32: blocked(WF32{w.data_ptr<float>(), K}, xp, yp, M, K, N, bp); break;
    case kBF16:
      blocked(WBF16{reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), K}, xp, yp, M, K, N, bp);
      break;
    case kI8: blocked(WI8{w.data_ptr<int8_t>(), sp, K, N}, xp, yp, M, K, N, bp); break;
    default: i4_blocked(WI4{w.data_ptr<uint8_t>(), sp, mp, K, group, N}, xp, yp, M, K, N, bp);
  }
}

// y [M, N] = x [M, K] W^T (+ bias) for M <= kMaxRows, threads over output rows.
void stream(int f, const torch::Tensor& w, const float* sp, const float* mp, const float* bp, int64_t N, int64_t K,
            int64_t group, const float* xp, int64_t M, float* yp) {
  thread_local std::vector<float> xsum;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xs;
  if (f == kI8 || f == kI4) {
    xq.resize(M * K);
    xs.resize(M * (K / 32));
    quantize_rows(xp, M, K, xq.data(), xs.data());
  }
  if (f == kI4) {
    // Sum of the quantized input per group, for the mins: then the product's error is
    // sum w (xq - x), as for int8, not sum (w - min) (xq - x).
    const int64_t groups = K / group;
    const int64_t per_group = group / 32;
    xsum.resize(M * groups);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < groups; ++g) {
        float s = 0.f;
        for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
          int32_t q = 0;
          for (int i = 0; i < 32; ++i) q += xq[m * K + b * 32 + i];
          s += static_cast<float>(q) * xs[m * (K / 32) + b];
        }
        xsum[m * groups + g] = s;
      }
  }
  const float* xsp = f == kI4 ? xsum.data() : nullptr;
  const int8_t* xqp = f >= kI8 ? xq.data() : nullptr;
  const float* xscp = f >= kI8 ? xs.data() : nullptr;
  // Threads take whole pairs of rows (the integer formats interleave them).
  at::parallel_for(0, (N + 1) / 2, 8, [&](int64_t p0, int64_t p1) {
    const int64_t n0 = 2 * p0, n1 = std::min(N, 2 * p1);
    switch (M) {
      case 1: stream_rows<1>(f, w, sp, mp, xp, xqp, xscp, xsp, yp, K, N, group, n0, n1, bp); break;
      case 2: stream_rows<2>(f, w, sp, mp, xp, xqp, xscp, xsp, yp, K, N, group, n0, n1, bp); break;
      case 3: stream_rows<3>(f, w, sp, mp, xp, xqp, xscp, xsp, yp, K, N, group, n0, n1, bp); break;
      default: stream_rows<4>(f, w, sp, mp, xp, xqp, xscp, xsp, yp, K, N, group, n0, n1, bp);
    }
  });
}

// x: [..., K] float32; returns [..., N] float32.
torch::Tensor linear(const torch::Tensor& x_in, int64_t fmt, const torch::Tensor& w,
                     const c10::optional<torch::Tensor>& scales, const c10::optional<torch::Tensor>& mins,
                     int64_t out_features, int64_t group, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat, "input must be float32 on the CPU");
  const int64_t K = x_in.size(-1);
  const int64_t N = out_features;
  check_weight(static_cast<int>(fmt), w, scales, mins, N, K, group);
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be float32 [out_features]");
  }
  auto x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = N;
  const float* sp = scales ? scales->data_ptr<float>() : nullptr;
  const float* mp = mins ? mins->data_ptr<float>() : nullptr;
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const int f = static_cast<int>(fmt);

  if (M > kMaxRows && M <= kBlockedMaxRows) {
    auto y = torch::empty({M, N}, x.options());
    blocked_linear(f, w, sp, mp, bp, N, K, group, x.data_ptr<float>(), M, y.data_ptr<float>());
    return y.reshape(out_shape);
  }
  if (M > kMaxRows) {
    // Longer inputs: widen a block of weight rows (4 MiB) into a float32 buffer, multiply with at::mm
    // into the transposed output (a contiguous slice), repeat.
    const int64_t block = std::min<int64_t>(N, std::max<int64_t>(16, (int64_t{1} << 20) / K));
    auto buf = torch::empty({block, K}, x.options());
    auto out_t = torch::empty({N, M}, x.options());
    auto xt = x.t();
    for (int64_t b0 = 0; b0 < N; b0 += block) {
      const int64_t nb = std::min(block, N - b0);
      float* bufp = buf.data_ptr<float>();
      at::parallel_for(0, nb, 8, [&](int64_t r0, int64_t r1) {
        widen_rows(f, w, sp, mp, N, K, group, b0 + r0, b0 + r1, bufp + r0 * K);
      });
      auto dst = out_t.narrow(0, b0, nb);
      at::mm_out(dst, buf.narrow(0, 0, nb), xt);
    }
    auto out = out_t.t().contiguous();
    if (bias) out.add_(*bias);
    return out.reshape(out_shape);
  }

  auto y = torch::empty({M, N}, x.options());
  if (M > 0) stream(f, w, sp, mp, bp, N, K, group, x.data_ptr<float>(), M, y.data_ptr<float>());
  return y.reshape(out_shape);
}

// The weight as float32 [N, K] (tests and diagnostics).
torch::Tensor dequantize(int64_t fmt, const torch::Tensor& w, const c10::optional<torch::Tensor>& scales,
                         const c10::optional<torch::Tensor>& mins, int64_t out_features, int64_t in_features,
                         int64_t group) {
  check_weight(static_cast<int>(fmt), w, scales, mins, out_features, in_features, group);
  auto out = torch::empty({out_features, in_features}, torch::kFloat);
  widen_rows(static_cast<int>(fmt), w, scales ? scales->data_ptr<float>() : nullptr,
             mins ? mins->data_ptr<float>() : nullptr, out_features, in_features, group, 0, out_features,
             out.data_ptr<float>());
  return out;
}

// ------------------------------------------------------------------------------------------
// One decoding position through a whole Qwen3 decoder stack (T == 1), every op in here: RMSNorm,
// fused q/k/v, per-head q/k RMSNorm, rotate-half RoPE, the KV-cache write, grouped-query
// attention over positions 0..start, o, SwiGLU, residuals, final norm. The Python version runs
// ~40 torch ops per layer at a few microseconds of dispatch each; here a layer is four weight
// streams plus a little arithmetic on vectors that stay in L1/L2.

struct Packed {
  int64_t fmt, n, k, group;
  torch::Tensor w;
  c10::optional<torch::Tensor> scales, mins, bias;
  Packed(int64_t fmt_, torch::Tensor w_, c10::optional<torch::Tensor> scales_, c10::optional<torch::Tensor> mins_,
         c10::optional<torch::Tensor> bias_, int64_t n_, int64_t k_, int64_t group_)
      : fmt(fmt_), n(n_), k(k_), group(group_), w(std::move(w_)), scales(std::move(scales_)), mins(std::move(mins_)),
        bias(std::move(bias_)) {
    check_weight(static_cast<int>(fmt), w, scales, mins, n, k, group);
    if (bias) TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n, "bias");
  }
  void operator()(const float* x, float* y, int64_t rows = 1) const {
    stream(static_cast<int>(fmt), w, scales ? scales->data_ptr<float>() : nullptr,
           mins ? mins->data_ptr<float>() : nullptr, bias ? bias->data_ptr<float>() : nullptr, n, k, group, x, rows,
           y);
  }
};

struct Layer {
  Packed qkv, o, gate_up, down;
  torch::Tensor ln1, ln2, qn, kn;
};

inline void rms_norm(const float* x, const float* w, int64_t d, float eps, float* out) {
  float ss = 0.f;
  for (int64_t i = 0; i < d; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i) out[i] = w[i] * (x[i] * r);
}

inline void rope(float* x, const float* cos, const float* sin, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

struct Stack {
  std::vector<Layer> layers;
  torch::Tensor norm;
  int64_t hidden, heads, kv_heads, head_dim, inter;
  double eps;

  Stack(std::vector<Layer> layers_, torch::Tensor norm_, int64_t hidden_, int64_t heads_, int64_t kv_heads_,
        int64_t head_dim_, int64_t inter_, double eps_)
      : layers(std::move(layers_)), norm(std::move(norm_)), hidden(hidden_), heads(heads_), kv_heads(kv_heads_),
        head_dim(head_dim_), inter(inter_), eps(eps_) {
    TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv_heads");
    TORCH_CHECK(head_dim % 8 == 0, "head_dim must be a multiple of 8");
    const int64_t nq = heads * head_dim, nkv = kv_heads * head_dim;
    for (const auto& l : layers) {
      TORCH_CHECK(l.qkv.k == hidden && l.qkv.n == nq + 2 * nkv, "qkv shape");
      TORCH_CHECK(l.o.k == nq && l.o.n == hidden, "o shape");
      TORCH_CHECK(l.gate_up.k == hidden && l.gate_up.n == 2 * inter, "gate_up shape");
      TORCH_CHECK(l.down.k == inter && l.down.n == hidden, "down shape");
      for (const auto* t : {&l.ln1, &l.ln2, &l.qn, &l.kn})
        TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "norm weights must be float32");
    }
  }

  // x [1, T, hidden] at positions start..start+T-1 (T <= kMaxRows, causal within the block);
  // k_all/v_all [layers, 1, kv_heads, max_len, head_dim]; cos/sin [T, head_dim].
  torch::Tensor run(const torch::Tensor& x_in, const torch::Tensor& k_all, const torch::Tensor& v_all,
                    const torch::Tensor& cos_t, const torch::Tensor& sin_t, int64_t start) const {
    const int64_t T = check_rows(x_in);
    check_cache(k_all, v_all);
    TORCH_CHECK(start >= 0 && start + T <= k_all.size(3), "positions ", start, "..", start + T - 1,
                " outside the KV cache (", k_all.size(3), ")");
    std::vector<Row> rows(T);
    for (int64_t r = 0; r < T; ++r)
      rows[r] = {k_all.data_ptr<float>(), v_all.data_ptr<float>(), k_all.size(3), start + r};
    return forward(x_in, rows, cos_t, sin_t);
  }

  // Rows of different sequences in one pass (a decoding step of several requests): row r of
  // x [1, T, hidden] is at position positions[r] of cache caches[r] (an index into k_list/v_list,
  // each [layers, 1, kv_heads, max_len, head_dim]) and attends to that cache's positions
  // 0..positions[r]. Rows of one cache may be consecutive positions (causal among them, as run).
  // The weights are read once for all rows: T rows cost about what one does on a memory-bound CPU.
  torch::Tensor run_rows(const torch::Tensor& x_in, const std::vector<torch::Tensor>& k_list,
                         const std::vector<torch::Tensor>& v_list, const torch::Tensor& cos_t,
                         const torch::Tensor& sin_t, const std::vector<int64_t>& caches,
                         const std::vector<int64_t>& positions) const {
    const int64_t T = check_rows(x_in);
    TORCH_CHECK(k_list.size() == v_list.size() && !k_list.empty(), "one v cache per k cache");
    TORCH_CHECK(static_cast<int64_t>(caches.size()) == T && static_cast<int64_t>(positions.size()) == T,
                "one cache index and one position per row");
    for (size_t c = 0; c < k_list.size(); ++c) check_cache(k_list[c], v_list[c]);
    std::vector<Row> rows(T);
    for (int64_t r = 0; r < T; ++r) {
      const int64_t c = caches[r];
      TORCH_CHECK(c >= 0 && c < static_cast<int64_t>(k_list.size()), "row ", r, ": no cache ", c);
      const int64_t max_len = k_list[c].size(3);
      TORCH_CHECK(positions[r] >= 0 && positions[r] < max_len, "row ", r, ": position ", positions[r],
                  " outside its KV cache (", max_len, ")");
      rows[r] = {k_list[c].data_ptr<float>(), v_list[c].data_ptr<float>(), max_len, positions[r]};
    }
    return forward(x_in, rows, cos_t, sin_t);
  }

 private:
  struct Row {
    float* k;  // layer 0 of the row's cache; layer li is li * kv_heads * max_len * head_dim further
    float* v;
    int64_t max_len;
    int64_t pos;  // written here; attends to 0..pos
  };

  int64_t check_rows(const torch::Tensor& x_in) const {
    TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 3 && x_in.size(0) == 1 &&
                    x_in.size(2) == hidden && x_in.size(1) >= 1 && x_in.size(1) <= kMaxRows,
                "x must be float32 [1, T <= ", kMaxRows, ", hidden]");
    return x_in.size(1);
  }

  void check_cache(const torch::Tensor& k_all, const torch::Tensor& v_all) const {
    TORCH_CHECK(k_all.scalar_type() == at::kFloat && k_all.is_contiguous() && v_all.is_contiguous() &&
                    k_all.dim() == 5 && k_all.size(0) >= static_cast<int64_t>(layers.size()) &&
                    k_all.size(2) == kv_heads && k_all.size(4) == head_dim && v_all.sizes() == k_all.sizes() &&
                    v_all.scalar_type() == at::kFloat,
                "KV cache must be float32 [layers, 1, kv_heads, max_len, head_dim]");
  }

  torch::Tensor forward(const torch::Tensor& x_in, const std::vector<Row>& rows, const torch::Tensor& cos_t,
                        const torch::Tensor& sin_t) const {
    const int64_t T = static_cast<int64_t>(rows.size());
    TORCH_CHECK(cos_t.numel() == T * head_dim && sin_t.numel() == T * head_dim && cos_t.is_contiguous() &&
                    sin_t.is_contiguous() && cos_t.scalar_type() == at::kFloat && sin_t.scalar_type() == at::kFloat,
                "cos/sin must be float32 [T, head_dim]");
    const float* cs = cos_t.data_ptr<float>();
    const float* sn = sin_t.data_ptr<float>();
    const int64_t nq = heads * head_dim, nkv = kv_heads * head_dim, group = heads / kv_heads;
    const int64_t width = nq + 2 * nkv;
    const float e = static_cast<float>(eps);
    const float scale = 1.f / std::sqrt(static_cast<float>(head_dim));
    auto x = x_in.contiguous();
    auto out = torch::empty({1, T, hidden}, x_in.options());
    std::vector<float> h(x.data_ptr<float>(), x.data_ptr<float>() + T * hidden);
    std::vector<float> t(T * std::max(hidden, nq)), qkv(T * width), attn(T * nq), gu(T * 2 * inter), y(T * hidden);
    std::vector<float> act(T * inter);
    int64_t span = 0;
    for (const Row& row : rows) span = std::max(span, row.pos + 1);
    std::vector<float> scores(heads * span);
    for (size_t li = 0; li < layers.size(); ++li) {
      const Layer& L = layers[li];
      for (int64_t r = 0; r < T; ++r)
        rms_norm(h.data() + r * hidden, L.ln1.data_ptr<float>(), hidden, e, t.data() + r * hidden);
      L.qkv(t.data(), qkv.data(), T);
      for (int64_t r = 0; r < T; ++r) {
        const Row& row = rows[r];
        const int64_t layer_offset = static_cast<int64_t>(li) * kv_heads * row.max_len * head_dim;
        float* kc = row.k + layer_offset;
        float* vc = row.v + layer_offset;
        float* q = qkv.data() + r * width;
        float* k = q + nq;
        const float* v = k + nkv;
        const float* cr = cs + r * head_dim;
        const float* sr = sn + r * head_dim;
        for (int64_t i = 0; i < heads; ++i) {
          float* qi = q + i * head_dim;
          rms_norm(qi, L.qn.data_ptr<float>(), head_dim, e, qi);
          rope(qi, cr, sr, head_dim);
        }
        for (int64_t j = 0; j < kv_heads; ++j) {
          float* kj = k + j * head_dim;
          rms_norm(kj, L.kn.data_ptr<float>(), head_dim, e, kj);
          rope(kj, cr, sr, head_dim);
          std::copy_n(kj, head_dim, kc + (j * row.max_len + row.pos) * head_dim);
          std::copy_n(v + j * head_dim, head_dim, vc + (j * row.max_len + row.pos) * head_dim);
        }
      }
      // Every row's keys are written before any row attends: a row sees the rows of its own cache
      // before it in this block, as a causal block would.
      at::parallel_for(0, heads, 1, [&](int64_t h0, int64_t h1) {
        for (int64_t i = h0; i < h1; ++i) {
          const int64_t j = i / group;
          float* sc = scores.data() + i * span;
          for (int64_t r = 0; r < T; ++r) {
            const Row& row = rows[r];
            const int64_t layer_offset = static_cast<int64_t>(li) * kv_heads * row.max_len * head_dim;
            const float* kb = row.k + layer_offset + j * row.max_len * head_dim;
            const float* vb = row.v + layer_offset + j * row.max_len * head_dim;
            const float* qi = qkv.data() + r * width + i * head_dim;
            const int64_t last = row.pos;  // causal: this row sees positions 0..last
            float mx = -INFINITY;
            for (int64_t p = 0; p <= last; ++p) {
              const float* kp = kb + p * head_dim;
              __m256 acc = _mm256_setzero_ps();
              for (int64_t d = 0; d < head_dim; d += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(qi + d), _mm256_loadu_ps(kp + d), acc);
              sc[p] = hsum(acc) * scale;
              mx = std::max(mx, sc[p]);
            }
            float total = 0.f;
            for (int64_t p = 0; p <= last; ++p) {
              sc[p] = std::exp(sc[p] - mx);
              total += sc[p];
            }
            const float inv = 1.f / total;
            float* o = attn.data() + r * nq + i * head_dim;
            std::fill_n(o, head_dim, 0.f);
            for (int64_t p = 0; p <= last; ++p) {
              const __m256 wp = _mm256_set1_ps(sc[p] * inv);
              const float* vp = vb + p * head_dim;
              for (int64_t d = 0; d < head_dim; d += 8)
                _mm256_storeu_ps(o + d, _mm256_fmadd_ps(wp, _mm256_loadu_ps(vp + d), _mm256_loadu_ps(o + d)));
            }
          }
        }
      });
      L.o(attn.data(), y.data(), T);
      for (int64_t i = 0; i < T * hidden; ++i) h[i] += y[i];
      for (int64_t r = 0; r < T; ++r)
        rms_norm(h.data() + r * hidden, L.ln2.data_ptr<float>(), hidden, e, t.data() + r * hidden);
      L.gate_up(t.data(), gu.data(), T);
      for (int64_t r = 0; r < T; ++r) {
        const float* g = gu.data() + r * 2 * inter;
        float* a = act.data() + r * inter;
        for (int64_t i = 0; i < inter; ++i) a[i] = g[i] / (1.f + std::exp(-g[i])) * g[inter + i];
      }
      L.down(act.data(), y.data(), T);
      for (int64_t i = 0; i < T * hidden; ++i) h[i] += y[i];
    }
    for (int64_t r = 0; r < T; ++r)
      rms_norm(h.data() + r * hidden, norm.data_ptr<float>(), hidden, e, out.data_ptr<float>() + r * hidden);
    return out;
  }
};

// ------------------------------------------------------------------------------------------
// Packing a float32 weight [N, K] into the integer formats at load time, in one pass over it
// (the same arithmetic as native/__init__.py's _pack_reference, which the tests compare with):
//   int8: scale = max(amax|row| / 127, 1e-12), q = clamp(round(w / scale), -127, 127);
//   int4: per group of G, scale = max((max - min) / 15, 1e-12), q = clamp(round((w - min) / scale), 0, 15);
// rounding half to even, as torch.round; rows written pair-interleaved (pair_offset).
std::vector<torch::Tensor> pack(int64_t fmt, const torch::Tensor& w_in, int64_t group) {
  TORCH_CHECK(fmt == kI8 || fmt == kI4, "pack makes the integer formats (", kI8, ", ", kI4, ")");
  TORCH_CHECK(w_in.device().is_cpu() && w_in.scalar_type() == at::kFloat && w_in.dim() == 2,
              "weight must be float32 [out_features, in_features] on the CPU");
  auto w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1), blocks = K / 32;
  TORCH_CHECK(K % 32 == 0, "in_features must be a multiple of 32, got ", K);
  const float* src = w.data_ptr<float>();
  if (fmt == kI8) {
    auto q = torch::empty({N * K}, torch::kChar);
    auto scale = torch::empty({N}, torch::kFloat);
    int8_t* qp = q.data_ptr<int8_t>();
    float* sp = scale.data_ptr<float>();
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        const float* row = src + n * K;
        float amax = 0.f;
        for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::abs(row[k]));
        const float s = std::max(amax / 127.f, 1e-12f);
        sp[n] = s;
        for (int64_t b = 0; b < blocks; ++b) {
          int8_t* dst = qp + pair_offset(n, N, blocks, b, 32);
          for (int i = 0; i < 32; ++i)
            dst[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(row[b * 32 + i] / s))));
        }
      }
    });
    return {q, scale};
  }
  TORCH_CHECK(group >= 32 && group % 32 == 0 && K % group == 0, "group size must be a multiple of 32 dividing ",
              K);
  const int64_t groups = K / group;
  auto q = torch::empty({N * K / 2}, torch::kByte);
  auto scales = torch::empty({N * groups}, torch::kFloat);
  auto mins = torch::empty({N * groups}, torch::kFloat);
  uint8_t* qp = q.data_ptr<uint8_t>();
  float* sp = scales.data_ptr<float>();
  float* mp = mins.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<uint8_t> codes(group);
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t g = 0; g < groups; ++g) {
        const float* v = src + n * K + g * group;
        float lo = v[0], hi = v[0];
        for (int64_t i = 1; i < group; ++i) {
          lo = std::min(lo, v[i]);
          hi = std::max(hi, v[i]);
        }
        const float s = std::max((hi - lo) / 15.f, 1e-12f);
        const int64_t gi = pair_offset(n, N, groups, g, 1);
        sp[gi] = s;
        mp[gi] = lo;
        for (int64_t i = 0; i < group; ++i)
          codes[i] = static_cast<uint8_t>(std::min(15.f, std::max(0.f, std::nearbyint((v[i] - lo) / s))));
        for (int64_t j = 0; j < group / 32; ++j) {
          uint8_t* dst = qp + pair_offset(n, N, blocks, g * (group / 32) + j, 16);
          const uint8_t* c = codes.data() + j * 32;
          for (int i = 0; i < 16; ++i) dst[i] = static_cast<uint8_t>(c[i] | (c[i + 16] << 4));
        }
      }
    }
  });
  return {q, scales, mins};
}

// ------------------------------------------------------------------------------------------
// SnakeBeta, the codec decoder's activation: y = x + inv_beta[c] * sin(x * alpha[c])^2 over
// x [B, C, T], in one pass (torch needs five, each through memory). sin^2 has period pi, so the
// argument is reduced by the nearest multiple of pi (two FMA steps with pi split in two floats)
// to [-pi/2, pi/2], where an odd polynomial of degree 11 (Taylor) is within 6e-8 of sin.
inline __m256 sin_squared(__m256 v) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(0.318309886183790671f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(3.14159274101257324f), v);  // float(pi)
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-8.74227800037248e-08f), r);       // pi - float(pi)
  const __m256 r2 = _mm256_mul_ps(r, r);
  __m256 p = _mm256_set1_ps(-2.50521083854417188e-08f);                       // -1/11!
  p = _mm256_fmadd_ps(p, r2, _mm256_set1_ps(2.75573192239858907e-06f));       // 1/9!
  p = _mm256_fmadd_ps(p, r2, _mm256_set1_ps(-1.98412698412698413e-04f));      // -1/7!
  p = _mm256_fmadd_ps(p, r2, _mm256_set1_ps(8.33333333333333333e-03f));       // 1/5!
  p = _mm256_fmadd_ps(p, r2, _mm256_set1_ps(-1.66666666666666667e-01f));      // -1/3!
  const __m256 sn = _mm256_fmadd_ps(_mm256_mul_ps(p, r2), r, r);
  return _mm256_mul_ps(sn, sn);
}

torch::Tensor snake(const torch::Tensor& x_in, const torch::Tensor& alpha, const torch::Tensor& inv_beta) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 3,
              "x must be float32 [batch, channels, time] on the CPU");
  const int64_t B = x_in.size(0), C = x_in.size(1), T = x_in.size(2);
  for (const auto* t : {&alpha, &inv_beta})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == C,
                "alpha and inv_beta must be float32 [channels]");
  auto x = x_in.contiguous();
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* ap = alpha.data_ptr<float>();
  const float* bp = inv_beta.data_ptr<float>();
  at::parallel_for(0, B * C, std::max<int64_t>(1, 4096 / std::max<int64_t>(T, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {
      const int64_t c = row % C;
      const float* src = xp + row * T;
      float* dst = yp + row * T;
      const __m256 a = _mm256_set1_ps(ap[c]);
      const __m256 ib = _mm256_set1_ps(bp[c]);
      int64_t t = 0;
      for (; t + 8 <= T; t += 8) {
        const __m256 v = _mm256_loadu_ps(src + t);
        _mm256_storeu_ps(dst + t, _mm256_fmadd_ps(ib, sin_squared(_mm256_mul_ps(v, a)), v));
      }
      for (; t < T; ++t) {
        const float sv = std::sin(src[t] * ap[c]);
        dst[t] = src[t] + bp[c] * (sv * sv);
      }
    }
  });
  return y;
}

}  // namespace

#define GIL_FREE py::call_guard<py::gil_scoped_release>()

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() =
      "AVX2 (and AVX-512 VNNI) weight-streaming linear layers (float32, bfloat16, int8, 4-bit weights; float32 "
      "activations)";
  // Every computing entry point lets go of the GIL (arguments are converted before, results after):
  // the event loop keeps serving stops, MQTT and signals while a long prefill or decoder call runs.
  m.def("linear", &linear, "y = x W^T (+ bias) for a packed weight", GIL_FREE, py::arg("x"), py::arg("fmt"), py::arg("weight"),
        py::arg("scales"), py::arg("mins"), py::arg("out_features"), py::arg("group"), py::arg("bias"));
  m.def("dequantize", &dequantize, "packed weight -> float32 [out, in]", GIL_FREE, py::arg("fmt"), py::arg("weight"),
        py::arg("scales"), py::arg("mins"), py::arg("out_features"), py::arg("in_features"), py::arg("group"));
  m.def("pack", &pack, "float32 weight [N, K] -> int8 (data, scales) or int4 (data, scales, mins)", GIL_FREE,
        py::arg("fmt"),
        py::arg("weight"), py::arg("group"));
  m.def("snake", &snake, "SnakeBeta: x + inv_beta * sin(x * alpha)^2 per channel of x [B, C, T]", GIL_FREE,
        py::arg("x"),
        py::arg("alpha"), py::arg("inv_beta"));
  m.def(
      "set_wide",
      [](bool on) {
        const bool before = g_wide;
        g_wide = on && g_wide_supported;
        return before;
      },
      "use the AVX-512 VNNI int8 kernel where the CPU has it (default); returns the previous setting",
      py::arg("on"));
  m.attr("WIDE_SUPPORTED") = g_wide_supported;
  m.attr("MAX_STREAM_ROWS") = kMaxRows;
  m.attr("MAX_BLOCKED_ROWS") = kBlockedMaxRows;
  py::class_<Packed>(m, "Packed")
      .def(py::init<int64_t, torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                    c10::optional<torch::Tensor>, int64_t, int64_t, int64_t>(),
           py::arg("fmt"), py::arg("weight"), py::arg("scales"), py::arg("mins"), py::arg("bias"),
           py::arg("out_features"), py::arg("in_features"), py::arg("group"))
      .def(
          "__call__",
          [](const Packed& self, const torch::Tensor& x) {
            TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.numel() == self.k, "x: float32 [in]");
            auto y = torch::empty({self.n}, x.options());
            self(x.data_ptr<float>(), y.data_ptr<float>());
            return y;
          },
          "one row (as Stack computes it)", GIL_FREE, py::arg("x"));
  py::class_<Layer>(m, "Layer")
      .def(py::init<Packed, Packed, Packed, Packed, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor>(),
           py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("input_norm"),
           py::arg("post_norm"), py::arg("q_norm"), py::arg("k_norm"));
  py::class_<Stack>(m, "Stack")
      .def(py::init<std::vector<Layer>, torch::Tensor, int64_t, int64_t, int64_t, int64_t, int64_t, double>(),
           py::arg("layers"), py::arg("norm"), py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"),
           py::arg("head_dim"), py::arg("intermediate"), py::arg("eps"))
      .def("run", &Stack::run, "one position through every layer and the final norm", GIL_FREE, py::arg("x"),
           py::arg("k_cache"), py::arg("v_cache"), py::arg("cos"), py::arg("sin"), py::arg("start"))
      .def("run_rows", &Stack::run_rows, "rows of several sequences, each at its own position of its own cache",
           GIL_FREE, py::arg("x"), py::arg("k_caches"), py::arg("v_caches"), py::arg("cos"), py::arg("sin"), py::arg("caches"),
           py::arg("positions"));
}
