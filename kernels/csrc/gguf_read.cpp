// GGUF tensors read block by block into their MLX arrays (see gguf_read.h).
#include "gguf_read.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <optional>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/types/half_types.h"
#include "qmm_common.h"

namespace metrale {

namespace {

using mx::float16_t;

constexpr int kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kI8 = 24, kI16 = 25, kI32 = 26;
constexpr int64_t kReadBytes = int64_t{4} << 20;  // blocks read at a time

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument("read_gguf_tensor: " + msg); }

class File {
 public:
  explicit File(const std::string& path) : fd_(::open(path.c_str(), O_RDONLY | O_CLOEXEC)), path_(path) {
    if (fd_ < 0) fail("cannot open " + path + ": " + std::strerror(errno));
    struct stat st;
    if (::fstat(fd_, &st) != 0) {
      const int error = errno;
      ::close(fd_);
      fail(path + ": " + std::strerror(error));
    }
    size_ = static_cast<int64_t>(st.st_size);
  }
  ~File() { ::close(fd_); }
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  // Refuses a tensor that would run past the end, before anything is allocated for it (a header's dims are
  // the file's word: a damaged or hostile one may claim any size).
  void check_holds(int64_t position, int64_t bytes) const {
    if (bytes > size_ - position) fail(path_ + " ends inside a tensor: " + std::to_string(bytes) + " bytes at " +
                                       std::to_string(position) + ", the file has " + std::to_string(size_));
  }

  void read(int64_t position, void* out, int64_t bytes) const {
    auto* p = static_cast<char*>(out);
    while (bytes > 0) {
      const ssize_t n = ::pread(fd_, p, static_cast<size_t>(bytes), static_cast<off_t>(position));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail(path_ + ": " + std::strerror(errno));
      if (n == 0) fail(path_ + " ends inside a tensor");
      p += n, position += n, bytes -= n;
    }
  }

 private:
  int fd_;
  std::string path_;
  int64_t size_ = 0;
};

// The blocks of one read, mapped and unmapped outside malloc: freeing a 4 MiB malloc block per tensor would
// raise glibc's mmap threshold to 4 MiB, after which the arrays freed once the weights are repacked stay in
// the heap (measured: +0.3 GiB of RSS after loading the 1B shape).
class ReadBuffer {
 public:
  explicit ReadBuffer(int64_t bytes) : bytes_(static_cast<size_t>(bytes)) {
    void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) fail(std::string("cannot map a read buffer: ") + std::strerror(errno));
    data_ = static_cast<uint8_t*>(p);
  }
  ~ReadBuffer() { ::munmap(data_, bytes_); }
  ReadBuffer(const ReadBuffer&) = delete;
  ReadBuffer& operator=(const ReadBuffer&) = delete;
  uint8_t* data() const { return data_; }

 private:
  size_t bytes_;
  uint8_t* data_ = nullptr;
};

mx::Shape to_shape(const std::vector<int64_t>& dims) {
  mx::Shape shape;
  for (int64_t d : dims) {
    if (d < 1 || d > std::numeric_limits<int32_t>::max()) fail("every dimension must be in 1 .. 2^31 - 1");
    shape.push_back(static_cast<int32_t>(d));
  }
  return shape;
}

mx::array allocated(const mx::Shape& shape, mx::Dtype dtype) {
  size_t count = 1;
  for (int32_t d : shape) count *= static_cast<size_t>(d);
  return mx::array(mx::allocator::malloc(count * mx::size_of(dtype)), shape, dtype);
}

float16_t half_at(const uint8_t* p) {
  float16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

// ggml's 32 4-bit values (16 bytes: values 0-15 in the low nibbles, 16-31 in the high ones) -> MLX's packing
// (value 2i in byte i's low nibble, 2i + 1 in its high one).
void pack_block32(const uint8_t* q, uint8_t* out) {
  for (int i = 0; i < 8; ++i) out[i] = low_nibbles(q[2 * i], q[2 * i + 1]), out[8 + i] = high_nibbles(q[2 * i], q[2 * i + 1]);
}

// The quantized types read here: values and bytes per block, bits of the MLX triple.
struct Format {
  int values;
  int bytes;
  int bits;
};

std::optional<Format> quantized_format(int type) {
  switch (type) {
    case kQ4_0: return Format{32, 18, 4};
    case kQ4_1: return Format{32, 20, 4};
    case kQ8_0: return Format{32, 34, 8};
    default: return std::nullopt;
  }
}

std::optional<mx::Dtype> plain_dtype(int type) {
  switch (type) {
    case kF32: return mx::float32;
    case kF16: return mx::float16;
    case kI8: return mx::int8;
    case kI16: return mx::int16;
    case kI32: return mx::int32;
    default: return std::nullopt;
  }
}

// One block -> its packed bytes (values * bits / 8), scales and biases (values / 32 each), as MLX's loader.
void convert_block(int type, const uint8_t* b, uint8_t* packed, float16_t* scales, float16_t* biases) {
  switch (type) {
    case kQ4_0:
      scales[0] = half_at(b);
      biases[0] = -8 * scales[0];
      pack_block32(b + 2, packed);
      return;
    case kQ4_1:
      scales[0] = half_at(b);
      biases[0] = half_at(b + 2);
      pack_block32(b + 4, packed);
      return;
    case kQ8_0:
      scales[0] = half_at(b);
      biases[0] = -128 * scales[0];
      for (int j = 0; j < 32; ++j) packed[j] = static_cast<uint8_t>(b[2 + j] ^ 0x80);  // int8 + 128
      return;
    default: fail("ggml type " + std::to_string(type) + " is not read here");
  }
}

// The tensor's number of values; fails where it overflows int64 (a header may claim any dims).
int64_t element_count(const std::vector<int64_t>& shape) {
  int64_t count = 1;
  for (int64_t d : shape) {
    if (count > std::numeric_limits<int64_t>::max() / d) fail("the tensor's size overflows");
    count *= d;
  }
  return count;
}

std::vector<mx::array> read_quantized(const File& file, int64_t position, int type, const Format& f,
                                      const std::vector<int64_t>& shape, const mx::Shape& full) {
  const int64_t last = shape.back();
  if (last % f.values)
    fail("a row of " + std::to_string(last) + " values is not whole blocks of " + std::to_string(f.values));
  const int64_t blocks = element_count(shape) / f.values;
  if (blocks > std::numeric_limits<int64_t>::max() / f.bytes) fail("the tensor's size overflows");
  file.check_holds(position, blocks * f.bytes);
  mx::Shape packed_shape = full, group_shape = full;
  packed_shape.back() = static_cast<int32_t>(last * f.bits / 32);
  group_shape.back() = static_cast<int32_t>(last / 32);
  mx::array packed = allocated(packed_shape, mx::uint32);
  mx::array scales = allocated(group_shape, mx::float16), biases = allocated(group_shape, mx::float16);
  auto* q = packed.data<uint8_t>();
  auto* s = scales.data<float16_t>();
  auto* b = biases.data<float16_t>();
  const int64_t per_read = std::max<int64_t>(1, kReadBytes / f.bytes);
  const ReadBuffer buffer(std::min(blocks, per_read) * f.bytes);
  const int64_t packed_per_block = int64_t{f.values} * f.bits / 8, groups_per_block = f.values / 32;
  for (int64_t first = 0; first < blocks; first += per_read) {
    const int64_t count = std::min(per_read, blocks - first);
    file.read(position + first * f.bytes, buffer.data(), count * f.bytes);
    for (int64_t i = 0; i < count; ++i) {
      const int64_t block = first + i;
      convert_block(type, buffer.data() + i * f.bytes, q + block * packed_per_block, s + block * groups_per_block,
                    b + block * groups_per_block);
    }
  }
  return {packed, scales, biases};
}

}  // namespace

std::vector<mx::array> read_gguf_tensor(const std::string& path, int64_t position, int ggml_type,
                                        const std::vector<int64_t>& shape) {
  if (shape.empty()) fail("a tensor needs at least one dimension");
  if (position < 0) fail("negative position");
  const mx::Shape full = to_shape(shape);
  const File file(path);
  if (const auto format = quantized_format(ggml_type)) return read_quantized(file, position, ggml_type, *format, shape, full);
  const auto dtype = plain_dtype(ggml_type);
  if (!dtype) fail("ggml type " + std::to_string(ggml_type) + " is not read here");
  const int64_t count = element_count(shape), item = static_cast<int64_t>(mx::size_of(*dtype));
  if (count > std::numeric_limits<int64_t>::max() / item) fail("the tensor's size overflows");
  const int64_t bytes = count * item;
  file.check_holds(position, bytes);
  mx::array out = allocated(full, *dtype);
  file.read(position, out.data<void>(), bytes);
  return {out};
}

std::map<int, int> gguf_block_values() {
  std::map<int, int> values;
  for (int type : {kF32, kF16, kI8, kI16, kI32}) values[type] = 1;
  for (int type : {kQ4_0, kQ4_1, kQ8_0}) values[type] = quantized_format(type)->values;
  return values;
}

}  // namespace metrale
