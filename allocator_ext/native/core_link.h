// The core library as every part of the native back end calls it: the one object install()
// obtained from it (csrc/native_core.h; this library never links against the core), and how
// a failure the core reports becomes PyTorch's error.
#pragma once

#include <c10/util/Exception.h>

#include "native_core.h"

namespace allocwatch::native_backend {

namespace core = allocwatch::native_core;

// Set once by allocwatch_native_install, before PyTorch can call anything here.
extern core::NativeCore* g_core;

// A failure as PyTorch's callers expect it: ValueError for a bad argument, RuntimeError else.
inline void check(const core::Failure& failure) {
  if (!failure) return;
  TORCH_CHECK_VALUE(failure.kind != core::Failure::invalid_argument, failure.message);
  TORCH_CHECK(false, failure.message);
}

}  // namespace allocwatch::native_backend
