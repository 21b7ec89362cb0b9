// zerort._C.Engine: the C++ Engine over torch tensors (this file needs torch_python for the
// at::Tensor <-> torch.Tensor conversion; it is a binding file, so torch/extension.h is fine).
#include <torch/extension.h>

#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <utility>

#include "core/dtype.h"
#include "core/error.h"
#include "optim/adamw.h"
#include "python/without_gil.h"
#include "runtime/engine.h"
#include "runtime/loss_scaler.h"
#include "runtime/shard_optimizer.h"

namespace py = pybind11;
using namespace zerort;

namespace {

py::dict stats_dict(const StepStats& s) {
  py::dict d;
  d["boundary"] = s.boundary;
  d["skipped"] = s.skipped;
  d["loss_scale"] = s.loss_scale;
  d["grad_norm"] = s.grad_norm;
  d["clip_coef"] = s.clip_coef;
  d["nonfinite"] = s.nonfinite;
  d["reduce_ms"] = s.reduce_ms;
  d["optimizer_ms"] = s.optimizer_ms;
  d["gather_ms"] = s.gather_ms;
  return d;
}

py::dict tier_stats_dict(const StateTierStats& s) {
  py::dict d;
  d["tier"] = tier_name(s.tier);
  d["path"] = s.path;
  d["file_bytes"] = s.file_bytes;
  d["gradient_bytes"] = s.gradient_bytes;
  d["pool_bytes"] = s.pool_bytes;
  d["ram_bytes"] = s.ram_bytes;
  d["gradient_on_device"] = s.gradient_on_device;
  d["bytes_read"] = s.bytes_read;
  d["bytes_written"] = s.bytes_written;
  d["io_wait_seconds"] = s.io_wait_seconds;
  d["io_backend"] = s.io_backend;
  d["io_backend_why"] = s.io_backend_why;
  return d;
}

// Checkpoint state as a plain dict of numbers.
py::dict state_dict(const LossScaler::State& s, int64_t adam_steps) {
  py::dict d;
  d["scale"] = s.scale;
  d["hysteresis_left"] = s.hysteresis_left;
  d["iteration"] = s.iteration;
  d["last_overflow_iteration"] = s.last_overflow_iteration;
  d["overflows"] = s.overflows;
  d["adam_steps"] = adam_steps;
  return d;
}

LossScaler::State scaler_state(const py::dict& d) {
  LossScaler::State s;
  s.scale = d["scale"].cast<double>();
  s.hysteresis_left = d["hysteresis_left"].cast<int64_t>();
  s.iteration = d["iteration"].cast<int64_t>();
  s.last_overflow_iteration = d["last_overflow_iteration"].cast<int64_t>();
  s.overflows = d["overflows"].cast<int64_t>();
  return s;
}

// (lr, beta1, beta2, eps, weight_decay, bias_correction 1 or 0) per param group, from
// zerort/engine/optimizer.py.
std::vector<AdamWHyper> hypers(const std::vector<std::array<double, 6>>& rows) {
  std::vector<AdamWHyper> out;
  for (const auto& r : rows) out.push_back(AdamWHyper{r[0], r[1], r[2], r[3], r[4], r[5] != 0.0});
  return out;
}

// Note [options by name]: EngineOptions, OptimizerOptions, LossScalerOptions and AdamWHyper
// are bound field by field (def_readwrite; a DType as its name, "bf16"), and each takes its
// fields as keywords: _C.LossScalerOptions(window=100), the rest at the struct's defaults; a
// keyword the struct lacks is a ConfigError naming it. zerort/config/native.py fills them from
// a Config's sections, taking each field a section has under the struct's own name.
template <typename T>
py::class_<T> options_class(py::module_& m, const char* name) {
  py::class_<T> cls(m, name);
  cls.def(py::init([name](const py::kwargs& kw) {
    T o;
    py::object view = py::cast(&o, py::return_value_policy::reference);  // the setters write into o
    py::object property = py::module_::import("builtins").attr("property");
    for (auto item : kw) {
      const auto key = item.first.cast<std::string>();
      py::object field = py::getattr(py::type::handle_of<T>(), key.c_str(), py::none());
      ZRT_CHECK_AS(ConfigError, py::isinstance(field, property), name, ": unknown keyword '", key, "'");
      view.attr(key.c_str()) = item.second;
    }
    return o;
  }));
  return cls;
}

template <typename T>
void dtype_field(py::class_<T>& cls, const char* name, DType T::*field) {
  cls.def_property(
      name, [field](const T& o) { return std::string(dtype_name(o.*field)); },
      [field](T& o, const std::string& dtype) { o.*field = parse_dtype(dtype); });
}

void bind_options(py::module_& m) {
  options_class<AdamWHyper>(m, "AdamWHyper")
      .def_readwrite("lr", &AdamWHyper::lr)
      .def_readwrite("beta1", &AdamWHyper::beta1)
      .def_readwrite("beta2", &AdamWHyper::beta2)
      .def_readwrite("eps", &AdamWHyper::eps)
      .def_readwrite("weight_decay", &AdamWHyper::weight_decay)
      .def_readwrite("bias_correction", &AdamWHyper::bias_correction);
  options_class<LossScalerOptions>(m, "LossScalerOptions")
      .def_readwrite("dynamic", &LossScalerOptions::dynamic)
      .def_readwrite("initial_scale", &LossScalerOptions::initial_scale)
      .def_readwrite("window", &LossScalerOptions::window)
      .def_readwrite("hysteresis", &LossScalerOptions::hysteresis)
      .def_readwrite("min_scale", &LossScalerOptions::min_scale)
      .def_readwrite("factor", &LossScalerOptions::factor)
      .def_readwrite("consecutive_hysteresis", &LossScalerOptions::consecutive_hysteresis);
  auto optimizer = options_class<OptimizerOptions>(m, "OptimizerOptions");
  dtype_field(optimizer, "precision", &OptimizerOptions::precision);
  dtype_field(optimizer, "state_dtype", &OptimizerOptions::state_dtype);
  dtype_field(optimizer, "master_dtype", &OptimizerOptions::master_dtype);
  optimizer.def_readwrite("adamw", &OptimizerOptions::adamw)
      .def_readwrite("loss_scale", &OptimizerOptions::loss_scale)
      .def_readwrite("gradient_clipping", &OptimizerOptions::gradient_clipping)
      .def_readwrite("gradient_accumulation_steps", &OptimizerOptions::gradient_accumulation_steps)
      .def_readwrite("owner_ranks", &OptimizerOptions::owner_ranks);
  options_class<NvmeStateOptions>(m, "NvmeStateOptions")  // rank is the Engine's: its communicator's
      .def_readwrite("directory", &NvmeStateOptions::directory)
      .def_readwrite("chunk_elements", &NvmeStateOptions::chunk_elements)
      .def_readwrite("buffer_count", &NvmeStateOptions::buffer_count)
      .def_readwrite("ram_fraction", &NvmeStateOptions::ram_fraction)
      .def_readwrite("queue_depth", &NvmeStateOptions::queue_depth)
      .def_readwrite("block_size", &NvmeStateOptions::block_size)
      .def_readwrite("gradient_in_file", &NvmeStateOptions::gradient_in_file)
      .def_property(
          "io_backend", [](const NvmeStateOptions& o) { return std::string(io::io_backend_name(o.io_backend)); },
          [](NvmeStateOptions& o, const std::string& backend) {
            o.io_backend = io::parse_io_backend(backend, "NvmeStateOptions.io_backend");
          });
  options_class<EngineOptions>(m, "EngineOptions")  // materialize is the Engine's own argument
      .def_readwrite("stage", &EngineOptions::stage)
      .def_readwrite("optimizer", &EngineOptions::optimizer)
      .def_readwrite("reduce_bucket_numel", &EngineOptions::reduce_bucket_numel)
      .def_readwrite("alignment", &EngineOptions::alignment)
      .def_property(
          "state_tier", [](const EngineOptions& o) { return std::string(tier_name(o.state_tier)); },
          [](EngineOptions& o, const std::string& tier) {
            ZRT_CHECK_AS(ConfigError, tier == "memory" || tier == "cpu" || tier == "nvme",
                         "EngineOptions.state_tier: got '", tier, "'; expected 'memory', 'cpu' or 'nvme'");
            o.state_tier = tier == "nvme" ? StateTier::kNvme : tier == "cpu" ? StateTier::kHost : StateTier::kMemory;
          })
      .def_readwrite("nvme", &EngineOptions::nvme)
      .def_readwrite("param_nvme_path", &EngineOptions::param_nvme_path)
      .def_readwrite("param_host", &EngineOptions::param_host)
      .def_readwrite("gradient_on_device", &EngineOptions::gradient_on_device)
      .def_readwrite("overlap_param_gather", &EngineOptions::overlap_param_gather)
      .def_readwrite("gather_int8", &EngineOptions::gather_int8)
      .def_readwrite("overlap_step", &EngineOptions::overlap_step);
}

// "master", "exp_avg" or "exp_avg_sq": the optimizer state's arrays, by Python's names.
StateArray state_array(const std::string& name) {
  if (name == "master") return StateArray::kMaster;
  if (name == "exp_avg") return StateArray::kExpAvg;
  ZRT_CHECK_AS(UsageError, name == "exp_avg_sq", "Engine: no optimizer state array '", name,
               "'; expected 'master', 'exp_avg' or 'exp_avg_sq'");
  return StateArray::kExpAvgSq;
}

// EngineOptions::materialize from a Python callable (None: none), for a meta-device model:
// (group, [param index]) -> [tensor].
std::function<std::vector<at::Tensor>(size_t, const std::vector<size_t>&)> materializer(const py::object& fn) {
  if (fn.is_none()) return nullptr;
  std::shared_ptr<py::object> held(new py::object(fn), [](py::object* p) {
    py::gil_scoped_acquire gil;
    delete p;
  });
  return [held](size_t group, const std::vector<size_t>& params) {
    py::gil_scoped_acquire gil;  // the constructor runs without the GIL
    return (*held)(group, params).cast<std::vector<at::Tensor>>();
  };
}

}  // namespace

void bind_streams(py::module_& m);  // stream_bindings.cpp

void bind_engine(py::module_& m) {
  bind_options(m);                              // See Note [options by name]
  m.attr("SHARD_ALIGNMENT") = kShardAlignment;  // elements: an Engine's shards are multiples of it
  bind_streams(m);                              // stream_bindings.cpp: Note [stream order]

  py::class_<ShardOptimizer>(m, "ShardOptimizer")
      .def(py::init([](at::Tensor master, Communicator& comm, const OptimizerOptions& options) {
             return std::make_unique<ShardOptimizer>(std::move(master), comm, options);
           }),
           py::keep_alive<1, 3>(), py::arg("master"), py::arg("comm"),  // it holds comm by reference
           py::arg("options") = OptimizerOptions())
      .def("step",
           [](ShardOptimizer& o, std::vector<std::pair<size_t, at::Tensor>> outputs) {
             // outputs: (offset into the master, contiguous bf16/f16/f32 tensor to write)
             std::vector<OutputSegment> segs;
             for (auto& [offset, t] : outputs) {
               ZRT_CHECK(t.is_contiguous(), "ShardOptimizer.step: output tensors must be contiguous");
               DType dt = t.scalar_type() == at::kBFloat16 ? DType::kBFloat16
                          : t.scalar_type() == at::kHalf   ? DType::kFloat16
                                                           : DType::kFloat32;
               ZRT_CHECK(dt != DType::kFloat32 || t.scalar_type() == at::kFloat,
                         "ShardOptimizer.step: outputs must be bf16, f16 or f32");
               segs.push_back({offset, static_cast<size_t>(t.numel()), t.data_ptr(), dt});
             }
             StepStats s;
             s.boundary = true;
             {
               py::gil_scoped_release release;
               o.step(segs, s);
             }
             return stats_dict(s);
           })
      .def_property_readonly("grad_shard", [](ShardOptimizer& o) { return o.grad_shard(); })
      .def_property_readonly("master", &ShardOptimizer::master)
      .def_property_readonly("exp_avg", &ShardOptimizer::exp_avg)
      .def_property_readonly("exp_avg_sq", &ShardOptimizer::exp_avg_sq)
      .def_property_readonly("loss_scale", &ShardOptimizer::loss_scale)
      .def_property_readonly("adam_steps", &ShardOptimizer::adam_steps)
      .def("set_hyper_groups",
           [](ShardOptimizer& o, const std::vector<std::array<double, 6>>& h, std::vector<std::array<int64_t, 3>> r) {
             o.set_hyper_groups(hypers(h), std::move(r));
           })
      .def("set_watch_regions", &ShardOptimizer::set_watch_regions)
      .def_property_readonly("nonfinite_ids", &ShardOptimizer::nonfinite_ids)
      .def("state", [](const ShardOptimizer& o) { return state_dict(o.scaler_state(), o.adam_steps()); })
      .def("load_state",
           [](ShardOptimizer& o, py::dict d) { o.load_state(scaler_state(d), d["adam_steps"].cast<int64_t>()); });

  // Deleted without the GIL (python/without_gil.h): ~Engine joins the comm thread.
  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine")
      .def(py::init([](std::vector<at::Tensor> params, std::vector<at::Tensor> fp32_params, Communicator& comm,
                       std::vector<std::tuple<std::vector<size_t>, bool, std::string>> units, EngineOptions o,
                       const py::object& materialize, Communicator* shard, Communicator* replicas,
                       const std::string& replica_dtype, Communicator* secondary) {
             o.materialize = materializer(materialize);
             // Note [hybrid sharding]; secondary: Note [secondary shards]
             const ShardGroups groups{shard, replicas, parse_inter_node_wire(replica_dtype), secondary};
             std::vector<UnitSpec> specs;  // stage 3: (parameter indices, persistent, name)
             for (auto& [ps, persistent, name] : units) specs.push_back({std::move(ps), persistent, std::move(name)});
             py::gil_scoped_release release;  // the initial broadcast is a collective
             return owned_without_gil(std::make_unique<Engine>(std::move(params), comm, o, std::move(fp32_params),
                                                               std::move(specs), groups));
           }),
           py::keep_alive<1, 4>(),  // the engine holds the communicators by reference
           py::keep_alive<1, 8>(), py::keep_alive<1, 9>(), py::keep_alive<1, 11>(), py::arg("params"),
           py::arg("fp32_params"), py::arg("comm"),
           py::arg("units") = std::vector<std::tuple<std::vector<size_t>, bool, std::string>>{},
           py::arg("options") = EngineOptions(), py::arg("materialize") = py::none(), py::arg("shard") = nullptr,
           py::arg("replicas") = nullptr, py::arg("replica_dtype") = "fp32", py::arg("secondary") = nullptr)
      .def("step",
           [](Engine& e) {
             StepStats s;
             {
               py::gil_scoped_release release;
               s = e.step();
             }
             return stats_dict(s);
           })
      .def("set_hyper_groups",
           [](Engine& e, const std::vector<std::array<double, 6>>& h, std::vector<std::array<int64_t, 3>> r) {
             auto groups = hypers(h);
             {
               py::gil_scoped_release release;
               e.finish_update();  // the overlapped update still reads the groups it began with
             }
             e.optimizer().set_hyper_groups(std::move(groups), std::move(r));
           })
      .def("set_watch_regions",
           [](Engine& e, std::vector<std::array<int64_t, 3>> r) { e.optimizer().set_watch_regions(std::move(r)); })
      .def_property_readonly("nonfinite_ids", [](Engine& e) { return e.optimizer().nonfinite_ids(); })
      .def_property_readonly("loss_scale", &Engine::loss_scale)
      .def_property_readonly("grad_denominator", &Engine::grad_denominator)
      .def_property_readonly("global_step", &Engine::global_step)
      .def_property_readonly("skipped_steps", &Engine::skipped_steps)
      .def_property_readonly("adam_steps", &Engine::adam_steps)
      .def_property_readonly("micro_steps", [](const Engine& e) { return e.counters().micro_steps; })
      // See Note [accumulation boundary] (runtime/engine.h)
      .def_property_readonly("micro_step_in_window", &Engine::micro_step_in_window)
      .def("is_boundary", &Engine::next_is_boundary)
      .def_property_readonly("num_groups", &Engine::num_groups)
      // from post-accumulate-grad hooks; at W = 1 it runs the reduce itself (Note [W = 1 is local])
      .def("grad_ready", &Engine::grad_ready, py::call_guard<py::gil_scoped_release>())
      .def("set_compute_stream", &Engine::set_compute_stream)  // Note [stream order]
      .def_property_readonly("local_only", &Engine::local_only)
      .def("begin_backward", &Engine::begin_backward, py::call_guard<py::gil_scoped_release>())
      .def("reduce_now", &Engine::reduce_now, py::call_guard<py::gil_scoped_release>())
      .def("grad", &Engine::grad)
      // Stage 3's units (from python/zerort/engine/stage3.py's module hooks). gather and
      // hold_gathered wait for the comm thread; release may wait for a gather in flight.
      .def("prefetch", &Engine::prefetch, py::call_guard<py::gil_scoped_release>())
      .def("gather", &Engine::gather, py::call_guard<py::gil_scoped_release>())
      .def("release", &Engine::release, py::call_guard<py::gil_scoped_release>())
      .def("hold_gathered", &Engine::hold_gathered, py::call_guard<py::gil_scoped_release>())
      // Stages 1-2's gathers after an update (python/zerort/engine/param_waits.py).
      .def("wait_param_gather", &Engine::wait_param_gather, py::call_guard<py::gil_scoped_release>())
      .def("wait_param_gathers", &Engine::wait_param_gathers, py::call_guard<py::gil_scoped_release>())
      .def("bucket_of", &Engine::bucket_of)
      .def_property_readonly("param_gathers_in_flight", &Engine::param_gathers_in_flight)
      .def_property_readonly("overlaps_param_gather", &Engine::overlaps_param_gather)
      // Note [overlapped step] (runtime/step_overlap.h).
      .def_property_readonly("overlaps_step", &Engine::overlaps_step)
      .def("set_update_order", &Engine::set_update_order)
      .def_property_readonly("update_order", &Engine::update_order)
      .def("hold_last_update", &Engine::hold_last_update)
      .def("finish_update", &Engine::finish_update, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("overlap_report",
                             [](const Engine& e) {
                               const OverlapReport r = e.overlap_report();
                               return py::dict(py::arg("units") = r.units, py::arg("waited_seconds") = r.waited_seconds,
                                               py::arg("caller_waited_seconds") = r.caller_waited_seconds,
                                               py::arg("waits") = r.waits,
                                               py::arg("done_at_first_wait") = r.done_at_first_wait,
                                               py::arg("first_wait_seen") = r.first_wait_seen,
                                               py::arg("hold_timed_out") = r.hold_timed_out,
                                               py::arg("update_seconds") = r.update_seconds);
                             })
      .def_property_readonly("shard_size", &Engine::shard_size)  // Note [hybrid sharding]
      .def_property_readonly("shard_rank", &Engine::shard_rank)
      .def_property_readonly("num_buckets", &Engine::num_buckets)
      .def_property_readonly("gathered_bytes", &Engine::gathered_bytes)
      .def_property_readonly("gathered_peak", &Engine::gathered_peak)
      .def("reset_gathered_peak", &Engine::reset_gathered_peak)
      .def_property_readonly("resident_param_bytes", &Engine::resident_param_bytes)
      .def_property_readonly("stage", [](const Engine& e) { return e.options().stage; })
      .def("param_offset", &Engine::param_offset)
      .def("gather_master",
           [](const Engine& e, size_t g) {
             py::gil_scoped_release release;  // a collective
             return e.gather_master(g);
           })
      .def("read_state", [](const Engine& e, const std::string& array, size_t offset,
                            size_t n) { return e.read_state(state_array(array), offset, n); })
      .def("write_state", [](Engine& e, const std::string& array, size_t offset,
                             const at::Tensor& values) { e.write_state(state_array(array), offset, values); })
      .def_property_readonly("state_numel", [](Engine& e) { return e.optimizer().state().numel(); })
      .def_property_readonly("state_tier_stats", [](const Engine& e) { return tier_stats_dict(e.state_tier_stats()); })
      .def_property_readonly("param_tier_stats", [](const Engine& e) { return tier_stats_dict(e.param_tier_stats()); })
      .def("master", &Engine::master)
      .def("exp_avg", &Engine::exp_avg)
      .def("exp_avg_sq", &Engine::exp_avg_sq)
      .def("flat_params", &Engine::flat_params)
      .def("flat_grads", &Engine::flat_grads)
      .def_property_readonly("grad_shard_bytes", &Engine::grad_shard_bytes)
      .def_property_readonly("stage0_scratch", &Engine::stage0_scratch)
      .def_property_readonly("pack_buffer_bytes", &Engine::pack_buffer_bytes)
      .def("bucket_layout", &Engine::bucket_layout)
      .def("state",
           [](const Engine& e) {
             auto c = e.counters();
             py::dict d = state_dict(c.scaler, c.adam_steps);
             d["global_step"] = c.global_step;
             d["skipped_steps"] = c.skipped_steps;
             d["micro_steps"] = c.micro_steps;
             return d;
           })
      .def("load_state",
           [](Engine& e, py::dict d) {
             e.load_counters({d["global_step"].cast<int64_t>(), d["skipped_steps"].cast<int64_t>(),
                              d["micro_steps"].cast<int64_t>(), d["adam_steps"].cast<int64_t>(), scaler_state(d)});
           })
      .def("refresh_params", [](Engine& e) {
        py::gil_scoped_release release;  // a collective
        e.refresh_params();
      });
}
