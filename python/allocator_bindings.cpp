// zerort._C's counting CPU allocator (runtime/counting_allocator.h): install it, read it,
// start a new peak window, mark a generation. zerort/accounting/phases.py is the Python side.
#include <torch/extension.h>

#include "core/error.h"
#include "runtime/counting_allocator.h"

namespace py = pybind11;
using namespace zerort;

namespace {

CountingAllocator& installed() {
  CountingAllocator* a = installed_counting_allocator();
  ZRT_CHECK(a != nullptr, "the counting CPU allocator is not installed; call "
            "zerort._C.install_counting_allocator() (zerort.accounting.memory.install_counting_allocator()) first");
  return *a;
}

}  // namespace

void bind_allocator(py::module_& m) {
  m.def("install_counting_allocator", &install_counting_allocator,
        "Installs zerort's counting CPU allocator over torch's, once per process (later calls do "
        "nothing). Returns True when it is torch's CPU allocator now. Only CPU storages allocated "
        "after the first call are counted.");
  m.def("allocator_stats", [] {
    const AllocatorStats s = installed().stats();
    py::dict d;
    d["current"] = s.current;
    d["peak"] = s.peak;
    return d;
  }, "Bytes of CPU memory the counting allocator has handed out: {'current': live now, 'peak': "
     "the most since the last reset_allocator_peak()}.");
  m.def("mark_allocator", [] { installed().mark(); },
        "Starts a new generation: allocator_since_mark() counts from 0 the bytes allocated after "
        "this call that are still live; freeing older memory does not change it.");
  m.def("allocator_since_mark", [] { return installed().stats().since_mark; },
        "Bytes allocated since the last mark_allocator() and still live.");
  m.def("allocated_since_mark", [](const at::Tensor& t) {
    return t.has_storage() && installed().allocated_since_mark(t.storage().data_ptr());
  }, "Whether the tensor's storage was allocated by the counting allocator after the last "
     "mark_allocator().");
  m.def("reset_allocator_peak", [] { installed().reset_peak(); },
        "Starts a new peak window: peak := current.");
}
