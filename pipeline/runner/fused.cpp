// The small ops between a decode step's linear layers, each one native call: RMSNorm, the
// rotary embedding and the declared activations (``fused.py`` says when they run and why).
//
// Both reproduce PyTorch's eager arithmetic bit for bit, so a step computes the same numbers as
// transformers' modules: every product and sum rounded where ATen rounds it (no FMA contraction:
// the extension is built with ``-ffp-contract=off``, ``matvec.CFLAGS``), bfloat16 results
// rounded to nearest even as c10::BFloat16 does, and the RMSNorm's sum of squares taken in the
// order of ATen's float sum (``aten_row_sum``). The Python side checks each against the module's
// own forward once before using it.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

namespace {

constexpr int MAX_LANES = 16;

inline void add_lanes(float* acc, const float* v, int lanes) {
  for (int l = 0; l < lanes; ++l) acc[l] += v[l];
}

// ceil(log2(x)), at least 1: ATen's utils::CeilLog2.
inline int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

// The float sum of a contiguous row as ATen's CPU sum takes it (SumKernel.cpp: vectorized_inner_sum
// over vectors of ``lanes`` floats, row_sum's four interleaved partial sums, multi_row_sum's cascade
// of levels, then the scalar tail and the vector's lanes in order).
float aten_row_sum(const float* v, int64_t n, int lanes) {
  const int64_t vectors = n / lanes, rows = vectors / 4;
  const int64_t power = std::max<int64_t>(4, ceil_log2(rows) / 4), step = int64_t(1) << power, mask = step - 1;
  float acc[4][4][MAX_LANES] = {};  // [level][partial sum][lane]
  int64_t i = 0;
  while (i + step <= rows) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int k = 0; k < 4; ++k) add_lanes(acc[0][k], v + (i * 4 + k) * lanes, lanes);
    for (int level = 1; level < 4; ++level) {
      for (int k = 0; k < 4; ++k) {
        add_lanes(acc[level][k], acc[level - 1][k], lanes);
        std::fill_n(acc[level - 1][k], lanes, 0.f);
      }
      if (i & (mask << (level * power))) break;
    }
  }
  for (; i < rows; ++i)
    for (int k = 0; k < 4; ++k) add_lanes(acc[0][k], v + (i * 4 + k) * lanes, lanes);
  for (int level = 1; level < 4; ++level)
    for (int k = 0; k < 4; ++k) add_lanes(acc[0][k], acc[level][k], lanes);
  for (int64_t t = rows * 4; t < vectors; ++t) add_lanes(acc[0][0], v + t * lanes, lanes);
  for (int k = 1; k < 4; ++k) add_lanes(acc[0][0], acc[0][k], lanes);
  float total = 0.f;
  for (int64_t e = vectors * lanes; e < n; ++e) total += v[e];
  for (int l = 0; l < lanes; ++l) total += acc[0][0][l];
  return total;
}

// transformers' RMSNorm: x in float32, times 1 / sqrt(mean(x^2) + eps), rounded to x's dtype,
// times the weight (of x's dtype).
template <typename T>
void rms_rows(const T* x, const T* w, int64_t rows, int64_t h, float eps, int lanes, T* y) {
  thread_local std::vector<float> row;
  row.resize(h);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < h; ++i) {
      const float v = static_cast<float>(x[r * h + i]);
      row[i] = v * v;
    }
    const float inv = 1.f / std::sqrt(aten_row_sum(row.data(), h, lanes) / static_cast<float>(h) + eps);
    for (int64_t i = 0; i < h; ++i) {
      const T normed = T(static_cast<float>(x[r * h + i]) * inv);
      y[r * h + i] = T(static_cast<float>(w[i]) * static_cast<float>(normed));
    }
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t lanes) {
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight must share a dtype");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "rms_norm: one weight per feature");
  TORCH_CHECK(lanes > 0 && lanes <= MAX_LANES, "rms_norm: lanes from 1 to ", MAX_LANES);
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const int64_t h = x.size(-1), rows = h ? x.numel() / h : 0;
  at::Tensor y = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) {
    rms_rows(xc.const_data_ptr<float>(), wc.const_data_ptr<float>(), rows, h, float(eps), int(lanes),
             y.data_ptr<float>());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "rms_norm: float32 or bfloat16");
    rms_rows(xc.const_data_ptr<at::BFloat16>(), wc.const_data_ptr<at::BFloat16>(), rows, h, float(eps), int(lanes),
             y.data_ptr<at::BFloat16>());
  }
  return y;
}

// transformers' apply_rotary_pos_emb on one tensor: x * cos + rotate_half(x) * sin, each product
// and the sum rounded to x's dtype. x [1, heads, tokens, dim] (any strides), cos/sin [1, tokens, dim].
template <typename T>
void rotate(const at::Tensor& x, const T* cos, const T* sin, at::Tensor& out) {
  const int64_t heads = x.size(1), tokens = x.size(2), dim = x.size(3), half = dim / 2;
  const int64_t xh = x.stride(1), xt = x.stride(2), xd = x.stride(3);  // read once, not a call per element
  const int64_t oh = out.stride(1), ot = out.stride(2), od = out.stride(3);
  const T* xp = x.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t t = 0; t < tokens; ++t) {
      const T* row = xp + h * xh + t * xt;
      T* dst = op + h * oh + t * ot;
      const T *c = cos + t * dim, *s = sin + t * dim;
      for (int64_t i = 0; i < dim; ++i) {
        const T turned = i < half ? T(-static_cast<float>(row[(i + half) * xd])) : row[(i - half) * xd];
        const T a = T(static_cast<float>(row[i * xd]) * static_cast<float>(c[i]));
        const T b = T(static_cast<float>(turned) * static_cast<float>(s[i]));
        dst[i * od] = T(static_cast<float>(a) + static_cast<float>(b));
      }
    }
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                          const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && q.size(0) == 1 && k.size(0) == 1, "rotary: q, k [1, heads, tokens, dim]");
  TORCH_CHECK(q.size(2) == k.size(2) && q.size(3) == k.size(3) && q.size(3) % 2 == 0, "rotary: q, k shapes disagree");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.numel() == q.size(2) * q.size(3), "rotary: cos, sin [1, tokens, dim]");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(k.scalar_type() == dtype && cos.scalar_type() == dtype && sin.scalar_type() == dtype,
              "rotary: q, k, cos and sin must share a dtype");
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  at::Tensor qo = at::empty_like(q), ko = at::empty_like(k);  // strides as q's and k's, as eager's results
  if (dtype == at::kFloat) {
    rotate(q, c.const_data_ptr<float>(), s.const_data_ptr<float>(), qo);
    rotate(k, c.const_data_ptr<float>(), s.const_data_ptr<float>(), ko);
  } else {
    TORCH_CHECK(dtype == at::kBFloat16, "rotary: float32 or bfloat16");
    rotate(q, c.const_data_ptr<at::BFloat16>(), s.const_data_ptr<at::BFloat16>(), qo);
    rotate(k, c.const_data_ptr<at::BFloat16>(), s.const_data_ptr<at::BFloat16>(), ko);
  }
  return {qo, ko};
}

// An activation transformers declares by its kernel layer name (``kind``: its index in
// ``fused.ACTIVATIONS``), as PyTorch's own kernel computes it: one opaque call in a compiled step,
// where Inductor's generated code would round otherwise. An index, not the name: Inductor's C++
// wrapper calls an op with a text argument back through Python (measured: 10 calls a token).
at::Tensor activation(const at::Tensor& x, int64_t kind) {
  if (kind == 0) return at::silu(x);
  if (kind == 1) return at::gelu(x, "tanh");
  if (kind == 2) return at::gelu(x);
  TORCH_CHECK(false, "activation: no kernel numbered ", kind);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mm_pipeline, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, int lanes) -> Tensor");
  m.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("activation(Tensor x, int kind) -> Tensor");
}

TORCH_LIBRARY_IMPL(mm_pipeline, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary", &rotary);
  m.impl("activation", &activation);
}
