// ShmSegment's creation, mapping and unlinking (Note [shm rounds]); the waits are in shm_wait.cpp.
#include "comm/shm/shm_segment.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>
#include <vector>

#include "comm/launch_env.h"
#include "comm/shm/shm_layout.h"
#include "core/error.h"

namespace zerort {

namespace {

constexpr const char* kFix = "set comm.intra_node to 'backend' to exchange through the launcher's backend instead";
constexpr size_t kNameWords = 8;  // the name travels as 64 bytes in int64 words, then the nonce

std::string path_of(const std::string& name) { return "/dev/shm" + name; }

// The mapping of the segment in this process: unmapped when dropped.
struct Mapping {
  void* base = nullptr;
  size_t bytes = 0;
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (base != nullptr) munmap(base, bytes);
  }
  void* release() {
    void* p = base;
    base = nullptr;
    return p;
  }
};

// The segment's name in /dev/shm while it has one: unlinked when dropped, on every path.
struct Name {
  std::string name;
  Name() = default;
  Name(const Name&) = delete;
  Name& operator=(const Name&) = delete;
  ~Name() { unlink(); }
  void unlink() {
    if (!name.empty()) shm_unlink(name.c_str());
    name.clear();
  }
};

void map_fd(int fd, size_t bytes, Mapping& m, const std::string& path) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  ZRT_CHECK_AS(CommError, p != MAP_FAILED, "shm: could not map ", path, " (", bytes, " bytes): ", std::strerror(err),
               "; ", kFix);
  m.base = p;
  m.bytes = bytes;
}

// Rank 0: a new segment of `bytes` under a fresh name, its pages reserved (so a full /dev/shm
// is an error here and not a SIGBUS later), its header filled in.
void create_named(Name& name, Mapping& m, size_t bytes, int world, size_t window_bytes, uint64_t nonce) {
  static std::atomic<uint32_t> counter{0};
  const std::string fresh =
      detail::concat("/zerort-shm-", getpid(), "-", counter.fetch_add(1), "-", std::to_string(nonce % 1000000007));
  const int fd = shm_open(fresh.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ZRT_CHECK_AS(CommError, fd >= 0, "shm: could not create ", path_of(fresh), ": ", std::strerror(errno),
               "; check that /dev/shm is mounted and writable, or ", kFix);
  name.name = fresh;
  int rc = ftruncate(fd, static_cast<off_t>(bytes)) == 0 ? 0 : errno;
  if (rc == 0) rc = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (rc != 0) {
    ::close(fd);
    ZRT_THROW_AS(CommError, "shm: /dev/shm has no room for ", path_of(fresh), " (", bytes, " bytes: ", world,
                 " ranks x 2 windows of ", window_bytes, " bytes and a header): ", std::strerror(rc),
                 "; mount a larger /dev/shm (docker run --shm-size) or ", kFix);
  }
  map_fd(fd, bytes, m, path_of(fresh));
  auto& h = *static_cast<ShmSegment::Header*>(m.base);
  h.magic = kShmMagic;
  h.nonce = nonce;
  h.world = static_cast<uint64_t>(world);
  h.window_bytes = window_bytes;
}

// Ranks 1..W-1: the segment rank 0 created, checked to be that one.
void open_named(const std::string& name, Mapping& m, size_t bytes, int world, uint64_t nonce) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  ZRT_CHECK_AS(CommError, fd >= 0, "shm: could not open ", path_of(name),
               ", which rank 0 of the group created: ", std::strerror(errno),
               "; the ranks of this group do not share one /dev/shm (one host, one container)", ": ", kFix);
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
    ::close(fd);
    ZRT_THROW_AS(CommError, "shm: ", path_of(name), " has ", st.st_size, " bytes where ", bytes,
                 " were expected; the ranks disagree on the group (", world, " ranks): ", kFix);
  }
  map_fd(fd, bytes, m, path_of(name));
  const auto& h = *static_cast<const ShmSegment::Header*>(m.base);
  ZRT_CHECK_AS(CommError, h.magic == kShmMagic && h.nonce == nonce && h.world == static_cast<uint64_t>(world),
               "shm: ", path_of(name), " is not the segment rank 0 of the group created (its header differs); ", kFix);
}

uint64_t fresh_nonce() {
  std::random_device rd;
  const auto t = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  return ((static_cast<uint64_t>(rd()) << 32) ^ rd() ^ t) | 1;  // never 0
}

int launch_rank() {
  try {
    return detect_launch_env().rank;
  } catch (const Error&) {
    return -1;  // a malformed launch environment only costs the errors their launch rank
  }
}

}  // namespace

std::unique_ptr<ShmSegment> ShmSegment::create(Communicator& bootstrap, size_t window_bytes) {
  const int rank = bootstrap.rank(), world = bootstrap.size();
  ZRT_CHECK(window_bytes >= 4096 && window_bytes % 4096 == 0, "shm: the window must be a positive multiple of 4096 ",
            "bytes, got ", window_bytes);
  const size_t bytes = shm_data_offset(world) + static_cast<size_t>(world) * 2 * window_bytes;
  Name name;
  Mapping mapping;
  std::string error;
  // Rank 0's name (64 bytes) and nonce; an empty name says rank 0 failed.
  std::array<int64_t, kNameWords + 1> msg{};
  if (rank == 0) {
    const uint64_t nonce = fresh_nonce();
    try {
      create_named(name, mapping, bytes, world, window_bytes, nonce);
      std::memcpy(msg.data(), name.name.data(), std::min(name.name.size(), kNameWords * 8 - 1));
      msg[kNameWords] = static_cast<int64_t>(nonce);
    } catch (const Error& e) {
      error = e.message();
    }
  }
  bootstrap.broadcast(msg.data(), msg.size(), DType::kInt64, 0)->wait();
  if (rank != 0 && msg[0] != 0) {
    char text[kNameWords * 8] = {};
    std::memcpy(text, msg.data(), sizeof(text) - 1);
    try {
      open_named(text, mapping, bytes, world, static_cast<uint64_t>(msg[kNameWords]));
    } catch (const Error& e) {
      error = e.message();
    }
  } else if (rank != 0) {
    error = detail::concat("shm: rank 0 of the group could not create the segment (see its log); ", kFix);
  }
  if (mapping.base != nullptr) {
    auto& s = *reinterpret_cast<Slot*>(static_cast<char*>(mapping.base) + sizeof(Header) +
                                       static_cast<size_t>(rank) * sizeof(Slot));
    s.pid.store(static_cast<int32_t>(getpid()));
    s.launch_rank.store(launch_rank());
  }
  // Every rank says whether it mapped the segment; after this, nobody opens the name again.
  std::vector<int32_t> ok(static_cast<size_t>(world));
  const int32_t mine = error.empty() ? 1 : 0;
  bootstrap.all_gather(&mine, ok.data(), 1, DType::kInt32)->wait();
  name.unlink();
  bootstrap.barrier()->wait();  // on return the name is gone for every rank
  ZRT_CHECK_AS(CommError, error.empty(), error);
  for (int r = 0; r < world; ++r) {
    ZRT_CHECK_AS(CommError, ok[static_cast<size_t>(r)] == 1, "shm: rank ", r, " of the group could not map the ",
                 "segment (see its log); ", kFix);
  }
  return std::unique_ptr<ShmSegment>(new ShmSegment(mapping.release(), bytes, rank, world, window_bytes));
}

ShmSegment::ShmSegment(void* base, size_t bytes, int rank, int world, size_t window_bytes)
    : base_(base), bytes_(bytes), rank_(rank), world_(world), window_bytes_(window_bytes),
      data_offset_(shm_data_offset(world)), watch_pid_(static_cast<size_t>(world)) {
  // A peer whose pid this process cannot see (another pid namespace) is never called gone;
  // its silence ends at the timeout instead.
  for (int r = 0; r < world; ++r) {
    const pid_t pid = slot(r).pid.load();
    watch_pid_[static_cast<size_t>(r)] = pid > 0 && (kill(pid, 0) == 0 || errno == EPERM);
  }
}

ShmSegment::~ShmSegment() { munmap(base_, bytes_); }

ShmSegment::Header& ShmSegment::header() const { return *static_cast<Header*>(base_); }

ShmSegment::Slot& ShmSegment::slot(int r) const {
  return *reinterpret_cast<Slot*>(static_cast<char*>(base_) + sizeof(Header) + static_cast<size_t>(r) * sizeof(Slot));
}

char* ShmSegment::window(int r, uint32_t round) const {
  const size_t index = static_cast<size_t>(r) * 2 + (round & 1U);
  return static_cast<char*>(base_) + data_offset_ + index * window_bytes_;
}

}  // namespace zerort
