// Errors raised by the PJRT layer. Every PJRT_Error is turned into a C++
// exception that carries the plugin's own message, so nothing is swallowed.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace torch_pjrt::pjrt {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

namespace detail {
inline void append(std::ostringstream&) {}
template <typename T, typename... Rest>
void append(std::ostringstream& os, const T& first, const Rest&... rest) {
  os << first;
  append(os, rest...);
}
}  // namespace detail

template <typename... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream os;
  detail::append(os, parts...);
  throw Error(os.str());
}

// Plugin::check writes a PJRT error's code into its message as "(PJRT error
// code N)"; RESOURCE_EXHAUSTED (8) is running out of device memory. An
// allocation failing while a program runs reaches us through its completion
// event as INTERNAL with XLA's "Out of memory allocating N bytes" (or
// "RESOURCE_EXHAUSTED: ..." in the text). Messages travel further as text (a
// fused graph's error names the user's lines), so the test reads the text.
inline bool is_out_of_memory(const std::string& message) {
  for (const char* marker : {"(PJRT error code 8)", "Out of memory", "out of memory", "RESOURCE_EXHAUSTED"})
    if (message.find(marker) != std::string::npos) return true;
  return false;
}

}  // namespace torch_pjrt::pjrt

// PJRT_CHECK(cond, "message parts", ...): TORCH_CHECK-style guard without torch.
#define PJRT_CHECK(cond, ...)                        \
  do {                                               \
    if (!(cond)) ::torch_pjrt::pjrt::fail(__VA_ARGS__); \
  } while (0)
