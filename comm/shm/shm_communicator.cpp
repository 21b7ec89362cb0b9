#include "comm/shm/shm_communicator.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "comm/local_reduce.h"
#include "comm/shm/shm_queue.h"
#include "comm/shm/shm_segment.h"
#include "core/error.h"

namespace zerort {

namespace {

using Clock = std::chrono::steady_clock;

// What one call's rounds need: its name for errors, its deadline and its timeout.
struct Call {
  std::string name;
  Clock::time_point deadline;
  std::chrono::milliseconds timeout;
};

// Every collective moves whole rounds (Note [shm rounds]). Reductions copy rank 0's piece and
// reduce ranks 1..W-1 into it in that order with reduce_into, as the in-process backend does,
// so every rank computes the same bits.
class ShmCommunicator final : public Communicator {
 public:
  ShmCommunicator(std::shared_ptr<ShmSegment> segment, CommOptions options)
      : Communicator(segment->rank(), segment->world(), options), segment_(std::move(segment)),
        queue_(std::make_unique<ShmQueue>()) {}
  ~ShmCommunicator() override {
    segment_->close();  // a call still waiting for peers ends within one wait slice
    queue_.reset();
  }
  const char* backend_name() const override { return "shm"; }

 protected:
  WorkPtr do_all_reduce(void* buf, const CollectiveDesc& d) override {
    return post(d, [this, buf, d](const Call& c) { all_reduce_rounds(static_cast<char*>(buf), d, c); });
  }
  WorkPtr do_reduce_scatter(const void* in, void* out, const CollectiveDesc& d) override {
    return post(d, [this, in, out, d](const Call& c) {
      chunk_rounds(static_cast<const char*>(in), d, c, [&](uint32_t s, size_t q, size_t o, size_t p) {
        char* dst = static_cast<char*>(out) + o;
        const size_t mine = static_cast<size_t>(rank()) * q;
        std::memcpy(dst, segment_->window(0, s) + mine, p);
        for (int r = 1; r < size(); ++r) {
          reduce_into(dst, segment_->window(r, s) + mine, p / dtype_size(d.dtype), d.dtype, d.op);
        }
      });
    });
  }
  WorkPtr do_all_gather(const void* in, void* out, const CollectiveDesc& d) override {
    return post(d, [this, in, out, d](const Call& c) {
      const size_t chunk = d.count * dtype_size(d.dtype);
      for (size_t o = 0; o < chunk; o += segment_->window_bytes()) {
        const size_t p = std::min(segment_->window_bytes(), chunk - o);
        round(
            c, [&](char* mine) { std::memcpy(mine, static_cast<const char*>(in) + o, p); },
            [&](uint32_t s) {
              for (int r = 0; r < size(); ++r) {
                std::memcpy(static_cast<char*>(out) + static_cast<size_t>(r) * chunk + o, segment_->window(r, s), p);
              }
            });
      }
    });
  }
  WorkPtr do_all_to_all(const void* in, void* out, const CollectiveDesc& d) override {
    return post(d, [this, in, out, d](const Call& c) {
      const size_t chunk = d.count * dtype_size(d.dtype);
      chunk_rounds(static_cast<const char*>(in), d, c, [&](uint32_t s, size_t q, size_t o, size_t p) {
        for (int r = 0; r < size(); ++r) {
          std::memcpy(static_cast<char*>(out) + static_cast<size_t>(r) * chunk + o,
                      segment_->window(r, s) + static_cast<size_t>(rank()) * q, p);
        }
      });
    });
  }
  WorkPtr do_broadcast(void* buf, const CollectiveDesc& d) override {
    return post(d, [this, buf, d](const Call& c) {
      const size_t bytes = d.count * dtype_size(d.dtype);
      char* data = static_cast<char*>(buf);
      for (size_t o = 0; o < bytes; o += segment_->window_bytes()) {
        const size_t p = std::min(segment_->window_bytes(), bytes - o);
        round(
            c,
            [&](char* mine) {
              if (rank() == d.root) std::memcpy(mine, data + o, p);
            },
            [&](uint32_t s) {
              if (rank() != d.root) std::memcpy(data + o, segment_->window(d.root, s), p);
            });
      }
    });
  }
  WorkPtr do_barrier(const CollectiveDesc& d) override {
    return post(d, [this](const Call& c) {
      round(
          c, [](char*) {}, [](uint32_t) {});
    });
  }

 private:
  template <typename Body>
  WorkPtr post(const CollectiveDesc& d, Body&& body) {
    if (d.count == 0 && d.kind != Collective::kBarrier) return std::make_shared<CompletedWork>(d, options().timeout);
    const std::string name = d.to_string();
    const auto timeout = options().timeout;
    auto work = std::make_shared<ShmWork>(d, timeout, segment_);
    queue_->post(work,
                 [segment = segment_, name, timeout, body = std::forward<Body>(body)](Clock::time_point deadline) {
                   try {
                     body(Call{name, deadline, timeout});
                   } catch (const Error& e) {
                     segment->abort(e.message());  // the peers fail within a wait slice, naming this rank
                     throw;
                   }
                 });
    return work;
  }

  // One round (on the worker thread): fill this rank's window, meet every rank, read.
  template <typename Fill, typename Read>
  void round(const Call& c, Fill&& fill, Read&& read) {
    const uint32_t s = ++round_;
    fill(segment_->window(rank(), s));
    segment_->arrive(s);
    segment_->wait_all(s, c.deadline, c.name, c.timeout);
    read(s);
  }

  // The rounds of a call whose input is W chunks of d.count elements, chunk j for rank j
  // (all_to_all, reduce_scatter): each round carries q bytes of every chunk, at offset j * q
  // of the sender's window; read(s, q, o, p) takes this rank's p bytes at chunk offset o.
  template <typename Read>
  void chunk_rounds(const char* in, const CollectiveDesc& d, const Call& c, Read&& read) {
    const size_t chunk = d.count * dtype_size(d.dtype), world = static_cast<size_t>(size());
    size_t q = segment_->window_bytes() / world / 64 * 64;  // cache-line pieces, whole elements
    if (q == 0) q = segment_->window_bytes() / world / dtype_size(d.dtype) * dtype_size(d.dtype);
    ZRT_CHECK(q > 0, c.name, ": the shm window of ", segment_->window_bytes(), " bytes is too small for ", world,
              " ranks");
    for (size_t o = 0; o < chunk; o += q) {
      const size_t p = std::min(q, chunk - o);
      round(
          c,
          [&](char* mine) {
            for (size_t j = 0; j < world; ++j) std::memcpy(mine + j * q, in + j * chunk + o, p);
          },
          [&](uint32_t s) { read(s, q, o, p); });
    }
  }

  void all_reduce_rounds(char* buf, const CollectiveDesc& d, const Call& c) {
    const size_t bytes = d.count * dtype_size(d.dtype);
    for (size_t o = 0; o < bytes; o += segment_->window_bytes()) {
      const size_t p = std::min(segment_->window_bytes(), bytes - o);
      round(
          c, [&](char* mine) { std::memcpy(mine, buf + o, p); },
          [&](uint32_t s) {
            std::memcpy(buf + o, segment_->window(0, s), p);
            for (int r = 1; r < size(); ++r) {
              reduce_into(buf + o, segment_->window(r, s), p / dtype_size(d.dtype), d.dtype, d.op);
            }
          });
    }
  }

  std::shared_ptr<ShmSegment> segment_;
  std::unique_ptr<ShmQueue> queue_;
  uint32_t round_ = 0;  // the worker's: rounds run so far
};

}  // namespace

size_t shm_window_bytes(int world) {
  const size_t share = kShmSegmentBudget / (2 * static_cast<size_t>(world > 0 ? world : 1));
  return std::min(kShmWindowBytes, std::max<size_t>(share / 4096 * 4096, 4096));
}

std::unique_ptr<Communicator> make_shm_communicator(Communicator& bootstrap, CommOptions options, size_t window_bytes) {
  if (window_bytes == 0) window_bytes = shm_window_bytes(bootstrap.size());
  std::shared_ptr<ShmSegment> segment = ShmSegment::create(bootstrap, window_bytes);
  return std::make_unique<ShmCommunicator>(std::move(segment), options);
}

}  // namespace zerort
