#include "comm/mpi_communicator.h"

#include <mpi.h>

#include <chrono>
#include <climits>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/local_reduce.h"
#include "comm/peer_exits.h"
#include "core/error.h"

namespace zerort {

namespace {

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  return std::string(text, static_cast<size_t>(len));
}

#define ZRT_CHECK_MPI(call, what)                                                                               \
  do {                                                                                                          \
    int zrt_rc_ = (call);                                                                                       \
    ZRT_CHECK_AS(CommError, zrt_rc_ == MPI_SUCCESS, what, ": ", #call, " failed: ", mpi_error_string(zrt_rc_)); \
  } while (0)

// Process-wide MPI state: init once, custom bf16/f16 types and ops, finalize at exit.
struct MpiRuntime {
  MPI_Datatype bf16 = MPI_DATATYPE_NULL;
  MPI_Datatype f16 = MPI_DATATYPE_NULL;
  MPI_Op half_ops[3] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};  // sum, max, min

  // Requests nobody will wait for again (a timed-out wait, a dropped Work). MPI forbids
  // freeing an active collective request, so they are polled once more at exit.
  void abandon(MPI_Request request) {
    std::lock_guard<std::mutex> lock(mu);
    abandoned.push_back(request);
  }
  bool has_abandoned() {
    std::lock_guard<std::mutex> lock(mu);
    return !abandoned.empty();
  }

  // Note [goodbye messages]: a rank that ends normally sends every peer its rank on a
  // communicator of its own (`exits`) before MPI_Finalize; a peer still waiting in a
  // collective receives it while it polls and notes the exit (comm/peer_exits.h), so that
  // wait ends at once, naming the rank, instead of at comm.timeout_s. The sends complete
  // before MPI_Finalize (or 2 s pass): Open MPI's finalize waits for every rank, and a send
  // left to progress after it could write to a peer that already exited (over TCP, a
  // broken pipe that ends this rank with a FATAL error and exit code 255).
  void set_exits(MPI_Comm comm) {
    std::lock_guard<std::mutex> lock(mu);
    if (exits == MPI_COMM_NULL) exits = comm;
  }
  bool has_exits() {
    std::lock_guard<std::mutex> lock(mu);
    return exits != MPI_COMM_NULL;
  }
  void poll_goodbyes() {
    MPI_Comm comm = current_exits();
    if (comm == MPI_COMM_NULL) return;
    for (;;) {
      int flag = 0;
      MPI_Status status;
      if (MPI_Iprobe(MPI_ANY_SOURCE, kGoodbyeTag, comm, &flag, &status) != MPI_SUCCESS || !flag) return;
      int rank = -1;
      MPI_Recv(&rank, 1, MPI_INT, status.MPI_SOURCE, kGoodbyeTag, comm, MPI_STATUS_IGNORE);
      note_peer_exit(status.MPI_SOURCE, "exited");
    }
  }

  static MpiRuntime& get() {
    static MpiRuntime* runtime = new MpiRuntime();  // leaked on purpose: finalize is atexit
    return *runtime;
  }

 private:
  static constexpr int kGoodbyeTag = 1;
  std::mutex mu;
  std::vector<MPI_Request> abandoned;
  MPI_Comm exits = MPI_COMM_NULL;

  MPI_Comm current_exits() {
    std::lock_guard<std::mutex> lock(mu);
    return exits;
  }
  // The goodbye sends, in flight: See Note [goodbye messages].
  std::vector<MPI_Request> say_goodbye() {
    std::vector<MPI_Request> sends;
    MPI_Comm comm = current_exits();
    if (comm == MPI_COMM_NULL) return sends;
    static int me = 0;  // the sends read it after this returns
    int size = 1;
    MPI_Comm_rank(comm, &me);
    MPI_Comm_size(comm, &size);
    for (int r = 0; r < size; ++r) {
      if (r == me) continue;
      MPI_Request req;
      if (MPI_Isend(&me, 1, MPI_INT, r, kGoodbyeTag, comm, &req) == MPI_SUCCESS) sends.push_back(req);
    }
    return sends;
  }

  // Tests requests until all are done or the deadline passes; true when all are done.
  static bool complete_by(std::vector<MPI_Request>& requests, std::chrono::steady_clock::time_point deadline) {
    int all_done = 0;
    for (;;) {
      MPI_Testall(static_cast<int>(requests.size()), requests.data(), &all_done, MPI_STATUSES_IGNORE);
      if (all_done || std::chrono::steady_clock::now() >= deadline) return all_done != 0;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  MpiRuntime() {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      ZRT_CHECK_MPI(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI init");
      std::atexit(&MpiRuntime::finalize_at_exit);
    }
    ZRT_CHECK_MPI(MPI_Type_contiguous(2, MPI_BYTE, &bf16), "MPI init");
    ZRT_CHECK_MPI(MPI_Type_commit(&bf16), "MPI init");
    ZRT_CHECK_MPI(MPI_Type_contiguous(2, MPI_BYTE, &f16), "MPI init");
    ZRT_CHECK_MPI(MPI_Type_commit(&f16), "MPI init");
    ZRT_CHECK_MPI(MPI_Op_create(&half_op<ReduceOp::kSum>, 1, &half_ops[0]), "MPI init");
    ZRT_CHECK_MPI(MPI_Op_create(&half_op<ReduceOp::kMax>, 1, &half_ops[1]), "MPI init");
    ZRT_CHECK_MPI(MPI_Op_create(&half_op<ReduceOp::kMin>, 1, &half_ops[2]), "MPI init");
  }

  template <ReduceOp Op>
  static void half_op(void* in, void* inout, int* len, MPI_Datatype* type) {
    DType dtype = (*type == get().bf16) ? DType::kBFloat16 : DType::kFloat16;
    reduce_into(inout, in, static_cast<size_t>(*len), dtype, Op);
  }

  static void finalize_at_exit() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    // A collective abandoned after a timeout may still complete once late peers join.
    // If it has not within 2 s, MPI_Finalize could wait for it forever: exit without it,
    // and mpirun reports this rank as failed instead of the job hanging.
    auto& rt = get();
    std::vector<MPI_Request> goodbyes = rt.say_goodbye();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    if (!complete_by(goodbyes, deadline)) {  // See Note [goodbye messages]; finalize takes them over, as before
      for (MPI_Request& r : goodbyes) {
        if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
      }
    }
    if (complete_by(rt.abandoned, deadline)) MPI_Finalize();
  }
};

MPI_Datatype mpi_type(DType dtype) {
  auto& rt = MpiRuntime::get();
  switch (dtype) {
    case DType::kFloat32: return MPI_FLOAT;
    case DType::kFloat64: return MPI_DOUBLE;
    case DType::kInt32: return MPI_INT32_T;
    case DType::kInt64: return MPI_INT64_T;
    case DType::kBFloat16: return rt.bf16;
    case DType::kFloat16: return rt.f16;
  }
  ZRT_THROW("MPI: unknown dtype value ", static_cast<int32_t>(dtype));
}

MPI_Op mpi_op(DType dtype, ReduceOp op) {
  int index = static_cast<int>(op);
  if (is_low_precision(dtype)) return MpiRuntime::get().half_ops[index];
  const MPI_Op builtin[3] = {MPI_SUM, MPI_MAX, MPI_MIN};
  return builtin[index];
}

int mpi_count(size_t count, const CollectiveDesc& d) {
  ZRT_CHECK(count <= static_cast<size_t>(INT_MAX), d.to_string(), ": ", count,
            " elements in one call exceed MPI's int count limit (", INT_MAX,
            "); split the call into pieces, or use more ranks so each shard is smaller");
  return static_cast<int>(count);
}

class MpiWork final : public Work {
 public:
  MpiWork(const CollectiveDesc& d, std::chrono::milliseconds timeout, MPI_Request request)
      : Work(d, timeout), request_(request) {}
  ~MpiWork() override {
    if (request_ != MPI_REQUEST_NULL) {  // dropped before completion: MPI may still write
      MpiRuntime::get().abandon(request_);
      retire_buffers();
    }
  }

 protected:
  bool wait_until(std::chrono::steady_clock::time_point deadline) override {
    MpiRuntime::get().poll_goodbyes();  // Note [goodbye messages]
    // Poll with MPI_Test (which also drives progress), backing off to ~200 us sleeps.
    for (int spins = 0;; ++spins) {
      int flag = 0;
      ZRT_CHECK_MPI(MPI_Test(&request_, &flag, MPI_STATUS_IGNORE), desc().to_string());
      if (flag) return true;
      if (std::chrono::steady_clock::now() >= deadline) return false;
      if (spins > 1000)
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      else if (spins > 100)
        std::this_thread::yield();
    }
  }
  void on_timeout() override {
    MpiRuntime::get().abandon(request_);
    request_ = MPI_REQUEST_NULL;
  }

 private:
  MPI_Request request_;
};

class MpiCommunicator final : public Communicator {
 public:
  static std::unique_ptr<Communicator> create(CommOptions options, int color, int key) {
    MpiRuntime::get();
    // Creation is collective too: a non-blocking dup, so a missing rank is a timeout. The
    // handle lives on the heap, kept alive by the Work, since MPI writes it on completion.
    auto comm_handle = std::make_shared<MPI_Comm>(MPI_COMM_NULL);
    MPI_Request req = MPI_REQUEST_NULL;
    ZRT_CHECK_MPI(MPI_Comm_idup(MPI_COMM_WORLD, comm_handle.get(), &req), "MPI communicator");
    CollectiveDesc d;
    d.kind = Collective::kBarrier;
    d.backend = "mpi (communicator creation)";
    MPI_Comm_rank(MPI_COMM_WORLD, &d.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &d.world);
    MpiWork creation(d, options.timeout, req);
    creation.keep_alive(comm_handle);
    creation.wait();
    MPI_Comm comm = *comm_handle;
    ZRT_CHECK_MPI(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI communicator");
    if (!MpiRuntime::get().has_exits()) {  // the first communicator also makes the goodbyes' own
      auto exits = std::make_shared<MPI_Comm>(MPI_COMM_NULL);
      ZRT_CHECK_MPI(MPI_Comm_idup(MPI_COMM_WORLD, exits.get(), &req), "MPI communicator");
      MpiWork exits_creation(d, options.timeout, req);
      exits_creation.keep_alive(exits);
      exits_creation.wait();
      ZRT_CHECK_MPI(MPI_Comm_set_errhandler(*exits, MPI_ERRORS_RETURN), "MPI communicator");
      MpiRuntime::get().set_exits(*exits);
    }
    if (color >= 0) {
      MPI_Comm part = MPI_COMM_NULL;
      ZRT_CHECK_MPI(MPI_Comm_split(comm, color, key, &part), "MPI communicator split");
      ZRT_CHECK_MPI(MPI_Comm_free(&comm), "MPI communicator split");
      comm = part;
      ZRT_CHECK_MPI(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI communicator split");
    }
    int rank = 0, size = 1;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    return std::unique_ptr<Communicator>(new MpiCommunicator(comm, rank, size, options));
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && !MpiRuntime::get().has_abandoned()) MPI_Comm_free(&comm_);
  }
  const char* backend_name() const override { return "mpi"; }

 protected:
  WorkPtr do_all_reduce(void* buf, const CollectiveDesc& d) override {
    MPI_Request req;
    ZRT_CHECK_MPI(
        MPI_Iallreduce(MPI_IN_PLACE, buf, mpi_count(d.count, d), mpi_type(d.dtype), mpi_op(d.dtype, d.op), comm_, &req),
        d.to_string());
    return make(d, req);
  }
  WorkPtr do_reduce_scatter(const void* in, void* out, const CollectiveDesc& d) override {
    MPI_Request req;
    ZRT_CHECK_MPI(MPI_Ireduce_scatter_block(in, out, mpi_count(d.count, d), mpi_type(d.dtype), mpi_op(d.dtype, d.op),
                                            comm_, &req),
                  d.to_string());
    return make(d, req);
  }
  WorkPtr do_all_gather(const void* in, void* out, const CollectiveDesc& d) override {
    MPI_Request req;
    int n = mpi_count(d.count, d);
    // In place when `in` is this rank's chunk of `out` (MPI forbids aliased buffers).
    const char* own = static_cast<const char*>(out) + static_cast<size_t>(rank()) * d.count * dtype_size(d.dtype);
    const void* send = in == own ? MPI_IN_PLACE : in;
    ZRT_CHECK_MPI(MPI_Iallgather(send, n, mpi_type(d.dtype), out, n, mpi_type(d.dtype), comm_, &req), d.to_string());
    return make(d, req);
  }
  WorkPtr do_all_to_all(const void* in, void* out, const CollectiveDesc& d) override {
    MPI_Request req;
    int n = mpi_count(d.count, d);
    ZRT_CHECK_MPI(MPI_Ialltoall(in, n, mpi_type(d.dtype), out, n, mpi_type(d.dtype), comm_, &req), d.to_string());
    return make(d, req);
  }
  WorkPtr do_broadcast(void* buf, const CollectiveDesc& d) override {
    MPI_Request req;
    ZRT_CHECK_MPI(MPI_Ibcast(buf, mpi_count(d.count, d), mpi_type(d.dtype), d.root, comm_, &req), d.to_string());
    return make(d, req);
  }
  WorkPtr do_barrier(const CollectiveDesc& d) override {
    MPI_Request req;
    ZRT_CHECK_MPI(MPI_Ibarrier(comm_, &req), d.to_string());
    return make(d, req);
  }

 private:
  MpiCommunicator(MPI_Comm comm, int rank, int size, CommOptions options)
      : Communicator(rank, size, options), comm_(comm) {}
  WorkPtr make(const CollectiveDesc& d, MPI_Request req) {
    return std::make_shared<MpiWork>(d, options().timeout, req);
  }

  MPI_Comm comm_;
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(CommOptions options, int color, int key) {
  ZRT_CHECK(color >= -1, "make_mpi_communicator: color must be >= 0 (or -1 for the whole world), got ", color);
  return MpiCommunicator::create(options, color, key);
}

}  // namespace zerort
