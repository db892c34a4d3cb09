// The KvWrite primitive: a pool updated in place (its donated buffer), one memcpy per new row, float32 rows
// rounded into a float16 / bfloat16 pool as they are written (no AsType node before it), or one quantized
// row per (token, kv head) for q8 pools.
#include "kv_write.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/types/half_types.h"
#include "isa.h"
#include "row_major.h"

namespace metrale {

namespace {

std::string describe(const mx::array& a) {
  std::ostringstream os;
  os << a.shape() << " " << a.dtype();
  return os.str();
}

// x (hd,) float32 -> out: hd int8 values, then hd / group float16 scales (little-endian bits). Branch-free
// per value, so the compiler vectorizes it in the baseline build: q = x * (1 / d) clamped to +-127, then
// rounded half to even by adding and subtracting 1.5 * 2^23 (exact for |q| < 2^22, as nearbyint, no libm);
// a NaN becomes 0.
void quantize_q8_row(const float* x, int hd, int group, int8_t* out) {
  constexpr float kMagic = 12582912.0f;
  for (int g0 = 0, k = 0; g0 < hd; g0 += group, ++k) {
    float amax = 0.0f;
    for (int i = g0; i < g0 + group; ++i) {
      const float a = std::fabs(x[i]);
      amax = a > amax ? a : amax;
    }
    const mx::float16_t d16 = static_cast<mx::float16_t>(amax / 127.0f);
    const float d = static_cast<float>(d16);
    const float inv = d > 0.0f ? 1.0f / d : 0.0f;
    for (int i = g0; i < g0 + group; ++i) {
      float q = x[i] * inv;
      q = q > 127.0f ? 127.0f : q;
      q = q < -127.0f ? -127.0f : q;
      q = q == q ? q : 0.0f;
      out[i] = static_cast<int8_t>(static_cast<int>((q + kMagic) - kMagic));
    }
    std::memcpy(out + hd + 2 * k, &d16, 2);
  }
}

}  // namespace

int q8_group(int head_dim, int row_bytes) {
  const int extra = row_bytes - head_dim;
  if (head_dim < 8 || extra < 2 || extra % 2 != 0 || head_dim % (extra / 2) != 0) return 0;
  const int group = head_dim / (extra / 2);
  return group % 8 == 0 ? group : 0;
}

mx::array kv_write(const mx::array& pool, const mx::array& rows, const mx::array& slots) {
  const bool q8 = pool.dtype() == mx::int8;
  const bool shapes = pool.ndim() == 4 && rows.ndim() == 3 && rows.shape(1) == pool.shape(1) && slots.ndim() == 1 &&
                      slots.shape(0) == rows.shape(0) && slots.dtype() == mx::int32;
  const bool rounds = (pool.dtype() == mx::float16 || pool.dtype() == mx::bfloat16) && rows.dtype() == mx::float32;
  const bool ok = shapes && (q8 ? rows.dtype() == mx::float32 && q8_group(rows.shape(2), pool.shape(3)) > 0
                                : rows.shape(2) == pool.shape(3) && (rows.dtype() == pool.dtype() || rounds));
  if (!ok)
    throw std::invalid_argument("kv_write: pool (N, H, B, D) (blocks, kv heads, block size, row), rows (T, H, D) of "
                                "the pool's dtype (or float32 into a float16 / bfloat16 pool) and slots (T,) int32 "
                                "(an int8 q8 pool: (N, H, B, D + 2 D / group), float32 rows (T, H, D)), got " +
                                describe(pool) + ", " + describe(rows) + ", " + describe(slots));
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(pool.shape(), pool.dtype(), std::make_shared<KvWrite>(s), {pool, rows, slots});
}

void KvWrite::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& pool = inputs[0];
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  const bool copy = !(pool.is_donatable() && pool.flags().row_contiguous);
  if (copy) {
    out.set_data(mx::allocator::malloc(out.nbytes()));  // someone still reads the old pool: copy it
  } else {
    out.copy_shared_buffer(pool);
  }
  encoder.set_output_array(out);
  const RowMajor old(copy ? pool : mx::array(0), encoder), rin(inputs[1], encoder), sin_(inputs[2], encoder);
  const int heads = pool.shape(1), bs = pool.shape(2), kv_row = pool.shape(3), hd = inputs[1].shape(2);
  const int64_t num_slots = static_cast<int64_t>(pool.shape(0)) * bs, tokens = inputs[1].shape(0);
  const int64_t item = pool.itemsize(), row_bytes = kv_row * item;  // one (kv head, slot) row
  const int64_t in_row_bytes = static_cast<int64_t>(hd) * inputs[1].itemsize();
  const int group = pool.dtype() == mx::int8 ? q8_group(hd, kv_row) : 0;
  // float32 rows into a 16-bit pool: each row rounded as it is written
  const bool rounds = group == 0 && inputs[1].dtype() != pool.dtype();
  const Dtype pool_dtype = pool.dtype() == mx::float16 ? Dtype::float16 : Dtype::bfloat16;
  encoder.dispatch([=, o = out.data<char>(), pool_bytes = static_cast<size_t>(out.nbytes())] {
    const auto& kernels = cpu_kernels();
    if (copy) std::memcpy(o, old.data<char>(), pool_bytes);
    const int32_t* sp = sin_.data<int32_t>();
    const char* r = rin.data<char>();  // (T, H, D) of the pool's dtype, or float32 (q8 and rounded rows)
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t slot = sp[t];
      if (slot < 0 || slot >= num_slots) continue;
      const int64_t block = slot / bs;
      const int in_block = static_cast<int>(slot % bs);
      for (int h = 0; h < heads; ++h) {
        char* dst = o + kv_row_offset(block, h, in_block, heads, bs, kv_row) * item;
        const char* src = r + (t * heads + h) * in_row_bytes;
        if (group > 0) {
          quantize_q8_row(reinterpret_cast<const float*>(src), hd, group, reinterpret_cast<int8_t*>(dst));
        } else if (rounds) {
          kernels.store_floats(reinterpret_cast<const float*>(src), pool_dtype, dst, hd);
        } else {
          std::memcpy(dst, src, row_bytes);
        }
      }
    }
  });
}

void KvWrite::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("kv_write: CPU only; GPU streams use indexed assignment");
}

}  // namespace metrale
