// The native CPU kernels' shared declarations: the C ABI types Python builds with ctypes
// (native/__init__.py mirrors them), the table of one instruction-set path's kernels, the weights'
// pair-interleaved layout, and the OpenMP loop every path runs its threads with.
//
// One library carries every instruction-set path of its architecture and picks one at run time
// (api.cpp): x86-64 `generic` (portable.cpp, no intrinsics), `avx2` and `avx512` (x86.inc, compiled
// twice under a target pragma: x86_avx2.cpp, x86_avx512.cpp); aarch64 `generic`, `neon`, `dotprod`
// and `i8mm` (arm.inc, compiled three times, each unit with its own -march: arm_neon.cpp,
// arm_dotprod.cpp, arm_i8mm.cpp; setup.py). Nothing in it knows torch: Python hands over pointers
// (tensors' data_ptr()) and keeps the tensors alive; outputs are allocated by Python.
//
// No function a path's unit compiles may stand in, at link time, for another unit's copy (an AVX2
// or SDOT instruction would reach the generic path): everything a path's unit defines lives in an
// anonymous namespace, and so do this header's inline functions (each unit compiles its own copy,
// for its own target), which use no C++ library template. The aarch64 units, compiled whole with
// their -march, export nothing else (scripts/arm64_check.sh checks the objects with nm and objdump).

#pragma once

#include <cstdint>

#ifdef _OPENMP
#include <omp.h>
#endif

#define S2S_API extern "C" __attribute__((visibility("default")))

namespace s2s {

constexpr int kF32 = 0;
constexpr int kBF16 = 1;
constexpr int kI8 = 2;
constexpr int kI4 = 3;
constexpr int64_t kMaxRows = 4;          // rows streamed: decoding, a batch's step, the Stack's positions
constexpr int64_t kBlockedMaxRows = 64;  // rows of the register-blocked product (a prompt)
constexpr int kAbiVersion = 3;           // native/__init__.py's ABI_VERSION: bump with any change below

// A packed weight: what PackedLinear's tensors hold (native/__init__.py's _Weight, same order).
//   f32   float32 [N, K]
//   bf16  bfloat16 [N, K]                      (bits << 16 is the float32)
//   i8    int8 [N * K], float32 scale [N]       w = scale[n] * q
//   i4    uint8 [N * K/2], float32 scale/min [N * K/G]   w = scale * q + min, q in 0..15;
//         each 32-weight block is 16 bytes: low nibbles weights 0..15, high nibbles 16..31
// The integer formats store output rows in pairs, interleaved block by block (pair_offset): block
// b of row 2p, block b of row 2p + 1, block b + 1 of row 2p, ... (an odd last row stands alone);
// i4's scales and mins likewise per group. A pair of rows is then one sequential stream.
struct Weight {
  int32_t fmt;
  int32_t group;  // i4: inputs per group; 0 otherwise
  int64_t n;      // out_features
  int64_t k;      // in_features
  const void* data;
  const float* scales;
  const float* mins;
  const float* bias;
};

// One decoder layer of a Stack (native/__init__.py's _Layer).
struct Layer {
  Weight qkv, o, gate_up, down;
  const float* ln1;  // input norm [hidden]
  const float* ln2;  // post-attention norm [hidden]
  const float* qn;   // q norm [head_dim]
  const float* kn;   // k norm [head_dim]
};

// Where one row of a Stack call writes its key and value and what it attends to (native's _Row).
struct Row {
  float* k;  // layer 0 of the row's cache [layers, 1, kv_heads, max_len, head_dim]; layer li is
  float* v;  // li * kv_heads * max_len * head_dim further
  int64_t max_len;
  int64_t pos;  // written here; attends to 0..pos
};

// An embedding table a Predictor looks its codes' rows up in (native/__init__.py's _Table): rows
// [rows, cols] of kF32 or kBF16 in memory at `data`, or, where data is null, in the file open as
// `fd` from byte `offset`, read a row at a time (checkpoint.FileRows: nothing of the file mapped).
struct Table {
  const void* data;
  int64_t offset;
  int64_t rows;
  int64_t cols;
  int32_t dtype;
  int32_t fd;
};

struct StackShape {
  int64_t layers, hidden, heads, kv_heads, head_dim, inter;
  float eps;
};

// One instruction-set path: every kernel the library runs.
struct Ops {
  const char* name;
  // y [M, N] = x [M, K] W^T (+ bias), M <= kMaxRows: each weight read once.
  void (*stream)(const Weight& w, const float* x, int64_t M, float* y, int threads);
  // The same for kMaxRows < M <= kBlockedMaxRows (a prompt): integer weights with the input
  // quantized as for stream (the same numbers), float weights against float32 input.
  void (*blocked)(const Weight& w, const float* x, int64_t M, float* y, int threads);
  // Rows [n0, n1) of the weight as float32 into dst ([n1 - n0, K], row-major).
  void (*widen)(const Weight& w, int64_t n0, int64_t n1, float* dst, int threads);
  // SnakeBeta over x [B, C, T]: y = x + inv_beta[c] * sin(x * alpha[c])^2.
  void (*snake)(const float* x, int64_t B, int64_t C, int64_t T, const float* alpha, const float* inv_beta,
                float* y, int threads);
  // T rows through a whole decoder stack (stack.inc); out [T, hidden].
  void (*stack)(const StackShape& s, const Layer* layers, const float* norm, const float* x, const Row* rows,
                int64_t T, const float* cos, const float* sin, float* out, int threads);
};

// Scratch memory of the calling thread, one buffer per slot, grown to at least `bytes` and kept
// for the thread's next call (api.cpp). A kernel's slots must not overlap with its callers'.
enum ScratchSlot {
  kScratchXq,     // stream: the input quantized to int8
  kScratchXs,     // stream: its scales per block of 32
  kScratchXsum,   // stream: its sums per int4 group
  kScratchRow,    // the portable blocked product: one widened weight row (per thread)
  kScratchStack,  // stack.inc's activations (one buffer, carved up)
  kScratchPairs,  // the i8mm path's stream: the quantized input rows in pairs (arm.inc)
  kScratchI4,     // the x86 stream: the quantized input as the 4-bit pair kernels read it
  kScratchAmx,    // the amx path's prompt product: the input as bfloat16, in its tiles' order
  kScratchAmxWeights,  // the amx path's prompt product: 32 weight rows widened to bfloat16
  kScratchVnni,   // the avx512 path's prompt product: the int8 codes' offsets per input block
  kScratchTileCodes,  // the x86 paths' prompt products (vnni_prompt, avx2_prompt): a tile of weight rows' codes
  kScratchSlots
};
void* scratch(int slot, int64_t bytes);

namespace {  // one copy per unit, compiled for its target (above)

// Rows interleaved in row n's pair: 2, or 1 for an odd last row.
inline int64_t pair_rows(int64_t n, int64_t N) { return (n | 1) < N ? 2 : 1; }
// Offset, in units of `unit` elements, of block b of row n in the pair-interleaved layout of an
// [N, blocks * unit] matrix.
inline int64_t pair_offset(int64_t n, int64_t N, int64_t blocks, int64_t b, int64_t unit) {
  return ((n & ~int64_t{1}) * blocks + b * pair_rows(n, N) + (n & 1)) * unit;
}

// f(lo, hi) over [begin, end) in chunks of at least `grain`, on up to `threads` OpenMP threads (the
// calling thread's team: with torch imported first, torch's own libgomp and pool). As
// at::parallel_for divides: as many threads as there are grains, up to `threads`, one contiguous
// chunk each. Without OpenMP (clang on macOS) it runs on the calling thread.
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, int threads, const F& f) {
  const int64_t range = end - begin;
  if (range <= 0) return;
  const int64_t grains = (range + grain - 1) / (grain > 1 ? grain : 1);
  const int64_t team = threads < 1 ? 1 : threads < grains ? threads : grains;
#ifdef _OPENMP
  if (team > 1 && !omp_in_parallel()) {
    const int64_t chunk = (range + team - 1) / team;
#pragma omp parallel num_threads(static_cast<int>(team))
    {
      const int64_t lo = begin + omp_get_thread_num() * chunk;
      if (lo < end) f(lo, lo + chunk < end ? lo + chunk : end);
    }
    return;
  }
#endif
  (void)team;
  f(begin, end);
}

// Each row of x [M, K] as int8 per block of 32 (round to nearest even, scale = max |x| / 127), as
// GGML's Q8_0: the integer formats multiply in integers against it.
inline void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* xs) {
  const int64_t blocks = K / 32;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* src = x + m * K + b * 32;
      float amax = 0.f;
      for (int i = 0; i < 32; ++i) {
        const float a = src[i] < 0.f ? -src[i] : src[i];
        amax = a > amax ? a : amax;
      }
      const float scale = amax / 127.f;
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* dst = xq + m * K + b * 32;
      for (int i = 0; i < 32; ++i) dst[i] = static_cast<int8_t>(__builtin_nearbyintf(src[i] * inv));
      xs[m * blocks + b] = scale;
    }
  }
}

// The sum of the quantized input per group of G (i4's mins): then the product's error is
// sum w (xq - x), as for int8, not sum (w - min) (xq - x).
inline void group_sums(const int8_t* xq, const float* xs, int64_t M, int64_t K, int64_t G, float* xsum) {
  const int64_t groups = K / G, per_group = G / 32, blocks = K / 32;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
        int32_t q = 0;
        for (int i = 0; i < 32; ++i) q += xq[m * K + b * 32 + i];
        s += static_cast<float>(q) * xs[m * blocks + b];
      }
      xsum[m * groups + g] = s;
    }
}

}  // namespace
}  // namespace s2s

extern "C" {
extern const s2s::Ops s2s_ops_generic;
#if defined(__x86_64__) || defined(_M_X64)
extern const s2s::Ops s2s_ops_avx2;
extern const s2s::Ops s2s_ops_avx512;
extern const s2s::Ops* const s2s_ops_amx;  // null where the compiler had no AMX (x86_amx.cpp)
#endif
#if defined(__aarch64__)
extern const s2s::Ops s2s_ops_neon;
extern const s2s::Ops s2s_ops_dotprod;
extern const s2s::Ops s2s_ops_i8mm;
#endif
}
