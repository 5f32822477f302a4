// Element types shared by the runtime and the StableHLO builder.
#pragma once
#include <pjrt_c_api.h>

#include <cstddef>
#include <string_view>

namespace torch_pjrt {

enum class ElementType { Pred, S8, S16, S32, S64, U8, U16, U32, U64, F16, BF16, F32, F64, C64, C128 };

constexpr size_t byte_size(ElementType t) {
  switch (t) {
    case ElementType::Pred: case ElementType::S8: case ElementType::U8: return 1;
    case ElementType::S16: case ElementType::U16: case ElementType::F16: case ElementType::BF16: return 2;
    case ElementType::S32: case ElementType::U32: case ElementType::F32: return 4;
    case ElementType::C128: return 16;
    default: return 8;
  }
}
constexpr bool is_float(ElementType t) {
  return t == ElementType::F16 || t == ElementType::BF16 || t == ElementType::F32 || t == ElementType::F64;
}
constexpr bool is_complex(ElementType t) { return t == ElementType::C64 || t == ElementType::C128; }
// The real type of a complex type's parts (itself for other types).
constexpr ElementType real_part_type(ElementType t) {
  return t == ElementType::C64 ? ElementType::F32 : t == ElementType::C128 ? ElementType::F64 : t;
}
constexpr ElementType complex_type_of(ElementType real) {
  return real == ElementType::F64 ? ElementType::C128 : ElementType::C64;
}
constexpr bool is_unsigned(ElementType t) {
  return t == ElementType::U8 || t == ElementType::U16 || t == ElementType::U32 || t == ElementType::U64;
}
constexpr bool is_signed_int(ElementType t) {
  return t == ElementType::S8 || t == ElementType::S16 || t == ElementType::S32 || t == ElementType::S64;
}

// MLIR spelling used in StableHLO text: signless integers, `ui` for unsigned.
constexpr std::string_view mlir_name(ElementType t) {
  switch (t) {
    case ElementType::Pred: return "i1";
    case ElementType::S8: return "i8";
    case ElementType::S16: return "i16";
    case ElementType::S32: return "i32";
    case ElementType::S64: return "i64";
    case ElementType::U8: return "ui8";
    case ElementType::U16: return "ui16";
    case ElementType::U32: return "ui32";
    case ElementType::U64: return "ui64";
    case ElementType::F16: return "f16";
    case ElementType::BF16: return "bf16";
    case ElementType::F32: return "f32";
    case ElementType::F64: return "f64";
    case ElementType::C64: return "complex<f32>";
    case ElementType::C128: return "complex<f64>";
  }
  return "?";
}

constexpr PJRT_Buffer_Type to_pjrt(ElementType t) {
  switch (t) {
    case ElementType::Pred: return PJRT_Buffer_Type_PRED;
    case ElementType::S8: return PJRT_Buffer_Type_S8;
    case ElementType::S16: return PJRT_Buffer_Type_S16;
    case ElementType::S32: return PJRT_Buffer_Type_S32;
    case ElementType::S64: return PJRT_Buffer_Type_S64;
    case ElementType::U8: return PJRT_Buffer_Type_U8;
    case ElementType::U16: return PJRT_Buffer_Type_U16;
    case ElementType::U32: return PJRT_Buffer_Type_U32;
    case ElementType::U64: return PJRT_Buffer_Type_U64;
    case ElementType::F16: return PJRT_Buffer_Type_F16;
    case ElementType::BF16: return PJRT_Buffer_Type_BF16;
    case ElementType::F32: return PJRT_Buffer_Type_F32;
    case ElementType::F64: return PJRT_Buffer_Type_F64;
    case ElementType::C64: return PJRT_Buffer_Type_C64;
    case ElementType::C128: return PJRT_Buffer_Type_C128;
  }
  return PJRT_Buffer_Type_INVALID;
}

}  // namespace torch_pjrt
