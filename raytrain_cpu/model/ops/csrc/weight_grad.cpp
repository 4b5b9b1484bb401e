// model.weight_grad_kernel: a linear layer's weight gradient dW [O x I] = dy^T x (dy [T x O],
// x [T x I], both token-major) on oneDNN's micro-kernels (at::native::cpublas::brgemm: AMX tiles
// where present, a plain GEMM elsewhere), bf16, on the calling thread's ATen threads (a rank's
// torch.set_num_threads). Built at first use by raytrain_cpu/linear.py; benchmarks/weight_grad.py
// times it against autograd's at one thread, benchmarks/kernel_threads.py at each thread count.
//
// Why: autograd hands oneDNN dy^T as a transposed view, whose reduction (the tokens) is its
// slow dimension, and oneDNN's matmul ran it at about half the forward's rate on AMX
// (benchmarks/gemm_layouts.py). Here each chunk of KC tokens is prepared once: x's rows as the
// B operand (VNNI pairs of rows on AMX, the rows themselves elsewhere), dy's columns for each
// block of MB output rows transposed into a small A (in cache); one micro-kernel call per
// (chunk, block) with N = I accumulates into an fp32 dW, rounded to bf16 at the end. Threads
// own blocks of dW (64 rows, split into column blocks too where the rows alone are too few for
// the threads), each running its blocks chunk by chunk; they share only the packing of x.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "transpose.h"

namespace {

// Tokens a chunk: x's chunk (KC x I bf16) stays in L2 at I = 512-1,408. 1,024 or 2,048 tokens a
// chunk (fewer passes over the fp32 dW) ran slower, even with N split into blocks of 256-512, and
// splitting N at 512 tokens gained nothing (2026-12-02, the 2-vCPU AMX host).
constexpr int64_t KC = 512;
constexpr int64_t MB = 64;   // output rows a block: the transposed dy block is MB x KC
constexpr int64_t LDA = KC + 16;  // off a power of two: the transpose's column walk spreads over cache sets
// Tasks a thread, at least, where threads share the GEMMs: at::parallel_for hands each thread an
// equal run of tasks, so with few a thread some threads idle (64 row blocks over 48 threads: two
// each for 32 of them, 16 with none); at 4 or more a thread, the busiest thread runs at most a
// quarter more tasks than the mean.
constexpr int64_t TASKS_A_THREAD = 4;
constexpr int64_t MIN_NB = 64;  // columns a task at least, where output rows are too few to share
// x's VNNI copy at most (where the micro-kernels take VNNI): the tokens are packed this many bytes'
// worth at a time, then every thread runs its tasks over them (one barrier each way a group).
constexpr int64_t PACK_BYTES = int64_t{64} << 20;

// The columns a task computes: all of I (one task per 64-row block) where the blocks alone give
// every thread TASKS_A_THREAD of them, else I split into column blocks (multiples of 32, at least
// MIN_NB).
int64_t column_block(int64_t O, int64_t I, int64_t threads) {
  const int64_t row_blocks = (O + MB - 1) / MB;
  if (threads <= 1 || row_blocks >= TASKS_A_THREAD * threads) return I;
  const int64_t want = (TASKS_A_THREAD * threads + row_blocks - 1) / row_blocks;  // column blocks
  const int64_t nb = ((I + want - 1) / want + 31) / 32 * 32;
  return std::min(I, std::max(MIN_NB, nb));
}

// x's rows [t0, t1) as the micro-kernel's B, chunk by chunk of KC rows (chunk c at b + c * KC * I):
// VNNI pairs of rows (rows r and r+1 interleaved element by element, an odd chunk's last row
// paired with zeros), the pairs shared among threads.
void pack_vnni(const uint16_t* xp, int64_t t0, int64_t t1, int64_t I, uint16_t* b) {
  const int64_t per_chunk = KC / 2, chunks = (t1 - t0 + KC - 1) / KC;
  at::parallel_for(0, chunks * per_chunk, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t c = p / per_chunk, r = 2 * (p % per_chunk), c0 = t0 + c * KC, k = std::min(KC, t1 - c0);
      if (r >= k) continue;  // past a short last chunk
      const uint16_t* r0 = xp + (c0 + r) * I;
      uint16_t* o = b + c * KC * I + r * I;
      if (r + 1 < k) {
        for (int64_t n = 0; n < I; ++n) o[2 * n] = r0[n], o[2 * n + 1] = r0[I + n];
      } else {
        for (int64_t n = 0; n < I; ++n) o[2 * n] = r0[n], o[2 * n + 1] = 0;
      }
    }
  });
}

// dy's columns [o0, o0 + m), rows [t0, t0 + k), transposed into a [m x LDA] (a zero column at k
// where VNNI pads an odd chunk)
void transpose_block(const uint16_t* dyp, int64_t O, int64_t t0, int64_t k, int64_t kp, int64_t o0, int64_t m,
                     uint16_t* a) {
  raytrain::transpose<uint16_t>(k, m, dyp + t0 * O + o0, O, a, LDA);
  if (kp > k)
    for (int64_t r = 0; r < m; ++r) a[r * LDA + k] = 0;
}

// dW [O x I] = dy^T x for contiguous bf16 dy [T x O] and x [T x I], any sizes; fp32 accumulation.
// Parallel over the calling thread's ATen threads (at::parallel_for): each task owns a block of
// dW (64 rows, all or some of the columns) and each thread runs its tasks chunk by chunk (its
// chunk of x still in its cache from one task to the next), so no two threads write the same
// output, nothing is reduced afterwards, and threads meet only where x is packed for VNNI: a
// barrier costs a whole time slice when a thread's core is busy elsewhere (a shared host, a
// rank's other work), which a barrier per chunk paid 8 times a call.
at::Tensor weight_grad(const at::Tensor& dy, const at::Tensor& x) {
  TORCH_CHECK(dy.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16, "weight_grad: bf16 only");
  TORCH_CHECK(dy.dim() == 2 && x.dim() == 2 && dy.size(0) == x.size(0), "weight_grad: dy [T x O], x [T x I]");
  TORCH_CHECK(dy.is_contiguous() && x.is_contiguous(), "weight_grad: contiguous operands");
  const int64_t T = dy.size(0), O = dy.size(1), I = x.size(1);
  if (T == 0 || O == 0 || I == 0) return at::zeros({O, I}, dy.options());
  auto acc = at::empty({O, I}, dy.options().dtype(at::kFloat));
  const bool vnni = at::native::cpublas::could_pack(at::kBFloat16);
  const int64_t NB = column_block(O, I, at::get_num_threads());
  const int64_t row_blocks = (O + MB - 1) / MB, col_blocks = (I + NB - 1) / NB;
  // Tokens a group: all of them without VNNI (the micro-kernel reads x's rows in place), else as
  // many whole chunks as PACK_BYTES holds packed.
  const int64_t group = vnni ? std::max<int64_t>(1, PACK_BYTES / (KC * I * 2)) * KC : T;
  std::vector<uint16_t> b(vnni ? std::min(group, (T + KC - 1) / KC * KC) * I : 0);
  const auto* dyp = reinterpret_cast<const uint16_t*>(dy.data_ptr<at::BFloat16>());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  float* C = acc.data_ptr<float>();
  for (int64_t g0 = 0; g0 < T; g0 += group) {
    const int64_t g1 = std::min(T, g0 + group);
    if (vnni) pack_vnni(xp, g0, g1, I, b.data());
    at::parallel_for(0, row_blocks * col_blocks, 1, [&](int64_t j0, int64_t j1) {
      std::vector<uint16_t> a(MB * LDA);
      for (int64_t t0 = g0; t0 < g1; t0 += KC) {
        const int64_t k = std::min(KC, g1 - t0), kp = k + (k & 1);  // VNNI pairs rows: an odd chunk gets a zero row
        const uint16_t* B = vnni ? b.data() + (t0 - g0) * I : xp + t0 * I;
        int64_t transposed = -1;  // the row block whose dy is in `a` for this chunk
        for (int64_t j = j0; j < j1; ++j) {
          const int64_t rb = j / col_blocks, n0 = (j % col_blocks) * NB;
          const int64_t o0 = rb * MB, m = std::min(MB, O - o0), n = std::min(NB, I - n0);
          if (rb != transposed) transpose_block(dyp, O, t0, k, kp, o0, m, a.data()), transposed = rb;
          // A column block of B: VNNI keeps each row pair's elements in pairs (2 n0 in), ldb stays I.
          at::native::cpublas::brgemm(m, n, vnni ? kp : k, LDA, I, I, t0 > 0,
                                      reinterpret_cast<const at::BFloat16*>(a.data()),
                                      reinterpret_cast<const at::BFloat16*>(B + (vnni ? 2 : 1) * n0),
                                      C + o0 * I + n0, vnni);
        }
      }
      at::native::cpublas::brgemm_release(vnni);
    });
  }
  return acc.to(at::kBFloat16);
}

}  // namespace

// An operator library, not a Python module: torch/library.h instead of torch/extension.h (pybind11 and
// the whole C++ frontend) takes a third of the build time. Python calls torch.ops.raytrain_weight_grad.
TORCH_LIBRARY(raytrain_weight_grad, m) { m.def("weight_grad", &weight_grad); }
