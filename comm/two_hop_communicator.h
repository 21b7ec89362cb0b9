// TwoHopCommunicator: the gradient reduce-scatter and the parameter all-gather in two hops,
// within a node and across nodes, over a flat communicator and its two sub-communicators
// (issue 30). Host backends (in-process, MPI, gloo) and CUDA buffers over nccl parts (issue 47).
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

// Note [pipelined hops]
// The hops run on two workers of this communicator (comm/serial_queue.h), one per
// sub-communicator, each running its hops one at a time in the order queued; a call returns a
// pending Work at once. So bucket k+1's hop 1 runs while bucket k's hop 2 is on the wire, and
// a stream of calls costs about the slower hop per call, not the sum.
// - Order. A call queues both its hops at once, under one lock (HopPair, comm/hop_pair.h), so
//   each sub-communicator runs its collectives in the caller's call order, and every rank
//   that calls in the same order issues them alike. A hop waits only for the other hop of its
//   own call, which sits in the other queue behind earlier calls' hops only: by induction on
//   the calls, every hop ends, and FIFO queues never deadlock.
// - Other collectives go to the flat communicator at once, on the caller's thread, and may
//   pass two-hop work still queued. That is safe: flat is a communicator of its own, so the
//   order of its collectives is the caller's on every rank, as is the order on intra and on
//   inter, and cross-rank matching only ever pairs collectives of one communicator. intra and
//   inter must serve this communicator alone (topology.grid_parts makes them for it).
// - Buffers. As with every backend, a caller keeps `in` and `out` untouched until the Work
//   completes: hop 1 reads `in` later. The hops' scratch counts (track_scratch) until then.
// - Errors. A failed hop completes the Work with the error's own kind (mismatch, timeout,
//   comm), naming the caller's collective and the hop: "reduce_scatter_accumulate(...) on rank 1
//   of 4 [gloo+two-hop], hop 2 (across nodes): ...". A failed hop 1 skips its hop 2. wait()
//   honours its timeout as any Work does; the hops themselves are bounded by the
//   sub-communicators' timeouts, so a worker is never stuck for good.
// - Destruction runs what is queued, then joins the workers.
// Same bits as running the hops in turn: each call's sums, and their order, are unchanged.

// Note [two hops on the device]
// Over communicators that move device memory (nccl and its parts, Note [nccl parts]) the hops
// take CUDA buffers: `device` is their GPU (-1: host memory). Each hop worker then has a CUDA
// stream of its own (HopMemory, comm/hop_memory.h): scratch from the stream-ordered allocator,
// the regrouping copies, the FP64 local sums (sum_chunks_to_f32_cuda) and the inter-node wire
// (bf16 rounding, and the 8-bit codes of comm/int8_blocks_cuda.h) as kernels on it.
// - Order. A hop's work on the caller's buffers waits for the caller's compute stream (Note
//   [stream order]); before a sub-communicator reads what the hop queued, the hop waits for
//   its stream (the sub-communicators order after the compute stream, not the hop's), and a
//   hop ends only when its stream has finished, so a completed Work's output is there.
// - Bits. The same operations in the same order as on the host: the kernels' sums and codes are
//   the host's bit for bit (Note [one 8-bit arithmetic]), so the result is the host path's.
// - Concurrency. Under Note [pipelined hops] the intra and inter parts' NCCL kernels of two calls
//   run at once, and ranks may launch them in different orders across the two parts: NCCL's
//   kernels of separate communicators then have to be resident together, which holds for the two
//   parts of one GPU's ranks (each takes its own channels); not yet run at W > 1 on NCCL.
std::unique_ptr<Communicator> make_two_hop_communicator(std::shared_ptr<Communicator> flat,
                                                        std::shared_ptr<Communicator> intra,
                                                        std::shared_ptr<Communicator> inter, InterNodeWire wire,
                                                        CommOptions options, int device = -1);

// The flat communicator of a two-hop one (what its parts are split from); nullptr otherwise.
Communicator* two_hop_flat(Communicator& comm);

}  // namespace zerort
