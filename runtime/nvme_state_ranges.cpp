// NvmeStateStore's reads and writes of a range of the state (checkpoints, gathers of the
// master, the initial master): record by record, through one pool buffer, from the file or
// straight from the records kept in RAM. See Note [NVMe state store].
#include <algorithm>
#include <cstring>
#include <deque>
#include <exception>

#include "core/error.h"
#include "runtime/nvme_state_store.h"

namespace zerort {

namespace {

// Gives the buffer back to the pool on every path out of a scope.
struct Lease {
  io::AlignedBufferPool& pool;
  void* buffer;
  ~Lease() { pool.release(buffer); }
};

// Copies `count` elements between a record's three arrays (from element `skip`) and the host's
// (from element `at`; a nullptr host array is skipped): into the record when to_record.
void copy_part(const AdamWBuffers& record, std::size_t skip, std::size_t at, std::size_t count, bool to_record,
               void* const (&host)[3]) {
  const std::size_t state_bytes = dtype_size(record.state_dtype);
  char* const arrays[3] = {reinterpret_cast<char*>(record.master), static_cast<char*>(record.exp_avg),
                           static_cast<char*>(record.exp_avg_sq)};
  for (int k = 0; k < 3; ++k) {
    if (host[k] == nullptr) continue;
    const std::size_t width = k == 0 ? sizeof(float) : state_bytes;
    char* in_record = arrays[k] + skip * width;
    char* in_host = static_cast<char*>(host[k]) + at * width;
    std::memcpy(to_record ? in_record : in_host, to_record ? in_host : in_record, count * width);
  }
}

void check_range(size_t offset, size_t n, int64_t numel, const char* call) {
  ZRT_CHECK(offset <= static_cast<size_t>(numel) && n <= static_cast<size_t>(numel) - offset, "NvmeStateStore::", call,
            ": range [", offset, ", ", offset + n, ") lies outside the state of ", numel, " elements");
}

}  // namespace

void NvmeStateStore::write_master(const at::Tensor& master) {
  ZRT_CHECK_AS(UsageError,
               master.defined() && master.scalar_type() == at::kFloat && master.dim() == 1 && master.is_contiguous() &&
                   master.device().is_cpu() && master.numel() == numel_,
               "NvmeStateStore: master must be a contiguous 1-D float32 CPU tensor of ", numel_, " elements");
  // Whole records: the master, zero m and v.
  const float* in = master.data_ptr<float>();
  std::deque<InFlight> none, writes;  // the store is new: nothing of its own is in flight
  try {
    for (std::size_t c = 0; c < ram_chunks_; ++c) {  // zeros already: the master only
      std::memcpy(ram_record(c), in + c * chunk_elements_, chunk_numel(c) * sizeof(float));
    }
    for (std::size_t c = ram_chunks_; c < chunk_count(); ++c) {
      void* buffer = take_buffer(writes, true);
      std::memset(buffer, 0, chunk_stride_);
      std::memcpy(buffer, in + c * chunk_elements_, chunk_numel(c) * sizeof(float));
      writes.push_back({c, buffer, queue_.write(file_, chunk_offset(c), buffer, chunk_stride_)});
      retire_done_writes(writes);
    }
    finish_writes(writes);
  } catch (const std::exception& e) {
    drain(none, writes, detail::concat("writing the initial state failed: ", e.what()));
    throw;
  }
}

void NvmeStateStore::read_range(size_t offset, size_t n, float* master, void* exp_avg, void* exp_avg_sq) {
  settle("read_range");
  check_range(offset, n, numel_, "read_range");
  if (n == 0) return;
  void* const host[3] = {master, exp_avg, exp_avg_sq};
  Lease lease{pool_, pool_.acquire()};
  for (std::size_t c = offset / chunk_elements_; c * chunk_elements_ < offset + n; ++c) {
    if (c >= ram_chunks_) queue_.wait(queue_.read(file_, chunk_offset(c), lease.buffer, chunk_stride_));
    const AdamWBuffers b = view(c, c < ram_chunks_ ? ram_record(c) : lease.buffer);
    const std::size_t first = c * chunk_elements_, lo = std::max(offset, first);
    const std::size_t count = std::min(offset + n, first + b.n) - lo;
    copy_part(b, lo - first, lo - offset, count, false, host);
  }
}

void NvmeStateStore::write_range(size_t offset, size_t n, const float* master, const void* exp_avg,
                                 const void* exp_avg_sq) {
  settle("write_range");
  check_range(offset, n, numel_, "write_range");
  if (n == 0) return;
  void* const host[3] = {const_cast<float*>(master), const_cast<void*>(exp_avg), const_cast<void*>(exp_avg_sq)};
  Lease lease{pool_, pool_.acquire()};
  try {
    for (std::size_t c = offset / chunk_elements_; c * chunk_elements_ < offset + n; ++c) {
      const bool in_ram = c < ram_chunks_;
      const AdamWBuffers b = view(c, in_ram ? ram_record(c) : lease.buffer);
      const std::size_t first = c * chunk_elements_, lo = std::max(offset, first);
      const std::size_t count = std::min(offset + n, first + b.n) - lo;
      if (in_ram) {  // in place
        copy_part(b, lo - first, lo - offset, count, true, host);
        continue;
      }
      if (count < b.n || !master || !exp_avg || !exp_avg_sq) {  // the record's other values stay
        queue_.wait(queue_.read(file_, chunk_offset(c), lease.buffer, chunk_stride_));
      }
      copy_part(b, lo - first, lo - offset, count, true, host);  // through the writable host pointers
      queue_.wait(queue_.write(file_, chunk_offset(c), lease.buffer, chunk_stride_));
    }
  } catch (const std::exception& e) {
    std::deque<InFlight> none;
    drain(none, none, detail::concat("write_range() failed: ", e.what()));
    throw;
  }
}

}  // namespace zerort
