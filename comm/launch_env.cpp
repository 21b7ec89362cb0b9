#include "comm/launch_env.h"

#include <cstdlib>

#include "comm/error.h"

namespace zerort {

const char* launcher_name(Launcher launcher) {
  switch (launcher) {
    case Launcher::kNone: return "none";
    case Launcher::kTorchrun: return "torchrun";
    case Launcher::kOpenMpi: return "openmpi";
    case Launcher::kPmi: return "pmi";
  }
  return "unknown";
}

namespace {

int parse_int(const EnvLookup& env, const std::string& name, int min_value) {
  auto text = env(name);
  ZRT_CHECK(text && !text->empty(), "environment variable ", name,
            " is not set but the launcher's other variables are; set it or unset them all");
  char* end = nullptr;
  long value = std::strtol(text->c_str(), &end, 10);
  ZRT_CHECK(end && *end == '\0' && value >= min_value && value <= 1 << 24, "environment variable ",
            name, "='", *text, "' is not an integer in [", min_value, ", ", 1 << 24, "]");
  return static_cast<int>(value);
}

int parse_optional_int(const EnvLookup& env, const std::string& name, int fallback) {
  return env(name) ? parse_int(env, name, 0) : fallback;
}

}  // namespace

LaunchEnv detect_launch_env() {
  return detect_launch_env([](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    return v ? std::optional<std::string>(v) : std::nullopt;
  });
}

LaunchEnv detect_launch_env(const EnvLookup& env) {
  LaunchEnv out;
  std::string rank_var, size_var;
  if (env("RANK") || env("WORLD_SIZE")) {
    out.launcher = Launcher::kTorchrun;
    rank_var = "RANK";
    size_var = "WORLD_SIZE";
    out.local_rank = parse_optional_int(env, "LOCAL_RANK", 0);
    out.master_addr = env("MASTER_ADDR").value_or("127.0.0.1");
    out.master_port = parse_optional_int(env, "MASTER_PORT", 29500);
  } else if (env("OMPI_COMM_WORLD_RANK") || env("OMPI_COMM_WORLD_SIZE")) {
    out.launcher = Launcher::kOpenMpi;
    rank_var = "OMPI_COMM_WORLD_RANK";
    size_var = "OMPI_COMM_WORLD_SIZE";
    out.local_rank = parse_optional_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0);
  } else if (env("PMI_RANK") || env("PMI_SIZE")) {
    out.launcher = Launcher::kPmi;
    rank_var = "PMI_RANK";
    size_var = "PMI_SIZE";
    out.local_rank = parse_optional_int(env, "MPI_LOCALRANKID", 0);
  } else {
    return out;
  }
  out.rank = parse_int(env, rank_var, 0);
  out.world_size = parse_int(env, size_var, 1);
  ZRT_CHECK(out.rank < out.world_size, rank_var, "=", out.rank, " must be below ", size_var, "=",
            out.world_size);
  return out;
}

}  // namespace zerort
