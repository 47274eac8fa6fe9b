// allocwatch's stand-in for CUDA's crt/host_defines.h, used only where the CUDA runtime headers
// that torch brings from PyPI (nvidia-cuda-runtime) come without NVIDIA's own crt/ folder
// (CUDA 13 ships it apart, in nvidia-cuda-crt, which torch does not depend on).
//
// The native back end is host code compiled by a plain C++ compiler: every CUDA qualifier the
// runtime headers use is empty here, and the few attributes that matter to a host compiler
// (alignment, inlining) keep their meaning. A real crt/host_defines.h found on the include path
// always wins (build.py puts this folder last).
#pragma once

#define __host__
#define __device__
#define __global__
#define __shared__
#define __constant__
#define __managed__
#define __grid_constant__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __align__(n) __attribute__((aligned(n)))
#define __builtin_align__(a) __align__(a)
#define __CUDA_ALIGN__(n) __align__(n)
#define __thread__ __thread
#define __import__
#define __export__
#define __cdecl
#define __annotate__(a) __attribute__((a))
#define __location__(a) __annotate__(a)
#define __no_return__ __attribute__((noreturn))
#define __specialization_static
#define __cudart_builtin__
#define __device_builtin__
#define __device_builtin_texture_type__
#define __device_builtin_surface_type__
#define __nv_pure__
#define CUDARTAPI
#define CUDARTAPI_CDECL
#define CUDA_CB
