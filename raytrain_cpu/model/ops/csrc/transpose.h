// The kernels' shared transpose (fused_attention.cpp, weight_grad.cpp): fbgemm's vectorized one,
// exported by libtorch_cpu (ATen's own utils::transpose calls it; its header would need fbgemm's
// headers, which torch's wheel does not ship). raytrain_cpu/fused_attention.build_kernel hashes
// this header with each source, so a change here rebuilds both.
#pragma once

#include <cstdint>

namespace fbgemm {
template <typename T>
void transpose_simd(int64_t M, int64_t N, const T* src, int64_t ld_src, T* dst, int64_t ld_dst);
}  // namespace fbgemm

namespace raytrain {

// src [M x N] (ld_src) -> dst [N x M] (ld_dst), for 16- and 32-bit elements: fbgemm's AVX2 /
// AVX-512 code where the kernel is built for them, else a loop.
template <typename T>
inline void transpose(int64_t M, int64_t N, const T* src, int64_t ld_src, T* dst, int64_t ld_dst) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  fbgemm::transpose_simd<T>(M, N, src, ld_src, dst, ld_dst);
#else
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) dst[j * ld_dst + i] = src[i * ld_src + j];
#endif
}

}  // namespace raytrain
