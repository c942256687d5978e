// One token through a linear layer on CPU: y = x W^T (+ bias), x one row, W [N, K] read once
// (int8 weights: a few rows, one after another; more, torchao's GEMM: ``matvec`` below).
//
// A decode step of one sequence is a chain of matrix-vector products: every weight byte is read
// once and used for one multiply-add, so the step runs at the speed memory delivers weights.
// PyTorch's CPU GEMMs stop near 60% of that for a single row (measured: docs/cpu-decode.md "Decode at the
// memory roofline"). This kernel streams each weight row once with FMAs in float32, row after
// row, split over torch's intra-op threads (at::parallel_for: torch.set_num_threads). Two
// instruction sets, chosen at run time (``isa``): AVX-512 where the CPU has it (16 lanes, half the
// instructions a weight), else AVX2. Weights stay in PyTorch's own layout, so every other path
// (prefill, generate()) reads the same tensor. bfloat16 activations on a CPU with AMX are summed
// in the order of oneDNN's AMX matmul instead (``amx`` and ``lanes`` below), on a copy of the
// weights laid out for it where there is one.
//
// Weights: float32, bfloat16 (widened by a shift: bfloat16 is the top half of a float32), or
// int8 with one scale per output row (torchao's Int8Tensor, weight-only). Rounding follows the
// stock paths: float32 accumulation, one rounding to the output dtype (with the bias); int8
// rounds as torchao does (x @ W_int8 rounded, times the scale rounded, plus the bias rounded).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "avx2.h"

#include <algorithm>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace {

namespace avx2 {

using mm_pipeline::avx2::hsum;
using mm_pipeline::avx2::widen;

// The dot product of one weight row with x (k a multiple of 16): eight accumulators (eight
// independent FMA chains), the row prefetched 1 KiB ahead. Rows one after another keep each
// thread's reads one sequential stream (measured on the 187M Llama's 57 bfloat16 matrices, 2
// threads: 29-30 GB/s, where eight rows interleaved gave 24 and PyTorch's GEMM 18; a bare
// sequential read 32). int8 takes dot4 below.
template <typename W>
inline float dot(const W* w, int64_t k, const float* x) {
  constexpr int64_t ahead = 1024 / sizeof(W);
  __m256 a[8];
  for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= k; i += 64) {
    for (int64_t p = 0; p < 64 * int64_t(sizeof(W)); p += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w + i + ahead) + p, _MM_HINT_T0);
    for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(widen(w + i + 8 * j), _mm256_loadu_ps(x + i + 8 * j), a[j]);
  }
  for (int j = 0; i < k; i += 8, ++j) a[j] = _mm256_fmadd_ps(widen(w + i), _mm256_loadu_ps(x + i), a[j]);
  return hsum(_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])),
                            _mm256_add_ps(_mm256_add_ps(a[4], a[5]), _mm256_add_ps(a[6], a[7]))));
}

// Four int8 rows at once, sharing each load of x: int8 is bound by widening, not by memory (one
// row at a time, 24-29 G weights/s on two threads here), and a shared x saves a quarter of the
// work per weight (four rows: 32-35 G weights/s from memory, level with a bare read). Two
// accumulators per row; k a multiple of 16. Four rows read as four short streams (a row of the
// 187M Llama is 1 KiB), too short for the hardware prefetcher: each step of 16 columns prefetches
// one cache line of the block six blocks ahead, in order (the model's int8 matrices, 2 threads:
// 15 GB/s without it, 25-26 with it, the same from 4 to 12 blocks ahead).
inline void dot4(const int8_t* w, int64_t k, const float* x, float* out) {
  __m256 a[4][2];
  for (int r = 0; r < 4; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(w + 6 * 4 * k + 4 * i), _MM_HINT_NTA);
    const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
    for (int r = 0; r < 4; ++r) {
      a[r][0] = _mm256_fmadd_ps(widen(w + r * k + i), x0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(widen(w + r * k + i + 8), x1, a[r][1]);
    }
  }
  for (int r = 0; r < 4; ++r) out[r] = hsum(_mm256_add_ps(a[r][0], a[r][1]));
}

}  // namespace avx2

// One value per output row (the int8 scales, the bias), float32 or bfloat16, read without a tensor
// call in the row loop (through at::Tensor they cost an eighth of an int8 product; converting them
// to the output dtype first, a copy per call). Empty: no such values.
struct PerRow {
  const void* data = nullptr;
  bool bf16 = false;
  float operator[](int64_t i) const {
    return bf16 ? static_cast<float>(static_cast<const at::BFloat16*>(data)[i]) : static_cast<const float*>(data)[i];
  }
  explicit operator bool() const { return data != nullptr; }
};

// y[row] from its dot product: the stock paths' roundings (see the file's head).
template <typename T>
inline T finish(float v, PerRow scale, PerRow bias, int64_t row) {
  if (scale) {
    v = static_cast<float>(T(static_cast<float>(T(v)) * static_cast<float>(T(scale[row]))));
    return bias ? T(v + static_cast<float>(T(bias[row]))) : T(v);
  }
  return T(bias ? v + bias[row] : v);
}

// Rows [0, n) split over torch's threads (one contiguous range each: one stream for the
// prefetchers) at multiples of four, so that every row is read by the same code (``dot4`` for a
// group of four, ``dot`` for the last few) whatever the number of threads: split anywhere, a row
// at the split was read by the other one and its bits depended on the thread count. (Chunks of
// 32 rows taken in turn as threads finish, to even out their finishing times, made the 254M
// Llama's 71 int8 products 1.76x slower: each thread's stream broken every 40 KB.)
template <typename F>
void in_fours(int64_t n, const F& body) {
  at::parallel_for(0, (n + 3) / 4, 4, [&](int64_t first, int64_t last) { body(4 * first, std::min(4 * last, n)); });
}

// y = W x for every output row (``in_fours``).
namespace avx2 {
template <typename W, typename T>
void rows(const W* w, int64_t n, int64_t k, const float* x, PerRow scale, PerRow bias, T* y) {
  in_fours(n, [&](int64_t first, int64_t last) {
    int64_t row = first;
    if constexpr (std::is_same_v<W, int8_t>) {
      float v[4];
      for (; row + 4 <= last; row += 4) {
        dot4(w + row * k, k, x, v);
        for (int r = 0; r < 4; ++r) y[row + r] = finish<T>(v[r], scale, bias, row + r);
      }
    }
    for (; row < last; ++row) y[row] = finish<T>(dot(w + row * k, k, x), scale, bias, row);
  });
}
}  // namespace avx2

// AVX-512 (measured on a 2-core Sapphire Rapids VM, the 187M Llama's 57 matrices:
// benchmarks/matvec_kernels.py and benchmarks/README.md, "A second machine"): one row after
// another for every weight type, four accumulators of 16 lanes, and the stream prefetched AHEAD
// bytes ahead into L2 (_MM_HINT_T1). There the AVX2 path's hints (1 KiB into L1; non-temporal for
// int8) left each core short of misses in flight (one core streams about 11 GB/s of the two
// cores' 20-25): bfloat16 17 GB/s there -> 22 here, int8 6.6 -> 19.
// bfloat16 rows are widened without a shuffle: a 32-bit lane holds two bfloat16 weights, the even
// one made a float32 by a shift, the odd one by a mask, multiplied by x split the same way
// (``split_even_odd``, once a call); int8 by sign extension and conversion.
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw")
namespace avx512 {

constexpr int64_t AHEAD = 8192;

inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(static_cast<const char*>(p) + AHEAD + b, _MM_HINT_T1);
}

inline __m512 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  return _mm512_add_ps(_mm512_add_ps(a, b), _mm512_add_ps(c, d));
}

inline __m512 widen(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 widen(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// 64 weights a step (k a multiple of 64); x in order (float32, int8 weights) or split (bfloat16, below).
template <typename W>
inline float dot(const W* w, int64_t k, const float* x) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < k; i += 64) {
    prefetch(w + i, 64 * sizeof(W));
    a0 = _mm512_fmadd_ps(widen(w + i), _mm512_loadu_ps(x + i), a0);
    a1 = _mm512_fmadd_ps(widen(w + i + 16), _mm512_loadu_ps(x + i + 16), a1);
    a2 = _mm512_fmadd_ps(widen(w + i + 32), _mm512_loadu_ps(x + i + 32), a2);
    a3 = _mm512_fmadd_ps(widen(w + i + 48), _mm512_loadu_ps(x + i + 48), a3);
  }
  return _mm512_reduce_add_ps(sum4(a0, a1, a2, a3));
}

inline __m512 even(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
inline __m512 odd(__m512i v) { return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xFFFF0000)))); }

// x split by ``split_even_odd``: per 32 columns, the 16 even ones, then the 16 odd ones.
inline float dot(const at::BFloat16* w, int64_t k, const float* x) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < k; i += 64) {
    prefetch(w + i, 128);
    const __m512i v0 = _mm512_loadu_si512(w + i), v1 = _mm512_loadu_si512(w + i + 32);
    a0 = _mm512_fmadd_ps(even(v0), _mm512_loadu_ps(x + i), a0);
    a1 = _mm512_fmadd_ps(odd(v0), _mm512_loadu_ps(x + i + 16), a1);
    a2 = _mm512_fmadd_ps(even(v1), _mm512_loadu_ps(x + i + 32), a2);
    a3 = _mm512_fmadd_ps(odd(v1), _mm512_loadu_ps(x + i + 48), a3);
  }
  return _mm512_reduce_add_ps(sum4(a0, a1, a2, a3));
}

// float32 to the nearest bfloat16 (ties to even; NaN to c10's quiet NaN), kept as a float32: the
// rounding of c10::BFloat16's constructor, sixteen lanes at once.
inline __m512 round_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_and_si512(r, _mm512_set1_epi32(int(0xFFFF0000)));
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000)));
}

inline __m512 per_row16(PerRow values, int64_t row) {
  if (!values.bf16) return _mm512_loadu_ps(static_cast<const float*>(values.data) + row);
  const auto* p = static_cast<const at::BFloat16*>(values.data) + row;
  return even(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}

// ``finish`` for sixteen rows of a bfloat16 output, the same roundings. One row at a time, c10's
// conversions added 2.3-2.6 ns a row to float32's cost, sixteen at once 0.2-0.4 (2-core AMX Xeon,
// benchmarks/matvec_rounding.py): 0.3 ms of the 254M Llama's 13 ms bfloat16 step (145,000 rows).
inline void finish16(__m512 v, PerRow scale, PerRow bias, int64_t row, at::BFloat16* y) {
  if (scale) {
    v = round_bf16(_mm512_mul_ps(round_bf16(v), round_bf16(per_row16(scale, row))));
    if (bias) v = _mm512_add_ps(v, round_bf16(per_row16(bias, row)));
  } else if (bias) {
    v = _mm512_add_ps(v, per_row16(bias, row));
  }
  const __m512i top = _mm512_srli_epi32(_mm512_castps_si512(round_bf16(v)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + row), _mm512_cvtepi32_epi16(top));
}

template <typename W, typename T>
void rows(const W* w, int64_t n, int64_t k, const float* x, PerRow scale, PerRow bias, T* y) {
  in_fours(n, [&](int64_t first, int64_t last) {
    int64_t row = first;
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      for (; row + 16 <= last; row += 16) {
        alignas(64) float v[16];
        for (int r = 0; r < 16; ++r) v[r] = dot(w + (row + r) * k, k, x);
        finish16(_mm512_load_ps(v), scale, bias, row, y);
      }
    }
    for (; row < last; ++row) y[row] = finish<T>(dot(w + row * k, k, x), scale, bias, row);
  });
}

}  // namespace avx512
#pragma GCC pop_options

// Where block ``b`` of ``blocks`` ends (a column): oneDNN splits a long row's columns into blocks of
// ceil(steps / blocks) 32-column steps, the last one shorter, sums each block from zero and adds
// the blocks' sums in order (found on its bits: 14,336 columns in 6 blocks are 5 of 75 steps and
// one of 73; its blocking heuristic picks how many by the matrix's shape and the thread count:
// ``matvec.py`` finds it per shape). A block past the row's end is empty.
inline int64_t block_end(int64_t k, int64_t blocks, int64_t b) {
  const int64_t steps = k / 32, each = (steps + blocks - 1) / blocks;
  return 32 * std::min((b + 1) * each, steps);
}

// bfloat16 activations on CPUs with AMX-BF16: every output summed in the order of oneDNN's AMX
// bfloat16 matmul, the call ``generate()`` makes (torchao widens an int8 weight to bfloat16 and
// calls torch.mm). The tile instruction (TDPBF16PS) sums, per 32 columns, the even columns'
// products and the odd ones' in two float32 chains, adds the two, and adds that to the output's
// total (docs/engine.md, "Exactness"). Summed in another order, about one output in ten parts on
// inputs of a wide range, and a bfloat16 answer parts from ``generate()`` at near ties. Two ways:
// - ``lanes``: the same sums in FMAs, on a copy of the weights laid out for them (``matvec.py``
//   makes it where RAM allows);
// - ``amx``: on the tiles themselves, on the weights as they are: the weight rows are the tiles'
//   rows and x the one column (or up to 16, a batch's rows), since the instruction sums an
//   output's products in the same order whichever operand holds the weights. int8 weights are
//   widened to bfloat16 (exactly) through a buffer in L1 first, which costs as much as the row
//   kernel's whole product: the 254M Llama's int8 step took 1.45x the row kernel's time.
// A compiler without the tiles' intrinsics (GCC before 11, clang before 12) builds the rest: then
// ``amx::usable`` is false and bfloat16 rows keep the row kernel's order.
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define MM_PIPELINE_AMX 1
#endif

#ifdef MM_PIPELINE_AMX
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,amx-tile,amx-bf16")
namespace amx {

// Whether the CPU has AMX-BF16 and AVX-512 (F, BW) and Linux lets this process use the tiles
// (asked once: arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, as oneDNN asks).
bool usable() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1) || !((d >> 24) & 1)) return false;
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw")) return false;
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0 and 1: two groups' outputs (16 rows by the R rows of x, float32); 2 and 3: their
// weights (16 rows by 32 columns); 4: x's 32 columns as 16 pairs by R.
inline void configure(int64_t r) {
  TileConfig c;
  for (int t = 0; t < 5; ++t) c.rows[t] = 16;
  c.colsb[0] = c.colsb[1] = c.colsb[4] = static_cast<uint16_t>(4 * r);
  c.colsb[2] = c.colsb[3] = 64;
  _tile_loadconfig(&c);
}

// The tiles' weights for ``cols`` (32 or 64) columns of 16 rows, into ``buffer`` [cols / 32, 16,
// 32] (rows past ``rows`` zero): int8 widened exactly (a float32's top half is the bfloat16 of an
// integer this small), bfloat16 copied.
inline void tile_rows(const int8_t* w, int64_t rows, int64_t k, int64_t cols, at::BFloat16* buffer) {
  const __m512i top = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25,
                                       23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  for (int64_t r = 0; r < 16; ++r)
    for (int64_t c = 0; c < cols; c += 32) {
      __m512i v = _mm512_setzero_si512();
      if (r < rows) {
        const auto* p = reinterpret_cast<const __m128i*>(w + r * k + c);
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
        v = _mm512_permutex2var_epi16(_mm512_castps_si512(lo), top, _mm512_castps_si512(hi));
      }
      _mm512_store_si512(buffer + 16 * c + 32 * r, v);
    }
}
inline void tile_rows(const at::BFloat16* w, int64_t rows, int64_t k, int64_t cols, at::BFloat16* buffer) {
  for (int64_t r = 0; r < 16; ++r)
    for (int64_t c = 0; c < cols; c += 32)
      _mm512_store_si512(buffer + 16 * c + 32 * r,
                         r < rows ? _mm512_loadu_si512(w + r * k + c) : _mm512_setzero_si512());
}

// y[:, first:last] for the R rows of x (``xv``: x's columns in pairs, [k / 2, R, 2]), two groups
// of 16 weight rows at a time, 64 columns (a cache line of int8) at a time, through a buffer in
// L1. Each row's line AHEAD_LINES ahead is prefetched (past a row's end, the next 32 rows').
constexpr int64_t AHEAD_LINES = 8;

// Each block's sums (``block_end``) are the tiles' from zero, stored and added in order to ``sums``.
template <typename W>
void groups(const W* w, int64_t n, int64_t k, int64_t blocks, const at::BFloat16* xv, int64_t r, PerRow scale,
            PerRow bias, at::BFloat16* y, int64_t first, int64_t last) {
  alignas(64) at::BFloat16 buffer[2][2 * 16 * 32];
  alignas(64) float sums[2][16 * 16], block[2][16 * 16];
  constexpr int64_t line = 64 / sizeof(W);  // columns a cache line holds
  configure(r);
  auto add_block = [&] {
    _tile_stored(0, block[0], 4 * r);
    _tile_stored(1, block[1], 4 * r);
    for (int g = 0; g < 2; ++g)
      for (int64_t q = 0; q < 16 * r; ++q) sums[g][q] += block[g][q];
    _tile_zero(0);
    _tile_zero(1);
  };
  for (int64_t row = first; row < last; row += 32) {
    const int64_t rows[2] = {std::min<int64_t>(16, last - row), std::clamp<int64_t>(last - row - 16, 0, 16)};
    std::fill(&sums[0][0], &sums[0][0] + 2 * 16 * 16, 0.0f);
    _tile_zero(0);
    _tile_zero(1);
    int64_t b = 0, end = block_end(k, blocks, 0);
    for (int64_t i = 0; i < k; i += 64) {
      for (int64_t c = i; c < i + 64; c += line) {
        const int64_t ahead = c + AHEAD_LINES * line, past = ahead >= k ? 32 : 0;
        for (int64_t q = row + past; q < std::min(row + past + 32, n); ++q)
          _mm_prefetch(reinterpret_cast<const char*>(w + q * k + ahead - (past ? k : 0)), _MM_HINT_T0);
      }
      const int64_t cols = std::min<int64_t>(64, k - i);
      for (int g = 0; g < 2; ++g)
        if (rows[g]) tile_rows(w + (row + 16 * g) * k + i, rows[g], k, cols, buffer[g]);
      for (int64_t c = 0; c < cols; c += 32) {
        if (i + c == end) {
          add_block();
          end = block_end(k, blocks, ++b);
        }
        _tile_loadd(4, xv + (i + c) * r, 4 * r);
        _tile_loadd(2, buffer[0] + 16 * c, 64);
        _tile_dpbf16ps(0, 2, 4);
        if (rows[1]) {
          _tile_loadd(3, buffer[1] + 16 * c, 64);
          _tile_dpbf16ps(1, 3, 4);
        }
      }
    }
    add_block();
    for (int g = 0; g < 2; ++g) {
      const int64_t base = row + 16 * g, count = rows[g];
      for (int64_t j = 0; j < r; ++j) {
        at::BFloat16* out = y + j * n;
        if (count == 16) {
          alignas(64) float v[16];
          for (int q = 0; q < 16; ++q) v[q] = sums[g][q * r + j];
          avx512::finish16(_mm512_load_ps(v), scale, bias, base, out);
          continue;
        }
        for (int64_t q = 0; q < count; ++q)
          out[base + q] = finish<at::BFloat16>(sums[g][q * r + j], scale, bias, base + q);
      }
    }
  }
  _tile_release();
}

// y [R, n] = x [R, k] W^T for R <= 16 rows of bfloat16 x (k a multiple of 32), rows split over
// torch's threads at multiples of 32.
template <typename W>
void rows(const W* w, int64_t n, int64_t k, int64_t blocks, const at::BFloat16* x, int64_t r, PerRow scale,
          PerRow bias, at::BFloat16* y) {
  thread_local std::vector<at::BFloat16> xv;
  xv.resize(k * r);
  for (int64_t p = 0; p < k / 2; ++p)
    for (int64_t j = 0; j < r; ++j) {
      xv[(p * r + j) * 2] = x[j * k + 2 * p];
      xv[(p * r + j) * 2 + 1] = x[j * k + 2 * p + 1];
    }
  const at::BFloat16* pairs = xv.data();
  at::parallel_for(0, (n + 31) / 32, 1, [&](int64_t first, int64_t last) {
    groups(w, n, k, blocks, pairs, r, scale, bias, y, 32 * first, std::min(32 * last, n));
  });
}

}  // namespace amx
#pragma GCC pop_options
#else
namespace amx {
bool usable() { return false; }
template <typename W>
void rows(const W*, int64_t, int64_t, int64_t, const at::BFloat16*, int64_t, PerRow, PerRow, at::BFloat16*) {
  TORCH_CHECK(false, "matvec: built without the AMX tiles");
}
}  // namespace amx
#endif

// Which instruction set the kernel runs: AVX-512 (F and BW) where the CPU has it, else AVX2 (the
// Python side builds the kernel only where AVX2 is there). ``matvec_isa`` reads or forces it.
enum class Isa { avx2, avx512 };

Isa& isa() {
  static Isa chosen = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") ? Isa::avx512 : Isa::avx2;
  return chosen;
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw")
// The tiles' order in FMAs (see ``amx`` above), on the weights laid out [ceil(n / ROWS), k, ROWS]:
// a group's ROWS rows are the lanes of V vectors, and a column of a group is one stream
// (``matvec.py``'s ``lanes`` makes the copy). Per 32 columns each lane sums the even columns'
// products and the odd ones' in two chains (FMAs round as the tiles' adds: the products are
// exact), adds the two, and adds that to its total; 2V chains in flight cover the FMA's latency.
// int8 is widened as by ``avx512::dot``. Measured against the row kernel (2-core AMX Xeon, 2
// threads): level on a 32,000 x 1,280 int8 matrix (40 against 41 G weights/s from cache, 20
// against 21.5 from memory); the 254M Llama's 71 int8 products 12-16% slower (whole runs:
// benchmarks/README.md, issue 52's check).
namespace lanes {

inline __m512 widen(const int8_t* p) { return avx512::widen(p); }
inline __m512 widen(const at::BFloat16* p) {
  return avx512::even(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}

constexpr int V = 8;          // vectors (of 16 rows) a group: 16 chains in flight (4: 8, slower)
constexpr int ROWS = 16 * V;  // rows a group, the copy's last dimension

template <typename W>
void group(const W* w, int64_t k, int64_t blocks, const float* x, __m512 total[V]) {
  for (int v = 0; v < V; ++v) total[v] = _mm512_setzero_ps();
  for (int64_t b = 0, c = 0; b < blocks; ++b) {
    __m512 block[V];
    for (int v = 0; v < V; ++v) block[v] = _mm512_setzero_ps();
    for (const int64_t end = block_end(k, blocks, b); c < end; c += 32) {
      __m512 e[V], o[V];
      for (int v = 0; v < V; ++v) e[v] = o[v] = _mm512_setzero_ps();
      for (int64_t col = c; col < c + 32; col += 2) {
        const W* p = w + col * ROWS;
        avx512::prefetch(p, 2 * ROWS * sizeof(W));
        const __m512 xe = _mm512_set1_ps(x[col]), xo = _mm512_set1_ps(x[col + 1]);
        for (int v = 0; v < V; ++v) e[v] = _mm512_fmadd_ps(widen(p + 16 * v), xe, e[v]);
        for (int v = 0; v < V; ++v) o[v] = _mm512_fmadd_ps(widen(p + ROWS + 16 * v), xo, o[v]);
      }
      for (int v = 0; v < V; ++v) block[v] = _mm512_add_ps(block[v], _mm512_add_ps(e[v], o[v]));
    }
    for (int v = 0; v < V; ++v) total[v] = _mm512_add_ps(total[v], block[v]);
  }
}

template <typename W>
void rows(const W* w, int64_t n, int64_t k, int64_t blocks, const float* x, PerRow scale, PerRow bias,
          at::BFloat16* y) {
  at::parallel_for(0, (n + ROWS - 1) / ROWS, 1, [&](int64_t first, int64_t last) {
    for (int64_t g = first; g < last; ++g) {
      __m512 total[V];
      group(w + g * k * ROWS, k, blocks, x, total);
      for (int v = 0; v < V; ++v) {
        const int64_t row = ROWS * g + 16 * v;
        if (row + 16 <= n) {
          avx512::finish16(total[v], scale, bias, row, y);
        } else if (row < n) {
          alignas(64) float sums[16];
          _mm512_store_ps(sums, total[v]);
          for (int64_t q = 0; row + q < n; ++q) y[row + q] = finish<at::BFloat16>(sums[q], scale, bias, row + q);
        }
      }
    }
  });
}

}  // namespace lanes

#pragma GCC pop_options

// Whether bfloat16 activations are summed in the tiles' order (``amx``, ``lanes``): where the CPU
// has the tiles; ``matvec_amx`` reads or switches it.
bool& amx_on() {
  static bool on = amx::usable();
  return on;
}

// The bfloat16 AVX-512 path reads x split per 32 columns into even and odd ones (see its dot).
void split_even_odd(const float* x, int64_t k, float* out) {
  for (int64_t i = 0; i < k; i += 32)
    for (int64_t j = 0; j < 16; ++j) {
      out[i + j] = x[i + 2 * j];
      out[i + 16 + j] = x[i + 2 * j + 1];
    }
}

template <typename W, typename T>
void matvec_rows(const W* w, int64_t n, int64_t k, const float* x, PerRow scale, PerRow bias, T* y) {
  if (isa() == Isa::avx2 || k % 64) {
    avx2::rows(w, n, k, x, scale, bias, y);
  } else if constexpr (std::is_same_v<W, at::BFloat16>) {
    thread_local std::vector<float> split;
    split.resize(k);
    split_even_odd(x, k, split.data());
    avx512::rows(w, n, k, split.data(), scale, bias, y);
  } else {
    avx512::rows(w, n, k, x, scale, bias, y);
  }
}

template <typename T>
void dispatch(const at::Tensor& weight, const float* x, PerRow scale, PerRow bias, T* y) {
  const int64_t n = weight.size(0), k = weight.size(1);
  switch (weight.scalar_type()) {
    case at::kFloat: matvec_rows(weight.const_data_ptr<float>(), n, k, x, scale, bias, y); break;
    case at::kBFloat16: matvec_rows(weight.const_data_ptr<at::BFloat16>(), n, k, x, scale, bias, y); break;
    case at::kChar:
      TORCH_CHECK(bool(scale), "matvec: int8 weights need their row scales");
      matvec_rows(weight.const_data_ptr<int8_t>(), n, k, x, scale, bias, y);
      break;
    default: TORCH_CHECK(false, "matvec: weights must be float32, bfloat16 or int8");
  }
}

// Rows of int8-weight products taken one by one, each through the one-row kernel: up to this
// many, reading the weight once a row beats widening it for a GEMM (a 1024x4096 matrix of the
// 187M Llama, 2 threads: 0.16 ms at 2 rows against torchao's 1.88, 0.60 at 8 against 2.06, 1.31
// at 16 against 3.61; a row costs the same each, a GEMM grows slowly). Beyond it, torchao's own
// arithmetic (``many_rows``). A row of a batch is then computed exactly as it is alone.
constexpr int64_t ROW_BY_ROW = 16;

// torchao's weight-only int8 linear, op for op: the int8 weight widened to x's dtype, one GEMM,
// times the row scales, plus the bias.
at::Tensor many_rows(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                     const std::optional<at::Tensor>& bias) {
  const int64_t k = weight.size(1);
  at::Tensor y = at::mm(x.reshape({-1, k}), weight.t().to(x.scalar_type()));
  y = y * scale.to(y.scalar_type()).flatten();
  if (bias.has_value()) y += *bias;
  auto sizes = x.sizes().vec();
  sizes.back() = weight.size(0);
  return y.to(x.scalar_type()).reshape(sizes);
}

// A bfloat16 row of x (k a multiple of 8) in float32, in this thread's buffer: no tensor is
// allocated per call (57 calls a step).
const float* widened(const at::BFloat16* x, int64_t k) {
  thread_local std::vector<float> row;
  row.resize(k);
  for (int64_t i = 0; i < k; i += 8) _mm256_storeu_ps(row.data() + i, avx2::widen(x + i));
  return row.data();
}

// y [rows, n] for bfloat16 x on ``lanes_w``, W laid out for ``lanes::rows`` ([ceil(n / ROWS), k,
// ROWS], int8 or bfloat16: ``matvec.py`` makes it), each row alone.
void lanes_matvec(const at::BFloat16* x, int64_t rows, const at::Tensor& lanes_w, int64_t n, int64_t blocks,
                  PerRow scale, PerRow bias, at::BFloat16* y) {
  const int64_t k = lanes_w.size(1);
  TORCH_CHECK(lanes_w.dim() == 3 && lanes_w.size(2) == lanes::ROWS && lanes_w.size(0) * lanes::ROWS >= n &&
                  lanes_w.is_contiguous() && k % 32 == 0 && lanes_w.scalar_type() != at::kFloat,
              "matvec: lanes must be the weights laid out [ceil(n / ", lanes::ROWS, "), k, ", lanes::ROWS, "]");
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = widened(x + r * k, k);
    if (lanes_w.scalar_type() == at::kChar)
      lanes::rows(lanes_w.const_data_ptr<int8_t>(), n, k, blocks, xr, scale, bias, y + r * n);
    else
      lanes::rows(lanes_w.const_data_ptr<at::BFloat16>(), n, k, blocks, xr, scale, bias, y + r * n);
  }
}

at::Tensor matvec(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                  const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& lanes_w, int64_t blocks) {
  const int64_t k = weight.size(1), n = weight.size(0);
  TORCH_CHECK(blocks >= 1 && blocks <= k / 32 + (k % 32 != 0), "matvec: blocks must be 1 to the 32-column steps of K");
  const int64_t rows = x.size(-1) == k ? x.numel() / k : 0;
  TORCH_CHECK(rows == 1 || (rows > 1 && weight.scalar_type() == at::kChar && scale.has_value()),
              "matvec: x must hold rows of ", k, " features, one unless the weights are int8");
  if (rows > ROW_BY_ROW) return many_rows(x, weight, *scale, bias);
  TORCH_CHECK(k % 16 == 0 && weight.is_contiguous(), "matvec: weight must be contiguous with K a multiple of 16");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "matvec: x must be float32 or bfloat16");
  auto vector = [n](const std::optional<at::Tensor>& t) {
    if (!t.has_value()) return at::Tensor();
    TORCH_CHECK(t->numel() == n && (t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16),
                "matvec: scale and bias must hold one float32 or bfloat16 value per output row");
    return t->contiguous();
  };
  auto per_row = [](const at::Tensor& t) {
    return t.defined() ? PerRow{t.const_data_ptr(), t.scalar_type() == at::kBFloat16} : PerRow{};
  };
  const at::Tensor s = vector(scale), b = vector(bias);
  const at::Tensor xc = x.contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  at::Tensor y = at::empty(sizes, x.options());
  if (xc.scalar_type() == at::kBFloat16 && lanes_w.has_value() && amx_on()) {
    lanes_matvec(xc.const_data_ptr<at::BFloat16>(), rows, *lanes_w, n, blocks, per_row(s), per_row(b),
                 y.data_ptr<at::BFloat16>());
    return y;
  }
  if (xc.scalar_type() == at::kBFloat16 && amx_on() && k % 32 == 0 && weight.scalar_type() != at::kFloat) {
    const auto* xb = xc.const_data_ptr<at::BFloat16>();
    auto* yb = y.data_ptr<at::BFloat16>();
    if (weight.scalar_type() == at::kChar)
      amx::rows(weight.const_data_ptr<int8_t>(), n, k, blocks, xb, rows, per_row(s), per_row(b), yb);
    else
      amx::rows(weight.const_data_ptr<at::BFloat16>(), n, k, blocks, xb, rows, per_row(s), per_row(b), yb);
    return y;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* xf = xc.scalar_type() == at::kFloat ? xc.const_data_ptr<float>() + r * k
                                                     : widened(xc.const_data_ptr<at::BFloat16>() + r * k, k);
    if (x.scalar_type() == at::kFloat) dispatch(weight, xf, per_row(s), per_row(b), y.data_ptr<float>() + r * n);
    else dispatch(weight, xf, per_row(s), per_row(b), y.data_ptr<at::BFloat16>() + r * n);
  }
  return y;
}

// The instruction set in use ("avx512" or "avx2"); ``force`` (tests, measurements) switches to
// one the CPU has.
std::string matvec_isa(const std::optional<std::string>& force) {
  if (force.has_value()) {
    const bool avx512 = *force == "avx512";
    TORCH_CHECK(avx512 || *force == "avx2", "matvec_isa: avx2 or avx512, not ", *force);
    TORCH_CHECK(!avx512 || (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")),
                "matvec_isa: this CPU has no AVX-512 (F and BW)");
    isa() = avx512 ? Isa::avx512 : Isa::avx2;
  }
  return isa() == Isa::avx512 ? "avx512" : "avx2";
}

// Whether bfloat16 activations are summed in the tiles' order; ``force`` (tests, measurements)
// switches it off (the row kernels' order), or on where the CPU has the tiles.
bool matvec_amx(std::optional<bool> force) {
  if (force.has_value()) {
    TORCH_CHECK(!*force || amx::usable(), "matvec_amx: this CPU (or its kernel) offers no AMX-BF16 tiles");
    amx_on() = *force;
  }
  return amx_on();
}

}  // namespace

TORCH_LIBRARY(mm_pipeline, m) {
  m.def(
      "matvec(Tensor x, Tensor weight, Tensor? scale=None, Tensor? bias=None, Tensor? lanes=None, int blocks=1) "
      "-> Tensor");
  m.def("matvec_isa(str? force=None) -> str", &matvec_isa);  // no tensor: one kernel for every backend
  m.def("matvec_amx(bool? force=None) -> bool", &matvec_amx);
}

TORCH_LIBRARY_IMPL(mm_pipeline, CPU, m) { m.impl("matvec", &matvec); }

