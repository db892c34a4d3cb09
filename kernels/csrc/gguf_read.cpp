// GGUF tensors read block by block into their MLX arrays (see gguf_read.h).
#include "gguf_read.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/types/half_types.h"

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
  }
  ~File() { ::close(fd_); }
  File(const File&) = delete;
  File& operator=(const File&) = delete;

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
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<uint8_t>((q[2 * i] & 0x0F) | (q[2 * i + 1] << 4));
    out[8 + i] = static_cast<uint8_t>((q[2 * i] >> 4) | (q[2 * i + 1] & 0xF0));
  }
}

struct Format {
  int values;  // per block
  int bytes;   // per block
  int bits;
};

Format quantized_format(int type) {
  switch (type) {
    case kQ4_0: return {32, 18, 4};
    case kQ4_1: return {32, 20, 4};
    case kQ8_0: return {32, 34, 8};
    default: fail("ggml type " + std::to_string(type) + " is not read here");
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

}  // namespace

std::vector<mx::array> read_gguf_tensor(const std::string& path, int64_t position, int ggml_type,
                                        const std::vector<int64_t>& shape) {
  if (shape.empty()) fail("a tensor needs at least one dimension");
  if (position < 0) fail("negative position");
  const mx::Shape full = to_shape(shape);
  const File file(path);
  mx::Dtype plain = mx::float32;
  switch (ggml_type) {
    case kF32: plain = mx::float32; break;
    case kF16: plain = mx::float16; break;
    case kI8: plain = mx::int8; break;
    case kI16: plain = mx::int16; break;
    case kI32: plain = mx::int32; break;
    default: {
      const Format f = quantized_format(ggml_type);
      const int64_t last = shape.back();
      if (last % f.values) fail("a row of " + std::to_string(last) + " values is not whole blocks of " +
                                std::to_string(f.values));
      int64_t rows = 1;
      for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
      const int64_t blocks = rows * (last / f.values);
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
          convert_block(ggml_type, buffer.data() + i * f.bytes, q + block * packed_per_block,
                        s + block * groups_per_block, b + block * groups_per_block);
        }
      }
      return {packed, scales, biases};
    }
  }
  mx::array out = allocated(full, plain);
  file.read(position, out.data<void>(), static_cast<int64_t>(out.nbytes()));
  return {out};
}

}  // namespace metrale
