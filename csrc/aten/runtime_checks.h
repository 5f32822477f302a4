// Runtime checks of programs that already ran (lowering::RuntimeCheck): a
// program whose ops declared checks returns one more tiny value, an s64[2]
// status {index of the first failed check or -1, its bad value}. The host
// keeps these status buffers and reads them at its next wait anyway (a data
// read, synchronize(), or at once in debug mode), then raises the CPU's error
// naming the op and the user's line that recorded it. One mechanism for every
// mode; nothing waits just for a check.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "aten/lowering.h"
#include "graph/source_location.h"
#include "pjrt/buffer.h"

namespace torch_pjrt {

struct CheckInfo {
  lowering::CheckError error;
  std::string message;  // "{}" stands for the bad value
  size_t op = 0;        // which checked op of the program declared it
};
using CheckInfos = std::shared_ptr<const std::vector<CheckInfo>>;

// Appends the checks one op declared, as its `op`-th checked op.
void add_check_infos(std::vector<CheckInfo>& into, const std::vector<lowering::RuntimeCheck>& checks, size_t op);

// What the error names for a checked op: "aten::index.Tensor(Float[5], Long[2])" and the user's line.
struct CheckedOp {
  std::string description;
  graph::SourceLocation location = 0;
};

// Keeps a program's status until the next wait. `ops` is indexed by CheckInfo::op.
void defer_checks(pjrt::BufferPtr status, CheckInfos checks, std::vector<CheckedOp> ops);

// At a host wait: reads every pending status (their programs ran before this
// wait) and raises the first failure as the CPU would (IndexError or
// RuntimeError). The pending list is empty afterwards either way.
void raise_failed_checks();

}  // namespace torch_pjrt
