// The compile cache's bound on loaded programs (TORCH_PJRT_MAX_LOADED_PROGRAMS):
// least recently used programs are unloaded and give their memory maps back,
// a program used again is reloaded (disk tier, else compiled from its text),
// and an executable someone still holds survives its unloading.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include <unistd.h>

#include "graph/compile_cache.h"
#include "graph/metrics.h"
#include "hlo/builder.h"
#include "pjrt/client.h"
#include "cpu_client.h"

using namespace torch_pjrt;

namespace {

std::shared_ptr<pjrt::Client> client() { return test_support::cpu_client(1); }

int64_t memory_maps() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  int64_t n = 0;
  while (std::getline(maps, line)) ++n;
  return n;
}

// `x + k` over f32[n]: a distinct program per (n, k).
std::string add_program(int64_t n, double k) {
  hlo::Builder b;
  hlo::Value x = b.parameter({ElementType::F32, {n}});
  return b.finish({b.binary("add", x, b.constant(k, ElementType::F32, {n}))});
}

// Runs `exe` on [0, 1, ..., n-1] and returns the first and last results.
std::pair<float, float> run_add(const pjrt::ExecutablePtr& exe, int64_t n) {
  std::vector<float> in(n);
  for (int64_t i = 0; i < n; ++i) in[i] = static_cast<float>(i);
  auto buf = client()->buffer_from_host(in.data(), ElementType::F32, {n});
  auto result = exe->execute({buf.get()});
  if (result.done) result.done->wait();
  std::vector<float> out(n);
  result.outputs[0]->to_host(out.data());
  return {out.front(), out.back()};
}

}  // namespace

// Measured on XLA:CPU: each loaded executable maps memory regions, and
// destroying it returns them (what makes unloading fix the map-count crash).
TEST(ProgramCache, UnloadedProgramsGiveTheirMemoryMapsBack) {
  std::vector<pjrt::ExecutablePtr> held;
  client()->compile(add_program(1, 0.5), {});  // the plugin's one-time maps
  int64_t before = memory_maps();
  constexpr int kPrograms = 40;
  for (int i = 0; i < kPrograms; ++i) held.push_back(client()->compile(add_program(i + 2, 1), {}));
  int64_t loaded = memory_maps();
  EXPECT_GE(loaded - before, 2 * kPrograms) << "XLA:CPU maps a few regions per loaded executable";
  held.clear();
  EXPECT_LE(memory_maps() - before, kPrograms / 4) << "destroying the executables returns their maps";
}

TEST(ProgramCache, LeastRecentlyUsedAreUnloadedAndReloadOnUse) {
  constexpr int64_t kBound = 5;
  graph::CompileCache cache(client(), nullptr, {.programs = kBound});
  graph::reset_metrics();
  std::vector<graph::ProgramPtr> programs;
  for (int i = 0; i < 30; ++i) {
    programs.push_back(cache.get_or_compile(add_program(8, i), 0));
    EXPECT_LE(cache.loaded(), static_cast<size_t>(kBound));
  }
  int64_t flat = memory_maps();
  for (int i = 30; i < 60; ++i) programs.push_back(cache.get_or_compile(add_program(8, i), 0));
  EXPECT_LE(memory_maps() - flat, 10) << "past the bound, new programs replace unloaded ones";
  EXPECT_EQ(cache.loaded(), static_cast<size_t>(kBound));
  EXPECT_EQ(graph::metrics().programs_unloaded, 60 - kBound);
  EXPECT_FALSE(programs[0]->loaded());
  EXPECT_TRUE(programs[59]->loaded());
  // Every program still computes its own result; the early ones reload.
  for (int i = 0; i < 60; i += 7) {
    auto [first, last] = run_add(programs[i]->executable(), 8);
    EXPECT_EQ(first, static_cast<float>(i));
    EXPECT_EQ(last, static_cast<float>(7 + i));
  }
  EXPECT_GE(graph::metrics().programs_reloaded, 8);
  EXPECT_EQ(graph::metrics().compiles, 60 + graph::metrics().programs_reloaded) << "no disk tier: reloads compile";
  EXPECT_EQ(cache.loaded(), static_cast<size_t>(kBound));
  // A use makes a program the most recent: it outlives newer unused ones.
  auto keep = cache.get_or_compile(add_program(8, 1000), 0);
  for (int i = 0; i < 2 * kBound; ++i) {
    cache.get_or_compile(add_program(8, 2000 + i), 0);
    keep->executable();
  }
  EXPECT_TRUE(keep->loaded());
}

// The maps budget: each program weighs the memory maps loading it added.
TEST(ProgramCache, TheMapsBudgetBoundsWhatLoadedProgramsMap) {
  client()->compile(add_program(1, 0.25), {});  // the plugin's one-time maps
  constexpr int64_t kMaps = 30;
  graph::CompileCache cache(client(), nullptr, {.programs = 1000, .maps = kMaps});
  int64_t before = memory_maps();
  for (int i = 0; i < 40; ++i) {
    cache.get_or_compile(add_program(8, 0.5 + i), 0);
    EXPECT_LE(cache.loaded_maps(), kMaps);
  }
  EXPECT_GE(cache.loaded(), 3u);  // ~3 maps each on XLA:CPU
  EXPECT_LT(cache.loaded(), 40u);
  EXPECT_LE(memory_maps() - before, kMaps + 10);
}

TEST(ProgramCache, AHeldExecutableOutlivesItsUnloading) {
  graph::CompileCache cache(client(), nullptr, {.programs = 1});
  auto program = cache.get_or_compile(add_program(16, 3), 0);
  pjrt::ExecutablePtr exe = program->executable();  // what an in-flight execution holds
  cache.get_or_compile(add_program(16, 4), 0);
  EXPECT_FALSE(program->loaded());
  EXPECT_EQ(run_add(exe, 16), (std::pair<float, float>{3, 18}));
  EXPECT_EQ(run_add(program->executable(), 16), (std::pair<float, float>{3, 18}));
}

TEST(ProgramCache, ReloadsFromTheDiskTierWithoutCompiling) {
  namespace fs = std::filesystem;
  fs::path dir = fs::temp_directory_path() / ("torch_pjrt_program_cache_test_" + std::to_string(getpid()));
  fs::remove_all(dir);
  graph::CompileCache cache(client(), std::make_unique<graph::DiskCache>(dir.string(), "id", 1 << 30),
                           {.programs = 2});
  graph::reset_metrics();
  std::vector<graph::ProgramPtr> programs;
  for (int i = 0; i < 6; ++i) programs.push_back(cache.get_or_compile(add_program(4, i), 0));
  EXPECT_EQ(graph::metrics().compiles, 6);
  // Newest first: the two still loaded run as they are, the other four reload.
  for (int i = 5; i >= 0; --i) EXPECT_EQ(run_add(programs[i]->executable(), 4).second, static_cast<float>(3 + i));
  EXPECT_EQ(graph::metrics().compiles, 6) << "reloads come from the disk tier";
  EXPECT_EQ(graph::metrics().programs_reloaded, 4);
  EXPECT_EQ(graph::metrics().disk_cache_hits, 4);
  fs::remove_all(dir);
}

// Threads running, reloading and unloading programs at once (bound far below
// the working set) all get their own program's results.
TEST(ProgramCache, ThreadsShareTheBoundSafely) {
  graph::CompileCache cache(client(), nullptr, {.programs = 3});
  std::vector<graph::ProgramPtr> programs;
  for (int i = 0; i < 8; ++i) programs.push_back(cache.get_or_compile(add_program(32, i), 0));
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int step = 0; step < 24; ++step) {
        int i = (step * 3 + t) % 8;
        if (run_add(programs[i]->executable(), 32) != std::pair<float, float>{float(i), float(31 + i)}) ++wrong;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong, 0);
  EXPECT_LE(cache.loaded(), 3u);
}
