// benchmarks/weight_grad.py's candidate: a linear layer's weight gradient dW [O x I] = dy^T x
// (dy [T x O], x [T x I], both token-major) on oneDNN's micro-kernels (at::native::cpublas::brgemm),
// for bf16 on one thread. Not used by the trainers (yet): it measures the lever.
//
// Why: autograd hands oneDNN dy^T as a transposed view, whose reduction (the tokens) is its
// slow dimension, and oneDNN's matmul ran it at about half the forward's rate on AMX
// (benchmarks/gemm_layouts.py). Here each chunk of KC tokens is prepared once: x's rows as the
// B operand (VNNI pairs of rows on AMX, the rows themselves elsewhere), dy's columns for each
// block of MB output rows transposed into a small A (in cache); one micro-kernel call per
// (chunk, block) with N = I accumulates into an fp32 dW, rounded to bf16 at the end.
#include <ATen/ATen.h>
#include <ATen/native/CPUBlas.h>
#include <torch/extension.h>

#include <vector>

namespace fbgemm {
template <typename T>
void transpose_simd(int64_t M, int64_t N, const T* src, int64_t ld_src, T* dst, int64_t ld_dst);
}  // namespace fbgemm

namespace {

void transpose16(int64_t M, int64_t N, const uint16_t* src, int64_t ld_src, uint16_t* dst, int64_t ld_dst) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  fbgemm::transpose_simd<uint16_t>(M, N, src, ld_src, dst, ld_dst);
#else
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) dst[j * ld_dst + i] = src[i * ld_src + j];
#endif
}

// dy [T x O], x [T x I] contiguous bf16; T % kc == 0, O % mb == 0, kc even
at::Tensor weight_grad(const at::Tensor& dy, const at::Tensor& x, int64_t kc, int64_t mb) {
  TORCH_CHECK(dy.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(dy.is_contiguous() && x.is_contiguous() && dy.size(0) == x.size(0), "contiguous [T x O], [T x I]");
  const int64_t T = dy.size(0), O = dy.size(1), I = x.size(1);
  TORCH_CHECK(T % kc == 0 && O % mb == 0 && kc % 2 == 0, "T a multiple of kc (even), O of mb");
  auto acc = at::empty({O, I}, dy.options().dtype(at::kFloat));
  const bool vnni = at::native::cpublas::could_pack(at::kBFloat16);
  const int64_t lda = kc + 16;  // off a power of two: the transpose's column walk spreads over cache sets
  std::vector<uint16_t> b(vnni ? kc * I : 0), a(mb * lda);
  const auto* dyp = reinterpret_cast<const uint16_t*>(dy.data_ptr<at::BFloat16>());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  float* C = acc.data_ptr<float>();
  for (int64_t t0 = 0; t0 < T; t0 += kc) {
    const uint16_t* B = xp + t0 * I;
    if (vnni) {  // rows k and k+1 interleaved, element by element
      for (int64_t k = 0; k < kc; k += 2) {
        const uint16_t* r0 = xp + (t0 + k) * I;
        uint16_t* o = b.data() + k * I;
        for (int64_t n = 0; n < I; ++n) o[2 * n] = r0[n], o[2 * n + 1] = r0[I + n];
      }
      B = b.data();
    }
    for (int64_t o0 = 0; o0 < O; o0 += mb) {
      transpose16(kc, mb, dyp + t0 * O + o0, O, a.data(), lda);
      at::native::cpublas::brgemm(mb, I, kc, lda, I, I, t0 > 0, reinterpret_cast<const at::BFloat16*>(a.data()),
                                  reinterpret_cast<const at::BFloat16*>(B), C + o0 * I, vnni);
    }
  }
  at::native::cpublas::brgemm_release(vnni);
  return acc.to(at::kBFloat16);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("weight_grad", &weight_grad); }
