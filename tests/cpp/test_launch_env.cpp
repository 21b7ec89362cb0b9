// Rank and world resolution: torchrun, then Open MPI, then PMI, else one rank.
#include <gtest/gtest.h>

#include <map>

#include "comm/communicator_factory.h"
#include "comm/launch_env.h"
#include "core/error.h"

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
  auto e = detect({{"RANK", "3"},
                   {"WORLD_SIZE", "4"},
                   {"LOCAL_RANK", "1"},
                   {"MASTER_ADDR", "10.0.0.1"},
                   {"MASTER_PORT", "29555"},
                   {"OMPI_COMM_WORLD_RANK", "0"},
                   {"OMPI_COMM_WORLD_SIZE", "2"}});
  EXPECT_EQ(e.launcher, Launcher::kTorchrun);
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.master_addr, "10.0.0.1");
  EXPECT_EQ(e.master_port, 29555);
  EXPECT_EQ(resolve_backend("auto", e), "gloo");
}

TEST(LaunchEnv, OpenMpiThenPmi) {
  auto e = detect({{"OMPI_COMM_WORLD_RANK", "1"},
                   {"OMPI_COMM_WORLD_SIZE", "2"},
                   {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                   {"PMI_RANK", "0"},
                   {"PMI_SIZE", "5"}});
  EXPECT_EQ(e.launcher, Launcher::kOpenMpi);
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.world_size, 2);
  EXPECT_EQ(resolve_backend("auto", e), "mpi");
  auto p = detect({{"PMI_RANK", "4"}, {"PMI_SIZE", "5"}});
  EXPECT_EQ(p.launcher, Launcher::kPmi);
  EXPECT_EQ(p.rank, 4);
  EXPECT_EQ(p.world_size, 5);
}

// The node-local rank and the node's size, from each launcher (two hosts of 2 ranks: rank 3
// is the second rank of the second node).
TEST(LaunchEnv, NodeLocalRankFromEveryLauncher) {
  auto t = detect({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"}});
  EXPECT_EQ(t.local_rank, 1);
  EXPECT_EQ(t.local_world_size, 2);
  auto o = detect({{"OMPI_COMM_WORLD_RANK", "3"},
                   {"OMPI_COMM_WORLD_SIZE", "4"},
                   {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                   {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_EQ(o.local_rank, 1);
  EXPECT_EQ(o.local_world_size, 2);
  auto mpich = detect({{"PMI_RANK", "3"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "1"}, {"MPI_LOCALNRANKS", "2"}});
  EXPECT_EQ(mpich.local_rank, 1);
  EXPECT_EQ(mpich.local_world_size, 2);
  // Slurm: the local id; SLURM_NTASKS_PER_NODE is a requested maximum (4 here, 2 used), not the size.
  auto slurm = detect({{"PMI_RANK", "3"}, {"PMI_SIZE", "4"}, {"SLURM_LOCALID", "1"}, {"SLURM_NTASKS_PER_NODE", "8"}});
  EXPECT_EQ(slurm.local_rank, 1);
  EXPECT_EQ(slurm.local_world_size, 4);
  auto one_node = detect({{"PMI_RANK", "3"}, {"PMI_SIZE", "4"}});
  EXPECT_EQ(one_node.local_rank, 0);
  EXPECT_EQ(one_node.local_world_size, 4);
  try {
    detect({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("node-local rank 2 and node size 2"), std::string::npos) << e.what();
  }
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
