// The traits every rlk XLA FFI handler declares.
#pragma once

#include "xla/ffi/api/ffi.h"

// Command-buffer compatible: XLA may capture the handler into the CUDA graph
// of the ops around it instead of running it as a thunk of its own between
// graphs. Our handlers qualify (xla/ffi/api/api.h lists the conditions): they
// only launch kernels on the stream they are given, never synchronize or
// query it, and touch only buffers XLA passes in. Workspace and scratch are
// XLA-allocated results for that reason: a ScratchAllocator block is freed
// when the handler returns, while a captured graph keeps its address.
// -DRLK_FFI_CMD_BUFFER=0 drops the trait (to measure what it buys).
#ifndef RLK_FFI_CMD_BUFFER
#define RLK_FFI_CMD_BUFFER 1
#endif
#if RLK_FFI_CMD_BUFFER
#define RLK_FFI_TRAITS {::xla::ffi::Traits::kCmdBufferCompatible}
#else
#define RLK_FFI_TRAITS {}
#endif
