// allocwatch's stand-in for CUDA's crt/host_config.h (see host_defines.h beside it): NVIDIA's
// file checks which host compilers nvcc supports, which says nothing to a plain C++ compile of
// host code.
#pragma once
