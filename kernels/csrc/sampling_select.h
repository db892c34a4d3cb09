// Selection inside one row of float32 logits, for the top_k / top_p sampling and top-n logprobs primitives
// (sampling.cpp). Plain C++ compiled once for the baseline CPU: the O(V) scans (block maxima, gathers, the
// masses and their histogram) are ISA kernels (sampling_kernel.h).
//
// sample_candidate_row: metrale.sampling.ops.sample_candidates for one row, in O(V) instead of a partition
// and sort of the vocabulary:
//   m = the largest non-NaN logit; y_i = (x_i - m) * scale; q_i = 2^y_i where y_i >= max(log2_min_p, -126), else 0
//   descending order: y desc, then x desc, then index asc (NaN logits: no mass, never counted)
//   top_k > 0  T = the k-th largest y; survivors y_i >= T with q_i > 0 (ties with the k-th survive); then, in
//              descending order and float32 like the reference: keep while the running probability before
//              the token (q / survivors' mass) is below top_p, and the inverse CDF at u over the kept q
//   top_k == 0 the whole vocabulary's mass M; the nucleus is the shortest descending prefix whose mass
//              reaches top_p * M (all of it where top_p >= 1); the token is where the running mass in
//              descending order reaches u * (the nucleus's mass)
// Nothing sorts the vocabulary. top_k: the k-th largest maximum of blocks of 64 (smaller blocks for k > V/256)
// is a bound that at least k logits reach; only those are partitioned (and, where the k-th value's y is
// shared below the bound, every y is compared). top_p alone: where the 256 largest values (same bound) hold
// the nucleus (a peaked row), those are sorted; else (flat logits) a histogram of masses over 2048 buckets of y
// in [floor, 0] (sampling_kernel.h candidate_masses), then 256 buckets over the cut bucket's y range, ...,
// narrows to at most 32 values (or values of one y), which are sorted. Those sums are in double: a uniform or
// top_p within float rounding of a token boundary may pick the neighbour of the reference's choice (float32).
// A row whose largest number is +inf or -inf gives its first index (the reference's fallback to its top
// candidate); a row of NaN gives 0.
//
// top_ids_row: the n largest values of a row, descending (ties: lower index first), NaN after every
// number (as mx.argsort(-x)): the same block bound as top_k, and only the values above it are sorted.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kernel_table.h"

namespace metrale {

struct CandidateParams {
  float scale;       // log2(e) / temperature
  float log2_min_p;  // -inf where min_p is off
  int32_t top_k;     // 0 where off
  float top_p;       // >= 1 (or inf) where off
  float u;           // the row's uniform in (0, 1)
};

// Buffers of one thread's rows, grown to V logits and kept (not zero-filled, never shrunk): a pool thread
// holds ~14 bytes per vocabulary entry (1.8 MB at 128256) between steps.
class CandidateScratch {
 public:
  void reserve(int64_t V);
  float* y() { return y_.get(); }
  float* q() { return q_.get(); }
  uint16_t* bucket() { return bucket_.get(); }
  int32_t* gather() { return gather_.get(); }  // room for V indices
  std::vector<float> block_max;
  std::vector<int32_t> set, spare;

 private:
  std::unique_ptr<float[]> y_, q_;
  std::unique_ptr<uint16_t[]> bucket_;
  std::unique_ptr<int32_t[]> gather_;
  int64_t capacity_ = 0;
};

// The calling thread's scratch, reserved for V.
CandidateScratch& thread_scratch(int64_t V);

int32_t sample_candidate_row(const KernelTable& kernels, const float* x, int64_t V, const CandidateParams& p,
                             CandidateScratch& scratch);

// ids (n,) int32: the indices of the n largest values of x (V,), n <= V.
void top_ids_row(const KernelTable& kernels, const float* x, int64_t V, int n, int32_t* ids, CandidateScratch& scratch);

}  // namespace metrale
