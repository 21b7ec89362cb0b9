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

// Timeouts are errors too, but callers (tests, the engine) may want to tell them apart.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

// comm.debug's check at the call: ranks called different collectives (or the same one
// with different arguments). Raised on every rank, listing each rank's call.
class CollectiveMismatchError : public Error {
 public:
  using Error::Error;
};

// The training loop called the engine in an order it cannot honour (step() without a
// backward(), a second gradient outside engine.backward(), ...). Raised on every rank.
class UsageError : public Error {
 public:
  using Error::Error;
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
#define ZRT_CHECK(cond, ...)                                                    \
  do {                                                                          \
    if (!(cond)) {                                                              \
      throw ::zerort::Error(__FILE__, __LINE__, ::zerort::detail::concat(__VA_ARGS__)); \
    }                                                                           \
  } while (0)

#define ZRT_THROW(...) throw ::zerort::Error(__FILE__, __LINE__, ::zerort::detail::concat(__VA_ARGS__))
