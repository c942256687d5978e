// One token through a linear layer on CPU: y = x W^T (+ bias), x one row, W [N, K] read once.
//
// A decode step of one sequence is a chain of matrix-vector products: every weight byte is read
// once and used for one multiply-add, so the step runs at the speed memory delivers weights.
// PyTorch's CPU GEMMs stop near 60% of that for a single row (measured: README "Decode at the
// memory roofline"). This kernel streams each weight row once with AVX2 FMAs in float32, row
// after row, split over torch's intra-op threads (at::parallel_for: torch.set_num_threads).
// Weights stay in PyTorch's own layout, so every other path (prefill, generate()) reads the same
// tensor.
//
// Weights: float32, bfloat16 (widened by a shift: bfloat16 is the top half of a float32), or
// int8 with one scale per output row (torchao's Int8Tensor, weight-only). Rounding follows the
// stock paths: float32 accumulation, one rounding to the output dtype (with the bias); int8
// rounds as torchao does (x @ W_int8 rounded, times the scale rounded, plus the bias rounded).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <optional>
#include <type_traits>
#include <vector>

namespace {

inline __m256 widen(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 widen(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 widen(const at::BFloat16* p) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

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

inline float read(const at::Tensor& t, int64_t i) {
  return t.scalar_type() == at::kBFloat16 ? static_cast<float>(t.const_data_ptr<at::BFloat16>()[i])
                                          : t.const_data_ptr<float>()[i];
}

// y[row] from its dot product: the stock paths' roundings (see the file's head).
template <typename T>
inline T finish(float v, const at::Tensor& scale, const at::Tensor& bias, int64_t row) {
  if (scale.defined()) {
    v = static_cast<float>(T(static_cast<float>(T(v)) * static_cast<float>(T(read(scale, row)))));
    return bias.defined() ? T(v + static_cast<float>(T(read(bias, row)))) : T(v);
  }
  return T(bias.defined() ? v + read(bias, row) : v);
}

// y = W x for every output row, the rows split into one contiguous range per intra-op thread.
template <typename W, typename T>
void matvec_rows(const W* w, int64_t n, int64_t k, const float* x, const at::Tensor& scale, const at::Tensor& bias,
                 T* y) {
  at::parallel_for(0, n, 16, [&](int64_t first, int64_t last) {
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

template <typename T>
void dispatch(const at::Tensor& weight, const float* x, const at::Tensor& scale, const at::Tensor& bias, T* y) {
  const int64_t n = weight.size(0), k = weight.size(1);
  switch (weight.scalar_type()) {
    case at::kFloat: matvec_rows(weight.const_data_ptr<float>(), n, k, x, scale, bias, y); break;
    case at::kBFloat16: matvec_rows(weight.const_data_ptr<at::BFloat16>(), n, k, x, scale, bias, y); break;
    case at::kChar:
      TORCH_CHECK(scale.defined(), "matvec: int8 weights need their row scales");
      matvec_rows(weight.const_data_ptr<int8_t>(), n, k, x, scale, bias, y);
      break;
    default: TORCH_CHECK(false, "matvec: weights must be float32, bfloat16 or int8");
  }
}

at::Tensor matvec(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                  const std::optional<at::Tensor>& bias) {
  const int64_t k = weight.size(1), n = weight.size(0);
  TORCH_CHECK(x.size(-1) == k && x.numel() == k, "matvec: x must hold one row of ", k, " features");
  TORCH_CHECK(k % 16 == 0 && weight.is_contiguous(), "matvec: weight must be contiguous with K a multiple of 16");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "matvec: x must be float32 or bfloat16");
  auto vector = [n](const std::optional<at::Tensor>& t) {
    if (!t.has_value()) return at::Tensor();
    TORCH_CHECK(t->numel() == n && (t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16),
                "matvec: scale and bias must hold one float32 or bfloat16 value per output row");
    return t->contiguous();
  };
  const at::Tensor s = vector(scale), b = vector(bias);
  const at::Tensor xc = x.contiguous();
  thread_local std::vector<float> widened;  // x in float32 (no tensor allocated per call: 57 calls a step)
  const float* xf = xc.scalar_type() == at::kFloat ? xc.const_data_ptr<float>() : nullptr;
  if (xf == nullptr) {
    const at::BFloat16* xb = xc.const_data_ptr<at::BFloat16>();
    widened.resize(k);
    for (int64_t i = 0; i < k; ++i) widened[i] = static_cast<float>(xb[i]);
    xf = widened.data();
  }
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  at::Tensor y = at::empty(sizes, x.options());
  if (x.scalar_type() == at::kFloat) dispatch(weight, xf, s, b, y.data_ptr<float>());
  else dispatch(weight, xf, s, b, y.data_ptr<at::BFloat16>());
  return y;
}

}  // namespace

TORCH_LIBRARY(mm_pipeline, m) {
  m.def("matvec(Tensor x, Tensor weight, Tensor? scale=None, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(mm_pipeline, CPU, m) { m.impl("matvec", &matvec); }
