// AVX2 helpers the native CPU kernels share (matvec.cpp, decode_attention.cpp). matvec.py folds
// this file's text into the extension's name with the sources', so a change here rebuilds them.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>

namespace mm_pipeline::avx2 {

// Eight values widened to float32: bfloat16 is the top half of a float32 (a shift), int8 by
// sign extension.
inline __m256 widen(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 widen(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 widen(const at::BFloat16* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// The sum of the eight lanes.
inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

}  // namespace mm_pipeline::avx2
