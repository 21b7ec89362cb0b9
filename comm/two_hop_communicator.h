// TwoHopCommunicator: the gradient reduce-scatter and the parameter all-gather in two hops,
// within a node and across nodes, over a flat communicator and its two sub-communicators
// (issue 30). Host backends (in-process, MPI, gloo); a device backend is refused.
#pragma once

#include <memory>
#include <string>

#include "comm/communicator.h"
#include "comm/wire_sum.h"

namespace zerort {

// Note [two hops]
// W = N nodes x G ranks, rank r = node * G + local. `intra` holds the G ranks of this rank's
// node (its rank: local), `inter` the N ranks with this rank's local index (its rank: node).
//
// reduce_scatter_accumulate(in: W chunks of n, chunk j for rank j):
//   hop 1, intra: an all-to-all sends to node-peer l the N chunks meant for the ranks of local
//     index l (one per node), in the input dtype. Each rank sums, for each node k, the G
//     chunks it got for rank k * G + local in local order 0..G-1, accumulated in FP64 and
//     rounded once to FP32 (sum_chunks_to_f32): N partial sums.
//   hop 2, inter: an all-to-all sends partial k to node k on the inter-node wire: fp32 (no
//     rounding between hops), bf16 (rounded to nearest even), or int8 or fp8_e4m3 (blocks of
//     codes with an FP32 scale each: Note [int8 blocks]). Each rank sums the N partials it got in node order
//     0..N-1, in FP64, rounded once into out (added to it with accumulate).
//   Fixed orders at both hops: the result is bitwise the same on every run. Against the
//   exact sum S of the W inputs x, with s_k the exact sum of node k's G chunks:
//     |out - S| <= 2^-24 |S| + u * sum_k |s_k| + 2^-53 (G + N) sum |x|,
//   u = 2^-24 for fp32 between the hops, 2^-8 for bf16 (the FP64 sums' own error is the last
//   term). For int8, u * sum_k |s_k| becomes sum_k (2^-24 |s_k| + (1/254 + 2^-22) a_k), a_k the
//   largest |partial| of node k in the element's block; for fp8_e4m3 it becomes
//   sum_k (2^-24 |s_k| + 2^-4 |p_k| + (2^-10 / 448 + 2^-22) a_k), p_k the partial. Each rank ends with the shard of the
//   flat reduce-scatter.
//   Bytes a rank sends across nodes: (N - 1) n elements on the wire (4, 2 or 1 + 4/256 bytes
//   each), against (W - G) n of the input dtype flat; messages (G - 1) + (N - 1) against W - 1.
// all_gather(in: n, out: W n): hop 1 across nodes (inter: the N chunks of this local index),
//   hop 2 within the node (intra: N n each), then each chunk to its rank's place. Across nodes
//   a rank receives (N - 1) n elements, against (W - G) n flat.
// Every other collective is the flat communicator's. The calls a caller makes are checked
// here (the funnel of this communicator); the hops' inner calls are the sub-communicators'.
// The partial sums' form between the hops: comm.inter_node_dtype (comm/wire_sum.h).

std::unique_ptr<Communicator> make_two_hop_communicator(std::shared_ptr<Communicator> flat,
                                                        std::shared_ptr<Communicator> intra,
                                                        std::shared_ptr<Communicator> inter, InterNodeWire wire,
                                                        CommOptions options);

}  // namespace zerort
