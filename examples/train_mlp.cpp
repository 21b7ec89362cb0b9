// Trains a small MLP with LibTorch through the C++ Engine: ZeRO stage 2, bf16, AdamW.
// Each rank draws different micro-batches from the same teacher network.
//   scripts/mpirun.sh -np 2 build/examples/train_mlp [steps]
#include <ATen/TensorOperators.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/mse_loss.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/tanh.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "comm/communicator_factory.h"
#include "runtime/engine.h"

namespace {

constexpr int64_t kIn = 32, kHidden = 128, kOut = 8, kBatch = 64;

struct Mlp {
  std::vector<at::Tensor> params;  // w1, b1, w2, b2
  at::Tensor forward(const at::Tensor& x) const {
    auto h = at::tanh(at::addmm(params[1], x.to(params[0].scalar_type()), params[0].t()));
    return at::addmm(params[3], h, params[2].t());
  }
};

Mlp make_mlp(uint64_t seed, bool trainable) {
  auto g = at::detail::createCPUGenerator(seed);
  Mlp m;
  m.params = {at::randn({kHidden, kIn}, g) * (1.0 / std::sqrt(kIn)), at::randn({kHidden}, g) * 0.1,
              at::randn({kOut, kHidden}, g) * (1.0 / std::sqrt(kHidden)), at::randn({kOut}, g) * 0.1};
  if (trainable)
    for (auto& p : m.params) p.requires_grad_(true);
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace zerort;
  try {
    const int steps = argc > 1 ? std::atoi(argv[1]) : 30;
    auto comm = make_communicator("auto", detect_launch_env());
    const Mlp teacher = make_mlp(7, false);
    Mlp student = make_mlp(8, true);

    EngineOptions o;
    o.stage = 2;
    o.optimizer.precision = DType::kBFloat16;
    o.optimizer.adamw = AdamWHyper{5e-3, 0.9, 0.999, 1e-8, 0.0};
    o.optimizer.gradient_clipping = 1.0;
    o.reduce_bucket_numel = 2048;
    Engine engine(student.params, *comm, o);
    if (comm->rank() == 0) {
      std::printf("train_mlp: %zu parameters, ZeRO stage %d, bf16, W=%d [%s], %lld FP32 master elements per rank\n",
                  engine.numel(), o.stage, comm->size(), comm->backend_name(),
                  static_cast<long long>(engine.master().numel()));
    }
    double first_loss = 0, last_loss = 0;
    for (int step = 0; step < steps; ++step) {
      auto g =
          at::detail::createCPUGenerator(1000 + static_cast<uint64_t>(step) * 64 + static_cast<uint64_t>(comm->rank()));
      at::Tensor x = at::randn({kBatch, kIn}, g);
      at::Tensor y = teacher.forward(x);
      at::Tensor loss = at::mse_loss(student.forward(x).to(at::kFloat), y);
      engine.begin_backward();  // before every backward pass
      (loss * engine.loss_scale()).backward();
      StepStats s = engine.step();
      double mean_loss = loss.item<double>();
      comm->all_reduce(&mean_loss, 1, DType::kFloat64)->wait();
      mean_loss /= comm->size();
      if (step == 0) first_loss = mean_loss;
      last_loss = mean_loss;
      if (comm->rank() == 0) {
        std::printf("step %2d  loss %.5f  grad_norm %.4f  clip %.3f  reduce %.2f ms  adamw %.2f ms  gather %.2f ms%s\n",
                    step + 1, mean_loss, s.grad_norm, s.clip_coef, s.reduce_ms, s.optimizer_ms, s.gather_ms,
                    s.skipped ? "  SKIPPED" : "");
      }
    }
    if (comm->rank() == 0) {
      std::printf("loss fell from %.5f to %.5f over %d steps\n", first_loss, last_loss, steps);
    }
    if (!(last_loss < 0.5 * first_loss)) {  // the example checks itself (ctest runs it)
      std::fprintf(stderr, "train_mlp: loss did not fall by half (%.5f -> %.5f)\n", first_loss, last_loss);
      return 1;
    }
  } catch (const std::exception& e) {
    std::cerr << "train_mlp: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
