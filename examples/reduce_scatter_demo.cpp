// make demo: a 2-rank reduce_scatter_accumulate under mpirun. Each rank holds a bf16
// "gradient" of 8 values; after the call each rank prints the FP32 sum of its half.
//   mpirun -np 2 build/examples/reduce_scatter_demo
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <vector>

#include "comm/communicator_factory.h"
#include "core/half.h"

int main() {
  using namespace zerort;
  try {
    LaunchEnv env = detect_launch_env();
    auto comm = make_communicator("auto", env);
    const int rank = comm->rank(), world = comm->size();
    const size_t shard = 4, total = shard * static_cast<size_t>(world);

    // rank r contributes (r + 1) * (i + 1) / 8 at position i: exact in bf16.
    std::vector<uint16_t> grad(total);
    std::vector<float> grad_f32(total);
    for (size_t i = 0; i < total; ++i) {
      grad_f32[i] = static_cast<float>((rank + 1) * (static_cast<int>(i) + 1)) / 8.0f;
      grad[i] = f32_to_bf16(grad_f32[i]);
    }
    std::vector<float> out(shard);
    comm->reduce_scatter_accumulate(grad.data(), DType::kBFloat16, out.data(), shard)->wait();

    for (int r = 0; r < world; ++r) {  // print in rank order
      if (r == rank) {
        std::ostringstream line;
        line << "rank " << rank << "/" << world << " [" << comm->backend_name() << "] sent bf16 [";
        for (size_t i = 0; i < total; ++i) line << (i ? " " : "") << grad_f32[i];
        line << "] -> received FP32 shard [" << shard * static_cast<size_t>(rank) << ", "
             << shard * static_cast<size_t>(rank + 1) << "): [";
        for (size_t i = 0; i < shard; ++i) line << (i ? " " : "") << out[i];
        line << "]";
        std::cout << line.str() << std::endl;
      }
      comm->barrier()->wait();
    }
    if (rank == 0) {
      std::cout << "each received value is the sum over ranks of (r+1)*(i+1)/8 = " << world * (world + 1) / 2
                << "*(i+1)/8" << std::endl;
    }
  } catch (const std::exception& e) {
    std::cerr << "reduce_scatter_demo: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
