#include "runtime/unit_names.h"

#include <cctype>
#include <set>

#include "core/error.h"

namespace zerort {

namespace {

// A name quoted as Python's repr() quotes a plain string: single quotes, or double quotes
// when it holds a single quote and no double one; backslashes and the quote escaped.
std::string quoted(const std::string& s) {
  const char q = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
  std::string out(1, q);
  for (char c : s) {
    if (c == '\\' || c == q) out += '\\';
    out += c;
  }
  return out + q;
}

// The same kind of error as the one it copies, with more after its what(): the Python
// binding translates it by its kind and raises its what().
template <typename Kind>
class WithMore : public Kind {
 public:
  WithMore(const Kind& e, const std::string& more) : Kind(e), what_(std::string(e.what()) + more) {}
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  std::string what_;
};

}  // namespace

std::string unit_names_suffix(const std::string& text, const UnitCache& units) {
  std::set<size_t> tags;
  const std::string key = "tag=";
  for (size_t at = text.find(key); at != std::string::npos; at = text.find(key, at + 1)) {
    size_t end = at + key.size(), tag = 0;
    if (end >= text.size() || !std::isdigit(static_cast<unsigned char>(text[end]))) continue;
    bool fits = true;
    for (; end < text.size() && std::isdigit(static_cast<unsigned char>(text[end])); ++end) {
      tag = tag * 10 + static_cast<size_t>(text[end] - '0');
      fits = fits && tag < units.size();
    }
    if (fits && !units.name(tag).empty()) tags.insert(tag);
  }
  std::string named;
  for (size_t t : tags) named += detail::concat(named.empty() ? "" : ", ", "tag ", t, " = ", quoted(units.name(t)));
  return named.empty() ? named : "\n(stage-3 units: " + named + ")";
}

void rethrow_with(const std::string& more) {
  try {
    throw;
  } catch (const DeviceError& e) {  // most derived first, as the Python binding translates them
    throw WithMore<DeviceError>(e, more);
  } catch (const UsageError& e) {
    throw WithMore<UsageError>(e, more);
  } catch (const ConfigError& e) {
    throw WithMore<ConfigError>(e, more);
  } catch (const LossScaleError& e) {
    throw WithMore<LossScaleError>(e, more);
  } catch (const CommTimeoutError& e) {
    throw WithMore<CommTimeoutError>(e, more);
  } catch (const CollectiveMismatchError& e) {
    throw WithMore<CollectiveMismatchError>(e, more);
  } catch (const CommError& e) {
    throw WithMore<CommError>(e, more);
  } catch (const Error& e) {
    throw WithMore<Error>(e, more);
  }
}

}  // namespace zerort
