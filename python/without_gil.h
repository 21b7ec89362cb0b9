// Python owns zerort's communicators and engines through a shared_ptr whose deleter lets
// go of the GIL first. Their destructors wait for threads: the Engine joins its comm
// thread, and a gloo communicator that drops the last reference to c10d's backend runs
// ProcessGroupGloo's destructor, which joins gloo's workers. Those threads may need the
// GIL to finish (dropping a tensor that Python created takes it), so deleting with the GIL
// held could wait forever. Whatever a destructor does to Python objects takes the GIL
// itself (torch's tensors do; the Engine's lr_schedule holder does).
#pragma once

#include <pybind11/pybind11.h>

#include <memory>

namespace zerort {

template <typename T>
std::shared_ptr<T> owned_without_gil(std::unique_ptr<T> object) {
  return std::shared_ptr<T>(object.release(), [](T* p) {
    if (PyGILState_Check()) {
      pybind11::gil_scoped_release release;
      delete p;
    } else {
      delete p;
    }
  });
}

}  // namespace zerort
