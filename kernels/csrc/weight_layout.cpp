// The packed weights' memory: the panel layout written once at load, on 2 MiB pages where allowed.
#include "weight_layout.h"

#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "kernel_table.h"
#include "mlx/allocator.h"
#include "mlx/ops.h"
#include "mlx/transforms.h"
#include "parallel.h"
#include "qmm_common.h"

namespace metrale {

namespace {

constexpr int64_t kHugePage = int64_t{2} << 20;
#if defined(MADV_COLLAPSE)
constexpr int kMadvCollapse = MADV_COLLAPSE;
#else
constexpr int kMadvCollapse = 25;  // Linux 6.1's value; older kernels answer EINVAL
#endif

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument("pack_panels: " + msg); }

mx::Stream cpu_stream() { return mx::default_stream(mx::Device::cpu); }

// "always" or "madvise" in /sys/kernel/mm/transparent_hugepage/enabled (the bracketed choice).
bool transparent_huge_pages_allowed() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string text;
  std::getline(in, text);
  return text.find("[always]") != std::string::npos || text.find("[madvise]") != std::string::npos;
}

// A fresh, not yet written, row-contiguous array of `shape` and `dtype`. With huge_pages, where THP
// allows and the array is 2 MiB or more, its bytes start at a 2 MiB boundary of a larger buffer whose
// whole 2 MiB pages are advised MADV_HUGEPAGE before anything touches them. Write through data(),
// then call collapse().
class Placed {
 public:
  Placed(const mx::Shape& shape, mx::Dtype dtype, bool huge_pages) : array_(mx::array(0)) {
    int64_t count = 1;
    for (int d : shape) count *= d;
    bytes_ = count * static_cast<int64_t>(mx::size_of(dtype));
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (huge_pages && applies(bytes_)) {
      const int64_t total = bytes_ + kHugePage;  // room to start at a 2 MiB boundary
      // fresh memory from MLX's allocator (malloc) is untouched past its header: the advice is in place
      // before the first write faults the pages in
      mx::array buffer(mx::allocator::malloc(static_cast<size_t>(total)), mx::Shape{static_cast<int32_t>(total)},
                       mx::uint8);
      auto* base = buffer.data<uint8_t>();
      const auto address = reinterpret_cast<uintptr_t>(base);
      const int64_t offset = static_cast<int64_t>((kHugePage - address % kHugePage) % kHugePage);
      // whole 2 MiB pages only: advising the tail would fault in a whole huge page past the end
      if (madvise(base + offset, static_cast<size_t>(bytes_ / kHugePage * kHugePage), MADV_HUGEPAGE) == 0) {
        auto s = cpu_stream();
        mx::array out = mx::slice(buffer, {static_cast<int32_t>(offset)},
                                  {static_cast<int32_t>(offset + bytes_)}, s);
        array_ = mx::reshape(mx::view(out, dtype, s), shape, s);  // shares the buffer (no copy)
        mx::eval({array_});
        data_ = base + offset;
        advised_ = true;
        return;
      }
    }
#endif
    array_ = mx::array(mx::allocator::malloc(static_cast<size_t>(bytes_)), shape, dtype);
    data_ = array_.data<uint8_t>();
  }

  // True where THP allows advice and `bytes` is at least one huge page (and its buffer fits MLX's 1-D shape).
  static bool applies(int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    static const bool allowed = transparent_huge_pages_allowed();
    return allowed && bytes >= kHugePage && bytes + kHugePage <= std::numeric_limits<int32_t>::max();
#else
    return false;
#endif
  }

  uint8_t* data() const { return data_; }
  int64_t bytes() const { return bytes_; }
  bool advised() const { return advised_; }

  // Pages faulted in before the advice (malloc may hand back memory freed earlier: glibc raises its mmap
  // threshold as big blocks are freed) collapsed into huge pages (Linux >= 6.1; best effort like the advice
  // itself: where it fails the pages stay small, the values are the same). Returns the array.
  mx::array collapse() const {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (advised_) madvise(data_, static_cast<size_t>(bytes_ / kHugePage * kHugePage), kMadvCollapse);
#endif
    return array_;
  }

 private:
  mx::array array_;
  uint8_t* data_ = nullptr;
  int64_t bytes_ = 0;
  bool advised_ = false;
};

mx::array evaluated_contiguous(const mx::array& a) {
  mx::array out = a;
  mx::eval({out});  // (an array's flags are only known once it is evaluated)
  if (!out.flags().row_contiguous) {
    out = mx::contiguous(out, false, cpu_stream());
    mx::eval({out});
  }
  return out;
}

// Row n's K quantized values (MLX order: value i at bits i*b .. i*b + b - 1 of the row's little-endian
// bytes) into one panel row r of the layout: words of 4 values, word w of every row of the panel
// together (16 x 4 bytes). 4-bit: word w's byte j holds value 8w + j (low nibble) and 8w + 4 + j (high).
void pack_row(const uint8_t* src, int K, int bits, int r, uint8_t* panel) {
  if (bits == 8) {
    for (int w = 0; w < K / 4; ++w) std::memcpy(panel + (int64_t{w} * kPanelRows + r) * 4, src + int64_t{w} * 4, 4);
    return;
  }
  for (int w = 0; w < K / 8; ++w) {
    const uint8_t* b = src + int64_t{w} * 4;  // values 8w .. 8w + 7, two per byte
    uint8_t* out = panel + (int64_t{w} * kPanelRows + r) * 4;
    out[0] = low_nibbles(b[0], b[2]), out[1] = high_nibbles(b[0], b[2]);
    out[2] = low_nibbles(b[1], b[3]), out[3] = high_nibbles(b[1], b[3]);
  }
}

void zero_row(int K, int bits, int r, uint8_t* panel) {
  for (int w = 0; w < K * bits / 32; ++w) std::memset(panel + (int64_t{w} * kPanelRows + r) * 4, 0, 4);
}

}  // namespace

std::vector<mx::array> pack_panels(const std::vector<mx::array>& packed, const std::vector<mx::array>& scales,
                                   const std::vector<mx::array>& biases, int bits, int group_size, bool interleave,
                                   bool huge_pages) {
  if (bits != 4 && bits != 8) fail("bits must be 4 or 8, got " + std::to_string(bits));
  if (group_size != 32 && group_size != 64 && group_size != 128)
    fail("group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  const size_t layers = packed.size();
  if (layers == 0 || scales.size() != layers || biases.size() != layers)
    fail("packed, scales and biases need one entry per layer (at least one)");
  if (interleave && (layers != 2 || packed[0].shape() != packed[1].shape()))
    fail("interleave takes exactly two layers of one shape (gate, up)");
  const mx::Dtype scale_dtype = scales[0].dtype();
  if (scale_dtype != mx::float16 && scale_dtype != mx::float32) fail("scales must be float16 or float32");
  if (packed[0].ndim() != 2) fail("packed must be (N, K * bits / 32) uint32, got " + shape_str(packed[0]));
  const int K = packed[0].shape(1) * 32 / bits;
  if (K % group_size) fail("K = " + std::to_string(K) + " is not a multiple of group_size");
  const int groups = K / group_size;
  std::vector<int64_t> first_panel(layers);
  int64_t panels = 0;
  for (size_t l = 0; l < layers; ++l) {
    const mx::array &q = packed[l], &s = scales[l], &b = biases[l];
    if (q.ndim() != 2 || q.dtype() != mx::uint32 || q.shape(1) * 32 / bits != K)
      fail("packed[" + std::to_string(l) + "] must be (N, " + std::to_string(K * bits / 32) + ") uint32, got " +
           shape_str(q));
    if (q.shape(0) < 1) fail("packed[" + std::to_string(l) + "] has no rows");
    const mx::Shape scale_shape{q.shape(0), groups};
    if (s.shape() != scale_shape || b.shape() != scale_shape || s.dtype() != scale_dtype || b.dtype() != scale_dtype)
      fail("scales[" + std::to_string(l) + "] and biases must be (" + std::to_string(q.shape(0)) + ", " +
           std::to_string(groups) + ") of one float dtype for every layer, got " + shape_str(s) + " and " +
           shape_str(b));
    first_panel[l] = panels;
    panels += ceil_div(q.shape(0), kPanelRows);
  }
  if (panels > std::numeric_limits<int32_t>::max()) fail("too many panels");
  const int64_t panel_bytes = int64_t{kPanelRows} * K * bits / 8;
  const int64_t row_bytes = int64_t{K} * bits / 8;
  const int64_t scale_size = static_cast<int64_t>(mx::size_of(scale_dtype));
  Placed q_out({static_cast<int32_t>(panels), static_cast<int32_t>(panel_bytes)}, mx::uint8, huge_pages);
  Placed s_out({static_cast<int32_t>(panels), groups, kPanelRows}, scale_dtype, huge_pages);
  Placed b_out({static_cast<int32_t>(panels), groups, kPanelRows}, scale_dtype, huge_pages);

  std::vector<mx::array> sources;  // evaluated, row-contiguous: [q, s, b] per layer
  for (size_t l = 0; l < layers; ++l)
    for (const mx::array* a : {&packed[l], &scales[l], &biases[l]}) sources.push_back(evaluated_contiguous(*a));
  struct Task {
    int layer;
    int64_t panel;  // within the layer
    int64_t out;    // destination panel
  };
  std::vector<Task> tasks;
  for (size_t l = 0; l < layers; ++l)
    for (int64_t p = 0; p < ceil_div(packed[l].shape(0), kPanelRows); ++p)
      tasks.push_back({static_cast<int>(l), p, interleave ? 2 * p + static_cast<int64_t>(l) : first_panel[l] + p});
  if (tasks.size() > static_cast<size_t>(std::numeric_limits<int>::max())) fail("too many panels");
  parallel_for(static_cast<int>(tasks.size()), num_threads(), [&](int i, int) {
    const Task& t = tasks[i];
    const int64_t rows = packed[t.layer].shape(0);
    const auto* q = sources[3 * t.layer].data<uint8_t>();
    const auto* s = sources[3 * t.layer + 1].data<uint8_t>();
    const auto* b = sources[3 * t.layer + 2].data<uint8_t>();
    uint8_t* panel = q_out.data() + t.out * panel_bytes;
    uint8_t* ps = s_out.data() + t.out * groups * kPanelRows * scale_size;  // (K / g, 16)
    uint8_t* pb = b_out.data() + t.out * groups * kPanelRows * scale_size;
    for (int r = 0; r < kPanelRows; ++r) {
      const int64_t n = t.panel * kPanelRows + r;
      if (n < rows) {
        pack_row(q + n * row_bytes, K, bits, r, panel);
      } else {
        zero_row(K, bits, r, panel);
      }
      for (int g = 0; g < groups; ++g) {
        const int64_t at = (int64_t{g} * kPanelRows + r) * scale_size;
        if (n < rows) {
          std::memcpy(ps + at, s + (n * groups + g) * scale_size, scale_size);
          std::memcpy(pb + at, b + (n * groups + g) * scale_size, scale_size);
        } else {
          std::memset(ps + at, 0, scale_size);
          std::memset(pb + at, 0, scale_size);
        }
      }
    }
  });
  return {q_out.collapse(), s_out.collapse(), b_out.collapse()};
}

mx::array huge_page_copy(const mx::array& a) {
  const mx::array src = evaluated_contiguous(a);
  if (!Placed::applies(static_cast<int64_t>(src.nbytes()))) return src;
  const Placed out(src.shape(), src.dtype(), true);
  if (!out.advised()) return src;  // the advice refused
  std::memcpy(out.data(), src.data<uint8_t>(), static_cast<size_t>(out.bytes()));
  return out.collapse();
}

int64_t anon_huge_page_bytes() {
  std::ifstream in("/proc/self/smaps_rollup");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("AnonHugePages:", 0) == 0) return std::stoll(line.substr(14)) * 1024;  // "   N kB"
  }
  return -1;
}

}  // namespace metrale
