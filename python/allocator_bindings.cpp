// zerort._C's counting CPU allocator (runtime/counting_allocator.h): install it, read it,
// start a new peak window, mark a generation, and a memory phase's boundary in one call
// (phase_mark). zerort/accounting/phases.py is the Python side.
#include <torch/extension.h>

#include "core/error.h"
#include "runtime/counting_allocator.h"
#include "runtime/engine.h"

namespace py = pybind11;
using namespace zerort;

namespace {

CountingAllocator& installed() {
  CountingAllocator* a = installed_counting_allocator();
  ZRT_CHECK(a != nullptr,
            "the counting CPU allocator is not installed; call "
            "zerort._C.install_counting_allocator() (zerort.accounting.memory.install_counting_allocator()) first");
  return *a;
}

}  // namespace

void bind_allocator(py::module_& m) {
  m.def("install_counting_allocator", &install_counting_allocator,
        "Installs zerort's counting CPU allocator over torch's, once per process (later calls do "
        "nothing). Returns True when it is torch's CPU allocator now. Only CPU storages allocated "
        "after the first call are counted.");
  m.def(
      "allocator_stats",
      [] {
        const AllocatorStats s = installed().stats();
        py::dict d;
        d["current"] = s.current;
        d["peak"] = s.peak;
        return d;
      },
      "Bytes of CPU memory the counting allocator has handed out: {'current': live now, 'peak': "
      "the most since the last reset_allocator_peak()}.");
  m.def(
      "mark_allocator", [] { installed().mark(); },
      "Starts a new generation: allocator_since_mark() counts from 0 the bytes allocated after "
      "this call that are still live; freeing older memory does not change it.");
  m.def(
      "allocator_since_mark", [] { return installed().stats().since_mark; },
      "Bytes allocated since the last mark_allocator() and still live.");
  m.def(
      "allocated_since_mark",
      [](const at::Tensor& t) { return t.has_storage() && installed().allocated_since_mark(t.storage().data_ptr()); },
      "Whether the tensor's storage was allocated by the counting allocator after the last "
      "mark_allocator().");
  m.def(
      "reset_allocator_peak", [] { installed().reset_peak(); }, "Starts a new peak window: peak := current.");
  m.def(
      "phase_mark",
      [](bool reset, bool cpu, Engine* engine) {
        // The engine's counter first, as zerort.accounting.phases.EngineMemory reads it.
        int64_t gathered_peak = 0, gathered_bytes = 0;
        if (engine != nullptr) {
          gathered_peak = static_cast<int64_t>(engine->gathered_peak());
          if (reset) engine->reset_gathered_peak();
          gathered_bytes = static_cast<int64_t>(engine->gathered_bytes());
        }
        const PhaseMark a = cpu ? installed().mark_phase(reset) : PhaseMark{};
        return py::make_tuple(a.current, a.peak, a.start, gathered_peak, gathered_bytes);
      },
      py::arg("reset"), py::arg("cpu"), py::arg("engine") = nullptr,
      "A memory phase's boundary in one crossing (zerort.accounting.phases): with engine (a "
      "stage-3 Engine) its gathered_peak, then with reset its reset_gathered_peak(), then its "
      "gathered_bytes; with cpu the counting allocator's current and peak bytes, then with "
      "reset its reset_allocator_peak() and the current bytes again. Returns (current, peak, "
      "start, gathered_peak, gathered_bytes), zeros for the parts not asked for.");
}
