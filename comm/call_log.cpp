#include "comm/call_log.h"

namespace zerort {

namespace {

// splitmix64's finalizer: every input bit moves about half the output bits.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

CallFields call_fields(const CollectiveDesc& d) {
  return {static_cast<int64_t>(d.kind),  static_cast<int64_t>(d.dtype), static_cast<int64_t>(d.op),
          static_cast<int64_t>(d.count), static_cast<int64_t>(d.root),  d.tag};
}

std::string describe_call(const CallFields& f, int rank, int world) {
  CollectiveDesc d;
  d.kind = static_cast<Collective>(f[0]);
  d.dtype = static_cast<DType>(f[1]);
  d.op = static_cast<ReduceOp>(f[2]);
  d.count = static_cast<size_t>(f[3]);
  d.root = static_cast<int>(f[4]);
  d.tag = f[5];
  d.rank = rank;
  d.world = world;
  return d.to_string();
}

void CallLog::record(const CollectiveDesc& d) {
  const CallFields f = call_fields(d);
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t h = static_cast<uint64_t>(summary_.fingerprint);
  for (int64_t v : f) h = mix(h ^ static_cast<uint64_t>(v));
  summary_.fingerprint = static_cast<int64_t>(h);
  ++summary_.calls;
  if (kept_.size() < kKept) kept_.push_back(f);
}

CallLog::Summary CallLog::summary() const {
  std::lock_guard<std::mutex> lock(mu_);
  return summary_;
}

std::vector<CallFields> CallLog::kept() const {
  std::lock_guard<std::mutex> lock(mu_);
  return kept_;
}

void CallLog::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  summary_ = Summary{};
  kept_.clear();
}

}  // namespace zerort
