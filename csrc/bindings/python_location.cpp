// The source-location hook for Python callers: the innermost frame outside
// torch and torch_pjrt, as an id. Ids are interned per (code object, line) and
// the code objects are kept alive, so an id stays valid for the process.
#include "bindings/python_location.h"

#include <Python.h>

#include "aten/exit_gate.h"

#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "graph/source_location.h"

#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/node.h>

namespace torch_pjrt {
namespace {

struct InstructionHash {
  size_t operator()(const std::pair<PyCodeObject*, int>& k) const {
    return std::hash<const void*>()(k.first) * 31 + std::hash<int>()(k.second);
  }
};

struct PairHash {
  size_t operator()(const std::pair<uint64_t, uint64_t>& k) const {
    return std::hash<uint64_t>()(k.first) * 1000003u ^ std::hash<uint64_t>()(k.second);
  }
};

constexpr size_t kNodeLines = 1 << 20;  // nodes remembered; a step's graph has far fewer

struct LocationTable {
  std::mutex mutex;
  std::vector<std::string> library_dirs;               // frames under these are not the user's
  std::unordered_map<PyCodeObject*, bool> is_library;  // owns a reference to each code object
  std::map<std::pair<PyCodeObject*, int>, graph::SourceLocation> ids;  // (code, line) -> id
  // (code, instruction offset) -> id: the per-op lookup. A frame's line number
  // is decoded from the code's line table on every call; its offset is not.
  std::unordered_map<std::pair<PyCodeObject*, int>, graph::SourceLocation, InstructionHash> by_instruction;
  std::vector<std::string> texts;  // id - 1 -> "file:line in function", made once per id
  // The line of the op that made each recent autograd node, by (forward thread, sequence number), oldest
  // first in node_order; and per line, the id of "that line (backward)". An op that autograd's backward runs
  // on a thread with no user frame is named by its node's forward line.
  std::unordered_map<std::pair<uint64_t, uint64_t>, graph::SourceLocation, PairHash> node_lines;
  std::deque<std::pair<uint64_t, uint64_t>> node_order;
  std::unordered_map<graph::SourceLocation, graph::SourceLocation> backward_ids;
  // Names the user's line behind a line of FX-generated code (a compiled
  // graph's "<eval_with_key>" file): callable(file, line) -> str or None.
  PyObject* generated_code_resolver = nullptr;
};

LocationTable& table() {
  static auto* t = new LocationTable();  // never destroyed: ids outlive interpreter shutdown order
  return *t;
}

bool library_code(LocationTable& t, PyCodeObject* code) {
  auto it = t.is_library.find(code);
  if (it != t.is_library.end()) return it->second;
  const char* file = PyUnicode_AsUTF8(code->co_filename);
  bool library = false;
  if (!file) {
    PyErr_Clear();
  } else {
    std::string path(file);
    for (const std::string& dir : t.library_dirs)
      if (path.compare(0, dir.size(), dir) == 0) library = true;
    if (path.rfind("<frozen", 0) == 0) library = true;
  }
  Py_INCREF(code);
  t.is_library.emplace(code, library);
  return library;
}

std::string text_of(PyCodeObject* code, int line) {
  const char* file = PyUnicode_AsUTF8(code->co_filename);
  if (!file) PyErr_Clear();
  const char* name = PyUnicode_AsUTF8(code->co_name);
  if (!name) PyErr_Clear();
  return std::string(file ? file : "?") + ":" + std::to_string(line) + " in " + (name ? name : "?");
}

bool generated_code(PyCodeObject* code) {
  const char* file = PyUnicode_AsUTF8(code->co_filename);
  if (!file) PyErr_Clear();
  return file && std::string(file).rfind("<eval_with_key>", 0) == 0;
}

// The resolver's text for a generated line; empty when it has none. Called
// without the table's lock: the resolver runs Python, which may switch threads.
std::string resolve_generated(PyObject* resolver, PyCodeObject* code, int line) {
  PyObject* result = PyObject_CallFunction(resolver, "Oi", code->co_filename, line);
  std::string text;
  if (result && PyUnicode_Check(result)) {
    const char* s = PyUnicode_AsUTF8(result);
    if (s) text = s;
  }
  Py_XDECREF(result);
  PyErr_Clear();
  return text;
}

// Under the table's lock, with `id` the line of the op running now: the autograd node made just before it
// (its grad_fn, made before the kernel runs) gets that line. The first op to see a node names it.
void note_node_line(LocationTable& t, graph::SourceLocation id) {
  const uint64_t next = at::sequence_number::peek();
  thread_local uint64_t last_noted = UINT64_MAX;
  if (next == 0 || next - 1 == last_noted) return;
  last_noted = next - 1;
  auto key = std::make_pair(at::RecordFunction::currentThreadId(), next - 1);
  if (!t.node_lines.emplace(key, id).second) return;
  t.node_order.push_back(key);
  if (t.node_order.size() > kNodeLines) {
    t.node_lines.erase(t.node_order.front());
    t.node_order.pop_front();
  }
}

// The line whose op made the autograd node being evaluated (backward), as "<line> (backward)"; 0 if none.
graph::SourceLocation backward_location() {
  c10::intrusive_ptr<torch::autograd::Node> node = torch::autograd::get_current_node();
  if (!node) return 0;
  LocationTable& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  auto it = t.node_lines.find({node->thread_id(), node->sequence_nr()});
  if (it == t.node_lines.end()) return 0;
  auto [entry, fresh] = t.backward_ids.emplace(it->second, static_cast<graph::SourceLocation>(t.texts.size() + 1));
  if (fresh) t.texts.push_back(t.texts[it->second - 1] + " (backward)");
  return entry->second;
}

graph::SourceLocation capture_with_gil() {
  PyCodeObject* generated = nullptr;  // a fresh id on generated code: ask the resolver
  int generated_line = 0;
  PyObject* resolver = nullptr;
  graph::SourceLocation id = 0;
  {
    LocationTable& t = table();
    std::lock_guard<std::mutex> lock(t.mutex);
    PyFrameObject* frame = PyEval_GetFrame();  // borrowed
    if (!frame) return 0;
    Py_INCREF(frame);
    while (frame) {
      PyCodeObject* code = PyFrame_GetCode(frame);
      bool library = library_code(t, code);
      if (!library) {
        auto instruction = std::make_pair(code, PyFrame_GetLasti(frame));
        auto seen = t.by_instruction.find(instruction);
        if (seen != t.by_instruction.end()) {
          id = seen->second;
        } else {
          auto key = std::make_pair(code, PyFrame_GetLineNumber(frame));
          auto [it, fresh] = t.ids.emplace(key, static_cast<graph::SourceLocation>(t.texts.size() + 1));
          if (fresh) t.texts.push_back(text_of(code, key.second));
          id = it->second;
          t.by_instruction.emplace(instruction, id);
          if (fresh && t.generated_code_resolver && generated_code(code)) {
            generated = code;  // kept alive by is_library's reference
            generated_line = key.second;
            resolver = t.generated_code_resolver;
            Py_INCREF(resolver);
          }
        }
      }
      Py_DECREF(code);
      if (!library) break;
      PyFrameObject* back = PyFrame_GetBack(frame);
      Py_DECREF(frame);
      frame = back;
    }
    Py_XDECREF(frame);
    if (id) note_node_line(t, id);
  }
  if (generated) {
    std::string text = resolve_generated(resolver, generated, generated_line);
    Py_DECREF(resolver);
    if (!text.empty()) {
      LocationTable& t = table();
      std::lock_guard<std::mutex> lock(t.mutex);
      t.texts[id - 1] = text;
    }
  }
  return id;
}

// Op dispatch runs with the GIL released; a thread that never ran Python
// (autograd's device threads) has no user frame to find.
// In backward, with no user frame on the thread, the op is named by its node's forward line.
graph::SourceLocation capture() {
  if (!Py_IsInitialized() || PyGILState_GetThisThreadState() == nullptr) return backward_location();
  park_if_device_closed();  // at exit, taking the GIL would end this thread in our frames
  PyGILState_STATE gil = PyGILState_Ensure();
  graph::SourceLocation id = capture_with_gil();
  PyGILState_Release(gil);
  return id ? id : backward_location();
}

// Needs no Python: errors may be described on threads without the GIL.
std::string describe(graph::SourceLocation id) {
  LocationTable& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  if (id == 0 || id > t.texts.size()) return "an unknown line";
  return t.texts[id - 1];
}

}  // namespace

void install_python_location_hook(std::vector<std::string> library_dirs) {
  {
    std::lock_guard<std::mutex> lock(table().mutex);
    table().library_dirs = std::move(library_dirs);
  }
  graph::set_source_location_hooks({&capture, &describe});
}

void set_generated_code_resolver(PyObject* resolver) {
  Py_XINCREF(resolver);
  std::lock_guard<std::mutex> lock(table().mutex);
  std::swap(table().generated_code_resolver, resolver);
  Py_XDECREF(resolver);  // the previous one; under the GIL, as our caller holds it
}

}  // namespace torch_pjrt
