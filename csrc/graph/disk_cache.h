// The persistent tier of the compile cache: serialized executables in one
// directory, shared by every process (and host) that points at it.
//
// Entries are written to a temporary file and renamed into place, so readers
// never see half an entry. Each entry carries the identity it was built for
// (plugin platform, version, API version, device kind) and a checksum; an
// entry that does not verify is ignored and rebuilt. The directory is kept
// under a size limit by deleting the least recently used entries.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

namespace torch_pjrt::graph {

class DiskCache {
 public:
  // `identity` names what compiled programs are valid for; entries built for
  // another identity are never used.
  DiskCache(std::string directory, std::string identity, int64_t max_bytes);

  std::optional<std::string> load(const std::string& program_key);
  void store(const std::string& program_key, const std::string& executable);
  const std::string& directory() const { return directory_; }

 private:
  std::string path_for(const std::string& program_key) const;
  void evict_if_needed();
  std::string directory_;
  std::string identity_;
  int64_t max_bytes_;
};

// 64-bit FNV-1a, for file names and checksums (not for security).
uint64_t fnv1a(const std::string& data, uint64_t seed = 1469598103934665603ULL);

}  // namespace torch_pjrt::graph
