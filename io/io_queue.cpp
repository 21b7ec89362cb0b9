#include "io/io_queue.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "core/error.h"
#include "io/aligned_buffer_pool.h"
#include "io/direct_file.h"

namespace zerort::io {

namespace {

const char* op_name(bool is_write) { return is_write ? "write" : "read"; }

bool aligned(std::uint64_t v, std::size_t alignment) { return v % alignment == 0; }

}  // namespace

// See Note [IoQueue backends].
IoQueue::IoQueue(unsigned queue_depth, std::size_t block_size, IoBackend backend)
    : queue_depth_(queue_depth), block_size_(block_size) {
  ZRT_CHECK_AS(ConfigError, queue_depth >= 1 && queue_depth <= kMaxDepth, "IoQueue: queue_depth must be in 1..",
               kMaxDepth, ", got ", queue_depth);
  ZRT_CHECK_AS(ConfigError, block_size >= 512 && block_size % 512 == 0 && block_size <= (std::size_t{1} << 30),
               "IoQueue: block_size must be a multiple of 512 bytes between 512 and 1 GiB, got ", block_size);
  EngineChoice choice = choose_io_engine(backend, queue_depth);
  engine_ = std::move(choice.engine);
  backend_why_ = std::move(choice.why);
  slots_.resize(queue_depth);
  free_slots_.reserve(queue_depth);
  for (unsigned i = queue_depth; i > 0; --i) free_slots_.push_back(i - 1);
}

IoQueue::~IoQueue() {
  queued_.clear();  // never started; only what the kernel holds must finish
  while (in_kernel_ > 0) {
    try {
      reap(true, std::chrono::seconds(1));
    } catch (...) {
      break;  // the engine itself failed: nothing more can be reaped
    }
  }
}

bool IoQueue::register_pool(const AlignedBufferPool& pool) {
  ZRT_CHECK_AS(UsageError, pool_ == nullptr, "IoQueue::register_pool: a pool is already registered");
  ZRT_CHECK_AS(UsageError, in_kernel_ == 0 && queued_.empty(),
               "IoQueue::register_pool: called with I/O in flight; wait for it first");
  if (!engine_->register_buffers(pool)) return false;
  pool_ = &pool;
  return true;
}

IoQueue::Request IoQueue::read(const DirectFile& file, std::uint64_t offset, void* buffer, std::size_t bytes) {
  return start(file, false, offset, static_cast<char*>(buffer), bytes);
}

IoQueue::Request IoQueue::write(const DirectFile& file, std::uint64_t offset, const void* buffer, std::size_t bytes) {
  // The kernel only reads from a write's buffer; the engines take it as char*.
  return start(file, true, offset, static_cast<char*>(const_cast<void*>(buffer)), bytes);
}

// See Note [IoQueue requests].
IoQueue::Request IoQueue::start(const DirectFile& file, bool is_write, std::uint64_t offset, char* buffer,
                                std::size_t bytes) {
  std::size_t a = file.alignment();
  const char* op = op_name(is_write);
  ZRT_CHECK_AS(UsageError, aligned(block_size_, a), "IoQueue: block_size ", block_size_,
               " is not a multiple of the direct-I/O alignment ", a, " of ", file.path());
  ZRT_CHECK_AS(UsageError, aligned(offset, a) && aligned(bytes, a), "IoQueue: ", op, " of ", bytes, " bytes at offset ",
               offset, " of ", file.path(), ": offset and length must be multiples of ", a);
  ZRT_CHECK_AS(UsageError, aligned(reinterpret_cast<std::uintptr_t>(buffer), a), "IoQueue: ", op, " at offset ", offset,
               " of ", file.path(), ": the buffer ", static_cast<void*>(buffer), " is not aligned to ", a,
               " bytes (use an AlignedBufferPool)");
  ZRT_CHECK_AS(UsageError, offset <= file.size() && bytes <= file.size() - offset, "IoQueue: ", op, " of ", bytes,
               " bytes at offset ", offset, " runs past the end of ", file.path(), " (", file.size(), " bytes)");
  Request id = next_request_++;
  std::size_t pieces = (bytes + block_size_ - 1) / block_size_;
  requests_[id] = RequestState{&file, is_write, offset, bytes, pieces, {}};
  for (std::size_t done = 0; done < bytes; done += block_size_) {
    auto len = static_cast<std::uint32_t>(std::min(block_size_, bytes - done));
    queued_.push_back(Piece{id, offset + done, buffer + done, len});
  }
  submit_queued();
  return id;
}

void IoQueue::submit_queued() {
  while (!queued_.empty() && !free_slots_.empty()) {
    Piece piece = queued_.front();
    queued_.pop_front();
    const RequestState& req = requests_.at(piece.request);
    std::uint64_t slot = free_slots_.back();
    free_slots_.pop_back();
    slots_[slot] = piece;
    engine_->prepare(slot, req.file->fd(), req.is_write, piece.buffer, piece.bytes, piece.offset);
    ++in_kernel_;
  }
  // A busy engine wants completions reaped first; the reap refills the queue and may submit
  // entries of ours with its own.
  while (!engine_->submit()) reap(true, std::chrono::milliseconds(10));
}

bool IoQueue::reap(bool block, std::chrono::milliseconds timeout) {
  completions_.clear();
  if (!engine_->reap(block && in_kernel_ > 0, timeout, completions_)) return false;
  for (const IoEngine::Completion& done : completions_) complete(done);
  submit_queued();
  return true;
}

void IoQueue::complete(const IoEngine::Completion& done) {
  const int result = done.result;
  Piece piece = slots_[done.tag];
  free_slots_.push_back(done.tag);
  --in_kernel_;
  RequestState& req = requests_.at(piece.request);
  --req.pieces_left;
  if (result == static_cast<int>(piece.bytes)) {
    (req.is_write ? bytes_written_ : bytes_read_) += piece.bytes;
    return;
  }
  if (!req.error.empty()) return;
  const char* op = op_name(req.is_write);
  req.error = result < 0
                  ? detail::concat(op, " of ", piece.bytes, " bytes at offset ", piece.offset, " of ", req.file->path(),
                                   " failed: ", std::strerror(-result), " (errno ", -result, ")")
                  : detail::concat("short ", op, ": ", result, " of ", piece.bytes, " bytes at offset ", piece.offset,
                                   " of ", req.file->path(),
                                   req.is_write ? " (the disk is full?)" : " (the file ends early: truncated?)");
  // Its pieces not yet in the kernel are dropped: the request has failed already.
  auto dropped =
      std::remove_if(queued_.begin(), queued_.end(), [&](const Piece& p) { return p.request == piece.request; });
  req.pieces_left -= static_cast<std::size_t>(queued_.end() - dropped);
  queued_.erase(dropped, queued_.end());
}

void IoQueue::finish(Request request) {
  auto it = requests_.find(request);
  std::string error = std::move(it->second.error);
  requests_.erase(it);
  ZRT_CHECK(error.empty(), "IoQueue: ", error);
}

void IoQueue::wait(Request request, std::chrono::milliseconds timeout) {
  struct Timer {  // counts on every way out, a failed wait's too
    double& total;
    std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
    ~Timer() { total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }
  } timer{wait_seconds_};
  auto it = requests_.find(request);
  ZRT_CHECK_AS(UsageError, it != requests_.end(), "IoQueue::wait: unknown request ", request,
               " (never submitted, or already waited for)");
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (it->second.pieces_left > 0) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    const RequestState& r = it->second;
    ZRT_CHECK(left.count() > 0 && reap(true, left), "IoQueue: timed out after ", timeout.count(),
              " ms waiting for the ", op_name(r.is_write), " of ", r.bytes, " bytes at offset ", r.offset, " of ",
              r.file->path(), " (", r.pieces_left, " pieces of ", block_size_,
              " bytes not done; the request stays in flight)");
  }
  finish(request);
}

bool IoQueue::poll(Request request) {
  auto it = requests_.find(request);
  ZRT_CHECK_AS(UsageError, it != requests_.end(), "IoQueue::poll: unknown request ", request,
               " (never submitted, or already waited for)");
  reap(false, std::chrono::milliseconds(0));
  if (it->second.pieces_left > 0) return false;
  finish(request);
  return true;
}

void IoQueue::wait_all(std::chrono::milliseconds timeout) {
  std::string first_error;
  while (!requests_.empty()) {
    Request id = requests_.begin()->first;
    try {
      wait(id, timeout);
    } catch (const Error& e) {
      if (requests_.count(id)) throw;  // a timeout: the request is still open
      if (first_error.empty()) first_error = e.message();
    }
  }
  ZRT_CHECK(first_error.empty(), first_error);
}

}  // namespace zerort::io
