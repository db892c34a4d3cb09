// Sampling kernels on the CPU, threaded over rows (sampling_kernel.h states their arithmetic):
//   argmax_rows       greedy: mx.argmax(x, axis=-1), bit for bit. MLX's CPU argmax runs on one thread, ~10 ms
//                     for the 32 x 128256 logits of a 1B-shaped model's decode step.
//   sample_full_rows  temperature (+ min_p) rows: the inverse CDF over the whole vocabulary in one pass of
//                     vectorized 2^y, where MLX's ops take ~35 ms for 32 x 128256 (its power is scalar).
//   logsumexp_rows    the logprobs' normalizer, vectorized (MLX's expression: ~60 ms at 32 x 128256).
//   sample_candidates_rows  top_k / top_p rows by O(V) selection (MLX's partition + sort of candidates, and
//                     the whole vocabulary's sort for a wide nucleus, took 13-450 ms at 32 x 128256).
//   top_ids_rows      the top-n logprobs' ids, n <= 20: a bound from block maxima, then a small sort.
#pragma once

#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace metrale {

namespace mx = mlx::core;

// x (..., V) float32, V >= 1 -> (...) uint32: the index of each row's maximum (mx.argmax's dtype).
mx::array argmax_rows(const mx::array& x);

// logits (R, V) float32, scale, log2_min_p, uniforms (R,) float32 -> (R,) int32 tokens.
mx::array sample_full_rows(const mx::array& logits, const mx::array& scale, const mx::array& log2_min_p,
                           const mx::array& uniforms);

// x (R, V) float32 -> (R,) float32: log(sum(exp(x))) per row (the raw logprobs' normalizer).
mx::array logsumexp_rows(const mx::array& x);

// logits (R, V) float32; scale, log2_min_p, top_p, uniforms (R,) float32; top_k (R,) int32 -> (R,) int32 tokens:
// top_k / top_p (+ min_p) sampling by selection, without sorting the vocabulary (sampling_select.h).
mx::array sample_candidates_rows(const mx::array& logits, const mx::array& scale, const mx::array& log2_min_p,
                                 const mx::array& top_k, const mx::array& top_p, const mx::array& uniforms);

// x (R, V) float32, 1 <= n <= V -> (R, n) int32: the indices of each row's n largest values, descending (ties:
// lower index first; NaN after every number).
mx::array top_ids_rows(const mx::array& x, int n);

class SampleCandidateRows : public mx::UnaryPrimitive {
 public:
  explicit SampleCandidateRows(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "SampleCandidateRowsCPU"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0)}};
  }
};

class TopIdsRows : public mx::UnaryPrimitive {
 public:
  TopIdsRows(mx::Stream stream, int n) : mx::UnaryPrimitive(stream), n_(n) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "TopIdsRowsCPU"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return static_cast<const TopIdsRows&>(other).n_ == n_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0), n_}};
  }

 private:
  int n_;
};

class LogsumexpRows : public mx::UnaryPrimitive {
 public:
  explicit LogsumexpRows(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "LogsumexpRowsCPU"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0)}};
  }
};

class SampleFullRows : public mx::UnaryPrimitive {
 public:
  explicit SampleFullRows(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "SampleFullRowsCPU"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0)}};
  }
};

class ArgmaxRows : public mx::UnaryPrimitive {
 public:
  explicit ArgmaxRows(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "ArgmaxRowsCPU"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
};

}  // namespace metrale
