// The KvWrite primitive: a pool updated in place (its donated buffer), one memcpy per new row.
#include "kv_write.h"

#include <cstring>
#include <sstream>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "row_major.h"

namespace metrale {

namespace {

std::string describe(const mx::array& a) {
  std::ostringstream os;
  os << a.shape() << " " << a.dtype();
  return os.str();
}

}  // namespace

mx::array kv_write(const mx::array& pool, const mx::array& rows, const mx::array& slots) {
  const bool ok = pool.ndim() == 3 && rows.ndim() == 3 && rows.shape(1) == pool.shape(1) &&
                  rows.shape(2) == pool.shape(2) && rows.dtype() == pool.dtype() && slots.ndim() == 1 &&
                  slots.shape(0) == rows.shape(0) && slots.dtype() == mx::int32;
  if (!ok)
    throw std::invalid_argument("kv_write: pool (S, H, D), rows (T, H, D) of the pool's dtype and slots (T,) int32, "
                                "got " + describe(pool) + ", " + describe(rows) + ", " + describe(slots));
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
  const int64_t num_slots = pool.shape(0), tokens = inputs[1].shape(0);
  const int64_t row_bytes = static_cast<int64_t>(pool.shape(1)) * pool.shape(2) * pool.itemsize();
  encoder.dispatch([=, o = out.data<char>(), pool_bytes = static_cast<size_t>(out.nbytes())] {
    if (copy) std::memcpy(o, old.data<char>(), pool_bytes);
    const char* r = rin.data<char>();
    const int32_t* sp = sin_.data<int32_t>();
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t slot = sp[t];
      if (slot >= 0 && slot < num_slots) std::memcpy(o + slot * row_bytes, r + t * row_bytes, row_bytes);
    }
  });
}

void KvWrite::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("kv_write: CPU only; GPU streams use indexed assignment");
}

}  // namespace metrale
