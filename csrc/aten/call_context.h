// Lowering one op call (call_context.cpp): CallContext implements lowering::Context over a real call's
// arguments, storages and runtime operands. emit_op (op_call.h) lowers a call into a fused graph; these lower
// it into a program of its own (strict/debug) or learn its operands (fused modes). Internal to the aten layer.
#pragma once
#include <string>

#include "graph/source_location.h"

namespace torch_pjrt {

struct Call;      // op_call.h
struct CachedOp;  // op_call.h

// Strict and debug modes: compiles the op as a program of its own into cached.program.
void compile_alone(Call& call, CachedOp& cached, graph::SourceLocation location);
// Fused modes: learns the op's operand order (and checks, compile cost) without compiling anything.
void learn_operands(Call& call, CachedOp& cached);

// A rule registered from Python (register_lowering): readies its lowering for the call's types
// (lowering::OpRule::prepare), on the calling thread with the GIL, before any graph lock.
void prepare_rule(Call& call, CachedOp& cached);

// Test hook: op `name` ("aten::tanh"), when lowered into a fused graph, calls a
// kernel no plugin has, so the graph fails to compile. "" turns it off.
// `located`: a call the verifier rejects instead, an error naming the op's line.
void inject_compile_fault(const std::string& name, bool located = false);

}  // namespace torch_pjrt
