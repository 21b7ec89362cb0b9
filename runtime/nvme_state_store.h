// NvmeStateStore: the `nvme` tier of the optimizer state (issue 29). This rank's master, m and
// v live in one preallocated O_DIRECT file (or, split, partly in RAM); the FP32 gradient stays in memory, or with
// gradient_in_file goes in the same file (runtime/nvme_gradient.h). The Engine
// makes one when EngineOptions::state_tier is kNvme (the config's offload_optimizer.device).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "io/aligned_buffer_pool.h"
#include "io/direct_file.h"
#include "io/io_queue.h"
#include "runtime/nvme_gradient.h"
#include "runtime/optimizer_state.h"

namespace zerort {

// Note [NVMe state store]
// Layout: the state is cut into chunks of chunk_elements elements (the last one may hold
// fewer). Chunk c is one record at file offset c * chunk_stride(): its master (chunk_elements
// float32), then its m, then its v (chunk_elements of state_dtype each). chunk_elements is a
// multiple of the direct-I/O alignment, so every record and each array inside it starts on an
// aligned offset; the last record is whole in the file, its elements past numel are zero and
// never handed out. One record per chunk, rather than three regions (all masters, then all m,
// then all v), because every step touches all three arrays of a chunk: one read and one write
// request per chunk, into one pool buffer, make the unit of I/O the unit of compute. The cost
// falls on read_range()/write_range() of one array alone (a checkpoint of the master only),
// which move whole records.
// The pipeline (update): the next visit's chunk (and more, up to the free buffers) is read while
// fn runs on this one, while the last one is written back. A buffer goes back to the pool when its write is
// done, so the RAM used is the pool's, buffer_count * chunk_stride() (pool_bytes()), whatever
// numel is (See Note [The pool never grows]); the gradient (numel float32) is the only RAM
// that grows with the state, and it is the reduces' target, as in memory. With
// gradient_in_file it is not in RAM either: it is one more region of the file, after the
// records (Note [gradient in the file]); each pool buffer then has a slot after its record
// for the chunk's gradient, read with the record by update() (never by prefetch(), which runs
// before the reduces that write it) and never written back, as zero_grad() needs no I/O.
// Across calls: prefetch() (the Engine calls it as the accumulation window's last backward
// pass begins) reads the first chunks into free buffers while backward runs, and update()
// returns with its last writes in flight, to finish behind what the caller does next (the
// parameter gather, the next forward). So up to pool_bytes() of reads and of writes per step
// hide behind compute outside the step; the rest streams inside it. Nothing runs on another
// thread: those requests progress in the kernel only, so the queue is made deep enough to
// hold every piece of the pool at once (buffer_count x record / block_size; queue_depth
// when larger, up to io_uring's 32768), and none waits in IoQueue's own queue for a reap
// that would come only at the next call. A record is never read
// before its last write is done (read_ahead), and read_range()/write_range() first wait for
// every write and drop what was read ahead (settle), which a direct write would make stale.
// Failure: an I/O error or short read names the file and offset (See Note [IoQueue
// requests]). A failed update() or write_range() has written some records and not others, so
// the file mixes two states: the store waits out every request still in flight, takes its
// buffers back, rethrows, and from then on refuses every call that reads or writes the state
// (Error naming the first failure), so nothing half-written is ever used. A failed read_range
// changes nothing and leaves the store usable.
// Order: update() visits the chunks in offset order. update_ranges() hands fn the ranges in the
// order given (the overlapped step's: the next forward's, Note [overlapped step]), each range as
// its parts within chunks, walked up, or down where it meets a neighbour at its start (it ends
// where the last range began, or, not going on from the last one's end, the next range ends where
// it begins: stages 1-2's forward order is the reverse of the offsets). Consecutive parts of one chunk are
// one visit: the record read once, fn called on each part in turn, the record written once. So
// an order that moves through the state up or down reads and writes each record once, like
// update(); where the order jumps, a record whose parts lie on both sides is visited (read and
// written) again, never read before its last write is done. prefetch() reads ahead in the last
// update's order, and an update in another order drops those reads.
// Split between RAM and the file (ram_fraction > 0): the first ram_chunks() = floor(ram_fraction
// x chunk count) records are kept in host RAM, in the same record layout, and the file holds the
// rest (record c at offset (c - ram_chunks()) * chunk_stride()). update() steps a RAM record in
// place, with no I/O, while the reads of the first file records run ahead into the pool; the
// ranges copy to and from RAM records directly. So a state bigger than RAM and than the disk
// alone trains, and each step reads and writes only the file's part. The same chunks and the
// same arithmetic whatever the split, so the same bits. The gradient then stays in RAM
// (gradient_in_file with a split is refused: it would give back the RAM the split takes).
struct NvmeStateOptions {
  std::string directory;                            // where the file goes (nvme_path); must exist
  int rank = 0;                                     // names the file: zerort-states-rank<rank>.bin
  std::size_t chunk_elements = 1u << 20;            // rounded up to a multiple of the direct-I/O alignment
  std::size_t buffer_count = 4;                     // pool buffers (>= 1; 3 or more overlap read, compute and write)
  unsigned queue_depth = 8;                         // I/O pieces in the kernel at once, at least (See Note)
  std::size_t block_size = std::size_t{1} << 20;    // the piece size (a multiple of the alignment)
  bool gradient_in_file = false;                    // the FP32 gradient in the file too (See Note)
  io::IoBackend io_backend = io::IoBackend::kAuto;  // See Note [IoQueue backends] (io/io_backend.h)
  double ram_fraction = 0;                          // 0 to 1: the records kept in RAM (See Note: split)
  // false: no gradient here, a DeviceGradientStore keeps it (Note [gradient on the device]); not with gradient_in_file
  bool with_gradient = true;
};

class NvmeStateStore final : public OptimizerStateStore {
 public:
  // A new file for numel elements, made and checked (See Note [DirectFile checks]), whose
  // state is all zeros (master, m and v: a new file's allocated blocks read as zeros); the
  // gradient is float32 zeros in memory. Throws ConfigError for an unusable directory or bad
  // options. Write the master with write_range(): a caller can make every rank's file, and
  // learn that all could be made, before any state is written.
  NvmeStateStore(int64_t numel, DType state_dtype, const NvmeStateOptions& options);
  // The same, with master (a contiguous 1-D float32 CPU tensor; not kept) written as the
  // master, record by record.
  NvmeStateStore(const at::Tensor& master, DType state_dtype, const NvmeStateOptions& options);
  ~NvmeStateStore() override;
  NvmeStateStore(const NvmeStateStore&) = delete;
  NvmeStateStore& operator=(const NvmeStateStore&) = delete;

  int64_t numel() const override { return numel_; }
  DType state_dtype() const override { return state_dtype_; }
  StateTierStats tier_stats() const override;
  // Not available for this tier yet (UsageError): use read_range()/write_range().
  const at::Tensor& master() const override;
  const at::Tensor& exp_avg() const override;
  const at::Tensor& exp_avg_sq() const override;
  // In memory, the reduces accumulate here; UsageError with gradient_in_file or without a gradient.
  at::Tensor& grad() override;
  const at::Tensor& grad() const override;
  bool gradient_in_memory() const override { return !file_grad_; }
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  void read_grad(size_t offset, size_t n, float* out) override;
  void write_grad(size_t offset, size_t n, const float* in) override;
  GradStats unscale_and_check_grad(float inv_scale) override;
  void zero_grad() override;
  void update(const ChunkFn& fn) override;  // every chunk in offset order: See Note [NVMe state store]
  // The ranges' order (See Note: order); the ranges cover [0, numel) once.
  void update_ranges(const std::vector<std::pair<size_t, size_t>>& ranges, const ChunkFn& fn) override;
  // Reads the first chunks the last update read (offset order before any) into free buffers, without waiting.
  void prefetch() override;
  void read_range(size_t offset, size_t n, float* master, void* exp_avg, void* exp_avg_sq) override;
  void write_range(size_t offset, size_t n, const float* master, const void* exp_avg, const void* exp_avg_sq) override;

  std::size_t pool_bytes() const { return pool_.bytes() + (file_grad_ ? file_grad_->staging_bytes() : 0); }
  std::size_t chunk_elements() const { return chunk_elements_; }
  std::size_t chunk_stride() const { return chunk_stride_; }  // bytes of one record in the file
  std::size_t chunk_count() const;
  std::size_t ram_chunks() const { return ram_chunks_; }  // the first records, kept in RAM (See Note: split)
  std::uint64_t ram_bytes() const { return static_cast<std::uint64_t>(ram_chunks_) * chunk_stride_; }
  std::uint64_t records_bytes() const;  // the records' part of the file; the gradient's region follows
  const std::string& path() const { return file_.path(); }
  std::uint64_t file_bytes() const { return file_.size(); }
  std::uint64_t bytes_read() const { return queue_.bytes_read(); }
  std::uint64_t bytes_written() const { return queue_.bytes_written(); }
  // Empty while usable; else why the store refuses further use.
  const std::string& failure() const { return failure_; }

 private:
  struct Part {  // elements [offset, offset + n) of chunk `chunk`, handed to fn as one call
    std::size_t chunk, offset, n;
  };
  struct InFlight {
    std::size_t chunk;
    void* buffer;
    io::IoQueue::Request request;
    std::vector<io::IoQueue::Request> grad_reads = {};  // gradient_in_file: its slot's, once started
    bool grad_started = false;
  };

  // Record c: at this offset in the file, or (c < ram_chunks_) at ram_record(c).
  std::uint64_t chunk_offset(std::size_t c) const {
    return static_cast<std::uint64_t>(c - ram_chunks_) * chunk_stride_;
  }
  char* ram_record(std::size_t c) { return static_cast<char*>(ram_.data_ptr()) + c * chunk_stride_; }
  std::size_t chunk_numel(std::size_t c) const;
  AdamWBuffers view(std::size_t c, void* buffer);  // chunk c's arrays inside its record in `buffer`
  float* grad_slot(void* buffer) const { return reinterpret_cast<float*>(static_cast<char*>(buffer) + chunk_stride_); }
  void start_grad(InFlight& read);  // gradient_in_file: starts reading its chunk's gradient, once
  void check_usable(const char* call) const;
  // Before a direct read or write: every write done, every read ahead dropped (after
  // check_usable(call)).
  void settle(const char* call);
  void drop_reads();  // waits for the reads ahead and gives their buffers back
  // update()'s and update_ranges()' pipeline: fn on every part, in order, each run of parts of
  // one chunk a visit that reads and writes the record once (See Note: the pipeline).
  void stream(const std::vector<Part>& parts, const ChunkFn& fn);
  void finish_write_of(std::size_t chunk);  // waits for chunk's write, if one is in flight
  // Starts reading chunk c (a file record) into a free buffer (taking the oldest write's when `block` and none
  // is free); false when no buffer is free, or, without `block`, c's last write is in flight.
  bool read_ahead(std::size_t c, bool block);
  void write_master(const at::Tensor& master);  // the second constructor's writes
  // A free buffer; when none is free and `block`, waits for the oldest write and takes its
  // buffer (nullptr when none is free and !block or there is no write to wait for).
  void* take_buffer(std::deque<InFlight>& writes, bool block);
  void retire_done_writes(std::deque<InFlight>& writes);  // gives back the buffers of the done ones, in order
  void finish_writes(std::deque<InFlight>& writes);       // waits for every one
  // After a failure: waits out every request, gives back every buffer, records why.
  void drain(std::deque<InFlight>& reads, std::deque<InFlight>& writes, const std::string& why) noexcept;

  int64_t numel_;
  DType state_dtype_;
  std::size_t state_bytes_;
  std::size_t chunk_elements_;
  std::size_t chunk_stride_;
  std::size_t ram_chunks_;
  at::Tensor ram_;  // uint8, ram_bytes(): the RAM records
  io::DirectFile file_;
  io::AlignedBufferPool pool_;
  io::IoQueue queue_;
  at::Tensor grad_;                          // undefined with gradient_in_file
  std::unique_ptr<NvmeGradient> file_grad_;  // gradient_in_file: the file's gradient region
  std::deque<InFlight> reads_;               // read ahead for the next update: read_order_'s first
  std::vector<std::size_t> read_order_;      // the file's chunks in the order the last update visited them
  std::deque<InFlight> writes_;              // in submit order; an update's last ones outlive it
  std::string failure_;
};

}  // namespace zerort
