// Softmax states of rows whose keys were split over several tasks (flash decoding), and their merge: the one
// place paged_decode.cpp and paged_prefill.cpp combine parts. A part of `rows` rows holds the unnormalized
// outputs O (rows, hd), then the running maxima m (rows,), then the sums l (rows,).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>

namespace metrale {

// out (hd,) = sum_i w_i O_i[r] / sum_i w_i l_i[r] over the n parts i, w_i = exp(m_i[r] - M), M = max_i m_i[r];
// `exp` is std::exp for maxima in natural units (decode) or std::exp2 for log2 units (prefill). A row that no
// part saw (every m -inf) comes out NaN, as a fully masked softmax.
template <typename Exp>
void merge_row(const float* const* parts, size_t n, int rows, int hd, int r, Exp exp, float* out) {
  const int64_t m_at = static_cast<int64_t>(rows) * hd + r, l_at = m_at + rows;
  float M = -std::numeric_limits<float>::infinity(), L = 0.0f;
  for (size_t p = 0; p < n; ++p) M = std::max(M, parts[p][m_at]);
  std::fill(out, out + hd, 0.0f);
  for (size_t p = 0; p < n; ++p) {
    const float w = exp(parts[p][m_at] - M);
    L += w * parts[p][l_at];
    const float* o = parts[p] + static_cast<int64_t>(r) * hd;
    for (int d = 0; d < hd; ++d) out[d] += w * o[d];
  }
  for (int d = 0; d < hd; ++d) out[d] /= L;
}

}  // namespace metrale
