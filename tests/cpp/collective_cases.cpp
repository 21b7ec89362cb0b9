#include "collective_cases.h"

#include <cmath>
#include <cstring>
#include <random>
#include <sstream>

#include "core/half.h"

namespace zerort::testing {

namespace {

const DType kAllDTypes[] = {DType::kFloat32, DType::kFloat64,  DType::kInt32,
                            DType::kInt64,   DType::kBFloat16, DType::kFloat16};
const ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin};

// Input element i of rank r: an integer in [-8, 8], exact in every dtype, as are sums of up
// to 16 of them (|sum| <= 128 < 2^8, bf16's significand).
double value(int rank, size_t i, int salt) {
  uint64_t h = (i + 1) * 0x9E3779B97F4A7C15ull ^ (static_cast<uint64_t>(rank) + 7) * 0xC2B2AE3D27D4EB4Full ^
               static_cast<uint64_t>(salt) * 0x165667B19E3779F9ull;
  h ^= h >> 29;
  return static_cast<double>(static_cast<int64_t>(h % 17) - 8);
}

void store(void* buf, DType dt, size_t i, double v) {
  switch (dt) {
    case DType::kFloat32: static_cast<float*>(buf)[i] = static_cast<float>(v); break;
    case DType::kFloat64: static_cast<double*>(buf)[i] = v; break;
    case DType::kInt32: static_cast<int32_t*>(buf)[i] = static_cast<int32_t>(v); break;
    case DType::kInt64: static_cast<int64_t*>(buf)[i] = static_cast<int64_t>(v); break;
    case DType::kBFloat16: static_cast<uint16_t*>(buf)[i] = f32_to_bf16(static_cast<float>(v)); break;
    case DType::kFloat16: static_cast<uint16_t*>(buf)[i] = f32_to_f16(static_cast<float>(v)); break;
  }
}

double load(const void* buf, DType dt, size_t i) {
  switch (dt) {
    case DType::kFloat32: return static_cast<const float*>(buf)[i];
    case DType::kFloat64: return static_cast<const double*>(buf)[i];
    case DType::kInt32: return static_cast<const int32_t*>(buf)[i];
    case DType::kInt64: return static_cast<double>(static_cast<const int64_t*>(buf)[i]);
    case DType::kBFloat16: return bf16_to_f32(static_cast<const uint16_t*>(buf)[i]);
    case DType::kFloat16: return f16_to_f32(static_cast<const uint16_t*>(buf)[i]);
  }
  return NAN;
}

double combine(ReduceOp op, int world, size_t i, int salt, size_t offset) {
  double acc = value(0, offset + i, salt);
  for (int r = 1; r < world; ++r) {
    double v = value(r, offset + i, salt);
    acc = op == ReduceOp::kSum ? acc + v : op == ReduceOp::kMax ? std::max(acc, v) : std::min(acc, v);
  }
  return acc;
}

struct Buffer {
  Buffer(size_t n, DType dt) : bytes(n * dtype_size(dt) + 1), dtype(dt) {}  // +1: never null
  void* data() { return bytes.data(); }
  std::vector<char> bytes;
  DType dtype;
};

class Checker {
 public:
  Checker(Communicator& comm, size_t count) : comm_(comm), count_(count) {}

  // Records the first mismatch of a case: out[i] vs expected(i) for n elements.
  template <typename Expected>
  void expect(const std::string& name, const void* out, DType dt, size_t n, Expected expected) {
    for (size_t i = 0; i < n; ++i) {
      double got = load(out, dt, i), want = expected(i);
      if (got != want) {
        std::ostringstream os;
        os << name << " dtype=" << dtype_name(dt) << " count=" << count_ << " rank " << comm_.rank() << " of "
           << comm_.size() << ": out[" << i << "]=" << got << ", expected " << want;
        failures.push_back(os.str());
        return;
      }
    }
  }

  std::vector<std::string> failures;

 private:
  Communicator& comm_;
  size_t count_;
};

}  // namespace

std::vector<std::string> check_all_collectives(Communicator& comm, size_t count) {
  const int me = comm.rank(), world = comm.size();
  const size_t w = static_cast<size_t>(world), mine = static_cast<size_t>(me);
  Checker c(comm, count);
  int salt = 0;
  for (DType dt : kAllDTypes) {
    for (ReduceOp op : kAllOps) {
      ++salt;
      Buffer buf(count, dt);
      for (size_t i = 0; i < count; ++i) store(buf.data(), dt, i, value(me, i, salt));
      comm.all_reduce(buf.data(), count, dt, op)->wait();
      c.expect(std::string("all_reduce ") + reduce_op_name(op), buf.data(), dt, count,
               [&](size_t i) { return combine(op, world, i, salt, 0); });

      Buffer in(count * w, dt), out(count, dt);
      for (size_t i = 0; i < count * w; ++i) store(in.data(), dt, i, value(me, i, salt));
      comm.reduce_scatter(in.data(), out.data(), count, dt, op)->wait();
      c.expect(std::string("reduce_scatter ") + reduce_op_name(op), out.data(), dt, count,
               [&](size_t i) { return combine(op, world, i, salt, mine * count); });
    }
    ++salt;
    Buffer gin(count, dt), gout(count * w, dt);
    for (size_t i = 0; i < count; ++i) store(gin.data(), dt, i, value(me, i, salt));
    comm.all_gather(gin.data(), gout.data(), count, dt)->wait();
    c.expect("all_gather", gout.data(), dt, count * w,
             [&](size_t i) { return value(static_cast<int>(i / count), i % count, salt); });  // n=0: never called

    ++salt;
    Buffer ain(count * w, dt), aout(count * w, dt);
    for (size_t i = 0; i < count * w; ++i) store(ain.data(), dt, i, value(me, i, salt));
    comm.all_to_all(ain.data(), aout.data(), count, dt)->wait();
    c.expect("all_to_all", aout.data(), dt, count * w, [&](size_t i) {
      size_t src = i / count, j = i % count;
      return value(static_cast<int>(src), mine * count + j, salt);
    });

    ++salt;
    const int root = static_cast<int>(count % w);
    Buffer b(count, dt);
    for (size_t i = 0; i < count; ++i) store(b.data(), dt, i, value(me, i, salt));
    comm.broadcast(b.data(), count, dt, root)->wait();
    c.expect("broadcast root=" + std::to_string(root), b.data(), dt, count,
             [&](size_t i) { return value(root, i, salt); });

    if (is_low_precision(dt) || dt == DType::kFloat32) {
      for (bool accumulate : {false, true}) {
        ++salt;
        Buffer rin(count * w, dt);
        for (size_t i = 0; i < count * w; ++i) store(rin.data(), dt, i, value(me, i, salt));
        std::vector<float> rout(count + 1, accumulate ? 0.5f : 1e30f);  // garbage when overwriting
        comm.reduce_scatter_accumulate(rin.data(), dt, rout.data(), count, accumulate)->wait();
        c.expect(accumulate ? "reduce_scatter_accumulate(accumulate)" : "reduce_scatter_accumulate", rout.data(),
                 DType::kFloat32, count, [&](size_t i) {
                   return (accumulate ? 0.5 : 0.0) + combine(ReduceOp::kSum, world, i, salt, mine * count);
                 });
      }
    }
  }
  comm.barrier()->wait();
  return c.failures;
}

std::string AccuracyResult::to_string() const {
  std::ostringstream os;
  os.precision(3);
  os << std::scientific << "reduce_scatter_accumulate (bf16 wire, FP32 sum): max |err| " << rsa_max_abs_err
     << ", mean |err| " << rsa_mean_abs_err
     << (rsa_bitwise_equal ? " (bitwise = fp64 sum rounded once)" : " (NOT bitwise equal)")
     << "; plain bf16 reduce_scatter: max |err| " << bf16_max_abs_err << ", mean |err| " << bf16_mean_abs_err;
  return os.str();
}

AccuracyResult check_rsa_accuracy(Communicator& comm, size_t count, uint64_t seed) {
  const size_t w = static_cast<size_t>(comm.size()), me = static_cast<size_t>(comm.rank());
  auto inputs_of = [&](size_t rank) {
    std::mt19937_64 gen(seed * 1000003 + rank);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<uint16_t> v(count * w);
    for (auto& x : v) x = f32_to_bf16(normal(gen));
    return v;
  };
  std::vector<double> ref(count, 0.0);  // fp64 sum of my chunk over all ranks
  for (size_t r = 0; r < w; ++r) {
    auto v = inputs_of(r);
    for (size_t i = 0; i < count; ++i) ref[i] += bf16_to_f32(v[me * count + i]);
  }
  auto mine = inputs_of(me);
  std::vector<float> rsa(count);
  comm.reduce_scatter_accumulate(mine.data(), DType::kBFloat16, rsa.data(), count)->wait();
  std::vector<uint16_t> plain(count);
  comm.reduce_scatter(mine.data(), plain.data(), count, DType::kBFloat16)->wait();

  AccuracyResult res;
  res.rsa_bitwise_equal = true;
  for (size_t i = 0; i < count; ++i) {
    float rounded = static_cast<float>(ref[i]);
    if (std::memcmp(&rounded, &rsa[i], sizeof(float)) != 0) res.rsa_bitwise_equal = false;
    double e1 = std::fabs(rsa[i] - ref[i]), e2 = std::fabs(bf16_to_f32(plain[i]) - ref[i]);
    res.rsa_max_abs_err = std::max(res.rsa_max_abs_err, e1);
    res.bf16_max_abs_err = std::max(res.bf16_max_abs_err, e2);
    res.rsa_mean_abs_err += e1 / static_cast<double>(count);
    res.bf16_mean_abs_err += e2 / static_cast<double>(count);
  }
  return res;
}

}  // namespace zerort::testing
