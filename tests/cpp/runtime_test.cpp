// Runs real programs on the CPU PJRT plugin: compile, execute, transfer,
// serialize, and the StableHLO builder's ops against hand-computed results.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <numeric>
#include <thread>

#include <unistd.h>

#include "graph/compile_cache.h"
#include "graph/metrics.h"
#include "hlo/builder.h"
#include "pjrt/client.h"
#include "cpu_client.h"
#include "pjrt/error.h"

using namespace torch_pjrt;

namespace {

std::shared_ptr<pjrt::Client> client() { return test_support::cpu_client(2); }

template <typename T>
std::vector<T> read(const pjrt::Buffer& b) {
  std::vector<T> out(b.element_count());
  b.to_host(out.data());
  return out;
}

template <typename T>
std::vector<T> run1(hlo::Builder& b, const std::vector<hlo::Value>& results,
                    const std::vector<pjrt::Buffer*>& args) {
  auto exe = client()->compile(b.finish(results), {});
  auto result = exe->execute(args);
  result.done->wait();
  return read<T>(*result.outputs[0]);
}

}  // namespace

TEST(Runtime, ClientReportsCpuDevices) {
  EXPECT_EQ(client()->platform_name(), "cpu");
  EXPECT_EQ(client()->device_count(), 2u);
  EXPECT_FALSE(client()->device_kind(0).empty());
  EXPECT_THROW(client()->device(7), pjrt::Error);
}

TEST(Runtime, RoundTripThroughHost) {
  std::vector<float> data{1, 2, 3, 4, 5, 6};
  auto buf = client()->buffer_from_host(data.data(), ElementType::F32, {2, 3});
  EXPECT_EQ(buf->dims(), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(read<float>(*buf), data);
}

TEST(Runtime, AddAndBroadcast) {
  hlo::Builder b;
  auto x = b.parameter({ElementType::F32, {2, 3}});
  auto y = b.parameter({ElementType::F32, {3}});
  auto yb = b.broadcast_in_dim(y, {2, 3}, {1});
  auto sum = b.binary("add", x, yb);
  std::vector<float> xs{1, 2, 3, 4, 5, 6}, ys{10, 20, 30};
  auto bx = client()->buffer_from_host(xs.data(), ElementType::F32, {2, 3});
  auto by = client()->buffer_from_host(ys.data(), ElementType::F32, {3});
  EXPECT_EQ(run1<float>(b, {sum}, {bx.get(), by.get()}), (std::vector<float>{11, 22, 33, 14, 25, 36}));
}

TEST(Runtime, ReduceDotAndArgmax) {
  hlo::Builder b;
  auto x = b.parameter({ElementType::F32, {2, 3}});
  auto total = b.reduce(x, b.constant(0, ElementType::F32), {1}, hlo::Reducer::Add);
  auto dot = b.dot_general(x, x, {}, {}, {1}, {1}, ElementType::F32);  // x @ x.T
  auto flat = b.reshape(dot, {4});
  auto both = b.concatenate({total, flat}, 0);
  std::vector<float> xs{1, 2, 3, 4, 5, 6};
  auto bx = client()->buffer_from_host(xs.data(), ElementType::F32, {2, 3});
  EXPECT_EQ(run1<float>(b, {both}, {bx.get()}), (std::vector<float>{6, 15, 14, 32, 32, 77}));

  hlo::Builder a;
  auto v = a.parameter({ElementType::F32, {2, 3}});
  auto idx = a.iota({ElementType::S64, {2, 3}}, 1);
  auto arg = a.reduce_arg(v, idx, 1, true);
  std::vector<float> vs{1, 9, 9, NAN, 0, 2};
  auto bv = client()->buffer_from_host(vs.data(), ElementType::F32, {2, 3});
  EXPECT_EQ(run1<int64_t>(a, {arg[1]}, {bv.get()}), (std::vector<int64_t>{1, 0}));
}

TEST(Runtime, GatherScatterSortAndRng) {
  hlo::Builder b;
  auto x = b.parameter({ElementType::F32, {5}});
  auto idx = b.constant_int(3, ElementType::S64, {2, 1});
  hlo::Builder::GatherDims g{{}, {0}, {}, {}, {0}, 1};
  auto got = b.gather(x, idx, g, {1}, {2});
  hlo::Builder::ScatterDims s{{}, {0}, {}, {}, {0}, 1};
  auto acc = b.scatter(x, idx, got, s, hlo::Reducer::Add);  // x[3] += 2 * x[3]
  auto sorted = b.sort({acc}, 0, /*descending=*/true);
  std::vector<float> xs{4, 1, 3, 2, 5};
  auto bx = client()->buffer_from_host(xs.data(), ElementType::F32, {5});
  EXPECT_EQ(run1<float>(b, {sorted[0]}, {bx.get()}), (std::vector<float>{6, 5, 4, 3, 1}));

  hlo::Builder r;
  auto state = r.parameter({ElementType::U64, {2}});
  auto out = r.rng_bit_generator(state, {ElementType::U32, {4}});
  std::vector<uint64_t> key{42, 0};
  auto bs = client()->buffer_from_host(key.data(), ElementType::U64, {2});
  auto first = run1<uint32_t>(r, {out[1]}, {bs.get()});
  auto again = run1<uint32_t>(r, {out[1]}, {bs.get()});
  EXPECT_EQ(first, again);  // counter-based: same key, same bits
  EXPECT_NE(first[0], first[1]);
}

TEST(Runtime, ConstantsAreExact) {
  hlo::Builder b;
  auto c = b.constant(0.1, ElementType::F32, {2});
  auto h = b.convert(b.constant(0.1, ElementType::BF16, {2}), ElementType::F32);
  auto inf = b.constant(-INFINITY, ElementType::F32, {2});
  auto all = b.concatenate({c, h, inf}, 0);
  auto v = run1<float>(b, {all}, {});
  EXPECT_EQ(v[0], 0.1f);
  EXPECT_NEAR(v[2], 0.1f, 1e-3);
  EXPECT_TRUE(std::isinf(v[4]) && v[4] < 0);
}

TEST(Runtime, SerializeRoundTrip) {
  hlo::Builder b;
  auto x = b.parameter({ElementType::S32, {3}});
  auto y = b.binary("multiply", x, x);
  auto exe = client()->compile(b.finish({y}), {});
  auto bytes = exe->serialize();
  ASSERT_FALSE(bytes.empty());
  auto loaded = client()->deserialize(bytes);
  std::vector<int32_t> xs{1, -2, 3};
  auto bx = client()->buffer_from_host(xs.data(), ElementType::S32, {3});
  auto result = loaded->execute({bx.get()});
  result.done->wait();
  EXPECT_EQ(read<int32_t>(*result.outputs[0]), (std::vector<int32_t>{1, 4, 9}));
}

TEST(Runtime, BadProgramRaisesWithPluginMessage) {
  try {
    client()->compile("module { this is not stablehlo }", {});
    FAIL() << "expected an error";
  } catch (const pjrt::Error& e) {
    EXPECT_NE(std::string(e.what()).find("compiling StableHLO"), std::string::npos);
  }
}

TEST(Runtime, MissingPluginRaises) {
  EXPECT_THROW(pjrt::Plugin::load("/nonexistent/plugin.so"), pjrt::Error);
}

// The PJRT version rule: same major; a newer minor is fine; an older minor is
// fine when its function table holds every function torch_pjrt calls. Fakes
// are copies of the real plugin's table with their version or size changed.
namespace {
PJRT_Api fake_api(int major, int minor, size_t struct_size) {
  PJRT_Api api = *client()->plugin()->api();
  api.pjrt_api_version.major_version = major;
  api.pjrt_api_version.minor_version = minor;
  api.struct_size = struct_size;
  return api;
}
bool mentions(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }
}  // namespace

TEST(PluginVersion, TheInstalledPluginIsUsable) {
  EXPECT_EQ(pjrt::api_incompatibility(*client()->plugin()->api()), "");
}

TEST(PluginVersion, NewerMinorIsAccepted) {
  EXPECT_EQ(pjrt::api_incompatibility(fake_api(PJRT_API_MAJOR, PJRT_API_MINOR + 7, PJRT_Api_STRUCT_SIZE + 64)), "");
}

TEST(PluginVersion, OlderMinorWithEveryFunctionWeCallIsAccepted) {
  // Functions appended after the ones we call are absent: nothing we need.
  size_t size = offsetof(PJRT_Api, PJRT_Executable_OutputElementTypes);
  EXPECT_EQ(pjrt::api_incompatibility(fake_api(PJRT_API_MAJOR, PJRT_API_MINOR - 30, size)), "");
}

TEST(PluginVersion, OlderMinorMissingAFunctionWeCallIsRefusedByName) {
  size_t size = PJRT_STRUCT_SIZE(PJRT_Api, PJRT_Buffer_ReadyEvent);  // ends before PJRT_Buffer_UnsafePointer
  std::string why = pjrt::api_incompatibility(fake_api(PJRT_API_MAJOR, PJRT_API_MINOR - 1, size));
  EXPECT_TRUE(mentions(why, "lacks functions torch_pjrt calls: PJRT_Buffer_UnsafePointer")) << why;
  EXPECT_FALSE(mentions(why, "PJRT_Buffer_ReadyEvent")) << why;

  PJRT_Api null_slot = fake_api(PJRT_API_MAJOR, PJRT_API_MINOR - 1, PJRT_Api_STRUCT_SIZE);
  null_slot.PJRT_Client_Compile = nullptr;
  why = pjrt::api_incompatibility(null_slot);
  EXPECT_TRUE(mentions(why, "PJRT_Client_Compile")) << why;
}

TEST(PluginVersion, OtherMajorOrTruncatedTableIsRefused) {
  std::string why = pjrt::api_incompatibility(fake_api(PJRT_API_MAJOR + 1, 0, PJRT_Api_STRUCT_SIZE));
  EXPECT_TRUE(mentions(why, "major versions are incompatible")) << why;
  why = pjrt::api_incompatibility(fake_api(PJRT_API_MAJOR, PJRT_API_MINOR, 8));
  EXPECT_TRUE(mentions(why, "too small")) << why;
}

// The persistent tier: a second cache over the same directory loads instead
// of compiling; a corrupt entry is dropped and rebuilt; another identity misses.
TEST(CompileCache, DiskTierWarmStartCorruptionAndIdentity) {
  namespace fs = std::filesystem;
  fs::path dir = fs::temp_directory_path() / ("torch_pjrt_cache_test_" + std::to_string(getpid()));
  fs::remove_all(dir);
  hlo::Builder b;
  hlo::Value x = b.parameter({ElementType::F32, {3}});
  std::string program = b.finish({b.binary("multiply", x, x)});
  auto make = [&](const std::string& identity) {
    return graph::CompileCache(client(), std::make_unique<graph::DiskCache>(dir.string(), identity, 1 << 30));
  };
  auto run = [&](graph::CompileCache& cache) {
    float in[3] = {1, 2, 3};
    auto buf = client()->buffer_from_host(in, ElementType::F32, {3});
    auto result = cache.get_or_compile(program, 0)->executable()->execute({buf.get()});
    result.done->wait();
    return read<float>(*result.outputs[0]);
  };
  graph::reset_metrics();
  {
    auto cold = make("plugin v1");
    EXPECT_EQ(run(cold), (std::vector<float>{1, 4, 9}));
  }
  EXPECT_EQ(graph::metrics().compiles, 1);
  EXPECT_EQ(graph::metrics().disk_cache_writes, 1);
  {
    auto warm = make("plugin v1");
    EXPECT_EQ(run(warm), (std::vector<float>{1, 4, 9}));
  }
  EXPECT_EQ(graph::metrics().compiles, 1) << "a warm start must not compile";
  EXPECT_EQ(graph::metrics().disk_cache_hits, 1);
  {
    auto other = make("plugin v2");
    EXPECT_EQ(run(other), (std::vector<float>{1, 4, 9}));
  }
  EXPECT_EQ(graph::metrics().compiles, 2) << "another plugin version must not reuse entries";
  for (const auto& e : fs::directory_iterator(dir)) {  // truncate every entry
    fs::resize_file(e.path(), fs::file_size(e.path()) / 2);
  }
  {
    auto after = make("plugin v1");
    EXPECT_EQ(run(after), (std::vector<float>{1, 4, 9}));
  }
  EXPECT_EQ(graph::metrics().compiles, 3);
  EXPECT_GE(graph::metrics().disk_cache_corrupt, 1);
  {
    auto rebuilt = make("plugin v1");
    EXPECT_EQ(run(rebuilt), (std::vector<float>{1, 4, 9}));
  }
  EXPECT_EQ(graph::metrics().compiles, 3) << "the rebuilt entry is used";
  fs::remove_all(dir);
}

TEST(CompileCache, EvictsLeastRecentlyUsed) {
  namespace fs = std::filesystem;
  fs::path dir = fs::temp_directory_path() / ("torch_pjrt_lru_test_" + std::to_string(getpid()));
  fs::remove_all(dir);
  graph::DiskCache disk(dir.string(), "id", 3000);
  std::string blob(1000, 'x');
  disk.store("a", blob);
  disk.store("b", blob);
  ASSERT_TRUE(disk.load("a"));  // a is now more recent than b
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  disk.store("c", blob);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  disk.store("d", blob);  // over the limit: the oldest (b) goes first
  EXPECT_FALSE(disk.load("b"));
  EXPECT_TRUE(disk.load("d"));
  fs::remove_all(dir);
}

// The plugin receives and applies DebugOptions overrides by name: a known
// field compiles and runs the same, an unknown one is rejected by the plugin.
TEST(Runtime, CompileOptionOverridesReachThePlugin) {
  hlo::Builder b;
  auto x = b.parameter({ElementType::F32, {4}});
  auto y = b.binary("multiply", x, x);
  std::string program = b.finish({y});
  std::vector<float> xs{1, 2, 3, 4};
  auto bx = client()->buffer_from_host(xs.data(), ElementType::F32, {4});
  pjrt::CompileOptions quick;
  quick.overrides.emplace_back("xla_cpu_use_fusion_emitters", false);
  quick.overrides.emplace_back("xla_backend_optimization_level", int64_t{0});
  auto result = client()->compile(program, quick)->execute({bx.get()});
  result.done->wait();
  EXPECT_EQ(read<float>(*result.outputs[0]), (std::vector<float>{1, 4, 9, 16}));
  pjrt::CompileOptions unknown;
  unknown.overrides.emplace_back("xla_no_such_option_for_torch_pjrt", true);
  EXPECT_THROW(client()->compile(program, unknown), pjrt::Error);
}

// A region is built by the same emit functions as the enclosing function:
// fresh SSA names, the current location, a stablehlo.return. Here a variadic
// reduce with a reducer of its own (sum and largest magnitude at once).
TEST(Builder, RegionBodyEmitsThroughTheBuilder) {
  hlo::Builder b;
  b.set_location({"aten::custom", "model.py", 7});
  auto x = b.parameter({ElementType::F32, {2, 3}});
  auto zero = b.constant(0, ElementType::F32);
  auto reduced = b.reduce({x, x}, {zero, zero}, {1}, [](hlo::Builder& r, const std::vector<hlo::Value>& v) {
    // v: (sum, largest, element, element)
    return std::vector<hlo::Value>{r.binary("add", v[0], v[2]), r.max(r.unary("abs", v[1]), r.unary("abs", v[3]))};
  });
  std::string text = b.finish({reduced[0], reduced[1]});
  EXPECT_NE(text.find("^bb0("), std::string::npos) << text;
  EXPECT_NE(text.find("\"stablehlo.return\""), std::string::npos) << text;
  EXPECT_NE(text.find("#op0 = loc(\"aten::custom\"(\"model.py\":7:0))"), std::string::npos) << text;
  std::vector<float> xs{1, -5, 2, 3, 4, -1};
  auto bx = client()->buffer_from_host(xs.data(), ElementType::F32, {2, 3});
  auto result = client()->compile(text, {})->execute({bx.get()});
  result.done->wait();
  EXPECT_EQ(read<float>(*result.outputs[0]), (std::vector<float>{-2, 6}));
  EXPECT_EQ(read<float>(*result.outputs[1]), (std::vector<float>{5, 4}));
}

// Every op carries its location; a compile error names it. Locations are
// aliases defined after the module, which the plugin's parser resolves.
TEST(Builder, CompileErrorNamesTheOpsLocation) {
  hlo::Builder b;
  auto x = b.parameter({ElementType::F32, {3}});
  b.set_location({"aten::mul.Tensor", "train.py", 12});
  auto y = b.binary("multiply", x, x);
  b.set_location({"aten::tanh", "train.py", 13, /*graph_op=*/5});
  auto z = b.reshape(y, {4});  // 3 elements: the verifier rejects it
  try {
    client()->compile(b.finish({z}), {});
    FAIL() << "expected an error";
  } catch (const pjrt::Error& e) {
    // The verifier names the line and the graph op (the op's name goes to the HLO metadata).
    EXPECT_NE(std::string(e.what()).find("train.py:13:0: error"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(hlo::graph_op_location_mark(5)), std::string::npos) << e.what();
  }
}

// The same program recorded from other lines is one compile: locations are
// not part of the cache key.
TEST(CompileCache, LocationsAreNotPartOfTheKey) {
  graph::CompileCache cache(client());
  auto program = [](int line) {
    hlo::Builder b;
    auto x = b.parameter({ElementType::F32, {3}});
    b.set_location({"aten::mul.Tensor", "train.py", line});
    return b.finish({b.binary("multiply", x, x)});
  };
  std::string first = program(12), second = program(40);
  ASSERT_NE(first, second);
  graph::reset_metrics();
  auto a = cache.get_or_compile(first, 0);
  auto b = cache.get_or_compile(second, 0);
  EXPECT_EQ(a, b);
  EXPECT_EQ(graph::metrics().compiles, 1);
}
