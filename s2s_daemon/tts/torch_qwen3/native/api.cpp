// The library's C ABI (what native/__init__.py calls through ctypes), the instruction-set paths it
// carries and which of them this CPU runs, packing float32 weights into the integer formats, and
// the threads' scratch memory. Every entry point returns 0 on success, or -1 with the reason in
// s2s_error() (the calling thread's last error): bad arguments never abort the process.
//
// Why a plain C library and not a torch extension: no torch headers and no torch C++ ABI to match
// (any torch version loads it, pip builds it without torch), and one build per architecture. The
// per-call cost of ctypes is per linear or per decoder position (a whole Stack is one call).

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <new>
#include <vector>

#include "kernels.h"

#include <unistd.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#endif
#elif defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#elif defined(__aarch64__) && defined(__APPLE__)
#include <sys/sysctl.h>
#endif

#ifndef S2S_SOURCE_DIGEST
#define S2S_SOURCE_DIGEST ""
#endif

namespace {

using s2s::Ops;
using s2s::Weight;

thread_local char g_error[512];

int fail(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(g_error, sizeof g_error, fmt, args);
  va_end(args);
  return -1;
}

// ----------------------------------------------------------------------------- the paths

// What this CPU has, by path name (x86-64: cpuid, as GCC's __builtin_cpu_supports reads it with
// the OS's XSAVE support; aarch64 Linux: the kernel's HWCAPs; macOS: sysctl).
bool cpu_has(const char* name) {
  if (std::strcmp(name, "generic") == 0) return true;
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (std::strcmp(name, "avx2") == 0) return avx2;
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512vnni");
  if (std::strcmp(name, "avx512") == 0) return avx512;
  if (std::strcmp(name, "amx") == 0) {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(avx512 && (d >> 22 & 1) && (d >> 24 & 1))) return false;  // AMX-BF16, AMX-TILE
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a >> 5 & 1)) return false;  // AVX512_BF16
#if defined(__linux__)
    // Linux hands a process AMX's tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for
    // XFEATURE_XTILEDATA, Linux 5.16+); asked once, for the whole process, before any tile is used.
    static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return granted;
#else
    return false;
#endif
  }
#elif defined(__aarch64__) && defined(__linux__)
  const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
  if (std::strcmp(name, "neon") == 0) return hw & (1UL << 1);                                   // HWCAP_ASIMD
  if (std::strcmp(name, "dotprod") == 0) return (hw & (1UL << 1)) && (hw & (1UL << 20));        // HWCAP_ASIMDDP
  if (std::strcmp(name, "i8mm") == 0) return (hw & (1UL << 20)) && (hw2 & (1UL << 13));          // HWCAP2_I8MM
#elif defined(__aarch64__) && defined(__APPLE__)
  auto feature = [](const char* key) {
    int value = 0;
    size_t size = sizeof value;
    return sysctlbyname(key, &value, &size, nullptr, 0) == 0 && value != 0;
  };
  if (std::strcmp(name, "neon") == 0) return true;
  if (std::strcmp(name, "dotprod") == 0) return feature("hw.optional.arm.FEAT_DotProd");
  if (std::strcmp(name, "i8mm") == 0) return feature("hw.optional.arm.FEAT_I8MM");
#endif
  return false;
}

// The paths this build carries, best last (kernels.h declares their tables); null: one this
// build's compiler could not make (amx).
const Ops* const kCarried[] = {
    &s2s_ops_generic,
#if defined(__x86_64__) || defined(_M_X64)
    &s2s_ops_avx2,
    &s2s_ops_avx512,
    s2s_ops_amx,
#endif
#if defined(__aarch64__)
    &s2s_ops_neon,
    &s2s_ops_dotprod,
    &s2s_ops_i8mm,
#endif
};

int check_weight(const Weight* w) {
  if (w == nullptr || w->data == nullptr) return fail("no weight");
  if (w->fmt < s2s::kF32 || w->fmt > s2s::kI4) return fail("unknown weight format %d", w->fmt);
  if (w->n < 1 || w->k < 32) return fail("a weight of %lld x %lld", (long long)w->n, (long long)w->k);
  if (w->k % 32 != 0) return fail("in_features must be a multiple of 32, got %lld", (long long)w->k);
  if (w->fmt == s2s::kI8 && w->scales == nullptr) return fail("int8 weights need float32 scales [out_features]");
  if (w->fmt == s2s::kI4) {
    if (w->group < 32 || w->group % 32 != 0 || w->k % w->group != 0)
      return fail("group size must be a multiple of 32 dividing %lld, got %d", (long long)w->k, w->group);
    if (w->scales == nullptr || w->mins == nullptr)
      return fail("4-bit weights need float32 scales and mins [out_features, in_features / group]");
  }
  return 0;
}

// y [M, N] = x [M, K] W^T (s2s_linear, the predictor): streamed up to kMaxRows rows, blocked beyond.
void product(const Ops* ops, const Weight& w, const float* x, int64_t M, float* y, int threads) {
  if (M <= s2s::kMaxRows)
    ops->stream(w, x, M, y, threads);
  else
    ops->blocked(w, x, M, y, threads);
}

struct Stack {
  const Ops* ops;
  s2s::StackShape shape;
  std::vector<s2s::Layer> layers;
  const float* norm;
};

// ----------------------------------------------------------------------------- scratch

struct Scratch {
  void* p[s2s::kScratchSlots] = {};
  int64_t size[s2s::kScratchSlots] = {};
  ~Scratch() {
    for (void* q : p) std::free(q);
  }
};
thread_local Scratch g_scratch;

}  // namespace

void* s2s::scratch(int slot, int64_t bytes) {
  Scratch& s = g_scratch;
  if (bytes > s.size[slot]) {
    std::free(s.p[slot]);
    const int64_t rounded = (bytes + 4095) / 4096 * 4096;
    s.p[slot] = std::aligned_alloc(64, static_cast<size_t>(rounded));
    if (s.p[slot] == nullptr) throw std::bad_alloc();
    s.size[slot] = rounded;
  }
  return s.p[slot];
}

// ----------------------------------------------------------------------------- the C ABI

S2S_API const char* s2s_error() { return g_error; }
S2S_API int s2s_abi_version() { return s2s::kAbiVersion; }
S2S_API int64_t s2s_max_rows() { return s2s::kMaxRows; }
S2S_API int64_t s2s_max_blocked_rows() { return s2s::kBlockedMaxRows; }
S2S_API const char* s2s_source_digest() { return S2S_SOURCE_DIGEST; }

S2S_API int s2s_openmp() {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

// The paths this build carries, space-separated, the portable one first and the widest last.
S2S_API const char* s2s_paths() {
  static char names[128];
  if (names[0] == '\0') {
    for (const Ops* ops : kCarried) {
      if (ops == nullptr) continue;
      if (names[0] != '\0') std::strncat(names, " ", sizeof names - std::strlen(names) - 1);
      std::strncat(names, ops->name, sizeof names - std::strlen(names) - 1);
    }
  }
  return names;
}

// 1 when this CPU can run the named path (or has the named feature: `amx`), else 0.
S2S_API int s2s_cpu_has(const char* name) { return name != nullptr && cpu_has(name) ? 1 : 0; }

// The kernels of a carried path this CPU can run; NULL (and the reason) otherwise.
S2S_API const void* s2s_ops(const char* name) {
  if (name == nullptr) return fail("no path named"), nullptr;
  for (const Ops* ops : kCarried) {
    if (ops == nullptr || std::strcmp(ops->name, name) != 0) continue;
    if (!cpu_has(name)) return fail("this CPU cannot run the %s path", name), nullptr;
    return ops;
  }
  return fail("this build carries no %s path (it carries: %s)", name, s2s_paths()), nullptr;
}

S2S_API int s2s_check_weight(const Weight* w) { return check_weight(w); }

// y [M, N] = x [M, K] W^T (+ bias) for M <= s2s_max_blocked_rows() (Python widens blocks beyond).
S2S_API int s2s_linear(const void* ops_, const Weight* w, const float* x, int64_t M, float* y, int threads) {
  const Ops* ops = static_cast<const Ops*>(ops_);
  if (ops == nullptr) return fail("no kernels");
  if (check_weight(w) != 0) return -1;
  if (M < 0 || M > s2s::kBlockedMaxRows)
    return fail("%lld input rows (at most %lld)", (long long)M, (long long)s2s::kBlockedMaxRows);
  if (M == 0) return 0;
  product(ops, *w, x, M, y, threads);
  return 0;
}

namespace {

// One id drawn from float32 logits [V] the way HF's sampling draws it (sampling.choose): the
// scores are the logits over `temperature`; with 0 < top_k < V only the scores at least the
// top_k-th largest stay (a tie at it stays too, as HF's mask keeps it); with top_p < 1, of those
// in ascending order, the ones while the softmax's running sum stays <= 1 - top_p go (the largest
// always stays). Then `u` (uniform in [0, 1), from the caller's generator) times the softmax total
// of what stayed picks the id, walking them from the largest score (in index order when top_p is
// 1: no sort). Fails on a NaN or infinite largest score (torch's draw refuses them too).
int draw(const float* logits, int64_t V, float temperature, int64_t top_k, float top_p, double u, int64_t* id) {
  if (logits == nullptr || id == nullptr || V <= 0) return fail("no logits");
  if (!(temperature > 0.f)) return fail("temperature %g (must be > 0)", static_cast<double>(temperature));
  if (!(u >= 0.0 && u < 1.0)) return fail("u %g (must be in [0, 1))", u);
  try {
    std::vector<float> s(static_cast<size_t>(V));
    for (int64_t i = 0; i < V; ++i) {
      s[i] = logits[i] / temperature;
      if (std::isnan(s[i])) return fail("logit %lld is NaN", static_cast<long long>(i));
    }
    float kth = -INFINITY;
    if (top_k > 0 && top_k < V) {
      std::vector<float> copy(s);
      std::nth_element(copy.begin(), copy.begin() + (top_k - 1), copy.end(), std::greater<float>());
      kth = copy[top_k - 1];
    }
    std::vector<int32_t> kept;
    kept.reserve(static_cast<size_t>(top_k > 0 && top_k < V ? top_k : V));
    float top = -INFINITY;
    for (int64_t i = 0; i < V; ++i)
      if (s[i] >= kth) {
        kept.push_back(static_cast<int32_t>(i));
        top = std::max(top, s[i]);
      }
    if (!std::isfinite(top)) return fail("no finite largest score (%g)", static_cast<double>(top));
    if (top_p < 1.f)  // largest first, ties by index
      std::sort(kept.begin(), kept.end(), [&](int32_t a, int32_t b) { return s[a] > s[b] || (s[a] == s[b] && a < b); });
    std::vector<double> e(kept.size());
    double total = 0.0;
    for (size_t j = 0; j < kept.size(); ++j) total += e[j] = std::exp(static_cast<double>(s[kept[j]] - top));
    size_t n = kept.size();
    if (top_p < 1.f) {
      double running = 0.0;
      while (n > 1 && (running += e[n - 1] / total) <= 1.0 - static_cast<double>(top_p)) --n;
      total = 0.0;
      for (size_t j = 0; j < n; ++j) total += e[j];
    }
    const double r = u * total;
    double acc = 0.0;
    for (size_t j = 0; j < n; ++j) {
      acc += e[j];
      if (r < acc) return *id = kept[j], 0;
    }
    *id = kept[n - 1];  // u * total rounded up to the total
    return 0;
  } catch (const std::bad_alloc&) {
    return fail("out of memory");
  }
}

}  // namespace

S2S_API int s2s_sample(const float* logits, int64_t V, float temperature, int64_t top_k, float top_p, double u,
                       int64_t* id) {
  return draw(logits, V, temperature, top_k, top_p, u, id);
}

// Rows [n0, n1) of the weight as float32 into dst [n1 - n0, K].
S2S_API int s2s_widen(const void* ops_, const Weight* w, int64_t n0, int64_t n1, float* dst, int threads) {
  const Ops* ops = static_cast<const Ops*>(ops_);
  if (ops == nullptr) return fail("no kernels");
  if (check_weight(w) != 0) return -1;
  if (n0 < 0 || n1 > w->n || n0 > n1) return fail("rows %lld..%lld of %lld", (long long)n0, (long long)n1, (long long)w->n);
  ops->widen(*w, n0, n1, dst, threads);
  return 0;
}

S2S_API int s2s_snake(const void* ops_, const float* x, int64_t B, int64_t C, int64_t T, const float* alpha,
                      const float* inv_beta, float* y, int threads) {
  const Ops* ops = static_cast<const Ops*>(ops_);
  if (ops == nullptr) return fail("no kernels");
  if (B < 0 || C < 0 || T < 0) return fail("x must be [batch, channels, time]");
  ops->snake(x, B, C, T, alpha, inv_beta, y, threads);
  return 0;
}

// Packing a float32 weight [N, K] into the integer formats at load time, in one pass over it (the
// same arithmetic as native/__init__.py's _pack_reference, which the tests compare with):
//   int8: scale = max(amax|row| / 127, 1e-12), q = clamp(round(w / scale), -127, 127);
//   int4: per group of G, scale = max((max - min) / 15, 1e-12), q = clamp(round((w - min) / scale), 0, 15);
// rounding half to even, as torch.round; rows written pair-interleaved (pair_offset). The layout
// is native.PACK_LAYOUT: prepared weights are files of it.
S2S_API int s2s_pack(int fmt, const float* src, int64_t N, int64_t K, int64_t group, void* out, float* sp, float* mp,
                     int threads) {
  if (fmt != s2s::kI8 && fmt != s2s::kI4) return fail("pack makes the integer formats (%d, %d)", s2s::kI8, s2s::kI4);
  if (K % 32 != 0) return fail("in_features must be a multiple of 32, got %lld", (long long)K);
  const int64_t blocks = K / 32;
  if (fmt == s2s::kI8) {
    int8_t* qp = static_cast<int8_t*>(out);
    s2s::parallel_for(0, N, 16, threads, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        const float* row = src + n * K;
        float amax = 0.f;
        for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::abs(row[k]));
        const float s = std::max(amax / 127.f, 1e-12f);
        sp[n] = s;
        for (int64_t b = 0; b < blocks; ++b) {
          int8_t* dst = qp + s2s::pair_offset(n, N, blocks, b, 32);
          for (int i = 0; i < 32; ++i)
            dst[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(row[b * 32 + i] / s))));
        }
      }
    });
    return 0;
  }
  if (group < 32 || group % 32 != 0 || K % group != 0)
    return fail("group size must be a multiple of 32 dividing %lld, got %lld", (long long)K, (long long)group);
  const int64_t groups = K / group;
  uint8_t* qp = static_cast<uint8_t*>(out);
  s2s::parallel_for(0, N, 16, threads, [&](int64_t n0, int64_t n1) {
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
        const int64_t gi = s2s::pair_offset(n, N, groups, g, 1);
        sp[gi] = s;
        mp[gi] = lo;
        for (int64_t i = 0; i < group; ++i)
          codes[i] = static_cast<uint8_t>(std::min(15.f, std::max(0.f, std::nearbyint((v[i] - lo) / s))));
        for (int64_t j = 0; j < group / 32; ++j) {
          uint8_t* dst = qp + s2s::pair_offset(n, N, blocks, g * (group / 32) + j, 16);
          const uint8_t* c = codes.data() + j * 32;
          for (int i = 0; i < 16; ++i) dst[i] = static_cast<uint8_t>(c[i] | (c[i + 16] << 4));
        }
      }
    }
  });
  return 0;
}

// A whole decoder stack over the given layers' weights (which Python keeps alive as long as the
// stack): an opaque handle for s2s_stack_run, NULL (and the reason) when the shapes do not fit.
S2S_API void* s2s_stack_new(const void* ops_, const s2s::Layer* layers, int64_t count, const float* norm,
                            int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter,
                            float eps) {
  const Ops* ops = static_cast<const Ops*>(ops_);
  if (ops == nullptr) return fail("no kernels"), nullptr;
  if (count < 1 || norm == nullptr) return fail("a stack needs layers and a final norm"), nullptr;
  if (heads < 1 || kv_heads < 1 || heads % kv_heads != 0) return fail("heads must be a multiple of kv_heads"), nullptr;
  if (head_dim < 8 || head_dim % 8 != 0) return fail("head_dim must be a multiple of 8"), nullptr;
  const int64_t nq = heads * head_dim, nkv = kv_heads * head_dim;
  for (int64_t i = 0; i < count; ++i) {
    const s2s::Layer& l = layers[i];
    for (const Weight* w : {&l.qkv, &l.o, &l.gate_up, &l.down})
      if (check_weight(w) != 0) return nullptr;
    if (l.qkv.k != hidden || l.qkv.n != nq + 2 * nkv) return fail("layer %lld: qkv shape", (long long)i), nullptr;
    if (l.o.k != nq || l.o.n != hidden) return fail("layer %lld: o shape", (long long)i), nullptr;
    if (l.gate_up.k != hidden || l.gate_up.n != 2 * inter) return fail("layer %lld: gate_up shape", (long long)i), nullptr;
    if (l.down.k != inter || l.down.n != hidden) return fail("layer %lld: down shape", (long long)i), nullptr;
    if (!l.ln1 || !l.ln2 || !l.qn || !l.kn) return fail("layer %lld: norm weights missing", (long long)i), nullptr;
  }
  auto* stack = new (std::nothrow) Stack{ops, {count, hidden, heads, kv_heads, head_dim, inter, eps},
                                         std::vector<s2s::Layer>(layers, layers + count), norm};
  if (stack == nullptr) return fail("out of memory"), nullptr;
  return stack;
}

S2S_API void s2s_stack_free(void* stack) { delete static_cast<Stack*>(stack); }

// T rows of several sequences: row r at rows[r].pos of its own cache (s2s::Row), x [T, hidden],
// cos/sin [T, head_dim], out [T, hidden].
S2S_API int s2s_stack_run_rows(const void* stack_, const float* x, int64_t T, const s2s::Row* rows, const float* cos,
                               const float* sin, float* out, int threads) {
  const Stack* stack = static_cast<const Stack*>(stack_);
  if (stack == nullptr) return fail("no stack");
  if (T < 1 || T > s2s::kBlockedMaxRows)
    return fail("x must be float32 [1, T <= %lld, hidden]", (long long)s2s::kBlockedMaxRows);
  for (int64_t r = 0; r < T; ++r)
    if (rows[r].pos < 0 || rows[r].pos >= rows[r].max_len)
      return fail("row %lld: position %lld outside its KV cache (%lld)", (long long)r, (long long)rows[r].pos,
                  (long long)rows[r].max_len);
  stack->ops->stack(stack->shape, stack->layers.data(), stack->norm, x, rows, T, cos, sin, out, threads);
  return 0;
}

// T positions start..start+T-1 of one sequence (causal within the block), its cache k/v [layers,
// 1, kv_heads, max_len, head_dim].
S2S_API int s2s_stack_run(const void* stack_, const float* x, int64_t T, float* k, float* v, int64_t max_len,
                          int64_t start, const float* cos, const float* sin, float* out, int threads) {
  if (T < 1 || T > s2s::kBlockedMaxRows)
    return fail("x must be float32 [1, T <= %lld, hidden]", (long long)s2s::kBlockedMaxRows);
  if (start < 0 || start + T > max_len)
    return fail("positions %lld..%lld outside the KV cache (%lld)", (long long)start, (long long)(start + T - 1),
                (long long)max_len);
  s2s::Row rows[s2s::kBlockedMaxRows];
  for (int64_t r = 0; r < T; ++r) rows[r] = {k, v, max_len, start + r};
  return s2s_stack_run_rows(stack_, x, T, rows, cos, sin, out, threads);
}

// ----------------------------------------------------------------------------- the code predictor's frame

namespace {

// The code predictor of a frame (s2s_predictor_new): its Stack, the projection from the talker's
// width to the stack's (none where they are equal), one head and one embedding table per codebook.
struct Predictor {
  const Stack* stack;
  bool project;
  Weight projection;
  std::vector<Weight> heads;
  std::vector<s2s::Table> tables;
  int64_t width;          // the talker's hidden size: the tables' rows and the projection's input
  int64_t vocab;          // the widest head's outputs
  int64_t rows_per_call;  // the first step's rows per stack call (DecoderStack.run_rows's blocks)
};

// Row `row` of a table as float32 into out [cols].
int table_row(const s2s::Table& t, int64_t row, float* out, std::vector<char>& buffer) {
  if (row < 0 || row >= t.rows)
    return fail("code %lld is out of range for a table of %lld rows", (long long)row, (long long)t.rows);
  const int64_t size = t.dtype == s2s::kF32 ? 4 : 2, bytes = t.cols * size;
  const char* src = nullptr;
  if (t.data != nullptr) {
    src = static_cast<const char*>(t.data) + row * bytes;
  } else {
    char* dst = t.dtype == s2s::kF32 ? reinterpret_cast<char*>(out) : (buffer.resize(bytes), buffer.data());
    for (int64_t done = 0; done < bytes;) {
      const ssize_t got = pread(t.fd, dst + done, static_cast<size_t>(bytes - done), t.offset + row * bytes + done);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0)
        return fail("reading row %lld of a table: %s", (long long)row, got < 0 ? std::strerror(errno) : "the file ended");
      done += got;
    }
    if (t.dtype == s2s::kF32) return 0;
    src = dst;
  }
  if (t.dtype == s2s::kF32) {
    std::memcpy(out, src, static_cast<size_t>(bytes));
  } else {
    for (int64_t i = 0; i < t.cols; ++i) {
      uint16_t h;
      std::memcpy(&h, src + 2 * i, 2);
      const uint32_t bits = static_cast<uint32_t>(h) << 16;
      std::memcpy(out + i, &bits, 4);
    }
  }
  return 0;
}

}  // namespace

// The code predictor over a stack (s2s_stack_new's handle, kept alive by the caller as long as
// this): `project` (may be null) from the talker's width to the stack's, and `steps` heads and
// tables (codebooks 1..steps); the first step's 2 rows a sequence go to the stack `rows_per_call`
// at a time. An opaque handle for s2s_predictor_run, NULL when they do not fit.
S2S_API void* s2s_predictor_new(const void* stack_, const Weight* project, const Weight* heads,
                                const s2s::Table* tables, int64_t steps, int64_t width, int64_t rows_per_call) {
  const Stack* stack = static_cast<const Stack*>(stack_);
  if (stack == nullptr) return fail("no stack"), nullptr;
  const int64_t hidden = stack->shape.hidden;
  if (steps < 1 || heads == nullptr || tables == nullptr) return fail("a predictor needs heads and tables"), nullptr;
  if (rows_per_call < 2 || rows_per_call > s2s::kBlockedMaxRows)
    return fail("%lld rows a stack call", (long long)rows_per_call), nullptr;
  if (project != nullptr) {
    if (check_weight(project) != 0) return nullptr;
    if (project->k != width || project->n != hidden)
      return fail("the projection is %lld x %lld, not %lld x %lld", (long long)project->n, (long long)project->k,
                  (long long)hidden, (long long)width), nullptr;
  } else if (width != hidden) {
    return fail("no projection from width %lld to the stack's %lld", (long long)width, (long long)hidden), nullptr;
  }
  int64_t vocab = 0;
  for (int64_t j = 0; j < steps; ++j) {
    const Weight& w = heads[j];
    const s2s::Table& t = tables[j];
    if (check_weight(&w) != 0) return nullptr;
    if (w.k != hidden) return fail("head %lld takes %lld inputs, not %lld", (long long)j, (long long)w.k, (long long)hidden), nullptr;
    if (t.dtype != s2s::kF32 && t.dtype != s2s::kBF16) return fail("table %lld: dtype %d", (long long)j, t.dtype), nullptr;
    if (t.cols != width || t.rows < w.n)
      return fail("table %lld is %lld x %lld for head %lld's %lld codes of width %lld", (long long)j, (long long)t.rows,
                  (long long)t.cols, (long long)j, (long long)w.n, (long long)width), nullptr;
    if (t.data == nullptr && (t.fd < 0 || t.offset < 0)) return fail("table %lld: no memory and no file", (long long)j), nullptr;
    vocab = std::max(vocab, w.n);
  }
  auto* p = new (std::nothrow) Predictor{stack, project != nullptr, project != nullptr ? *project : Weight{},
                                         std::vector<Weight>(heads, heads + steps),
                                         std::vector<s2s::Table>(tables, tables + steps), width, vocab, rows_per_call};
  if (p == nullptr) return fail("out of memory"), nullptr;
  return p;
}

S2S_API void s2s_predictor_free(void* predictor) { delete static_cast<Predictor*>(predictor); }

// One frame's codebooks 1..steps of n sequences together, as runtime.predict_frame (n = 1) and
// _predict_rows make them a torch call at a time. Sequence r: `hidden` row r (the talker's normed
// state) and `first` row r (codebook 0's embedding), each [n, width], at positions 0 and 1 of its
// cache caches[r] (k/v [layers, 1, kv_heads, max_len, head_dim]; pos unused); then per step j the
// head's logits of every sequence's last position (one pass of the head), its code (argmax where
// greedy[r], else drawn as s2s_sample draws it with u[r * steps + j]) into codes[r * steps + j],
// its table's row into embeds [n, steps, width], and those rows, projected, at positions j + 2 in
// one pass. cos/sin: the stack's rope tables [>= steps + 1, head_dim]. Fails (naming the step and
// the sequence) on a NaN logit or a code outside its table.
S2S_API int s2s_predictor_run(const void* predictor_, int64_t n, const float* hidden, const float* first,
                              const s2s::Row* caches, const float* cos, const float* sin, const int32_t* greedy,
                              float temperature, int64_t top_k, float top_p, const double* u, int64_t* codes,
                              float* embeds, int threads) {
  const Predictor* p = static_cast<const Predictor*>(predictor_);
  if (p == nullptr) return fail("no predictor");
  const int64_t steps = static_cast<int64_t>(p->heads.size());
  if (n < 1 || n > s2s::kMaxRows) return fail("%lld sequences (1 to %lld)", (long long)n, (long long)s2s::kMaxRows);
  for (int64_t r = 0; r < n; ++r) {
    if (caches[r].max_len < steps + 1)
      return fail("sequence %lld: a KV cache of %lld positions for %lld", (long long)r, (long long)caches[r].max_len,
                  (long long)(steps + 1));
    if (!greedy[r] && u == nullptr) return fail("sampling needs a uniform number per step");
  }
  const Stack& st = *p->stack;
  const Ops* ops = st.ops;
  const int64_t width = p->width, size = st.shape.hidden, head_dim = st.shape.head_dim;
  try {
    std::vector<float> input(2 * n * width), projected(2 * n * size), out(2 * n * size), last(n * size);
    std::vector<float> logits(n * p->vocab), cs(2 * n * head_dim), sn(2 * n * head_dim);
    std::vector<s2s::Row> rows(2 * n);
    std::vector<char> buffer;
    for (int64_t j = 0; j < steps; ++j) {
      // The step's input rows: (hidden, first) of each sequence at 0, 1; then each code's embedding.
      const int64_t per = j == 0 ? 2 : 1, count = per * n;
      for (int64_t r = 0; r < n; ++r)
        for (int64_t q = 0; q < per; ++q) {
          const float* src = j > 0 ? embeds + (r * steps + j - 1) * width : (q == 0 ? hidden : first) + r * width;
          std::memcpy(input.data() + (r * per + q) * width, src, width * sizeof(float));
          const int64_t pos = j == 0 ? q : j + 1;
          rows[r * per + q] = {caches[r].k, caches[r].v, caches[r].max_len, pos};
          std::memcpy(cs.data() + (r * per + q) * head_dim, cos + pos * head_dim, head_dim * sizeof(float));
          std::memcpy(sn.data() + (r * per + q) * head_dim, sin + pos * head_dim, head_dim * sizeof(float));
        }
      const float* x = input.data();
      if (p->project) {
        product(ops, p->projection, x, count, projected.data(), threads);
        x = projected.data();
      }
      for (int64_t r0 = 0; r0 < count; r0 += p->rows_per_call) {  // rows in order: later ones see earlier keys
        const int64_t m = std::min(p->rows_per_call, count - r0);
        ops->stack(st.shape, st.layers.data(), st.norm, x + r0 * size, rows.data() + r0, m, cs.data() + r0 * head_dim,
                   sn.data() + r0 * head_dim, out.data() + r0 * size, threads);
      }
      for (int64_t r = 0; r < n; ++r)
        std::memcpy(last.data() + r * size, out.data() + (r * per + per - 1) * size, size * sizeof(float));
      const Weight& head = p->heads[j];
      product(ops, head, last.data(), n, logits.data(), threads);
      for (int64_t r = 0; r < n; ++r) {
        const float* row = logits.data() + r * head.n;
        int64_t code = 0;
        if (greedy[r]) {
          for (int64_t i = 0; i < head.n; ++i) {
            if (std::isnan(row[i]))
              return fail("step %lld, sequence %lld: logit %lld is NaN", (long long)j, (long long)r, (long long)i);
            if (row[i] > row[code]) code = i;
          }
        } else if (draw(row, head.n, temperature, top_k, top_p, u[r * steps + j], &code) != 0) {
          char why[sizeof g_error];
          std::memcpy(why, g_error, sizeof why);
          return fail("step %lld, sequence %lld: %s", (long long)j, (long long)r, why);
        }
        codes[r * steps + j] = code;
        if (table_row(p->tables[j], code, embeds + (r * steps + j) * width, buffer) != 0) return -1;
      }
    }
    return 0;
  } catch (const std::bad_alloc&) {
    return fail("out of memory");
  }
}
