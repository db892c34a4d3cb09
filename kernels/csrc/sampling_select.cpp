// Selection inside one row (sampling_select.h states what it computes).
#include "sampling_select.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>

namespace metrale {

namespace {

constexpr int kFirstBuckets = 2048;  // over y in [floor, 0]; bucket kFirstBuckets: y below the floor (no mass)
constexpr int kBuckets = 256;        // over the [lowest, highest] y of a cut bucket
constexpr size_t kLeafSize = 32;     // a set this small is sorted
constexpr float kInf = std::numeric_limits<float>::infinity();

struct RowView {
  const float* x;
  const float* y;
  const float* q;
};

struct Found {
  int32_t index;  // the element
  double before;  // the mass ahead of it in descending order
};

// The sampling order: y desc, then x desc (values that round to one y), then index asc.
struct Descending {
  const RowView* r;
  bool operator()(int32_t a, int32_t b) const {
    if (r->y[a] != r->y[b]) return r->y[a] > r->y[b];
    if (r->x[a] != r->x[b]) return r->x[a] > r->x[b];
    return a < b;
  }
};

// The first bucket with weight whose running weight reaches t; where rounding leaves the total short of t,
// the last bucket with weight. `before` gets the weight ahead of it. -1 when no bucket has weight.
int cut_bucket(const double* w, int n, double t, double& before) {
  double cum = 0.0;
  int last = -1;
  for (int b = 0; b < n; ++b) {
    if (w[b] <= 0.0) continue;
    if (cum + w[b] >= t) {
      before = cum;
      return b;
    }
    cum += w[b];
    last = b;
  }
  if (last >= 0) before = cum - w[last];
  return last;
}

// The element of `set` (y >= floor: q > 0) where the running mass in descending order first reaches t,
// and the mass ahead of it within `set`; where rounding leaves `set` short of t, its last element. Narrows
// `set` by histograms over its y range until it is small or of one y, then sorts it.
Found find_in(const RowView& r, std::vector<int32_t>& set, std::vector<int32_t>& spare, double t) {
  double before = 0.0;
  while (set.size() > kLeafSize) {
    float hi = -kInf, lo = kInf;
    for (const int32_t i : set) {
      hi = std::max(hi, r.y[i]);
      lo = std::min(lo, r.y[i]);
    }
    if (hi == lo) break;
    const double inv = kBuckets / (static_cast<double>(hi) - lo);
    const auto bucket = [&](int32_t i) {
      return std::min(kBuckets - 1, static_cast<int>((hi - static_cast<double>(r.y[i])) * inv));
    };
    double w[kBuckets] = {};
    for (const int32_t i : set) w[bucket(i)] += r.q[i];
    double ahead = 0.0;
    const int b = cut_bucket(w, kBuckets, t, ahead);
    if (b < 0) break;
    spare.clear();
    for (const int32_t i : set)
      if (bucket(i) == b) spare.push_back(i);
    set.swap(spare);
    before += ahead;
    t -= ahead;
  }
  std::sort(set.begin(), set.end(), Descending{&r});
  double cum = 0.0, last_before = 0.0;
  int32_t last = set.empty() ? 0 : set.front();
  for (const int32_t i : set) {
    const double wi = r.q[i];
    if (wi <= 0.0) continue;
    if (cum + wi >= t) return {i, before + cum};
    last = i;
    last_before = cum;
    cum += wi;
  }
  return {last, before + last_before};
}

// metrale.sampling.ops.pick's float32 arithmetic over the survivors in descending order: top_p on their
// renormalized mass, then the inverse CDF at u (a zero-mass pick falls back to the first survivor).
int32_t pick_in_order(const RowView& r, const std::vector<int32_t>& order, const CandidateParams& p) {
  double total = 0.0;
  for (const int32_t i : order) total += r.q[i];
  const float mass = static_cast<float>(total);
  float running = 0.0f, kept = 0.0f;
  size_t n_kept = 0;
  for (; n_kept < order.size(); ++n_kept) {
    const float prob = r.q[order[n_kept]] / mass;
    running += prob;
    if (!(running - prob < p.top_p)) break;
    kept += r.q[order[n_kept]];
  }
  const float target = p.u * kept;
  float cdf = 0.0f;
  for (size_t j = 0; j < n_kept; ++j) {
    cdf += r.q[order[j]];
    if (cdf >= target) return r.q[order[j]] > 0.0f ? order[j] : order.front();
  }
  return order.front();
}

// out = the indices that gather(s.gather()) writes (a vector's resize would zero-fill V entries first).
template <typename Gather>
void gathered_into(std::vector<int32_t>& out, CandidateScratch& s, const Gather& gather) {
  const int64_t n = gather(s.gather());
  out.assign(s.gather(), s.gather() + n);
}

// Blocks for a bound that at least k values reach: the k-th largest block maximum (k blocks reach it).
int64_t block_for(int64_t V, int64_t k) { return std::clamp<int64_t>(V / (4 * k), 1, 64); }

// The indices of the values of x >= the k-th largest block maximum (every value where the row has fewer than
// k blocks with a number), ascending, into `found`. Returns the row's largest number (-inf: none).
float at_least_kth_block(const KernelTable& kernels, const float* x, int64_t V, int64_t k, CandidateScratch& s,
                         std::vector<int32_t>& found) {
  std::vector<float>& block_max = s.block_max;
  const int64_t block = block_for(V, k), blocks = (V + block - 1) / block;
  block_max.resize(blocks);
  kernels.block_maxima(x, V, block, block_max.data());
  const float largest = *std::max_element(block_max.begin(), block_max.end());
  float bound = -kInf;
  if (blocks >= k) {
    std::nth_element(block_max.begin(), block_max.begin() + (k - 1), block_max.end(), std::greater<float>());
    bound = block_max[k - 1];
  }
  gathered_into(found, s, [&](int32_t* out) { return kernels.gather_at_least(x, V, bound, out); });
  return largest;
}

// top_k rows (`found`: at_least_kth_block's values, m the largest number): the k-th largest logit among them,
// its y the threshold (a plateau of y reaching below the bound: every value's y), the survivors' q, then
// pick_in_order.
int32_t sample_top_k(const float* x, int64_t V, float m, float floor, const CandidateParams& p, CandidateScratch& s) {
  std::vector<int32_t>& found = s.set;
  float* y = s.y();  // y and q of the found values only
  float* q = s.q();
  for (const int32_t i : found) y[i] = (x[i] - m) * p.scale;
  const RowView r{x, y, q};
  float threshold = floor;
  if (static_cast<int64_t>(found.size()) >= p.top_k) {
    std::nth_element(found.begin(), found.begin() + (p.top_k - 1), found.end(), Descending{&r});
    threshold = std::max(floor, y[found[p.top_k - 1]]);
    float lowest = kInf;
    for (const int32_t i : found) lowest = std::min(lowest, y[i]);
    if (lowest == threshold) {  // values below the bound may share the threshold's y
      found.clear();
      for (int64_t i = 0; i < V; ++i) {
        const float yi = (x[i] - m) * p.scale;
        if (yi >= threshold) y[i] = yi, found.push_back(static_cast<int32_t>(i));
      }
    }
  }
  std::vector<int32_t>& survivors = s.spare;
  survivors.clear();
  for (const int32_t i : found) {
    if (!(y[i] >= threshold)) continue;
    q[i] = std::exp2(y[i]);
    survivors.push_back(i);
  }
  std::sort(survivors.begin(), survivors.end(), Descending{&r});
  return pick_in_order(r, survivors, p);
}

// find_in over a whole row whose first-level masses per bucket are w.
Found find_in_row(const KernelTable& kernels, const RowView& r, int64_t V, const uint16_t* bucket, const double* w,
                  double t, CandidateScratch& s) {
  double ahead = 0.0;
  const int b = cut_bucket(w, kSelectBuckets, t, ahead);
  gathered_into(s.set, s, [&](int32_t* out) { return kernels.gather_bucket(bucket, V, b, out); });
  Found found = find_in(r, s.set, s.spare, t - ahead);
  found.before += ahead;
  return found;
}

// A nucleus inside the largest kNucleusCandidates values (a peaked row: a real model at temperature < 1) is
// found by sorting those; a wider one (flat logits) by the histograms.
constexpr int64_t kNucleusCandidates = 256;

// The nucleus's token from the values at or above the kNucleusCandidates-th block bound (a prefix of the
// descending order), where their mass reaches top_p * total; -1 where it does not.
int32_t sample_peaked_nucleus(const float* x, float m, float floor, const CandidateParams& p, double total,
                              CandidateScratch& s) {
  std::vector<int32_t>& found = s.set;  // at_least_kth_block's, for kNucleusCandidates
  float *y = s.y(), *q = s.q();
  for (const int32_t i : found) {
    y[i] = (x[i] - m) * p.scale;
    q[i] = y[i] >= floor ? std::exp2(y[i]) : 0.0f;
  }
  const RowView r{x, y, q};
  std::sort(found.begin(), found.end(), Descending{&r});
  const double cut = p.top_p * total;
  double kept = 0.0;
  size_t end = 0;
  while (end < found.size() && kept < cut) kept += q[found[end++]];
  if (kept < cut) return -1;
  const double target = p.u * kept;
  double running = 0.0;
  for (size_t j = 0; j < end; ++j) {
    running += q[found[j]];
    if (running >= target && q[found[j]] > 0.0f) return found[j];
  }
  return found.front();
}

// top_p rows without top_k (s.set: at_least_kth_block's values for kNucleusCandidates): the nucleus's end and
// the token, from those values or by the histograms.
int32_t sample_nucleus(const KernelTable& kernels, const float* x, int64_t V, float m, float floor,
                       const CandidateParams& p, CandidateScratch& s) {
  if (p.top_p < 1.0f) {
    const double total = kernels.candidate_masses(x, V, m, p.scale, floor, 0.0f, nullptr, nullptr, nullptr, nullptr);
    const int32_t token = sample_peaked_nucleus(x, m, floor, p, total, s);
    if (token >= 0) return token;
  }
  double masses[kSelectBuckets];
  const float inv = floor < 0.0f ? kSelectBuckets / -floor : 0.0f;
  const double total = kernels.candidate_masses(x, V, m, p.scale, floor, inv, s.y(), s.q(), s.bucket(), masses);
  const RowView r{x, s.y(), s.q()};
  double kept = total;
  if (p.top_p < 1.0f) {
    const Found end = find_in_row(kernels, r, V, s.bucket(), masses, p.top_p * total, s);
    kept = end.before + r.q[end.index];
  }
  return find_in_row(kernels, r, V, s.bucket(), masses, p.u * kept, s).index;
}

}  // namespace

void CandidateScratch::reserve(int64_t V) {
  if (V <= capacity_) return;
  y_.reset(new float[V]);
  q_.reset(new float[V]);
  bucket_.reset(new uint16_t[V]);
  gather_.reset(new int32_t[V]);
  capacity_ = V;
}

CandidateScratch& thread_scratch(int64_t V) {
  thread_local CandidateScratch scratch;
  scratch.reserve(V);
  return scratch;
}

// The index of the row's largest number (the reference's order puts NaN last; the first on ties) and the
// number, in m; -1 for a row of NaN.
int64_t largest_number(const KernelTable& kernels, const float* x, int64_t V, float& m) {
  const ArgmaxPart best = kernels.argmax_range(x, 0, V);
  m = best.value;
  if (best.first_nan < 0) return best.index;
  int64_t mode = -1;
  for (int64_t i = 0; i < V; ++i)
    if (x[i] == x[i] && (mode < 0 || x[i] > m)) m = x[i], mode = i;
  return mode;
}

int32_t sample_candidate_row(const KernelTable& kernels, const float* x, int64_t V, const CandidateParams& p,
                             CandidateScratch& s) {
  const float floor = std::max(p.log2_min_p, -126.0f);
  float m = at_least_kth_block(kernels, x, V, p.top_k > 0 ? p.top_k : std::min(V, kNucleusCandidates), s, s.set);
  if (m - m == 0.0f)
    return p.top_k > 0 ? sample_top_k(x, V, m, floor, p, s) : sample_nucleus(kernels, x, V, m, floor, p, s);
  const int64_t mode = largest_number(kernels, x, V, m);  // +inf or no number: the reference's top candidate
  return mode < 0 ? 0 : static_cast<int32_t>(mode);
}

void top_ids_row(const KernelTable& kernels, const float* x, int64_t V, int n, int32_t* ids, CandidateScratch& s) {
  std::vector<int32_t>& found = s.set;
  at_least_kth_block(kernels, x, V, n, s, found);
  const size_t take = std::min<size_t>(found.size(), n);
  std::partial_sort(found.begin(), found.begin() + take, found.end(),
                    [x](int32_t a, int32_t b) { return x[a] != x[b] ? x[a] > x[b] : a < b; });
  std::copy(found.begin(), found.begin() + take, ids);
  int64_t k = static_cast<int64_t>(take);  // fewer than n numbers: the NaNs follow, first index first
  for (int64_t i = 0; k < n && i < V; ++i)
    if (x[i] != x[i]) ids[k++] = static_cast<int32_t>(i);
}

}  // namespace metrale
