#include "comm/launch_env.h"

#include <cstdlib>

#include "core/error.h"

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
  ZRT_CHECK(end && *end == '\0' && value >= min_value && value <= 1 << 24, "environment variable ", name, "='", *text,
            "' is not an integer in [", min_value, ", ", 1 << 24, "]");
  return static_cast<int>(value);
}

int parse_optional_int(const EnvLookup& env, const std::string& name, int fallback) {
  return env(name) ? parse_int(env, name, 0) : fallback;
}

// The first of these variables that is set, or fallback.
int first_of(const EnvLookup& env, std::initializer_list<const char*> names, int fallback) {
  for (const char* name : names) {
    if (env(name)) return parse_int(env, name, 0);
  }
  return fallback;
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
    out.local_world_size = parse_optional_int(env, "LOCAL_WORLD_SIZE", -1);
    out.master_addr = env("MASTER_ADDR").value_or("127.0.0.1");
    out.master_port = parse_optional_int(env, "MASTER_PORT", 29500);
  } else if (env("OMPI_COMM_WORLD_RANK") || env("OMPI_COMM_WORLD_SIZE")) {
    out.launcher = Launcher::kOpenMpi;
    rank_var = "OMPI_COMM_WORLD_RANK";
    size_var = "OMPI_COMM_WORLD_SIZE";
    out.local_rank = parse_optional_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0);
    out.local_world_size = parse_optional_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", -1);
  } else if (env("PMI_RANK") || env("PMI_SIZE")) {
    out.launcher = Launcher::kPmi;
    rank_var = "PMI_RANK";
    size_var = "PMI_SIZE";
    out.local_rank = first_of(env, {"MPI_LOCALRANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID"}, 0);
    out.local_world_size = first_of(env, {"MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"}, -1);
  } else {
    return out;
  }
  out.rank = parse_int(env, rank_var, 0);
  out.world_size = parse_int(env, size_var, 1);
  ZRT_CHECK(out.rank < out.world_size, rank_var, "=", out.rank, " must be below ", size_var, "=", out.world_size);
  if (out.local_world_size < 0) out.local_world_size = out.world_size;  // not given: one node
  ZRT_CHECK(out.local_rank < out.local_world_size && out.local_world_size <= out.world_size,
            "the launcher's "
            "node-local rank ",
            out.local_rank, " and node size ", out.local_world_size, " do not fit a world of ", out.world_size, " (",
            launcher_name(out.launcher), " variables)");
  return out;
}

}  // namespace zerort
