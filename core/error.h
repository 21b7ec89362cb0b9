// zerort::Error and ZRT_CHECK: the one way every layer reports a user-facing error.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace zerort {

// Thrown for every error a caller can act on. what() is "file:line: message".
class Error : public std::runtime_error {
 public:
  Error(const char* file, int line, const std::string& message);
  const std::string& message() const { return message_; }

 private:
  std::string message_;
};

// The kinds of failure, each with the class of the same name in python/zerort/errors.py
// (the binding translates one into the other), so a failure has one type whichever
// language raised it.

// The training loop called the engine in an order it cannot honour (step() without a
// backward(), a second gradient outside engine.backward(), ...). Raised on every rank.
class UsageError : public Error {
 public:
  using Error::Error;
};

// A tensor (or the model) on a device, or in a build, that the call cannot use.
class DeviceError : public UsageError {
 public:
  using UsageError::UsageError;
};

// A bad option: the value named, and what is allowed.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// An fp16 overflow with the loss scale already at its minimum (loss_scale.min_scale).
class LossScaleError : public Error {
 public:
  using Error::Error;
};

// A communicator that cannot be made or used (a backend not in this build, a dead peer).
class CommError : public Error {
 public:
  using Error::Error;
};

// A collective that did not finish within comm.timeout_s.
class CommTimeoutError : public CommError {
 public:
  using CommError::CommError;
};

// comm.debug's check at the call: ranks called different collectives (or the same one
// with different arguments). Raised on every rank, listing each rank's call.
class CollectiveMismatchError : public CommError {
 public:
  using CommError::CommError;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace zerort

// ZRT_CHECK(cond, parts...): throws zerort::Error built from the streamed parts.
#define ZRT_CHECK(cond, ...)                                                            \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      throw ::zerort::Error(__FILE__, __LINE__, ::zerort::detail::concat(__VA_ARGS__)); \
    }                                                                                   \
  } while (0)

#define ZRT_THROW(...) throw ::zerort::Error(__FILE__, __LINE__, ::zerort::detail::concat(__VA_ARGS__))

// The same, throwing one of the kinds above: ZRT_CHECK_AS(ConfigError, cond, parts...).
#define ZRT_CHECK_AS(Kind, cond, ...)                                                  \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      throw ::zerort::Kind(__FILE__, __LINE__, ::zerort::detail::concat(__VA_ARGS__)); \
    }                                                                                  \
  } while (0)

#define ZRT_THROW_AS(Kind, ...) throw ::zerort::Kind(__FILE__, __LINE__, ::zerort::detail::concat(__VA_ARGS__))
