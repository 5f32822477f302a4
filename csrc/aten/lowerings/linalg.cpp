// Matrix products: mm, bmm, addmm, baddbmm, addbmm, addmv, mv, dot, vdot. matmul and linear
// are composites in PyTorch that reach these. Products of f16/bf16 take their
// inputs as they are and accumulate in f32 (dot_general's result type), as
// PyTorch's CPU kernels and autocast on CUDA do; the executor rounds the result.
#include "aten/lowerings/common.h"

namespace torch_pjrt::lowering {
namespace {

// a @ b contracting a's last dim with b's dim `rhs_contract`, batching over
// the leading `batch` dims of both.
Value product(Context& c, std::string_view lhs, std::string_view rhs, int64_t batch, int64_t rhs_contract) {
  ElementType in = c.output(0).element;
  Value a = c.b.convert(c.tensor(lhs), in), b = c.b.convert(c.tensor(rhs), in);
  Dims batch_dims = all_dims(batch);
  return c.b.dot_general(a, b, batch_dims, batch_dims, {a.rank() - 1}, {rhs_contract}, widen(in));
}

// beta * self + alpha * product, where beta == 0 ignores self (NaN included).
Value scale_and_add(Context& c, Value prod) {
  ElementType e = prod.element();
  if (c.has("alpha")) prod = c.b.binary("multiply", prod, c.b.broadcast_in_dim(c.scalar("alpha", e), prod.dims(), {}));
  Value self = to(c.b, c.tensor("self"), e, prod.dims());
  if (c.has("beta")) {
    Value beta = c.b.broadcast_in_dim(c.scalar("beta", e), prod.dims(), {});
    Value scaled = c.b.binary("multiply", self, beta);
    self = c.b.select(c.b.compare(beta, full(c.b, 0, beta), hlo::Compare::EQ), full(c.b, 0, beta), scaled);
  }
  return c.b.binary("add", self, prod);
}

std::vector<Value> lower_mm(Context& c) { return {product(c, "self", "mat2", 0, 0)}; }
std::vector<Value> lower_bmm(Context& c) { return {product(c, "self", "mat2", 1, 1)}; }
std::vector<Value> lower_mv(Context& c) { return {product(c, "self", "vec", 0, 0)}; }
std::vector<Value> lower_dot(Context& c) { return {product(c, "self", "tensor", 0, 0)}; }
std::vector<Value> lower_vdot(Context& c) {  // conj(self) . other (conj is nothing for real values)
  ElementType e = widen(c.output(0).element);
  Value a = c.b.conj(c.b.convert(c.tensor("self"), e)), b = c.b.convert(c.tensor("other"), e);
  return {c.b.dot_general(a, b, {}, {}, {0}, {0}, e)};
}
std::vector<Value> lower_addmm(Context& c) { return {scale_and_add(c, product(c, "mat1", "mat2", 0, 0))}; }
std::vector<Value> lower_baddbmm(Context& c) { return {scale_and_add(c, product(c, "batch1", "batch2", 1, 1))}; }
// addbmm: the batch of products summed, i.e. contracting the batch dim too.
std::vector<Value> lower_addbmm(Context& c) {
  ElementType in = c.output(0).element;
  Value a = c.b.convert(c.tensor("batch1"), in), b = c.b.convert(c.tensor("batch2"), in);
  return {scale_and_add(c, c.b.dot_general(a, b, {}, {}, {0, 2}, {0, 1}, widen(in)))};
}
std::vector<Value> lower_addmv(Context& c) { return {scale_and_add(c, product(c, "mat", "vec", 0, 0))}; }

}  // namespace

void register_linalg(Table& t) {
  add_lowerings(t, {
           {"mm", lower_mm, kComplex}, {"bmm", lower_bmm, kComplex}, {"mv", lower_mv, kComplex}, {"dot", lower_dot, kComplex}, {"vdot", lower_vdot, kComplex},
           {"addmm", lower_addmm, kComplex}, {"baddbmm", lower_baddbmm, kComplex}, {"addbmm", lower_addbmm, kComplex}, {"addmv", lower_addmv, kComplex}});
  // The CPU's matmul kernels check no overlap of their output with the inputs.
  for (const char* name : {"mm", "addmm", "bmm", "baddbmm", "mv", "addmv"}) rule(t, name).inputs_overlap_unchecked();
}

}  // namespace torch_pjrt::lowering
