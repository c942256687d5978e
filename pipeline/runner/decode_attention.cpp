// Decode attention on CPU: one query token per row, over keys and values read where they lie in
// the paged pool.
//
// A batched decode step's attention through PyTorch first gathers every row's keys and values
// into a dense [rows, kv_heads, keys, head_dim] copy (an index_select each), then runs SDPA's
// flash kernel, which is tuned for many queries: with one query per row (the query heads that
// share a key/value head as its rows) it spends most of its time in per-block overhead. Here
// each (row, key/value head) is one task: its query heads' scores against every visible key
// (each key read once for all of them), a softmax in float32, the weighted sum of values (each
// read once), split over torch's intra-op threads. Arithmetic: float32 throughout, one rounding
// to the output dtype; the order of the sums differs from SDPA's, as between any two kernels.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "avx2.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

namespace {

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }

using mm_pipeline::avx2::hsum;
using mm_pipeline::avx2::widen;

// score[g * stride] = q[g] . key for the G query heads of one key/value head (q [G, dim] float32,
// dim a multiple of 8): the key is widened once for all of them; G is a template argument so
// that the accumulators stay in registers.
template <int G, typename T>
inline void scores_of(const float* q, const T* key, int64_t dim, float* score, int64_t stride) {
  __m256 a[G];
  for (int g = 0; g < G; ++g) a[g] = _mm256_setzero_ps();
  for (int64_t i = 0; i < dim; i += 8) {
    const __m256 k = widen(key + i);
    for (int g = 0; g < G; ++g) a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * dim + i), k, a[g]);
  }
  for (int g = 0; g < G; ++g) score[g * stride] = hsum(a[g]);
}

// acc[g][i .. i + 8W) = the sum over keys t, in order, of p[g * keys + t] * value_t, one FMA
// each (values[t] null: a masked key, skipped), the sums held in registers.
template <int G, int W, typename T>
inline void weighted_block(const float* p, const T* const* values, int64_t keys, int64_t dim, int64_t i,
                           float* acc) {
  __m256 a[W][G];
  for (int c = 0; c < W; ++c)
    for (int g = 0; g < G; ++g) a[c][g] = _mm256_setzero_ps();
  for (int64_t t = 0; t < keys; ++t) {
    if (values[t] == nullptr) continue;
    for (int c = 0; c < W; ++c) {
      const __m256 v = widen(values[t] + i + 8 * c);
      for (int g = 0; g < G; ++g) a[c][g] = _mm256_fmadd_ps(_mm256_set1_ps(p[g * keys + t]), v, a[c][g]);
    }
  }
  for (int c = 0; c < W; ++c)
    for (int g = 0; g < G; ++g) _mm256_storeu_ps(acc + g * dim + i + 8 * c, a[c][g]);
}

// The probability-weighted sum of values for the G query heads (acc [G, dim]), 16 columns at a time
// where G allows (twice the independent FMA chains in the 16 registers), else 8. The same sums as
// a key-by-key pass over acc in memory, which waited on its own stores at every key
// (benchmarks/README.md, ``paged_attention.py``).
template <int G, typename T>
inline void weighted_values(const float* p, const T* const* values, int64_t keys, int64_t dim, float* acc) {
  int64_t i = 0;
  if constexpr (G <= 6)
    for (; i + 16 <= dim; i += 16) weighted_block<G, 2>(p, values, keys, dim, i, acc);
  for (; i < dim; i += 8) weighted_block<G, 1>(p, values, keys, dim, i, acc);
}

// exp(x) for x <= 0 (scores less their maximum), eight lanes: 2^(x log2 e) split into an integer
// power (the exponent bits) and 2^f for f in [-0.5, 0.5] by a degree-6 polynomial (relative error
// about 2e-7, near float32's own; SDPA's CPU kernel uses a similar one). Below -87 (and for a
// masked key's -inf, or NaN) it is 0.
constexpr float EXP_POLY[7] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                               5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.f};
constexpr float LOG2E = 1.44269504088896341f, ROUNDER = 12582912.f;  // 1.5 * 2^23: round to nearest by adding

inline __m256 exp_nonpositive(__m256 x) {
  const __m256 zero = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_NGE_UQ);
  x = _mm256_blendv_ps(x, _mm256_set1_ps(-87.f), zero);
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(LOG2E));
  const __m256 n = _mm256_sub_ps(_mm256_add_ps(t, _mm256_set1_ps(ROUNDER)), _mm256_set1_ps(ROUNDER));
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP_POLY[i]));
  const __m256i bits = _mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23));
  return _mm256_andnot_ps(zero, _mm256_castsi256_ps(bits));
}

// s[t] = exp(s[t] - m) for a row of scores; returns their sum, taken per lane (key t in lane t % 8)
// and then across the lanes: a key past the row's end (padding in a batch, masked: weight 0) adds
// nothing to any sum, so a row's weights have the same bits alone and padded.
inline float softmax_weights(float* s, int64_t keys, float m) {
  const __m256 top = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= keys; t += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), top));
    _mm256_storeu_ps(s + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (t < keys) {
    float tail[8];
    std::fill_n(tail, 8, -std::numeric_limits<float>::infinity());
    std::copy(s + t, s + keys, tail);
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(tail), top));
    _mm256_storeu_ps(tail, e);
    std::copy(tail, tail + (keys - t), s + t);
    sum = _mm256_add_ps(sum, e);
  }
  return hsum(sum);
}

// Tasks (a row's key/value head) are split over threads only when each thread gets at least this
// many keys to read: a parallel region costs about what 150-250 keys of one head do (measured:
// 2-core AVX2 EPYC, 5 query heads a key/value head, 4 heads a row: one thread was as fast as two
// up to about 100 keys a row).
constexpr int64_t KEYS_PER_THREAD = 384;

template <int G, typename T>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
            const bool* mask, double scale, at::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k.size(1), keys = slots.size(1), pool_slots = k.size(0);
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), ss0 = slots.stride(0);
  const int64_t grain = std::max<int64_t>(1, (KEYS_PER_THREAD + keys - 1) / std::max<int64_t>(keys, 1));
  at::parallel_for(0, rows * kv_heads, grain, [&](int64_t first, int64_t last) {
    std::vector<float> query(G * dim), scores(G * keys), acc(G * dim);
    std::vector<const T*> values(keys);
    for (int64_t task = first; task < last; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      for (int64_t g = 0; g < G; ++g) {
        const T* src = qp + b * qs0 + (h * G + g) * qs1;
        for (int64_t i = 0; i < dim; ++i) query[g * dim + i] = to_float(src[i]) * static_cast<float>(scale);
      }
      float top[G], total[G];
      for (int g = 0; g < G; ++g) top[g] = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < keys; ++t) {
        if (mask != nullptr && !mask[b * keys + t]) {
          for (int64_t g = 0; g < G; ++g) scores[g * keys + t] = -std::numeric_limits<float>::infinity();
          values[t] = nullptr;
          continue;
        }
        const int64_t slot = sp[b * ss0 + t];
        TORCH_CHECK(slot >= 0 && slot < pool_slots, "decode_attention: slot ", slot, " outside the pool");
        scores_of<G>(query.data(), kp + slot * ks0 + h * ks1, dim, scores.data() + t, keys);
        values[t] = vp + slot * vs0 + h * vs1;
        for (int64_t g = 0; g < G; ++g) top[g] = std::max(top[g], scores[g * keys + t]);
      }
      for (int64_t g = 0; g < G; ++g) total[g] = softmax_weights(scores.data() + g * keys, keys, top[g]);  // masked: 0
      weighted_values<G>(scores.data(), values.data(), keys, dim, acc.data());
      for (int64_t g = 0; g < G; ++g) {
        T* dst = op + (b * heads + h * G + g) * dim;
        const float norm = total[g] > 0.f ? 1.f / total[g] : 0.f;  // a row that sees no key: zeros
        for (int64_t i = 0; i < dim; ++i) dst[i] = static_cast<T>(acc[g * dim + i] * norm);
      }
    }
  });
}

constexpr int64_t MAX_GROUP = 8;  // query heads per key/value head (GQA groups: 1, 2, 4, 6, 7, 8 in the families here)

template <int G>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots, const bool* mask,
         double scale, at::Tensor& out) {
  if (q.scalar_type() == at::kFloat) {
    attend<G, float>(q, k, v, slots, mask, scale, out);
  } else {
    attend<G, at::BFloat16>(q, k, v, slots, mask, scale, out);
  }
}

// q [rows, heads, dim]; k, v [slots, kv_heads, dim] (one layer of the pool); slots [rows, keys]
// the pool slot of each key position; mask [rows, keys] (or [rows, 1, 1, keys]) true where the
// row sees the key (None: every key). Returns [rows, heads, dim] in q's dtype.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                            const std::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && slots.dim() == 2, "decode_attention: bad ranks");
  TORCH_CHECK(q.dtype() == k.dtype() && k.dtype() == v.dtype(), "decode_attention: q, k, v must share a dtype");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "decode_attention: head_dim not contiguous");
  TORCH_CHECK(q.size(1) % k.size(1) == 0 && q.size(2) == k.size(2), "decode_attention: head shapes disagree");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.size(0) == q.size(0), "decode_attention: slots [rows, keys] int64");
  at::Tensor m;
  if (mask.has_value()) {
    m = mask->reshape({slots.size(0), slots.size(1)}).contiguous();
    TORCH_CHECK(m.scalar_type() == at::kBool, "decode_attention: a boolean mask");
  }
  const bool* mp = mask.has_value() ? m.data_ptr<bool>() : nullptr;
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "decode_attention: float32 or bfloat16");
  TORCH_CHECK(q.size(2) % 8 == 0, "decode_attention: head_dim a multiple of 8");
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  const int64_t group = q.size(1) / k.size(1);
  switch (group) {
    case 1: run<1>(q, k, v, slots, mp, scale, out); break;
    case 2: run<2>(q, k, v, slots, mp, scale, out); break;
    case 3: run<3>(q, k, v, slots, mp, scale, out); break;
    case 4: run<4>(q, k, v, slots, mp, scale, out); break;
    case 5: run<5>(q, k, v, slots, mp, scale, out); break;
    case 6: run<6>(q, k, v, slots, mp, scale, out); break;
    case 7: run<7>(q, k, v, slots, mp, scale, out); break;
    case 8: run<8>(q, k, v, slots, mp, scale, out); break;
    default: TORCH_CHECK(false, "decode_attention: at most ", MAX_GROUP, " query heads per key/value head");
  }
  return out;
}

// Each decode row (q [B, heads, D]) over exactly the keys its mask ([B, 1, 1, K] boolean, or none:
// all) shows of ``slots`` [B, K], by the SDPA call transformers' ``sdpa_attention_forward`` makes
// for one unpadded row, ``generate()``'s: no mask, the query heads sharing a key/value head
// through ``enable_gqa`` (head_dim up to 256), else as the rows of that head (``pack_gqa``). Used
// where the one-row products are summed as ``generate()``'s (bfloat16 on AMX, ``matvec.cpp``):
// PyTorch's flash attention blocks its sums by the key count, so over padding keys or in the
// kernel above a row's bfloat16 output rounds otherwise. Keys read in place where they are
// consecutive slots (a lone stream's usually are), else gathered. An op, so that a compiled step
// calls it as it is, the key count read here (a traced count would specialise the graph on it).
at::Tensor rows_as_alone(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                         const std::optional<at::Tensor>& mask, std::optional<double> scale) {
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k.size(1);
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == rows && heads % kv_heads == 0,
              "rows_as_alone: slots [B, K] for B rows, heads a multiple of the key/value heads");
  const at::Tensor all = slots.to(at::kLong).contiguous();
  at::Tensor m;
  if (mask.has_value()) {
    m = mask->reshape({rows, all.size(1)}).contiguous();
    TORCH_CHECK(m.scalar_type() == at::kBool, "rows_as_alone: a boolean mask");
  }
  at::Tensor out = at::empty_like(q);
  std::vector<int64_t> picked;
  for (int64_t b = 0; b < rows; ++b) {
    const int64_t* s = all.const_data_ptr<int64_t>() + b * all.size(1);
    const bool* shown = m.defined() ? m.const_data_ptr<bool>() + b * all.size(1) : nullptr;
    picked.clear();
    for (int64_t j = 0; j < all.size(1); ++j)
      if (shown == nullptr || shown[j]) picked.push_back(s[j]);
    TORCH_CHECK(!picked.empty(), "rows_as_alone: a row sees no key");
    const int64_t n = static_cast<int64_t>(picked.size());
    bool consecutive = true;
    for (int64_t j = 1; j < n && consecutive; ++j) consecutive = picked[j] == picked[0] + j;
    at::Tensor ks, vs;
    if (consecutive) {
      ks = k.narrow(0, picked[0], n);
      vs = v.narrow(0, picked[0], n);
    } else {
      const at::Tensor index = at::tensor(picked, at::kLong);
      ks = k.index_select(0, index);
      vs = v.index_select(0, index);
    }
    const at::Tensor keys = ks.transpose(0, 1).unsqueeze(0), values = vs.transpose(0, 1).unsqueeze(0);
    at::Tensor query = q[b].view({1, heads, 1, dim});
    const bool grouped = heads != kv_heads, gqa = grouped && dim <= 256 && v.size(2) == dim;
    if (grouped && !gqa) query = query.reshape({1, kv_heads, heads / kv_heads, dim});
    const at::Tensor o = at::scaled_dot_product_attention(query, keys, values, {}, 0.0, false, scale, gqa);
    out[b].copy_(gqa || !grouped ? o.transpose(1, 2).reshape({heads, dim}) : o.reshape({heads, dim}));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mm_pipeline, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor? mask, float scale) -> Tensor");
  m.def("rows_as_alone(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor? mask, float? scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(mm_pipeline, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("rows_as_alone", &rows_as_alone);
}
