// gloo backend: wraps the c10d ProcessGroupGloo that torch.distributed created (its
// rendezvous is MASTER_ADDR/MASTER_PORT under torchrun). The only comm/ file that needs
// LibTorch; it sees c10d only through the generic Backend interface.
#pragma once

#include <memory>
#include <string>

#include "comm/communicator.h"

namespace zerort {

// group_name is torch.distributed's ProcessGroup.group_name (the default group is "0").
// Errors when the group is unknown or has no gloo backend for CPU tensors.
std::unique_ptr<Communicator> make_gloo_communicator(const std::string& group_name, CommOptions options = {});

}  // namespace zerort
