// Collectives as one program over the CPU plugin's virtual devices: compiled
// for N replicas with a device assignment, executed with one argument list per
// device (PJRT_LoadedExecutable_Execute, num_devices = N).
#include <gtest/gtest.h>

#include <cstdlib>
#include <numeric>

#include "aten/lowerings/collectives.h"
#include "graph/compile_cache.h"
#include "graph/metrics.h"
#include "pjrt/client.h"
#include "cpu_client.h"
#include "pjrt/error.h"

using namespace torch_pjrt;
using lowering::Collective;
using lowering::CollectiveSpec;
using lowering::ReduceOp;

namespace {

constexpr int kDevices = 4;

std::shared_ptr<pjrt::Client> client() { return test_support::cpu_client(kDevices); }

// Replica r's input: r * 100 + i for i in [0, count).
std::vector<std::vector<float>> run(const CollectiveSpec& spec, const std::vector<size_t>& devices,
                                    graph::CompileCache* cache = nullptr) {
  auto program = lowering::collective_program(spec);
  int64_t count = 1, out_count = 1;
  for (int64_t d : spec.dims) count *= d;
  for (int64_t d : program.out_dims) out_count *= d;
  pjrt::ExecutablePtr exe = cache ? cache->get_or_compile_replicated(program.text, devices)->executable()
                                  : client()->compile(program.text, client()->replicated_options({}, devices));
  std::vector<pjrt::BufferPtr> inputs;
  std::vector<std::vector<pjrt::Buffer*>> args;
  std::vector<PJRT_Device*> replica_devices;
  for (size_t r = 0; r < devices.size(); ++r) {
    std::vector<float> host(count);
    for (int64_t i = 0; i < count; ++i) host[i] = static_cast<float>(r * 100 + i);
    inputs.push_back(client()->buffer_from_host(host.data(), ElementType::F32, {count}, devices[r]));
    args.push_back({inputs.back().get()});
    replica_devices.push_back(client()->device(devices[r]));
  }
  auto result = exe->execute_replicated(args, replica_devices);
  std::vector<std::vector<float>> out;
  for (size_t r = 0; r < devices.size(); ++r) {
    if (result.done[r]) result.done[r]->wait();
    EXPECT_EQ(result.outputs[r][0]->element_count(), out_count);
    std::vector<float> host(out_count);
    result.outputs[r][0]->to_host(host.data());
    out.push_back(host);
  }
  return out;
}

CollectiveSpec spec_of(Collective kind, hlo::Dims dims, int64_t replicas) {
  CollectiveSpec s;
  s.kind = kind;
  s.dims = std::move(dims);
  s.replicas = replicas;
  return s;
}

}  // namespace

TEST(Collectives, AllReduceSumAcrossFourDevices) {
  auto out = run(spec_of(Collective::AllReduce, {3}, 4), {0, 1, 2, 3});
  for (const auto& r : out) EXPECT_EQ(r, (std::vector<float>{600, 604, 608}));
}

TEST(Collectives, ReplicaOrderFollowsTheDeviceList) {
  // Replica 0 on device 3: a gather puts replica 0's value first whatever its device.
  auto out = run(spec_of(Collective::AllGather, {2}, 2), {3, 1});
  for (const auto& r : out) EXPECT_EQ(r, (std::vector<float>{0, 1, 100, 101}));
}

TEST(Collectives, ReduceScatterAllToAllPermuteBroadcast) {
  auto rs = run(spec_of(Collective::ReduceScatter, {4}, 2), {0, 1});
  EXPECT_EQ(rs[0], (std::vector<float>{100, 102}));
  EXPECT_EQ(rs[1], (std::vector<float>{104, 106}));
  auto a2a = run(spec_of(Collective::AllToAll, {4}, 2), {0, 1});
  EXPECT_EQ(a2a[0], (std::vector<float>{0, 1, 100, 101}));
  EXPECT_EQ(a2a[1], (std::vector<float>{2, 3, 102, 103}));
  auto perm_spec = spec_of(Collective::Permute, {2}, 3);
  perm_spec.pairs = {{0, 1}, {1, 2}};
  auto perm = run(perm_spec, {0, 1, 2});
  EXPECT_EQ(perm[0], (std::vector<float>{0, 0}));  // no source sends to replica 0
  EXPECT_EQ(perm[1], (std::vector<float>{0, 1}));
  EXPECT_EQ(perm[2], (std::vector<float>{100, 101}));
  auto bc_spec = spec_of(Collective::Broadcast, {2}, 3);
  bc_spec.root = 2;
  for (const auto& r : run(bc_spec, {0, 1, 2})) EXPECT_EQ(r, (std::vector<float>{200, 201}));
  bc_spec.groups = {{0}, {1}, {2}};  // each replica its own root
  bc_spec.root = 0;
  auto own = run(bc_spec, {0, 1, 2});
  EXPECT_EQ(own[1], (std::vector<float>{100, 101}));
}

TEST(Collectives, GroupsReduceAmongThemselves) {
  auto s = spec_of(Collective::AllReduce, {1}, 4);
  s.groups = {{0, 2}, {1, 3}};
  auto out = run(s, {0, 1, 2, 3});
  EXPECT_EQ(out[0][0], 200);
  EXPECT_EQ(out[2][0], 200);
  EXPECT_EQ(out[1][0], 400);
  EXPECT_EQ(out[3][0], 400);
}

TEST(Collectives, AvgMaxMinProd) {
  auto s = spec_of(Collective::AllReduce, {2}, 2);
  s.op = ReduceOp::Avg;
  EXPECT_EQ(run(s, {0, 1})[0], (std::vector<float>{50, 51}));
  s.op = ReduceOp::Max;
  EXPECT_EQ(run(s, {0, 1})[1], (std::vector<float>{100, 101}));
  s.op = ReduceOp::Min;
  EXPECT_EQ(run(s, {0, 1})[1], (std::vector<float>{0, 1}));
  s.op = ReduceOp::Prod;
  EXPECT_EQ(run(s, {0, 1})[0], (std::vector<float>{0, 101}));
}

TEST(Collectives, CacheKeyHoldsTheDeviceSet) {
  graph::CompileCache cache(client());
  auto s = spec_of(Collective::AllReduce, {2}, 2);
  int64_t before = graph::metrics().compiles;
  run(s, {0, 1}, &cache);
  run(s, {0, 1}, &cache);
  EXPECT_EQ(graph::metrics().compiles - before, 1);  // the same devices: compiled once
  auto out = run(s, {2, 3}, &cache);                 // other devices: another executable
  EXPECT_EQ(graph::metrics().compiles - before, 2);
  EXPECT_EQ(out[0], (std::vector<float>{100, 102}));
}

TEST(Collectives, BadSpecsRaiseNamingTheProblem) {
  auto s = spec_of(Collective::ReduceScatter, {3}, 2);
  EXPECT_THROW(lowering::collective_program(s), std::invalid_argument);
  s = spec_of(Collective::AllReduce, {3}, 2);
  s.op = ReduceOp::Avg;
  s.element = ElementType::S64;
  EXPECT_THROW(lowering::collective_program(s), std::invalid_argument);
  s = spec_of(Collective::Permute, {3}, 2);
  s.pairs = {{0, 1}, {0, 0}};
  EXPECT_THROW(lowering::collective_program(s), std::invalid_argument);
  s = spec_of(Collective::AllReduce, {3}, 4);
  s.groups = {{0, 1}, {1, 2}};
  EXPECT_THROW(lowering::collective_program(s), std::invalid_argument);
}
