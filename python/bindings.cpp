// zerort._C: thin pybind11 layer. Buffers arrive as (data_ptr, numel, dtype name) from
// zerort.comm (python/zerort/comm/__init__.py) and the tests' kernels
// (python/zerort/_testing/kernels.py), through python/zerort/comm/tensor_args.py, which owns
// the tensor checks. Blocking calls release the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>

#include "comm/communicator.h"
#include "comm/communicator_factory.h"
#include "comm/gloo/gloo_communicator.h"
#include "comm/shm/shm_communicator.h"
#include "comm/launch_env.h"
#include "comm/peer_exits.h"
#include "comm/staged_communicator.h"
#include "comm/int8_blocks.h"
#include "comm/two_hop_communicator.h"
#include "core/error.h"
#include "optim/adamw.h"
#include "partition/bucket_plan.h"
#include "partition/shard_layout.h"
#include "python/comm_options.h"
#include "python/without_gil.h"
#include "runtime/kernel_dispatch.h"
#include "zerort/config.h"
#if ZERORT_WITH_NCCL
#include "comm/nccl/nccl_communicator.h"
#endif
#if ZERORT_WITH_MPI
#include "comm/mpi_communicator.h"
#endif

namespace py = pybind11;
using namespace zerort;

void bind_engine(py::module_& m);     // engine_bindings.cpp
void bind_allocator(py::module_& m);  // allocator_bindings.cpp
void bind_comm_gpu(py::module_& m);   // comm_gpu_bindings.cpp

namespace {

void* ptr(uintptr_t address) { return reinterpret_cast<void*>(address); }

// Kernels take the tensor's device index: -1 for CPU memory, else the CUDA device.
c10::Device device_of(int index) {
  return index < 0 ? c10::Device(c10::kCPU) : c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
}

ReduceOp parse_op(const std::string& op) {
  if (op == "sum") return ReduceOp::kSum;
  if (op == "max") return ReduceOp::kMax;
  if (op == "min") return ReduceOp::kMin;
  ZRT_THROW("unknown reduce op '", op, "'; use 'sum', 'max' or 'min'");
}

// Runs a collective to completion without the GIL.
template <typename Launch>
void run(Launch&& launch) {
  py::gil_scoped_release release;
  launch()->wait();
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "zerort C++ core";
  // Each C++ kind of failure (core/error.h) is raised as the Python class of the same
  // name in zerort.errors, so a failure has one type whichever language raised it. The
  // classes live as long as the process (the translator may run at any time).
  py::module_ errors = py::module_::import("zerort.errors");
  const auto kind = [&errors](const char* name) {
    return py::object(errors.attr(name)).release().ptr();  // one reference kept for good
  };
  for (const char* name : {"Error", "UsageError", "DeviceError", "ConfigError", "LossScaleError", "CommError",
                           "CommTimeoutError", "CollectiveMismatchError"}) {
    m.attr(name) = errors.attr(name);  // zerort._C.X is zerort.errors.X
  }
  static PyObject* const error = kind("Error");
  static PyObject* const usage_error = kind("UsageError");
  static PyObject* const device_error = kind("DeviceError");
  static PyObject* const config_error = kind("ConfigError");
  static PyObject* const loss_scale_error = kind("LossScaleError");
  static PyObject* const comm_error = kind("CommError");
  static PyObject* const comm_timeout_error = kind("CommTimeoutError");
  static PyObject* const mismatch_error = kind("CollectiveMismatchError");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const DeviceError& e) {  // most derived first
      PyErr_SetString(device_error, e.what());
    } catch (const UsageError& e) {
      PyErr_SetString(usage_error, e.what());
    } catch (const ConfigError& e) {
      PyErr_SetString(config_error, e.what());
    } catch (const LossScaleError& e) {
      PyErr_SetString(loss_scale_error, e.what());
    } catch (const CommTimeoutError& e) {
      PyErr_SetString(comm_timeout_error, e.what());
    } catch (const CollectiveMismatchError& e) {
      PyErr_SetString(mismatch_error, e.what());
    } catch (const CommError& e) {
      PyErr_SetString(comm_error, e.what());
    } catch (const Error& e) {
      PyErr_SetString(error, e.what());
    }
  });

  m.attr("__version__") = ZERORT_VERSION;
  bind_engine(m);
  bind_allocator(m);
  bind_comm_gpu(m);
  m.attr("with_mpi") = static_cast<bool>(ZERORT_WITH_MPI);
  m.attr("with_cuda") = static_cast<bool>(ZERORT_WITH_CUDA);
  m.attr("with_nccl") = static_cast<bool>(ZERORT_WITH_NCCL);

  m.def("detect_launch_env", [] {
    LaunchEnv e = detect_launch_env();
    py::dict d;
    d["launcher"] = launcher_name(e.launcher);
    d["rank"] = e.rank;
    d["world_size"] = e.world_size;
    d["local_rank"] = e.local_rank;
    d["local_world_size"] = e.local_world_size;
    d["master_addr"] = e.master_addr;
    d["master_port"] = e.master_port;
    return d;
  });
  m.def("note_peer_exit", &note_peer_exit, py::arg("rank"), py::arg("how"));
  m.def("clear_peer_exits", &clear_peer_exits);
  m.def("resolve_backend", [](const std::string& backend) { return resolve_backend(backend, detect_launch_env()); });

  py::class_<Work, std::shared_ptr<Work>>(m, "Work").def("wait", [](Work& w) {
    py::gil_scoped_release release;
    w.wait();
  });

  // Deleted without the GIL (python/without_gil.h): a gloo communicator's last reference to
  // c10d's backend joins gloo's worker threads.
  py::class_<Communicator, std::shared_ptr<Communicator>>(m, "Communicator")
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def_property_readonly("backend", &Communicator::backend_name)
      .def_property_readonly("device_memory", &Communicator::device_memory)
      .def_property_readonly("scratch_peak_bytes", &Communicator::scratch_peak_bytes)
      .def_property_readonly("backend_calls", &Communicator::backend_calls)
      .def_property_readonly("checks_each_call", &Communicator::checks_each_call)
      .def("check_each_call", &Communicator::check_each_call)
      // A test knob: See Note [delayed calls] (comm/communicator.h). kind: "gathers" or "reduces".
      .def(
          "delay_calls",
          [](Communicator& c, const std::string& kind, int64_t microseconds) {
            ZRT_CHECK_AS(ConfigError, kind == "gathers" || kind == "reduces",
                         "comm.delay_calls: kind must be 'gathers' or 'reduces', got '", kind, "'");
            c.delay_calls(kind == "gathers" ? DelayedCalls::kGathers : DelayedCalls::kReduces,
                          std::chrono::microseconds(microseconds));
          },
          py::arg("kind"), py::arg("microseconds"))
      .def("reset_scratch_peak", &Communicator::reset_scratch_peak)
      .def("all_reduce",
           [](Communicator& c, uintptr_t buf, size_t n, const std::string& dt, const std::string& op) {
             run([&] { return c.all_reduce(ptr(buf), n, parse_dtype(dt), parse_op(op)); });
           })
      .def("reduce_scatter",
           [](Communicator& c, uintptr_t in, uintptr_t out, size_t n, const std::string& dt, const std::string& op) {
             run([&] { return c.reduce_scatter(ptr(in), ptr(out), n, parse_dtype(dt), parse_op(op)); });
           })
      .def(
          "reduce_scatter_accumulate",
          [](Communicator& c, uintptr_t in, const std::string& dt, uintptr_t out, size_t n, bool accumulate,
             int64_t tag) {
            run([&] {
              return c.reduce_scatter_accumulate(ptr(in), parse_dtype(dt), static_cast<float*>(ptr(out)), n, accumulate,
                                                 tag);
            });
          },
          py::arg("inp"), py::arg("dtype"), py::arg("out"), py::arg("n"), py::arg("accumulate"),
          py::arg("tag") = kNoTag)
      .def(
          "all_gather",
          [](Communicator& c, uintptr_t in, uintptr_t out, size_t n, const std::string& dt, int64_t tag) {
            run([&] { return c.all_gather(ptr(in), ptr(out), n, parse_dtype(dt), tag); });
          },
          py::arg("inp"), py::arg("out"), py::arg("n"), py::arg("dtype"), py::arg("tag") = kNoTag)
      .def(
          "all_gather_async",
          [](Communicator& c, uintptr_t in, uintptr_t out, size_t n, const std::string& dt, int64_t tag) {
            return c.all_gather(ptr(in), ptr(out), n, parse_dtype(dt), tag);  // may block in the arg check
          },
          py::arg("inp"), py::arg("out"), py::arg("n"), py::arg("dtype"), py::arg("tag") = kNoTag,
          py::call_guard<py::gil_scoped_release>())
      .def("all_to_all",
           [](Communicator& c, uintptr_t in, uintptr_t out, size_t n, const std::string& dt) {
             run([&] { return c.all_to_all(ptr(in), ptr(out), n, parse_dtype(dt)); });
           })
      .def("broadcast", [](Communicator& c, uintptr_t buf, size_t n, const std::string& dt,
                           int root) { run([&] { return c.broadcast(ptr(buf), n, parse_dtype(dt), root); }); })
      .def("barrier", [](Communicator& c) { run([&] { return c.barrier(); }); });

  m.def(
      "make_communicator",
      [](const std::string& backend, double timeout_s, bool check) {
        py::gil_scoped_release release;  // MPI_Init may take a while
        return owned_without_gil(make_communicator(backend, detect_launch_env(), comm_options(timeout_s, check)));
      },
      py::arg("backend"), py::arg("timeout_s"), py::arg("debug"));
  // Note [two hops]: the flat communicator over its intra-node and inter-node parts.
  m.def(
      "make_two_hop_communicator",
      [](std::shared_ptr<Communicator> flat, std::shared_ptr<Communicator> intra, std::shared_ptr<Communicator> inter,
         const std::string& inter_dtype, double timeout_s, bool debug, int device) {
        return owned_without_gil(make_two_hop_communicator(std::move(flat), std::move(intra), std::move(inter),
                                                           parse_inter_node_wire(inter_dtype),
                                                           comm_options(timeout_s, debug), device));
      },
      py::arg("flat"), py::arg("intra"), py::arg("inter"), py::arg("inter_dtype"), py::arg("timeout_s"),
      py::arg("debug"), py::arg("device") = -1);  // device: the CUDA device of nccl parts, -1: host
#if ZERORT_WITH_MPI
  m.def(
      "make_mpi_part",
      [](int color, int key, double timeout_s, bool debug) {
        py::gil_scoped_release release;
        return owned_without_gil(make_mpi_communicator(comm_options(timeout_s, debug), color, key));
      },
      py::arg("color"), py::arg("key"), py::arg("timeout_s"), py::arg("debug"));
#endif
  m.def(
      "make_gloo_communicator",
      [](const std::string& group_name, double timeout_s, bool check) {
        return owned_without_gil(make_gloo_communicator(group_name, comm_options(timeout_s, check)));
      },
      py::arg("group_name"), py::arg("timeout_s"), py::arg("debug"));
  // The ranks of one host through one /dev/shm segment, its name carried once by `bootstrap`
  // (a communicator of the same ranks; a collective over it).
  m.def(
      "make_shm_communicator",
      [](std::shared_ptr<Communicator> bootstrap, double timeout_s, bool debug) {
        py::gil_scoped_release release;
        return owned_without_gil(make_shm_communicator(*bootstrap, comm_options(timeout_s, debug)));
      },
      py::arg("bootstrap"), py::arg("timeout_s"), py::arg("debug"));

  // A host communicator carrying device buffers (device >= 0: CUDA, pinned staging) or,
  // with device -1, CPU buffers through the same staging code.
  m.def(
      "make_staged_communicator",
      [](std::shared_ptr<Communicator> inner, int device, double timeout_s, bool debug) {
        std::unique_ptr<Mover> mover;
        if (device < 0) {
          mover = make_host_mover();
        } else {
#if ZERORT_WITH_NCCL
          mover = make_cuda_mover(device);
#else
          ZRT_THROW("staging CUDA buffers needs a build with CUDA (nvcc was not found at build time)");
#endif
        }
        return owned_without_gil(
            make_staged_communicator(std::move(inner), std::move(mover), comm_options(timeout_s, debug)));
      },
      py::arg("inner"), py::arg("device"), py::arg("timeout_s"), py::arg("debug"));

#if ZERORT_WITH_NCCL
  m.def("nccl_unique_id", [] { return py::bytes(nccl_unique_id()); });
  m.def(
      "make_nccl_communicator",
      [](int rank, int size, int device, py::bytes id, double timeout_s, bool check) {
        std::string raw = id;
        py::gil_scoped_release release;  // waits for every rank to join
        return owned_without_gil(make_nccl_communicator(rank, size, device, raw, comm_options(timeout_s, check)));
      },
      py::arg("rank"), py::arg("size"), py::arg("device"), py::arg("unique_id"), py::arg("timeout_s"),
      py::arg("debug"));
#endif

  m.def(
      "cast_from_f32",
      [](uintptr_t in, uintptr_t out, const std::string& dt, size_t n, int device) {
        py::gil_scoped_release release;
        cast_from_f32_on(device_of(device), static_cast<const float*>(ptr(in)), ptr(out), parse_dtype(dt), n);
      },
      py::arg("inp"), py::arg("out"), py::arg("dtype"), py::arg("n"), py::arg("device") = -1);
  m.def(
      "cast_to_f32",
      [](uintptr_t in, const std::string& dt, uintptr_t out, size_t n, int device) {
        py::gil_scoped_release release;
        cast_to_f32_on(device_of(device), ptr(in), parse_dtype(dt), static_cast<float*>(ptr(out)), n);
      },
      py::arg("inp"), py::arg("dtype"), py::arg("out"), py::arg("n"), py::arg("device") = -1);
  m.def(
      "sum_chunks_to_f32",
      [](uintptr_t chunks, const std::string& dt, size_t world, size_t n, uintptr_t out, bool accumulate, int device) {
        py::gil_scoped_release release;
        sum_chunks_to_f32_on(device_of(device), ptr(chunks), parse_dtype(dt), world, n, static_cast<float*>(ptr(out)),
                             accumulate);
      },
      py::arg("chunks"), py::arg("dtype"), py::arg("world"), py::arg("n"), py::arg("out"), py::arg("accumulate"),
      py::arg("device") = -1);

  // Note [int8 blocks]: the two-hop wire's codes and scales (CPU; tests and bench/int8_wire.py).
  m.attr("INT8_BLOCK") = kInt8Block;
  m.def(
      "int8_wire_bytes", [](size_t n, size_t block) { return int8_wire_bytes(n, block); }, py::arg("n"),
      py::arg("block") = kInt8Block);
  // code: "int8" or "fp8_e4m3".
  auto is_int8 = [](const std::string& code) {
    ZRT_CHECK(code == "int8" || code == "fp8_e4m3", "8-bit blocks: code '", code, "'; expected int8 or fp8_e4m3");
    return code == "int8";
  };
  m.def(
      "encode_8bit_blocks",
      [is_int8](const std::string& code, uintptr_t x, size_t n, uintptr_t wire, size_t block) {
        auto encode = is_int8(code) ? encode_int8_blocks : encode_fp8_blocks;
        py::gil_scoped_release release;
        encode(static_cast<const float*>(ptr(x)), n, ptr(wire), block);
      },
      py::arg("code"), py::arg("x"), py::arg("n"), py::arg("wire"), py::arg("block") = kInt8Block);
  m.def(
      "decode_8bit_blocks",
      [is_int8](const std::string& code, uintptr_t wire, size_t n, uintptr_t x, size_t block) {
        auto decode = is_int8(code) ? decode_int8_blocks : decode_fp8_blocks;
        py::gil_scoped_release release;
        decode(ptr(wire), n, static_cast<float*>(ptr(x)), block);
      },
      py::arg("code"), py::arg("wire"), py::arg("n"), py::arg("x"), py::arg("block") = kInt8Block);

  m.def("adamw_step",
        [](uintptr_t grad, const std::string& grad_dt, uintptr_t master, uintptr_t m_, uintptr_t v,
           const std::string& state_dt, uintptr_t param, const std::string& param_dt, size_t n, double lr, double beta1,
           double beta2, double eps, double weight_decay, int64_t step, float grad_multiplier, int device) {
          AdamWBuffers b;
          b.grad = ptr(grad);
          b.grad_dtype = parse_dtype(grad_dt);
          b.master = static_cast<float*>(ptr(master));
          b.exp_avg = ptr(m_);
          b.exp_avg_sq = ptr(v);
          b.state_dtype = parse_dtype(state_dt);
          b.param = ptr(param);
          b.param_dtype = parse_dtype(param_dt);
          b.n = n;
          AdamWStep s;
          s.hyper = AdamWHyper{lr, beta1, beta2, eps, weight_decay};
          s.step = step;
          s.grad_multiplier = grad_multiplier;
          py::gil_scoped_release release;
          adamw_step_on(device_of(device), b, s);
        });
  m.def("unscale_and_check", [](uintptr_t grad, size_t n, float inv_scale, int device) {
    GradStats s;
    {
      py::gil_scoped_release release;
      s = unscale_and_check_on(device_of(device), static_cast<float*>(ptr(grad)), n, inv_scale);
    }
    return py::make_tuple(s.nonfinite, s.sum_squares);
  });

  m.def("plan_buckets", [](const std::vector<size_t>& numels, int world, size_t bucket, size_t alignment) {
    py::list out;  // (parameter indices, padded_numel, shard_numel) per bucket
    for (auto& b : plan_buckets(numels, world, bucket, alignment)) {
      out.append(py::make_tuple(b.params, b.layout.padded_numel(), b.layout.shard_numel()));
    }
    return out;
  });

  py::class_<ParamSlice>(m, "ParamSlice")
      .def_readonly("param", &ParamSlice::param)
      .def_readonly("rank", &ParamSlice::rank)
      .def_readonly("param_offset", &ParamSlice::param_offset)
      .def_readonly("flat_offset", &ParamSlice::flat_offset)
      .def_readonly("shard_offset", &ParamSlice::shard_offset)
      .def_readonly("numel", &ParamSlice::numel);
  py::class_<ShardLayout>(m, "ShardLayout")
      .def(py::init<std::vector<size_t>, int, size_t>(), py::arg("numels"), py::arg("world_size"),
           py::arg("alignment") = 1)
      .def_property_readonly("numel", &ShardLayout::numel)
      .def_property_readonly("padded_numel", &ShardLayout::padded_numel)
      .def_property_readonly("shard_numel", &ShardLayout::shard_numel)
      .def("shard_range",
           [](const ShardLayout& l, int rank) {
             Range r = l.shard_range(rank);
             return py::make_tuple(r.begin, r.end);
           })
      .def("slices_in_shard", &ShardLayout::slices_in_shard)
      .def("slices_of_param", &ShardLayout::slices_of_param);
}
