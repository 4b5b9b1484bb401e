// model.weight_grad_kernel: a linear layer's weight gradient dW [O x I] = dy^T x (dy [T x O],
// x [T x I], both token-major) on oneDNN's micro-kernels (at::native::cpublas::brgemm: AMX tiles
// where present, a plain GEMM elsewhere), bf16, on the calling thread. Built at first use by
// raytrain_cpu/linear.py; benchmarks/weight_grad.py times it against autograd's.
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

#include <algorithm>
#include <vector>

#include "transpose.h"

namespace {

// Tokens a chunk: x's chunk (KC x I bf16) stays in L2 at I = 512-1,408. 1,024 or 2,048 tokens a
// chunk (fewer passes over the fp32 dW) ran slower, even with N split into blocks of 256-512, and
// splitting N at 512 tokens gained nothing (2026-12-02, the 2-vCPU AMX host).
constexpr int64_t KC = 512;
constexpr int64_t MB = 64;   // output rows a block: the transposed dy block is MB x KC

// dW [O x I] = dy^T x for contiguous bf16 dy [T x O] and x [T x I], any sizes; fp32 accumulation.
at::Tensor weight_grad(const at::Tensor& dy, const at::Tensor& x) {
  TORCH_CHECK(dy.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16, "weight_grad: bf16 only");
  TORCH_CHECK(dy.dim() == 2 && x.dim() == 2 && dy.size(0) == x.size(0), "weight_grad: dy [T x O], x [T x I]");
  TORCH_CHECK(dy.is_contiguous() && x.is_contiguous(), "weight_grad: contiguous operands");
  const int64_t T = dy.size(0), O = dy.size(1), I = x.size(1);
  if (T == 0 || O == 0 || I == 0) return at::zeros({O, I}, dy.options());
  auto acc = at::empty({O, I}, dy.options().dtype(at::kFloat));
  const bool vnni = at::native::cpublas::could_pack(at::kBFloat16);
  const int64_t lda = KC + 16;  // off a power of two: the transpose's column walk spreads over cache sets
  std::vector<uint16_t> b(vnni ? KC * I : 0), a(MB * lda);
  const auto* dyp = reinterpret_cast<const uint16_t*>(dy.data_ptr<at::BFloat16>());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  float* C = acc.data_ptr<float>();
  for (int64_t t0 = 0; t0 < T; t0 += KC) {
    const int64_t k = std::min(KC, T - t0), kp = k + (k & 1);  // VNNI pairs rows: an odd chunk gets a zero row
    const uint16_t* B = xp + t0 * I;  // without VNNI the micro-kernel reads x's rows in place
    if (vnni) {  // rows r and r+1 interleaved element by element
      for (int64_t r = 0; r < kp; r += 2) {
        const uint16_t* r0 = xp + (t0 + r) * I;
        uint16_t* o = b.data() + r * I;
        if (r + 1 < k) {
          for (int64_t n = 0; n < I; ++n) o[2 * n] = r0[n], o[2 * n + 1] = r0[I + n];
        } else {
          for (int64_t n = 0; n < I; ++n) o[2 * n] = r0[n], o[2 * n + 1] = 0;
        }
      }
      B = b.data();
    }
    for (int64_t o0 = 0; o0 < O; o0 += MB) {
      const int64_t m = std::min(MB, O - o0);
      raytrain::transpose<uint16_t>(k, m, dyp + t0 * O + o0, O, a.data(), lda);
      if (kp > k)
        for (int64_t r = 0; r < m; ++r) a[r * lda + k] = 0;
      at::native::cpublas::brgemm(m, I, vnni ? kp : k, lda, I, I, t0 > 0, reinterpret_cast<const at::BFloat16*>(a.data()),
                                  reinterpret_cast<const at::BFloat16*>(B), C + o0 * I, vnni);
    }
  }
  at::native::cpublas::brgemm_release(vnni);
  return acc.to(at::kBFloat16);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("weight_grad", &weight_grad); }
