// Runtime checks of programs that already ran (lowering::RuntimeCheck): a
// program whose ops declared checks returns one more tiny value, an s64[3]
// status {index of the first failed check or -1, its bad value, a size known
// only at runtime}. The host keeps these status buffers and reads them at its
// next wait anyway (a data read, synchronize(), or at once in debug mode),
// then raises the CPU's error naming the op and the user's line that recorded it. One mechanism for every
// mode; nothing waits just for a check.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "aten/lowering.h"
#include "graph/source_location.h"
#include "pjrt/buffer.h"

namespace torch_pjrt {

// One check of a compiled program. Everything but the user's line follows
// from the program's ops' signatures, so it is made once per program.
struct CheckInfo {
  lowering::CheckError error;
  std::string message;  // "{}" stands for the bad value
  std::string op;       // "aten::index.Tensor(Float[5], Long[2])"
  size_t checked_op = 0;  // which of the program's ops with checks declared it
};
using CheckInfos = std::shared_ptr<const std::vector<CheckInfo>>;

// Appends the checks that op `op` (the program's `checked_op`-th op with checks) declared.
void add_check_infos(std::vector<CheckInfo>& into, const std::vector<lowering::RuntimeCheck>& checks,
                     const std::string& op, size_t checked_op);

// A program's status not yet read, kept in its device's context.
struct PendingStatus {
  pjrt::BufferPtr status;
  CheckInfos checks;
  std::vector<graph::SourceLocation> locations;
};

// Keeps a program's status until the next wait on `device`, with the user's
// line of each of its ops with checks (indexed by CheckInfo::checked_op).
void defer_checks(int device, pjrt::BufferPtr status, CheckInfos checks, std::vector<graph::SourceLocation> locations);

// At a host wait: reads every pending status of `device` (-1: of every
// device; their programs ran before this wait) and raises the first failure
// as the CPU would (IndexError or RuntimeError). Those pending lists are
// empty afterwards either way.
void raise_failed_checks(int device = -1);

}  // namespace torch_pjrt
