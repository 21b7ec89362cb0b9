// ReducePolicy: what the ZeRO stage means for the Engine's buckets, decided once when the
// Engine is built (ReducePolicy::for_stage), so the rest of the Engine asks a named question
// ("is the FP32 state replicated?", "is a reduced bucket released?") instead of the stage.
#pragma once

namespace zerort {

// Note [reduce policy]: each stage is one fixed answer to these questions.
//
//                     stage 0      stage 1      stage 2          stage 3
//   replicated        yes          no           no               no
//   every_micro_step  no           no           yes              yes
//   pack              kNone        kNone        kPooled          kOwnBuffer
//   units             no           no           no               yes
//
// replicated: every rank holds the whole FP32 state; a bucket is reduce-scattered into a
//   scratch shard, added to this rank's part and all-gathered back (an all-reduce), and
//   the update writes every weight on every rank, so nothing is gathered after it.
//   Otherwise a bucket is reduce-scattered straight into this rank's FP32 gradient shard.
// every_micro_step: gradients are reduced in every micro-step, not only in the
//   accumulation window's last one.
// pack: kNone keeps whole low-precision gradients in the group's flat buffer (parameters'
//   .grad are views of it); kPooled moves each gradient into one of two shared pack buffers
//   as it completes (a one-off buffer when both are taken; See Note [grad packer]);
//   kOwnBuffer gives each bucket a buffer of its own until its reduce is done.
// units: the buckets are the caller's units: they start released, are gathered on use,
//   are queued for reduce as soon as complete (not in bucket order), and are released
//   once their gradients are all in and again after the reduce round. See Note [unit cache].
struct ReducePolicy {
  enum class Pack { kNone, kPooled, kOwnBuffer };
  bool replicated = false;
  bool every_micro_step = false;
  Pack pack = Pack::kNone;
  bool units = false;

  // No whole low-precision gradient buffer: gradients are packed per bucket.
  bool packs() const { return pack != Pack::kNone; }

  // stage: 0, 1, 2 or 3 (the Engine has checked it).
  static ReducePolicy for_stage(int stage) {
    ReducePolicy p;
    p.replicated = stage == 0;
    p.every_micro_step = stage >= 2;
    p.pack = stage == 2 ? Pack::kPooled : stage == 3 ? Pack::kOwnBuffer : Pack::kNone;
    p.units = stage == 3;
    return p;
  }
};

}  // namespace zerort
