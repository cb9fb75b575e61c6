// The `generic` path: every kernel in portable C++ (no intrinsics; the compiler vectorizes for the
// architecture's baseline: SSE2 on x86-64, NEON on aarch64). It runs on any CPU the library was
// built for, computes what the wide paths compute (the integer formats against the input quantized
// per block of 32, float32 accumulation) in another summation order, and is the reference the
// other paths are tested against (tests/test_native_kernels.py). Accumulators are kept 8 wide so
// that the compiler can vectorize the sums without reassociating them.

#include "kernels.h"

namespace {

using s2s::Weight;

constexpr int kLanes = 8;

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}

inline float lanes_sum(const float* acc) {
  float s = 0.f;
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}

inline float dot(const float* a, const float* b, int64_t d) {
  float acc[kLanes] = {};
  for (int64_t i = 0; i < d; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  return lanes_sum(acc);
}

inline void axpy(float w, const float* v, float* o, int64_t d) {
  for (int64_t i = 0; i < d; ++i) o[i] += w * v[i];
}

// Rows [n0, n1) of the weight as float32 into dst ([n1 - n0, K], row-major).
void widen_rows(const Weight& w, int64_t n0, int64_t n1, float* dst) {
  const int64_t N = w.n, K = w.k, blocks = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    float* d = dst + (n - n0) * K;
    if (w.fmt == s2s::kF32) {
      const float* r = static_cast<const float*>(w.data) + n * K;
      for (int64_t k = 0; k < K; ++k) d[k] = r[k];
    } else if (w.fmt == s2s::kBF16) {
      const uint16_t* r = static_cast<const uint16_t*>(w.data) + n * K;
      for (int64_t k = 0; k < K; ++k) d[k] = bf16_to_float(r[k]);
    } else if (w.fmt == s2s::kI8) {
      const int8_t* base = static_cast<const int8_t*>(w.data);
      const float s = w.scales[n];
      for (int64_t b = 0; b < blocks; ++b) {
        const int8_t* blk = base + s2s::pair_offset(n, N, blocks, b, 32);
        for (int i = 0; i < 32; ++i) d[b * 32 + i] = s * static_cast<float>(blk[i]);
      }
    } else {
      const uint8_t* base = static_cast<const uint8_t*>(w.data);
      const int64_t groups = K / w.group;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t gi = s2s::pair_offset(n, N, groups, b * 32 / w.group, 1);
        const float s = w.scales[gi], mn = w.mins[gi];
        const uint8_t* blk = base + s2s::pair_offset(n, N, blocks, b, 16);
        for (int i = 0; i < 16; ++i) {  // one rounding, as the wide paths' fused multiply-add
          d[b * 32 + i] = __builtin_fmaf(s, static_cast<float>(blk[i] & 0x0F), mn);
          d[b * 32 + 16 + i] = __builtin_fmaf(s, static_cast<float>(blk[i] >> 4), mn);
        }
      }
    }
  }
}

void widen(const Weight& w, int64_t n0, int64_t n1, float* dst, int threads) {
  s2s::parallel_for(n0, n1, 8, threads,
                    [&](int64_t r0, int64_t r1) { widen_rows(w, r0, r1, dst + (r0 - n0) * w.k); });
}

template <class T, class Load>
float dense_dot(const T* row, const float* x, int64_t K, Load load) {
  float acc[kLanes] = {};
  for (int64_t k = 0; k < K; k += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += load(row[k + j]) * x[k + j];
  return lanes_sum(acc);
}

// int8 row n against the quantized input row m: sum_b xs[b] * sum_{k in b} q xq, times the row's scale.
float i8_dot(const Weight& w, int64_t n, const int8_t* xq, const float* xs) {
  const int64_t blocks = w.k / 32;
  const int8_t* base = static_cast<const int8_t*>(w.data);
  float acc = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* blk = base + s2s::pair_offset(n, w.n, blocks, b, 32);
    const int8_t* xb = xq + b * 32;
    int32_t sum = 0;
    for (int i = 0; i < 32; ++i) sum += static_cast<int32_t>(blk[i]) * static_cast<int32_t>(xb[i]);
    acc += static_cast<float>(sum) * xs[b];
  }
  return acc * w.scales[n];
}

// 4-bit row n: sum_g scale[g] * sum_{b in g} xs[b] * sum_k q xq + sum_g min[g] * sum_{k in g} x.
float i4_dot(const Weight& w, int64_t n, const int8_t* xq, const float* xs, const float* xsum) {
  const int64_t K = w.k, blocks = K / 32, groups = K / w.group, per_group = w.group / 32;
  const uint8_t* base = static_cast<const uint8_t*>(w.data);
  float out = 0.f, off = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    float acc = 0.f;
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      const uint8_t* blk = base + s2s::pair_offset(n, w.n, blocks, b, 16);
      const int8_t* xb = xq + b * 32;
      int32_t sum = 0;
      for (int i = 0; i < 16; ++i)
        sum += static_cast<int32_t>(blk[i] & 0x0F) * xb[i] + static_cast<int32_t>(blk[i] >> 4) * xb[16 + i];
      acc += static_cast<float>(sum) * xs[b];
    }
    const int64_t gi = s2s::pair_offset(n, w.n, groups, g, 1);
    out += w.scales[gi] * acc;
    off += w.mins[gi] * xsum[g];
  }
  return out + off;
}

void stream(const Weight& w, const float* x, int64_t M, float* y, int threads) {
  const int64_t N = w.n, K = w.k;
  const bool integer = w.fmt == s2s::kI8 || w.fmt == s2s::kI4;
  int8_t* xq = nullptr;
  float* xs = nullptr;
  float* xsum = nullptr;
  if (integer) {
    xq = static_cast<int8_t*>(s2s::scratch(s2s::kScratchXq, M * K));
    xs = static_cast<float*>(s2s::scratch(s2s::kScratchXs, M * (K / 32) * static_cast<int64_t>(sizeof(float))));
    s2s::quantize_rows(x, M, K, xq, xs);
  }
  if (w.fmt == s2s::kI4) {
    xsum = static_cast<float*>(
        s2s::scratch(s2s::kScratchXsum, M * (K / w.group) * static_cast<int64_t>(sizeof(float))));
    s2s::group_sums(xq, xs, M, K, w.group, xsum);
  }
  s2s::parallel_for(0, (N + 1) / 2, 8, threads, [&](int64_t p0, int64_t p1) {
    const int64_t n1 = 2 * p1 < N ? 2 * p1 : N;
    for (int64_t n = 2 * p0; n < n1; ++n)
      for (int64_t m = 0; m < M; ++m) {
        float v;
        switch (w.fmt) {
          case s2s::kF32:
            v = dense_dot(static_cast<const float*>(w.data) + n * K, x + m * K, K, [](float f) { return f; });
            break;
          case s2s::kBF16:
            v = dense_dot(static_cast<const uint16_t*>(w.data) + n * K, x + m * K, K, bf16_to_float);
            break;
          case s2s::kI8:
            v = i8_dot(w, n, xq + m * K, xs + m * (K / 32));
            break;
          default:
            v = i4_dot(w, n, xq + m * K, xs + m * (K / 32), xsum + m * (K / w.group));
        }
        y[m * N + n] = v + (w.bias ? w.bias[n] : 0.f);
      }
  });
}

// kMaxRows < M <= kBlockedMaxRows: integer weights as streaming (the input quantized, as the wide
// paths' integer_prompt); float weights: each weight row widened once (into the thread's scratch
// row) and multiplied by every input row (float32, as the wide paths' register-blocked product).
void blocked(const Weight& w, const float* x, int64_t M, float* y, int threads) {
  if (w.fmt == s2s::kI8 || w.fmt == s2s::kI4) return stream(w, x, M, y, threads);
  const int64_t N = w.n, K = w.k;
  s2s::parallel_for(0, N, 8, threads, [&](int64_t n0, int64_t n1) {
    float* row = static_cast<float*>(s2s::scratch(s2s::kScratchRow, K * static_cast<int64_t>(sizeof(float))));
    for (int64_t n = n0; n < n1; ++n) {
      widen_rows(w, n, n + 1, row);
      const float add = w.bias ? w.bias[n] : 0.f;
      for (int64_t m = 0; m < M; ++m) y[m * N + n] = dot(row, x + m * K, K) + add;
    }
  });
}

void snake(const float* xp, int64_t B, int64_t C, int64_t T, const float* ap, const float* bp, float* yp,
           int threads) {
  const int64_t grain = T > 0 && T < 4096 ? 4096 / T : 1;
  s2s::parallel_for(0, B * C, grain, threads, [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {
      const int64_t c = row % C;
      const float* src = xp + row * T;
      float* dst = yp + row * T;
      for (int64_t t = 0; t < T; ++t) {
        const float sv = __builtin_sinf(src[t] * ap[c]);
        dst[t] = src[t] + bp[c] * (sv * sv);
      }
    }
  });
}

#include "stack.inc"

}  // namespace

extern "C" const s2s::Ops s2s_ops_generic = {"generic", stream, blocked, widen, snake, stack};
