// StreamOrder's decisions on a fake device (Note [stream order], comm/stream_order.h): which
// events are recorded on which stream, which stream waits for which, that the engine's path
// never blocks the host, and that work ordered this way sees what came before it. The fake
// keeps a vector clock per stream, so "B runs after A" is checked, not just logged.
#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/stream_order.h"

namespace zerort {
namespace {

using Clock = std::map<int, int>;  // stream -> ops of that stream that happen before

struct FakeDevice {
  std::mutex mu;
  std::vector<std::string> log;
  std::map<int, Clock> streams;  // each stream's clock: what its next op runs after
  std::map<int, Clock> events;   // each event's clock at its last record
  int next_event = 100;
  int host_syncs = 0;

  Clock run(int stream) {  // an op on `stream`: returns what it happens after, itself included
    std::lock_guard<std::mutex> lock(mu);
    Clock& c = streams[stream];
    ++c[stream];
    return c;
  }
};

// The Streams interface of StreamOrder over a FakeDevice.
struct FakeStreams {
  using Stream = int;
  using Event = int;
  FakeDevice* device;

  Event make_event() {
    std::lock_guard<std::mutex> lock(device->mu);
    return device->next_event++;
  }
  void record(Event e, Stream s) {
    std::lock_guard<std::mutex> lock(device->mu);
    device->events[e] = device->streams[s];
    device->log.push_back("record e" + std::to_string(e) + " on s" + std::to_string(s));
  }
  void wait(Stream s, Event e) {
    std::lock_guard<std::mutex> lock(device->mu);
    Clock& c = device->streams[s];
    for (auto [stream, n] : device->events[e]) c[stream] = std::max(c[stream], n);
    device->log.push_back("s" + std::to_string(s) + " waits e" + std::to_string(e));
  }
  void synchronize(Event e) {
    std::lock_guard<std::mutex> lock(device->mu);
    ++device->host_syncs;
    device->log.push_back("host waits e" + std::to_string(e));
  }
};

bool after(const Clock& later, int stream, const Clock& earlier) {  // earlier's op on `stream` precedes later
  auto it = later.find(stream);
  return it != later.end() && it->second >= earlier.at(stream);
}

constexpr int kLegacy = 0, kUserSide = 7, kComm = 3;

TEST(StreamOrder, SideStreamWaitsForTheComputeStreamThroughOneEvent) {
  FakeDevice dev;
  StreamOrder<FakeStreams> order(FakeStreams{&dev}, kLegacy);
  EXPECT_EQ(order.compute(), kLegacy);
  order.side_after_compute(kComm);
  order.side_after_compute(kComm);
  EXPECT_EQ(dev.log,
            (std::vector<std::string>{"record e100 on s0", "s3 waits e100", "record e100 on s0", "s3 waits e100"}));
  EXPECT_EQ(dev.host_syncs, 0);
}

TEST(StreamOrder, NothingIsRecordedWhenTheSideStreamIsTheComputeStream) {
  FakeDevice dev;
  StreamOrder<FakeStreams> order(FakeStreams{&dev}, kLegacy);
  order.set_compute(kComm);
  order.side_after_compute(kComm);
  EXPECT_TRUE(dev.log.empty());
}

TEST(StreamOrder, FollowsTheUsersSideStreamNotTheLegacyOne) {
  FakeDevice dev;
  StreamOrder<FakeStreams> order(FakeStreams{&dev}, kLegacy);
  order.set_compute(kUserSide);  // `with torch.cuda.stream(s):` at the engine's entry
  order.side_after_compute(kComm);
  const int done = dev.next_event++;
  order.record(done, kComm);
  order.compute_after(done);
  EXPECT_EQ(dev.log,
            (std::vector<std::string>{"record e100 on s7", "s3 waits e100", "record e101 on s3", "s7 waits e101"}));
  for (const auto& line : dev.log) EXPECT_EQ(line.find("s0"), std::string::npos) << line;
}

// One step of the engine's device path: the user's backward writes a gradient bucket on the
// compute stream, the collective reads it on the comm stream, the user's next op reads the
// result. Each read must come after the write it needs, with no host wait.
TEST(StreamOrder, EnginePathOrdersEveryReadAfterItsWriteWithoutHostWaits) {
  for (int compute : {kLegacy, kUserSide}) {
    FakeDevice dev;
    StreamOrder<FakeStreams> order(FakeStreams{&dev}, kLegacy);
    order.set_compute(compute);
    const Clock bucket_written = dev.run(compute);
    order.side_after_compute(kComm);
    const Clock reduce = dev.run(kComm);
    const int done = order.streams().make_event();
    order.record(done, kComm);
    const Clock unrelated_user_op = dev.run(compute);  // queued before the join: may overlap the reduce
    order.compute_after(done);
    const Clock next_forward = dev.run(compute);
    EXPECT_TRUE(after(reduce, compute, bucket_written));
    EXPECT_TRUE(after(next_forward, kComm, reduce));
    EXPECT_FALSE(after(reduce, compute, unrelated_user_op));
    EXPECT_FALSE(after(unrelated_user_op, kComm, reduce));
    EXPECT_EQ(dev.host_syncs, 0);
    EXPECT_EQ(order.host_waits(HostWait::kStepDecision) + order.host_waits(HostWait::kUserCall), 0);
  }
}

TEST(StreamOrder, WithoutTheJoinTheUsersNextOpWouldRaceTheReduce) {
  FakeDevice dev;  // the check above can fail: the same path without compute_after is unordered
  StreamOrder<FakeStreams> order(FakeStreams{&dev}, kLegacy);
  order.set_compute(kUserSide);
  dev.run(kUserSide);
  order.side_after_compute(kComm);
  const Clock reduce = dev.run(kComm);
  const Clock next_forward = dev.run(kUserSide);
  EXPECT_FALSE(after(next_forward, kComm, reduce));
}

TEST(StreamOrder, HostWaitsAreCountedByReason) {
  FakeDevice dev;
  StreamOrder<FakeStreams> order(FakeStreams{&dev}, kLegacy);
  const int e = order.streams().make_event();
  order.host_wait(e, HostWait::kStepDecision);
  order.host_wait(e, HostWait::kUserCall);
  order.host_wait(e, HostWait::kUserCall);
  order.count_host_wait(HostWait::kStepDecision);
  EXPECT_EQ(order.host_waits(HostWait::kStepDecision), 2);
  EXPECT_EQ(order.host_waits(HostWait::kUserCall), 2);
  EXPECT_EQ(dev.host_syncs, 3);  // count_host_wait counts a wait another layer makes
}

TEST(StreamOrder, RecordAndWaitStayPairedAcrossThreads) {
  FakeDevice dev;
  StreamOrder<FakeStreams> order(FakeStreams{&dev}, kLegacy);
  order.set_compute(kUserSide);
  std::vector<std::thread> threads;
  for (int side : {1, 2, 3}) {
    threads.emplace_back([&, side] {
      for (int i = 0; i < 500; ++i) order.side_after_compute(side);
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_EQ(dev.log.size(), 2u * 3u * 500u);
  for (size_t i = 0; i < dev.log.size(); i += 2) {
    EXPECT_EQ(dev.log[i], "record e100 on s7");
    EXPECT_EQ(dev.log[i + 1].substr(dev.log[i + 1].find(' ')), " waits e100");
  }
}

}  // namespace
}  // namespace zerort
