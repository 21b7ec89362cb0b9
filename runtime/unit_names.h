// Stage-3 errors that name the units behind the collective tags they list.
#pragma once

#include <string>

#include "runtime/unit_cache.h"

namespace zerort {

// Note [unit names]: a collective's error lists each rank's call with its tag, and an
// Engine's tag is its bucket's index, so at stage 3 a unit's index (ranks that take
// different paths through the model gather different units). The Engine's stage-3 entry
// points (gather, prefetch, step) catch a zerort::Error whose text lists "tag=N" for units
// the caller named (UnitSpec::name) and rethrow it as the same kind, its what() followed
// by "\n(stage-3 units: tag N = 'name', ...)": each such tag once, in increasing order.
// Python raises it unchanged, as the same zerort.errors type.

// That suffix for the tags in text that name a unit of `units` with a name; "" for none.
std::string unit_names_suffix(const std::string& text, const UnitCache& units);

// Rethrows the zerort::Error being handled as the same kind with `more` after its what().
// Call it only inside a catch block of a zerort::Error.
[[noreturn]] void rethrow_with(const std::string& more);

}  // namespace zerort
