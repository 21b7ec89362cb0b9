#include "runtime/nvme_state_store.h"

#include <ATen/ops/zeros.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>

#include "core/error.h"
#include "io/alignment.h"

namespace zerort {

namespace {

// The options and numel, checked before any member is built from them.
int64_t checked_numel(int64_t numel, DType state_dtype, const NvmeStateOptions& o) {
  ZRT_CHECK_AS(ConfigError, state_dtype == DType::kFloat32 || state_dtype == DType::kBFloat16,
               "NvmeStateStore: optimizer state dtype must be fp32 or bf16, got ", dtype_name(state_dtype));
  ZRT_CHECK_AS(ConfigError, o.rank >= 0, "NvmeStateStore: rank must be >= 0, got ", o.rank);
  ZRT_CHECK_AS(ConfigError, o.chunk_elements >= 1, "NvmeStateStore: chunk_elements must be >= 1");
  ZRT_CHECK_AS(ConfigError, o.buffer_count >= 1, "NvmeStateStore: buffer_count must be >= 1, got ", o.buffer_count);
  ZRT_CHECK_AS(UsageError, numel >= 0, "NvmeStateStore: numel must be >= 0, got ", numel);
  ZRT_CHECK_AS(ConfigError, o.ram_fraction >= 0 && o.ram_fraction <= 1,
               "NvmeStateStore: ram_fraction must be within 0 to 1, got ", o.ram_fraction);
  ZRT_CHECK_AS(ConfigError, o.ram_fraction == 0 || !o.gradient_in_file, "NvmeStateStore: ram_fraction ", o.ram_fraction,
               " with gradient_in_file: a split keeps the gradient in RAM (See Note [NVMe state ",
               "store]); drop gradient_in_file, or set ram_fraction to 0");
  ZRT_CHECK_AS(ConfigError, o.with_gradient || !o.gradient_in_file,
               "NvmeStateStore: gradient_in_file without a gradient of its own (with_gradient false: it is on the ",
               "device); drop one of them");
  return numel;
}

// The records kept in RAM: floor(ram_fraction x chunks), as zerort.accounting.nvme_tier counts them.
std::size_t ram_chunk_count(int64_t numel, std::size_t chunk_elements, double ram_fraction) {
  const std::size_t chunks = (static_cast<std::size_t>(numel) + chunk_elements - 1) / chunk_elements;
  return std::min(chunks, static_cast<std::size_t>(ram_fraction * static_cast<double>(chunks)));
}

// The queue holds every piece of the pool at once, and at least queue_depth: See Note [NVMe
// state store] (no thread moves a request queued behind a full ring).
unsigned pool_depth(const NvmeStateOptions& o, std::size_t record) {
  const std::size_t pieces = o.buffer_count * ((record + o.block_size - 1) / std::max<std::size_t>(o.block_size, 1));
  return static_cast<unsigned>(
      std::min<std::size_t>(std::max<std::size_t>(o.queue_depth, pieces), io::IoQueue::kMaxDepth));
}

std::size_t record_bytes(std::size_t chunk_elements, DType state_dtype) {
  return chunk_elements * (sizeof(float) + 2 * dtype_size(state_dtype));
}

// A pool buffer: a record, and with the gradient in the file a slot for the chunk's gradient.
std::size_t buffer_bytes(std::size_t chunk_elements, std::size_t record, const NvmeStateOptions& o) {
  return record + (o.gradient_in_file ? chunk_elements * sizeof(float) : 0);
}

}  // namespace

NvmeStateStore::NvmeStateStore(int64_t numel, DType state_dtype, const NvmeStateOptions& options)
    : numel_(checked_numel(numel, state_dtype, options)), state_dtype_(state_dtype),
      state_bytes_(dtype_size(state_dtype)),
      chunk_elements_(io::round_up(options.chunk_elements, io::direct_io_alignment(options.directory))),
      chunk_stride_(record_bytes(chunk_elements_, state_dtype)),
      ram_chunks_(ram_chunk_count(numel_, chunk_elements_, options.ram_fraction)),
      ram_(at::zeros({static_cast<int64_t>(ram_bytes())}, at::TensorOptions().dtype(at::kByte))),
      file_(options.directory, detail::concat("zerort-states-rank", options.rank, ".bin"),
            records_bytes() + (options.gradient_in_file
                                   ? NvmeGradient::region_bytes(static_cast<std::size_t>(numel_),
                                                                io::direct_io_alignment(options.directory))
                                   : 0)),
      pool_(options.buffer_count, buffer_bytes(chunk_elements_, chunk_stride_, options), file_.alignment()),
      queue_(pool_depth(options, pool_.buffer_size()), options.block_size, options.io_backend) {
  ZRT_CHECK_AS(ConfigError, chunk_stride_ % file_.alignment() == 0 && options.block_size % file_.alignment() == 0,
               "NvmeStateStore: block_size ", options.block_size, " and the record of ", chunk_stride_,
               " bytes must be multiples of the direct-I/O alignment ", file_.alignment(), " of ", file_.path());
  queue_.register_pool(pool_);  // false: the same I/O without fixed buffers
  for (std::size_t c = ram_chunks_; c < chunk_count(); ++c) read_order_.push_back(c);
  if (options.gradient_in_file) {
    file_grad_ = std::make_unique<NvmeGradient>(file_, queue_, records_bytes(), static_cast<std::size_t>(numel_),
                                                io::direct_io_alignment(options.directory), chunk_elements_);
  } else if (options.with_gradient) {
    grad_ = at::zeros({numel_}, at::TensorOptions().dtype(at::kFloat));
  }
}

NvmeStateStore::NvmeStateStore(const at::Tensor& master, DType state_dtype, const NvmeStateOptions& options)
    : NvmeStateStore(master.defined() ? master.numel() : -1, state_dtype, options) {
  write_master(master);
}

std::uint64_t NvmeStateStore::records_bytes() const {
  return static_cast<std::uint64_t>(chunk_count() - ram_chunks_) * chunk_stride_;
}

std::size_t NvmeStateStore::chunk_count() const {
  return (static_cast<std::size_t>(numel_) + chunk_elements_ - 1) / chunk_elements_;
}

std::size_t NvmeStateStore::chunk_numel(std::size_t c) const {
  return std::min(chunk_elements_, static_cast<std::size_t>(numel_) - c * chunk_elements_);
}

AdamWBuffers NvmeStateStore::view(std::size_t c, void* buffer) {
  char* record = static_cast<char*>(buffer);
  AdamWBuffers b;
  b.grad = file_grad_        ? grad_slot(buffer)
           : grad_.defined() ? grad_.data_ptr<float>() + c * chunk_elements_
                             : nullptr;  // a DeviceGradientStore's inner store: it fills the gradient in
  b.grad_dtype = DType::kFloat32;
  b.master = reinterpret_cast<float*>(record);
  b.exp_avg = record + chunk_elements_ * sizeof(float);
  b.exp_avg_sq = record + chunk_elements_ * (sizeof(float) + state_bytes_);
  b.state_dtype = state_dtype_;
  b.n = chunk_numel(c);
  return b;
}

namespace {

[[noreturn]] void no_whole_tensor(const char* call, const std::string& path,
                                  const char* instead = "read_range()/write_range()") {
  throw UsageError(
      __FILE__, __LINE__,
      detail::concat("NvmeStateStore::", call, "(): the whole tensor is not available for the nvme tier (it lives in ",
                     path, "); stream it with ", instead));
}

}  // namespace

StateTierStats NvmeStateStore::tier_stats() const {
  StateTierStats s;
  s.tier = StateTier::kNvme;
  s.path = file_.path();
  s.file_bytes = file_.size();
  s.ram_bytes = ram_bytes();
  s.gradient_bytes = file_.size() - records_bytes();
  s.pool_bytes = pool_bytes();
  s.bytes_read = queue_.bytes_read();
  s.bytes_written = queue_.bytes_written();
  s.io_wait_seconds = queue_.wait_seconds();
  s.io_backend = queue_.backend();
  s.io_backend_why = queue_.backend_why();
  return s;
}

const at::Tensor& NvmeStateStore::master() const { no_whole_tensor("master", file_.path()); }
const at::Tensor& NvmeStateStore::exp_avg() const { no_whole_tensor("exp_avg", file_.path()); }
const at::Tensor& NvmeStateStore::exp_avg_sq() const { no_whole_tensor("exp_avg_sq", file_.path()); }
at::Tensor& NvmeStateStore::grad() {
  if (file_grad_) no_whole_tensor("grad", file_.path(), "read_grad()/write_grad()");
  ZRT_CHECK_AS(UsageError, grad_.defined(), "NvmeStateStore::grad(): the store of ", file_.path(),
               " was made without a gradient; its DeviceGradientStore holds it (Note [gradient on the device])");
  return grad_;
}
const at::Tensor& NvmeStateStore::grad() const { return const_cast<NvmeStateStore*>(this)->grad(); }

void NvmeStateStore::read_grad(size_t offset, size_t n, float* out) {
  if (!file_grad_) return OptimizerStateStore::read_grad(offset, n, out);
  check_usable("read_grad");
  file_grad_->read(offset, n, out);
}

void NvmeStateStore::write_grad(size_t offset, size_t n, const float* in) {
  if (!file_grad_) return OptimizerStateStore::write_grad(offset, n, in);
  check_usable("write_grad");
  file_grad_->write(offset, n, in);
}

GradStats NvmeStateStore::unscale_and_check_grad(float inv_scale) {
  if (!file_grad_) return OptimizerStateStore::unscale_and_check_grad(inv_scale);
  check_usable("unscale_and_check_grad");
  return file_grad_->check(inv_scale);
}

void NvmeStateStore::zero_grad() {
  if (!file_grad_) return OptimizerStateStore::zero_grad();
  file_grad_->zero();
}

void NvmeStateStore::start_grad(InFlight& read) {
  if (!file_grad_ || read.grad_started) return;
  read.grad_reads = file_grad_->start(read.chunk * chunk_elements_, chunk_numel(read.chunk), grad_slot(read.buffer));
  read.grad_started = true;
}

void NvmeStateStore::check_usable(const char* call) const {
  ZRT_CHECK(failure_.empty(), "NvmeStateStore::", call, ": the state in ", file_.path(),
            " is unusable after an earlier failure (", failure_,
            "); its records may mix two steps, so nothing more is read from or written to it");
}

void* NvmeStateStore::take_buffer(std::deque<InFlight>& writes, bool block) {
  if (void* buffer = pool_.try_acquire()) return buffer;
  if (writes.empty()) return nullptr;
  if (!block && !queue_.poll(writes.front().request)) return nullptr;
  if (block) queue_.wait(writes.front().request);
  void* buffer = writes.front().buffer;  // done: its buffer passes straight to the caller
  writes.pop_front();
  return buffer;
}

void NvmeStateStore::retire_done_writes(std::deque<InFlight>& writes) {
  while (!writes.empty() && queue_.poll(writes.front().request)) {
    pool_.release(writes.front().buffer);
    writes.pop_front();
  }
}

void NvmeStateStore::finish_writes(std::deque<InFlight>& writes) {
  while (!writes.empty()) {
    queue_.wait(writes.front().request);
    pool_.release(writes.front().buffer);
    writes.pop_front();
  }
}

void NvmeStateStore::drain(std::deque<InFlight>& reads, std::deque<InFlight>& writes, const std::string& why) noexcept {
  for (auto* list : {&reads, &writes}) {
    for (InFlight& f : *list) {
      if (file_grad_) file_grad_->forget(f.grad_reads);
      try {
        queue_.wait(f.request);
      } catch (...) {  // its error, or a request already forgotten: either way none of it is in the kernel
      }
      try {
        pool_.release(f.buffer);
      } catch (...) {
      }
    }
    list->clear();
  }
  failure_ = why.empty() ? "unknown error" : why;
}

void NvmeStateStore::finish_write_of(std::size_t c) {
  for (auto it = writes_.begin(); it != writes_.end(); ++it) {
    if (it->chunk != c) continue;
    queue_.wait(it->request);
    pool_.release(it->buffer);
    writes_.erase(it);
    return;
  }
}

void NvmeStateStore::drop_reads() {
  while (!reads_.empty()) {
    if (file_grad_) file_grad_->await(reads_.front().grad_reads);
    queue_.wait(reads_.front().request);
    pool_.release(reads_.front().buffer);
    reads_.pop_front();
  }
}

void NvmeStateStore::settle(const char* call) {
  check_usable(call);
  try {
    finish_writes(writes_);
    drop_reads();  // read ahead for an update that a direct read or write comes before
  } catch (const std::exception& e) {
    drain(reads_, writes_, detail::concat(call, "() failed waiting for earlier I/O: ", e.what()));
    throw;
  }
}

NvmeStateStore::~NvmeStateStore() {
  drain(reads_, writes_, "destroyed");  // nothing may land in a buffer after the pool is gone
}

}  // namespace zerort
