#include "pjrt/buffer.h"

#include "pjrt/error.h"

namespace torch_pjrt::pjrt {
namespace {

ElementType from_pjrt(PJRT_Buffer_Type t) {
  switch (t) {
    case PJRT_Buffer_Type_PRED: return ElementType::Pred;
    case PJRT_Buffer_Type_S8: return ElementType::S8;
    case PJRT_Buffer_Type_S16: return ElementType::S16;
    case PJRT_Buffer_Type_S32: return ElementType::S32;
    case PJRT_Buffer_Type_S64: return ElementType::S64;
    case PJRT_Buffer_Type_U8: return ElementType::U8;
    case PJRT_Buffer_Type_U16: return ElementType::U16;
    case PJRT_Buffer_Type_U32: return ElementType::U32;
    case PJRT_Buffer_Type_U64: return ElementType::U64;
    case PJRT_Buffer_Type_F16: return ElementType::F16;
    case PJRT_Buffer_Type_BF16: return ElementType::BF16;
    case PJRT_Buffer_Type_F32: return ElementType::F32;
    case PJRT_Buffer_Type_F64: return ElementType::F64;
    case PJRT_Buffer_Type_C64: return ElementType::C64;
    case PJRT_Buffer_Type_C128: return ElementType::C128;
    default: fail("PJRT buffer has an element type torch_pjrt does not support (", static_cast<int>(t), ")");
  }
}

}  // namespace

Event::~Event() {
  if (in_forked_child()) return;
  auto args = PJRT_ARGS(PJRT_Event_Destroy_Args);
  args.event = event_;
  plugin_->api()->PJRT_Event_Destroy(&args);
}

void Event::wait() {
  auto args = PJRT_ARGS(PJRT_Event_Await_Args);
  args.event = event_;
  plugin_->check(plugin_->api()->PJRT_Event_Await(&args), "PJRT_Event_Await");
  auto err = PJRT_ARGS(PJRT_Event_Error_Args);
  err.event = event_;
  plugin_->check(plugin_->api()->PJRT_Event_Error(&err), "device execution");
}

bool Event::is_ready() const {
  auto args = PJRT_ARGS(PJRT_Event_IsReady_Args);
  args.event = event_;
  plugin_->check(plugin_->api()->PJRT_Event_IsReady(&args), "PJRT_Event_IsReady");
  return args.is_ready;
}

namespace {
struct ReadyCallback {
  std::shared_ptr<Plugin> plugin;
  std::function<void()> callback;
};
void run_ready_callback(PJRT_Error* error, void* arg) {
  std::unique_ptr<ReadyCallback> ready(static_cast<ReadyCallback*>(arg));
  if (error) {  // the waiter sees the error through wait(); only free it here
    auto args = PJRT_ARGS(PJRT_Error_Destroy_Args);
    args.error = error;
    ready->plugin->api()->PJRT_Error_Destroy(&args);
  }
  ready->callback();
}
}  // namespace

void Event::on_ready(std::function<void()> callback) {
  auto args = PJRT_ARGS(PJRT_Event_OnReady_Args);
  args.event = event_;
  args.callback = &run_ready_callback;
  args.user_arg = new ReadyCallback{plugin_, std::move(callback)};
  PJRT_Error* error = plugin_->api()->PJRT_Event_OnReady(&args);
  if (error) delete static_cast<ReadyCallback*>(args.user_arg);
  plugin_->check(error, "PJRT_Event_OnReady");
}

Buffer::Buffer(std::shared_ptr<Plugin> plugin, PJRT_Buffer* buffer) : plugin_(std::move(plugin)), buffer_(buffer) {
  const PJRT_Api* api = plugin_->api();
  auto type = PJRT_ARGS(PJRT_Buffer_ElementType_Args);
  type.buffer = buffer_;
  plugin_->check(api->PJRT_Buffer_ElementType(&type), "PJRT_Buffer_ElementType");
  type_ = from_pjrt(type.type);
  auto dims = PJRT_ARGS(PJRT_Buffer_Dimensions_Args);
  dims.buffer = buffer_;
  plugin_->check(api->PJRT_Buffer_Dimensions(&dims), "PJRT_Buffer_Dimensions");
  dims_.assign(dims.dims, dims.dims + dims.num_dims);
}

Buffer::~Buffer() {
  if (in_forked_child()) return;
  auto args = PJRT_ARGS(PJRT_Buffer_Destroy_Args);
  args.buffer = buffer_;
  plugin_->api()->PJRT_Buffer_Destroy(&args);
}

int64_t Buffer::element_count() const {
  int64_t n = 1;
  for (int64_t d : dims_) n *= d;
  return n;
}

void Buffer::to_host(void* dst) const { to_host_async(dst)->wait(); }

std::unique_ptr<Event> Buffer::to_host_async(void* dst) const {
  auto args = PJRT_ARGS(PJRT_Buffer_ToHostBuffer_Args);
  args.src = buffer_;
  args.dst = dst;
  args.dst_size = byte_count();
  plugin_->check(plugin_->api()->PJRT_Buffer_ToHostBuffer(&args), "PJRT_Buffer_ToHostBuffer");
  return std::make_unique<Event>(plugin_, args.event);
}

std::shared_ptr<Buffer> Buffer::copy_to_device(PJRT_Device* device) const {
  auto args = PJRT_ARGS(PJRT_Buffer_CopyToDevice_Args);
  args.buffer = buffer_;
  args.dst_device = device;
  plugin_->check(plugin_->api()->PJRT_Buffer_CopyToDevice(&args), "PJRT_Buffer_CopyToDevice");
  return std::make_shared<Buffer>(plugin_, args.dst_buffer, type_, dims_);
}

void Buffer::wait_ready() const {
  auto args = PJRT_ARGS(PJRT_Buffer_ReadyEvent_Args);
  args.buffer = buffer_;
  plugin_->check(plugin_->api()->PJRT_Buffer_ReadyEvent(&args), "PJRT_Buffer_ReadyEvent");
  Event(plugin_, args.event).wait();
}

uintptr_t Buffer::device_address() const {
  auto args = PJRT_ARGS(PJRT_Buffer_UnsafePointer_Args);
  args.buffer = buffer_;
  plugin_->check(plugin_->api()->PJRT_Buffer_UnsafePointer(&args), "PJRT_Buffer_UnsafePointer");
  return args.buffer_pointer;
}

bool Buffer::is_deleted() const {
  auto args = PJRT_ARGS(PJRT_Buffer_IsDeleted_Args);
  args.buffer = buffer_;
  plugin_->check(plugin_->api()->PJRT_Buffer_IsDeleted(&args), "PJRT_Buffer_IsDeleted");
  return args.is_deleted;
}

}  // namespace torch_pjrt::pjrt
