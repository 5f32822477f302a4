// Runtime checks of programs that already ran (lowering::RuntimeCheck): a
// program whose ops declared checks returns one more tiny value, an s64[3]
// status {index of the first failed check or -1, its bad value, a size known
// only at runtime}. The host keeps these status buffers and reads them at its
// next wait anyway (a data read, synchronize(), or at once in debug mode),
// then raises the CPU's error naming the op and the user's line that recorded it. One mechanism for every
// mode; nothing waits just for a check.
#pragma once
#include <cstdint>
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
  uint64_t program = 0;  // the program that returned it (begin_program)
  CheckInfos checks;
  std::vector<graph::SourceLocation> locations;
};

// Keeps a program's status until the next wait on `device`, with the user's
// line of each of its ops with checks (indexed by CheckInfo::checked_op).
// `program` is the number begin_program gave it (passed, not read back: another
// thread may launch a program on `device` meanwhile).
void defer_checks(int device, uint64_t program, pjrt::BufferPtr status, CheckInfos checks,
                  std::vector<graph::SourceLocation> locations);

// At a host wait: reads every pending status of `device` (-1: of every
// device; their programs ran before this wait) and raises the first failure
// as the CPU would (IndexError or RuntimeError). Those pending lists are
// empty afterwards either way.
void raise_failed_checks(int device = -1);

// ---- Nothing written after a failed check ----
// A failed check must leave every tensor that existed before it unchanged
// until its error is raised, so that a user who catches the error and skips
// the batch loses nothing. Inside one program, writes are selected on the
// program's own checks (fused_graph.cpp's compile_graph). Across programs,
// programs are numbered per device as they launch, a storage remembers the
// program that gave it its first buffer (StorageState::born), and a program
// that overwrites a storage born before an unread status first reads the
// pending statuses (a wait, only then). When one failed, writes to storages
// born before it are dropped until the error is raised at the user's next
// wait, as before.

// Whether failed checks keep values (default on). Off only to measure what
// keeping them costs (benchmarks/bench_failed_checks.py); returns the old setting.
bool keep_values_on_failed_checks();
bool set_keep_values_on_failed_checks(bool on);

// Numbers the next program launched on `device`; call before installing its outputs.
uint64_t begin_program(int device);
// The number of the last program launched on `device`.
uint64_t current_program(int device);
// Before a program writes storages whose oldest was born at `oldest_born`:
// the birth before which its writes must be dropped (0: none; the common case
// costs a lock and a comparison). May wait for earlier programs.
uint64_t writes_dropped_before(int device, uint64_t oldest_born);
// Whether a program of `device` with an unread check status ran.
bool checks_unread(int device);

// ---- Chained statuses (fused programs) ----
// A chained program takes the status of its device's newest unread program as
// its last parameter and ANDs "that one passed" into the condition that
// selects its writes over older values; its own status then reads
// lowering::kEarlierCheckFailed when only the chain failed (the host reads it
// as passed: the earlier one reports), and the next program chains that one.
// So an earlier program's failed check keeps every value a later one rewrites,
// without any program waiting for an earlier one's status.
// Whether a program of `device` with checks was launched: from then on its
// fused programs chain (a device that never checks runs unchanged programs).
bool chains_statuses(int device);
// The status a chained program launched now on `device` takes: the newest
// unread one, or a status that passed.
pjrt::BufferPtr chained_status(int device);

}  // namespace torch_pjrt
