// Portability macros shared by the CPU and CUDA kernels.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define VELOCE_HD __host__ __device__ __forceinline__
#else
#define VELOCE_HD inline
#endif
