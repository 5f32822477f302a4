#include "graph/disk_cache.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "graph/metrics.h"

namespace fs = std::filesystem;

namespace torch_pjrt::graph {
namespace {

constexpr char kMagic[] = "torch_pjrt-executable-v1\n";

std::string hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

uint64_t fnv1a(const std::string& data, uint64_t seed) {
  uint64_t h = seed;
  for (unsigned char c : data) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

DiskCache::DiskCache(std::string directory, std::string identity, int64_t max_bytes)
    : directory_(std::move(directory)), identity_(std::move(identity)), max_bytes_(max_bytes) {
  std::error_code ec;
  fs::create_directories(directory_, ec);  // a failure shows up as misses, never as a crash
}

std::string DiskCache::path_for(const std::string& program_key) const {
  // Two independent 64-bit hashes of identity + program: 128 bits of name.
  std::string material = identity_ + '\0' + program_key;
  return (fs::path(directory_) / (hex(fnv1a(material)) + hex(fnv1a(material, 0x9e3779b97f4a7c15ULL)) + ".xla"))
      .string();
}

// Layout: magic, identity line, program-key hash line, payload size and
// checksum line, payload.
std::optional<std::string> DiskCache::load(const std::string& program_key) {
  std::string path = path_for(program_key);
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    ++metrics().disk_cache_misses;
    return std::nullopt;
  }
  std::stringstream whole;
  whole << in.rdbuf();
  std::string data = whole.str();
  std::string header = std::string(kMagic) + identity_ + "\n" + hex(fnv1a(program_key)) + "\n";
  bool ok = data.compare(0, header.size(), header) == 0;
  std::string payload;
  if (ok) {
    size_t line_end = data.find('\n', header.size());
    ok = line_end != std::string::npos;
    if (ok) {
      std::istringstream sizes(data.substr(header.size(), line_end - header.size()));
      uint64_t size = 0;
      std::string checksum;
      sizes >> size >> checksum;
      payload = data.substr(line_end + 1);
      ok = payload.size() == size && hex(fnv1a(payload)) == checksum;
    }
  }
  if (!ok) {
    // Truncated, corrupt, or written for another plugin: drop it; the caller rebuilds.
    ++metrics().disk_cache_corrupt;
    ++metrics().disk_cache_misses;
    std::error_code ec;
    fs::remove(path, ec);
    return std::nullopt;
  }
  std::error_code ec;
  fs::last_write_time(path, fs::file_time_type::clock::now(), ec);  // recency for LRU
  ++metrics().disk_cache_hits;
  return payload;
}

void DiskCache::store(const std::string& program_key, const std::string& executable) {
  static std::atomic<uint64_t> counter{0};
  std::string path = path_for(program_key);
  std::string tmp = path + "." + std::to_string(getpid()) + "." + std::to_string(counter++) + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return;
    out << kMagic << identity_ << "\n" << hex(fnv1a(program_key)) << "\n"
        << executable.size() << " " << hex(fnv1a(executable)) << "\n";
    out.write(executable.data(), static_cast<std::streamsize>(executable.size()));
    if (!out.good()) {
      out.close();
      std::error_code ec;
      fs::remove(tmp, ec);
      return;
    }
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);  // atomic: readers see the old entry or the whole new one
  if (ec) {
    fs::remove(tmp, ec);
    return;
  }
  ++metrics().disk_cache_writes;
  evict_if_needed();
}

void DiskCache::evict_if_needed() {
  struct Entry {
    fs::path path;
    fs::file_time_type used;
    int64_t size;
  };
  std::vector<Entry> entries;
  int64_t total = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(directory_, ec)) {
    if (e.path().extension() != ".xla") continue;
    std::error_code stat_ec;
    auto size = static_cast<int64_t>(e.file_size(stat_ec));
    auto used = e.last_write_time(stat_ec);
    if (stat_ec) continue;  // another process removed it meanwhile
    entries.push_back({e.path(), used, size});
    total += size;
  }
  if (total <= max_bytes_) return;
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.used < b.used; });
  for (const auto& e : entries) {
    if (total <= max_bytes_ * 9 / 10) break;
    std::error_code rm_ec;
    if (fs::remove(e.path, rm_ec)) {
      total -= e.size;
      ++metrics().disk_cache_evictions;
    }
  }
}

}  // namespace torch_pjrt::graph
