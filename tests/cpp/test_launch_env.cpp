// Rank and world resolution: torchrun, then Open MPI, then PMI, else one rank.
#include <gtest/gtest.h>

#include <map>

#include "comm/communicator_factory.h"
#include "comm/error.h"
#include "comm/launch_env.h"

namespace zerort {
namespace {

LaunchEnv detect(const std::map<std::string, std::string>& vars) {
  return detect_launch_env([&](const std::string& k) -> std::optional<std::string> {
    auto it = vars.find(k);
    return it == vars.end() ? std::nullopt : std::optional<std::string>(it->second);
  });
}

TEST(LaunchEnv, NoLauncherIsSingleRank) {
  auto e = detect({});
  EXPECT_EQ(e.launcher, Launcher::kNone);
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(resolve_backend("auto", e), "inprocess");
}

TEST(LaunchEnv, TorchrunWinsOverOpenMpi) {
  auto e = detect({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "10.0.0.1"},
                   {"MASTER_PORT", "29555"}, {"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}});
  EXPECT_EQ(e.launcher, Launcher::kTorchrun);
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.master_addr, "10.0.0.1");
  EXPECT_EQ(e.master_port, 29555);
  EXPECT_EQ(resolve_backend("auto", e), "gloo");
}

TEST(LaunchEnv, OpenMpiThenPmi) {
  auto e = detect({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                   {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"PMI_RANK", "0"}, {"PMI_SIZE", "5"}});
  EXPECT_EQ(e.launcher, Launcher::kOpenMpi);
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.world_size, 2);
  EXPECT_EQ(resolve_backend("auto", e), "mpi");
  auto p = detect({{"PMI_RANK", "4"}, {"PMI_SIZE", "5"}});
  EXPECT_EQ(p.launcher, Launcher::kPmi);
  EXPECT_EQ(p.rank, 4);
  EXPECT_EQ(p.world_size, 5);
}

TEST(LaunchEnv, BadValuesNameTheVariable) {
  try {
    detect({{"RANK", "x"}, {"WORLD_SIZE", "2"}});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("RANK='x'"), std::string::npos) << e.what();
  }
  try {
    detect({{"RANK", "2"}, {"WORLD_SIZE", "2"}});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("RANK=2 must be below WORLD_SIZE=2"), std::string::npos);
  }
  try {
    detect({{"OMPI_COMM_WORLD_RANK", "0"}});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("OMPI_COMM_WORLD_SIZE is not set"), std::string::npos);
  }
  EXPECT_THROW(make_communicator("tcp", detect({})), Error);
}

}  // namespace
}  // namespace zerort
