// ShardGroups: the parts of the world an engine shards its state over (hybrid sharding,
// shard_size / DeepSpeed's mics_shard_size), and the sum of a gradient shard across them.
#pragma once

#include <c10/core/Device.h>

#include <cstddef>

#include "comm/communicator.h"
#include "comm/wire_sum.h"

namespace zerort {

// Note [hybrid sharding]
// W = R groups x S ranks, rank r = group * S + index (groups of S consecutive ranks, a node
// each by default). `shard` holds the S ranks of this rank's group (its rank: index), `replicas`
// the R ranks with this rank's index (its rank: group). The model states (FP32 master, m, v,
// the FP32 gradient and at stage 3 the parameters) are sharded over the group as a flat engine
// shards them over W, and replicated across the groups: rank r holds the shard of index r % S.
//   - Gradients: each bucket is reduce-scattered within the group (the low-precision chunks,
//     summed in FP32 as always). In the accumulation window's last micro-step, as soon as a
//     bucket's reduce is done (on the comm thread, beside the rest of backward), its FP32 shard,
//     the window's whole gradient, is summed across the groups: sum_across_replicas, a
//     reduce-scatter on comm.inter_node_dtype's wire with FP32 sums in group order, then an
//     all-gather of the sums on the same wire, decoded on every rank, the summing one too, so
//     every group ends with the same bits (fp32 moves them exactly; bf16 rounds each sum once
//     more; int8 and fp8 carry them as blocks again: Note [int8 blocks]). A later reduce of the
//     bucket in that micro-step (another backward pass, a drain after reduce_now) sums its own
//     part across the groups and adds it: the sum stays linear. Before that micro-step the
//     gradient holds the group's sums only, so reduce_now() is refused there.
//   - Parameter gathers (stages 1-2 after the update, stage 3 on use) stay inside the group.
//   - One decision per step over the world: every rank's row, but only group 0's gradient
//     figures (each shard is counted once), so every rank decides alike. The parts' calls go
//     into the world's call log (Communicator::share_call_log), so the decision checks them.
//   - Memory per rank: the flat formulas with S in place of W (16 Psi / S at stage 3).
//   - Checkpoints: group 0 writes the S shards, recorded as a world of S; a load reads any.
struct ShardGroups {
  Communicator* shard = nullptr;              // nullptr: the engine shards over the whole world
  Communicator* replicas = nullptr;           // with shard: the other groups' ranks of this index
  InterNodeWire wire = InterNodeWire::kFp32;  // sum_across_replicas' wire
  // Stage 3: the consecutive ranks of this rank's node within the shard group, whose secondary
  // shards serve the re-gathers (hpZ: Note [secondary shards], runtime/secondary_shards.h).
  Communicator* secondary = nullptr;
};

// grad (n FP32 values, this rank's shard of a bucket) becomes its sum over `replicas`, the
// same bits on each of them: split into replicas.size() pieces (the last zero-padded), piece k
// summed on rank k (sum_over_wire) and all-gathered on the wire (gather_over_wire). tag: the
// bucket, for the checks. grad lives on `device` (a CUDA model's, staged: one copy into host
// scratch and one back, Note [staging once]). Replicas that move device memory (nccl parts)
// sum on the device, in device scratch on the compute stream, with the host's bits.
void sum_across_replicas(Communicator& replicas, float* grad, size_t n, const c10::Device& device, InterNodeWire wire,
                         int64_t tag);

}  // namespace zerort
