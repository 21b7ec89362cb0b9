// zerort._C's parts of nccl communicators (Note [nccl parts]) and the 8-bit wires' CUDA kernels
// (comm/int8_blocks_cuda.h; tests/gpu/test_gpu_int8_wire.py checks them against the CPU codes).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>

#include "comm/communicator.h"
#include "comm/int8_blocks.h"
#include "comm/two_hop_communicator.h"
#include "core/error.h"
#include "python/comm_options.h"
#include "python/without_gil.h"
#include "runtime/int8_gather.h"
#include "zerort/config.h"
#if ZERORT_WITH_NCCL
#include <cuda_runtime_api.h>

#include "comm/int8_blocks_cuda.h"
#include "comm/nccl/nccl_communicator.h"
#include "core/cuda_check.h"
#endif

namespace py = pybind11;
using namespace zerort;

#if ZERORT_WITH_NCCL
namespace {

void* ptr(uintptr_t address) { return reinterpret_cast<void*>(address); }

EightBitCode parse_code(const std::string& code) {
  ZRT_CHECK(code == "int8" || code == "fp8_e4m3", "8-bit blocks: code '", code, "'; expected int8 or fp8_e4m3");
  return code == "int8" ? EightBitCode::kInt8 : EightBitCode::kFp8E4m3;
}

// The kernels on the legacy default stream (torch's default), finished when the call returns.
template <typename Launch>
void on_default_stream(Launch&& launch) {
  py::gil_scoped_release release;
  launch(cudaStreamLegacy);
  ZRT_CHECK_CUDA(cudaStreamSynchronize(cudaStreamLegacy));
}

}  // namespace
#endif

void bind_comm_gpu(py::module_& m) {
#if ZERORT_WITH_NCCL
  // This rank's part of an nccl communicator (a two-hop one: of its flat one): ncclCommSplit.
  m.def(
      "make_nccl_part",
      [](std::shared_ptr<Communicator> comm, int color, int key, const std::string& group, double timeout_s,
         bool debug) {
        py::gil_scoped_release release;  // a collective over comm
        Communicator* flat = two_hop_flat(*comm);
        return owned_without_gil(
            make_nccl_part(flat ? *flat : *comm, color, key, group, comm_options(timeout_s, debug)));
      },
      py::arg("comm"), py::arg("color"), py::arg("key"), py::arg("group"), py::arg("timeout_s"), py::arg("debug"));
  m.def(
      "encode_8bit_blocks_cuda",
      [](const std::string& code, uintptr_t x, size_t n, uintptr_t wire, size_t block) {
        const EightBitCode c = parse_code(code);
        on_default_stream([&](cudaStream_t s) {
          encode_8bit_blocks_cuda(c, static_cast<const float*>(ptr(x)), n, ptr(wire), block, s);
        });
      },
      py::arg("code"), py::arg("x"), py::arg("n"), py::arg("wire"), py::arg("block") = kInt8Block);
  m.def(
      "decode_8bit_blocks_cuda",
      [](const std::string& code, uintptr_t wire, size_t n, uintptr_t x, size_t block) {
        const EightBitCode c = parse_code(code);
        on_default_stream(
            [&](cudaStream_t s) { decode_8bit_blocks_cuda(c, ptr(wire), n, static_cast<float*>(ptr(x)), block, s); });
      },
      py::arg("code"), py::arg("wire"), py::arg("n"), py::arg("x"), py::arg("block") = kInt8Block);
  m.def(
      "sum_8bit_wires_cuda",
      [](const std::string& code, uintptr_t wires, size_t world, size_t n, uintptr_t out, bool accumulate,
         size_t block) {
        const EightBitCode c = parse_code(code);
        on_default_stream([&](cudaStream_t s) {
          sum_8bit_wires_to_f32_cuda(c, ptr(wires), world, n, block, static_cast<float*>(ptr(out)), accumulate, s);
        });
      },
      py::arg("code"), py::arg("wires"), py::arg("world"), py::arg("n"), py::arg("out"), py::arg("accumulate"),
      py::arg("block") = kInt8Block);
  // Stage 3's int8 gather (runtime/int8_gather.h) on cuda:device, waited for (tests).
  m.def(
      "gather_int8_blocks",
      [](std::shared_ptr<Communicator> comm, uintptr_t own, const std::string& dtype, size_t n, uintptr_t full,
         int device) {
        py::gil_scoped_release release;
        const c10::Device on(c10::kCUDA, static_cast<c10::DeviceIndex>(device));
        gather_int8_blocks(*comm, ptr(own), parse_dtype(dtype), n, ptr(full), 0, on)->wait();
        ZRT_CHECK_CUDA(cudaDeviceSynchronize());
      },
      py::arg("comm"), py::arg("own"), py::arg("dtype"), py::arg("n"), py::arg("full"), py::arg("device"));
#else
  (void)m;
#endif
}
