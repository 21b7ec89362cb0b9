#include "core/error.h"

namespace zerort {

namespace {
std::string basename_of(const char* file) {
  std::string path(file);
  auto slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}
}  // namespace

Error::Error(const char* file, int line, const std::string& message)
    : std::runtime_error(basename_of(file) + ":" + std::to_string(line) + ": " + message), message_(message) {}

}  // namespace zerort
