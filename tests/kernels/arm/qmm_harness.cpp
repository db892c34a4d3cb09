// Standalone check of the quantized-matmul kernels of every kernel set this CPU runs, without MLX:
// linked with kernels/csrc/isa.cpp and isa_kernels.cpp compiled once per set (tests/kernels/test_arm_qmm.py
// builds it for aarch64, run under qemu-aarch64, and for the x86-64 host).
//
// For each set and case (bits 4/8, float16/float32 scales, int8/int16 activations, groups 32/64/128, 1..9
// tokens, 40 rows: the last panel padded), on random weights packed here from q (N, K) by the layout of
// kernel_table.h:
//   - qmm_quantize against a reference of its arithmetic (X, hi/lo, d, sum X exactly; xsum within 1e-6),
//   - the GLU epilogue (silu, gelu_tanh) of a (gate, up) panel pair within 1e-5 of its definition,
//   - qmm_panels (called in two pieces over panels and tokens) against a reference computed from the
//     unpacked q (N, K) and the quantized activations: exact integer block sums, then the float epilogue
//     of the AVX-512 tile (fma(float(ia), s * d, acc) per block, fma(bias, xsum, acc) per group). Every
//     set but scalar must match it bit for bit; scalar (plain loops, the compiler decides on fusing)
//     within 1e-6 of sum |terms|.
// Prints `isas <names>` (the sets this CPU runs, best last; also alone with --isas), one line
// `case <set> <case> <digest> <digest>` per case (FNV-1a of the quantized activations, then also of the
// plain and GLU outputs: equal digests
// across sets and machines mean equal bits), and exits 1 after `FAIL ...` lines on any mismatch.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "isa.h"
#include "kernel_table.h"

namespace {

using metrale::kActBlock;
using metrale::kPanelRows;
using metrale::kWideMax;

struct Rng {  // splitmix64: the same numbers on every machine
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  int below(int n) { return static_cast<int>(next() % static_cast<uint64_t>(n)); }
  float uniform() { return static_cast<float>(next() >> 40) / static_cast<float>(1 << 24); }  // [0, 1)
};

// A random float16 with |v| in [2^-6, 2^2) (exact in float32), as its bits and its value.
uint16_t random_f16(Rng& rng, float* value) {
  const int exp = 9 + rng.below(8), man = rng.below(1024), sign = rng.below(2);
  *value = (sign ? -1.0f : 1.0f) * std::ldexp(1.0f + man / 1024.0f, exp - 15);
  return static_cast<uint16_t>(sign << 15 | exp << 10 | man);
}

struct Case {
  int bits, group_size, tokens;
  bool f16;
  int act;  // activation bits: 8, 12 or 16
  std::string name() const {
    return "b" + std::to_string(bits) + (f16 ? "_f16" : "_f32") + "_g" + std::to_string(group_size) + "_x" +
           std::to_string(act) + "_t" + std::to_string(tokens);
  }
};

constexpr int kRows = 40, kK = 256;

struct Weights {  // the unpacked values and the packed copy
  std::vector<int> q;                // (N, K)
  std::vector<float> scale, bias;    // (N, K / group)
  std::vector<uint8_t> packed;       // (P, 16 K bits / 8)
  std::vector<uint16_t> s16, b16;    // (P, K / group, 16) float16 bits
  std::vector<float> s32, b32;       // the same as float32
  int64_t panels;
};

Weights make_weights(const Case& c, Rng& rng) {
  Weights w;
  const int groups = kK / c.group_size;
  w.panels = (kRows + kPanelRows - 1) / kPanelRows;
  w.q.resize(kRows * kK);
  for (int& v : w.q) v = rng.below(1 << c.bits);
  w.scale.assign(w.panels * kPanelRows * groups, 0.0f);
  w.bias = w.scale;
  w.s16.assign(w.scale.size(), 0);
  w.b16 = w.s16;
  w.s32 = w.b32 = w.scale;
  for (int n = 0; n < kRows; ++n)
    for (int g = 0; g < groups; ++g) {
      const int64_t at = (n / kPanelRows * groups + g) * kPanelRows + n % kPanelRows;
      w.s16[at] = random_f16(rng, &w.scale[n * groups + g]);
      w.b16[at] = random_f16(rng, &w.bias[n * groups + g]);
      w.s32[at] = w.scale[n * groups + g];
      w.b32[at] = w.bias[n * groups + g];
    }
  const int64_t panel_bytes = int64_t{kPanelRows} * kK * c.bits / 8;
  w.packed.assign(w.panels * panel_bytes, 0);
  const int per_chunk = c.bits == 4 ? 8 : 4;  // k per 64-byte chunk
  for (int n = 0; n < kRows; ++n)
    for (int k = 0; k < kK; ++k) {
      const int chunk = k / per_chunk, j = k % per_chunk, r = n % kPanelRows;
      uint8_t& byte = w.packed[n / kPanelRows * panel_bytes + chunk * 64 + 4 * r + j % 4];
      byte |= static_cast<uint8_t>(c.bits == 8 ? w.q[n * kK + k] : w.q[n * kK + k] << (j < 4 ? 0 : 4));
    }
  return w;
}

struct Acts {
  std::vector<int8_t> xq;
  std::vector<float> xd, xsum;
  std::vector<int32_t> xisum;
  metrale::QmmActs view(const Case& c) {
    return {xq.data(), xd.data(), xsum.data(), xisum.data(), c.tokens, kK, c.group_size, c.act};
  }
  // X of token t at k, from its plane(s) (kernel_table.h: act_at)
  int value(const Case& c, int t, int k) const {
    const int64_t at = metrale::act_at(t, k / kActBlock, kK, c.act) + k % kActBlock;
    return metrale::act_two_planes(c.act) ? metrale::act_hi_weight(c.act) * xq[at] + xq[at + kActBlock] : xq[at];
  }
  // the planes of X (t, k) within their documented ranges
  bool planes_in_range(const Case& c, int t, int k) const {
    const int64_t at = metrale::act_at(t, k / kActBlock, kK, c.act) + k % kActBlock;
    if (c.act == 16) return std::abs(xq[at]) <= 127 && std::abs(xq[at + kActBlock]) <= 127;
    if (c.act == 12) return std::abs(xq[at]) <= 127 && xq[at + kActBlock] >= 0 && xq[at + kActBlock] <= 15;
    return true;
  }
};

std::vector<float> make_x(const Case& c, Rng& rng) {
  std::vector<float> x(c.tokens * kK);
  for (int t = 0; t < c.tokens; ++t)
    for (int b = 0; b < kK / kActBlock; ++b) {
      const float range = (t + b) % 7 == 3 ? 0.0f : std::ldexp(1.0f, rng.below(12) - 6);  // some blocks all zero
      for (int i = 0; i < kActBlock; ++i) x[t * kK + b * kActBlock + i] = range * (2.0f * rng.uniform() - 1.0f);
    }
  return x;
}

int failures = 0;

void fail(const std::string& where, const std::string& what) {
  ++failures;
  std::printf("FAIL %s: %s\n", where.c_str(), what.c_str());
}

// The quantized activations against their definition (kernel_table.h: QmmActs).
void check_quantize(const std::string& where, const Case& c, const std::vector<float>& x, const Acts& a) {
  const int blocks = kK / kActBlock, per_group = c.group_size / kActBlock;
  const float top = c.act == 16 ? static_cast<float>(kWideMax) : c.act == 12 ? static_cast<float>(metrale::kMidMax)
                                                                             : 127.0f;
  for (int t = 0; t < c.tokens; ++t) {
    double gsum = 0.0, gabs = 0.0;
    for (int b = 0; b < blocks; ++b) {
      float m = 0.0f;
      for (int i = 0; i < kActBlock; ++i) m = std::fmax(m, std::fabs(x[t * kK + b * kActBlock + i]));
      const float d = m / top, id = m > 0.0f ? top / m : 0.0f;
      int32_t sum = 0;
      for (int i = 0; i < kActBlock; ++i) {
        const int64_t at = t * kK + b * kActBlock + i;
        const float product = x[at] * id;
        const int X = static_cast<int>(std::nearbyint(product));
        const int got = a.value(c, t, b * kActBlock + i);
        if (got != X || !a.planes_in_range(c, t, b * kActBlock + i)) {
          fail(where, "quantized x[" + std::to_string(t) + "][" + std::to_string(b * kActBlock + i) + "] " +
                          std::to_string(got) + ", expected " + std::to_string(X));
          return;
        }
        sum += X;
      }
      if (a.xd[t * blocks + b] != d || a.xisum[t * blocks + b] != sum) {
        fail(where, "block d or sum X of token " + std::to_string(t) + " block " + std::to_string(b));
        return;
      }
      gsum += static_cast<double>(d) * sum;
      gabs += std::fabs(static_cast<double>(d) * sum);
      if ((b + 1) % per_group == 0) {
        const double got = a.xsum[t * (kK / c.group_size) + b / per_group];
        if (std::fabs(got - gsum) > 1e-6 * gabs + 1e-30) fail(where, "xsum of token " + std::to_string(t));
        gsum = gabs = 0.0;
      }
    }
  }
}

// y[t][n] computed as the AVX-512 tile does, from the unpacked weights and the kernel's activations.
std::vector<float> reference(const Case& c, const Weights& w, const Acts& a, std::vector<double>* magnitude) {
  const int blocks = kK / kActBlock, groups = kK / c.group_size, per_group = c.group_size / kActBlock;
  std::vector<float> y(c.tokens * kRows);
  magnitude->assign(y.size(), 0.0);
  for (int t = 0; t < c.tokens; ++t)
    for (int n = 0; n < kRows; ++n) {
      float acc = 0.0f;
      double mag = 0.0;
      for (int g = 0; g < groups; ++g) {
        const float s = w.scale[n * groups + g], m = w.bias[n * groups + g];
        for (int bb = 0; bb < per_group; ++bb) {
          const int blk = g * per_group + bb;
          int64_t ia = 0;
          for (int i = 0; i < kActBlock; ++i)
            ia += static_cast<int64_t>(w.q[n * kK + blk * kActBlock + i]) * a.value(c, t, blk * kActBlock + i);
          const float sd = s * a.xd[t * blocks + blk];
          acc = std::fma(static_cast<float>(ia), sd, acc);
          mag += std::fabs(static_cast<double>(ia) * sd);
        }
        acc = std::fma(m, a.xsum[t * groups + g], acc);
        mag += std::fabs(static_cast<double>(m) * a.xsum[t * groups + g]);
      }
      y[t * kRows + n] = acc;
      (*magnitude)[t * kRows + n] = mag;
    }
  return y;
}

// The GLU epilogue: panels 0 and 1 as one (gate, up) pair, 16 columns of act(gate) * up, for silu and
// gelu_tanh, against act computed in double from this set's own plain outputs y (rows 0..15 and 16..31;
// the weights' range makes some gates < -88, where sigmoid8 is 0 by design).
// Returns both results (silu's then gelu's) for the digest.
std::vector<float> check_glu(const std::string& where, const Case& c, const metrale::KernelTable& table,
                             const metrale::QmmWeights& qw, const metrale::QmmActs& acts, const std::vector<float>& y) {
  std::vector<float> both;
  for (auto kind : {metrale::GatedKind::silu, metrale::GatedKind::gelu_tanh}) {
    std::vector<float> out(c.tokens * kPanelRows);
    table.qmm_panels(qw, acts, metrale::QmmOut{out.data(), kPanelRows, 0, kPanelRows, static_cast<int>(kind)}, 0, 1,
                     0, c.tokens);
    for (int t = 0; t < c.tokens; ++t)
      for (int r = 0; r < kPanelRows; ++r) {
        const double g = y[t * kRows + r], u = y[t * kRows + kPanelRows + r];
        const double z = kind == metrale::GatedKind::silu ? g : 2.0 * 0.7978845608028654 * (g + 0.044715 * g * g * g);
        const double sigmoid = z < -88.0 ? 0.0 : 1.0 / (1.0 + std::exp(-z));  // vecmath.h: 0 below -88
        const double expected = g * sigmoid * u, got = out[t * kPanelRows + r];
        if (!(std::fabs(got - expected) <= 1e-5 * std::fabs(expected) + 1e-37)) {
          char text[160];
          std::snprintf(text, sizeof(text), "GLU %d at token %d row %d: %.9g, expected %.9g (g %.9g u %.9g)",
                        static_cast<int>(kind), t, r, got, expected, g, u);
          fail(where, text);
          return both;
        }
      }
    both.insert(both.end(), out.begin(), out.end());
  }
  return both;
}

uint64_t fnv1a(uint64_t h, const void* data, size_t bytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

void run_case(const std::string& isa, const Case& c, int index) {
  const std::string where = isa + " " + c.name();
  const metrale::KernelTable& table = metrale::cpu_kernels();
  Rng rng{0x5eedull * 1000003ull + static_cast<uint64_t>(index)};
  const Weights w = make_weights(c, rng);
  const std::vector<float> x = make_x(c, rng);
  const int blocks = kK / kActBlock;
  Acts a{std::vector<int8_t>(c.tokens * metrale::act_row_bytes(kK, c.act)),
         std::vector<float>(c.tokens * blocks), std::vector<float>(c.tokens * (kK / c.group_size)),
         std::vector<int32_t>(c.tokens * blocks)};
  const metrale::QmmActs acts = a.view(c);
  table.qmm_quantize(x.data(), acts, 0, c.tokens);
  check_quantize(where, c, x, a);

  const metrale::QmmWeights qw{w.packed.data(), c.f16 ? static_cast<const void*>(w.s16.data()) : w.s32.data(),
                               c.f16 ? static_cast<const void*>(w.b16.data()) : w.b32.data(), w.panels, kK,
                               c.bits, c.group_size, c.f16};
  std::vector<float> y(c.tokens * kRows, -1.0f);
  const metrale::QmmOut out{y.data(), kRows, 0, kRows, -1};
  const int64_t t_split = c.tokens / 2;  // two calls each way: offsets into panels and tokens
  table.qmm_panels(qw, acts, out, 0, 1, 0, c.tokens);
  table.qmm_panels(qw, acts, out, 1, w.panels, 0, t_split);
  table.qmm_panels(qw, acts, out, 1, w.panels, t_split, c.tokens);

  std::vector<double> magnitude;
  const std::vector<float> expected = reference(c, w, a, &magnitude);
  const bool exact = isa != "scalar";
  for (size_t i = 0; i < y.size(); ++i) {
    const bool ok = exact ? std::memcmp(&y[i], &expected[i], sizeof(float)) == 0
                          : std::fabs(static_cast<double>(y[i]) - expected[i]) <= 1e-6 * magnitude[i];
    if (!ok) {
      char text[160];
      std::snprintf(text, sizeof(text), "y[%zu][%zu] = %.9g, expected %.9g (%s)", i / kRows, i % kRows, y[i],
                    expected[i], exact ? "bit for bit" : "within 1e-6 of the terms");
      fail(where, text);
      break;
    }
  }
  const std::vector<float> gated = check_glu(where, c, table, qw, acts, y);

  uint64_t h = 0xcbf29ce484222325ull;
  h = fnv1a(h, a.xq.data(), a.xq.size());
  h = fnv1a(h, a.xd.data(), a.xd.size() * sizeof(float));
  h = fnv1a(h, a.xsum.data(), a.xsum.size() * sizeof(float));
  h = fnv1a(h, a.xisum.data(), a.xisum.size() * sizeof(int32_t));
  const uint64_t hq = h;
  h = fnv1a(h, y.data(), y.size() * sizeof(float));
  h = fnv1a(h, gated.data(), gated.size() * sizeof(float));
  std::printf("case %s %s %016llx %016llx\n", isa.c_str(), c.name().c_str(), static_cast<unsigned long long>(hq),
              static_cast<unsigned long long>(h));
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> isas = metrale::supported_isas();
  std::string names;
  for (const auto& name : isas) names += " " + name;
  std::printf("isas%s\nbest %s\n", names.c_str(), metrale::cpu_kernels().isa);
  if (argc > 1 && std::string(argv[1]) == "--isas") return 0;
  for (const auto& isa : isas) {
    metrale::set_cpu_isa(isa);
    int index = 0;
    for (int bits : {4, 8})
      for (bool f16 : {true, false})
        for (int act : {8, 12, 16})
          for (int group : {32, 64, 128})
            for (int tokens : {1, 2, 4, 5, 9}) run_case(isa, Case{bits, group, tokens, f16, act}, index++);
  }
  std::printf("failures %d\n", failures);
  return failures == 0 ? 0 : 1;
}
