// model.attention=fused: causal self-attention for CPU training as one kernel per (batch, head),
// built at first use by raytrain_cpu/fused_attention.py (torch.utils.cpp_extension).
//
// Why: the causal blocks (raytrain_cpu/attention.py) run each block of queries as batched GEMMs
// over all heads, and every step between them (scores, mask, softmax, its backward, the gradient
// sums) is a pass over memory: on the AMX host their forward + backward ran at ~90 useful GFLOP/s,
// a twelfth of its GEMM rate. Here one head's 64 x 64 tiles go through oneDNN's batch-reduce
// micro-kernels (at::native::cpublas::brgemm: AMX tiles where present, a plain GEMM elsewhere)
// and the softmax runs on the tile just made, still in cache.
//
// Forward, per block of 64 queries: scores against the keys up to the block's end (fp32, one
// GEMM), softmax (exact: each row's max over all its keys, then exp straight to bf16, its sum in
// fp32), O = P V divided by the sum. It returns O and the log-sum-exp of each row, which is all
// the backward keeps besides q, k and v (no probabilities).
// Backward, two passes per head (flash attention 2's arithmetic without its atomics):
//   1. per block of queries: P again from the log-sum-exp, dP = dO V^T, delta = rowsum(P * dP),
//      dS = P * (dP - delta), dQ = scale * dS K; each 64 x 64 tile of P and dS (bf16) is packed
//      into a store per block of keys, as the B operand pass 2 needs;
//   2. per block of keys, over every query that sees it: dV^T += dO^T P, dK^T += scale * Q^T dS
//      (fp32; under grouped queries each head sums its own and a last loop adds up the group's).
// Five GEMMs, the fewest without keeping probabilities between forward and backward: every A
// operand is a plain row-major matrix (q, dO and their transposes, made once a head), every B
// packed once a head or once a tile. Scores and softmax are fp32, P and dS enter the GEMMs in
// bf16. Scratch a thread while it runs: the stores, about seq^2 bytes (8.7 MB at seq 2,048).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "transpose.h"

namespace {

using bf16 = at::BFloat16;
using raytrain::transpose;

using Vec = at::vec::Vectorized<float>;
constexpr int64_t BLK = 64;  // queries and keys a block; N of every operand cpublas::pack packs

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The row length of the transposed matrices ([D x seq], or K^T's [D/2 x seq] words): Sp plus 16,
// because at a power of two (Sp = 512: rows 2 KB apart in fp32) a transpose's column walk hits
// one cache set again and again (store_transposed: 4.5% of the backward's samples, 2.0% padded).
int64_t transposed_ld(int64_t Sp) { return Sp + 16; }

// B operands: row-major [K x N] (ld_in) into the micro-kernel's layout (VNNI pairs of rows on
// AMX, plain rows elsewhere), N <= BLK, K even (zero rows padded by the caller).
struct Packer {
  bool vnni = at::native::cpublas::could_pack(at::kBFloat16);
  void operator()(const bf16* in, int64_t K, int64_t N, int64_t ld_in, bf16* out) const {
    if (vnni) {
      at::native::cpublas::pack(K, N, ld_in, N, at::kBFloat16, at::kBFloat16, in, out);
    } else {
      for (int64_t k = 0; k < K; ++k) std::memcpy(out + k * N, in + k * ld_in, N * sizeof(bf16));
    }
  }
  // C[M x N] (+)= A[M x K] (ld_a) @ B (packed [K x N], ld_b >= N columns a row)
  void gemm(int64_t M, int64_t N, int64_t K, const bf16* A, int64_t ld_a, const bf16* B, int64_t ld_b, float* C,
            int64_t ld_c, bool add) const {
    at::native::cpublas::brgemm(M, N, K, ld_a, ld_b, ld_c, add, A, B, C, vnni);
  }
};

// x [S x D] (rows `ld` apart) -> its transpose [D x Sp] (rows ld_out apart), plain rows (an A
// operand, or B without VNNI), zero columns past S
void transpose_rows(const bf16* x, int64_t ld, int64_t S, int64_t Sp, int64_t D, bf16* out, int64_t ld_out) {
  transpose(S, D, reinterpret_cast<const uint16_t*>(x), ld, reinterpret_cast<uint16_t*>(out), ld_out);
  for (int64_t dd = 0; dd < D; ++dd) std::fill(out + dd * ld_out + S, out + dd * ld_out + Sp, bf16(0.0f));
}

// x [S x D] (rows `ld` apart, read in place) -> packed as B with K = Sp (rows; zero rows past
// S), per BLK-wide column chunk: out + c * Sp * BLK holds columns [c * BLK, ...) of every row;
// a row suffix from an even row r starts r * width elements in. A ragged S goes through
// `scratch` ([Sp x D]) for its zero rows.
void pack_rows(const Packer& pk, const bf16* x, int64_t ld, int64_t S, int64_t Sp, int64_t D, bf16* out,
               bf16* scratch) {
  if (S < Sp) {
    for (int64_t s = 0; s < S; ++s) std::memcpy(scratch + s * D, x + s * ld, D * sizeof(bf16));
    std::memset(scratch + S * D, 0, (Sp - S) * D * sizeof(bf16));
    x = scratch, ld = D;
  }
  for (int64_t c = 0; c < D; c += BLK) pk(x + c, Sp, std::min(BLK, D - c), ld, out + c * Sp);
}

// x [S x D] (rows `ld` apart, read in place) -> its transpose [D x Sp] packed as B (K = D,
// N = Sp: every key at once, so one GEMM makes a block's scores against all its keys), zero
// columns past S. VNNI keeps pairs of K (here: of the head dim, adjacent in a row of x)
// together, so the packed transpose is a transpose of 32-bit words; without VNNI, B is the
// plain transpose.
void pack_transposed(const Packer& pk, const bf16* x, int64_t ld, int64_t S, int64_t Sp, int64_t D, bf16* out,
                     int64_t ld_out) {
  if (!pk.vnni) return transpose_rows(x, ld, S, Sp, D, out, ld_out);
  float* words = reinterpret_cast<float*>(out);  // bit patterns only, no arithmetic
  transpose(S, D / 2, reinterpret_cast<const float*>(x), ld / 2, words, ld_out);
  for (int64_t r = 0; r < D / 2; ++r) std::fill(words + r * ld_out + S, words + r * ld_out + Sp, 0.0f);
}

// C [M x D] (+)= A [M x K] @ rows [K x D] packed by pack_rows, from row `r0` (even)
void gemm_rows(const Packer& pk, int64_t M, int64_t K, int64_t D, const bf16* A, int64_t ld_a, const bf16* packed,
               int64_t Sp, int64_t r0, float* C, bool add) {
  for (int64_t c = 0; c < D; c += BLK) {
    int64_t w = std::min(BLK, D - c);
    pk.gemm(M, w, K, A, ld_a, packed + c * Sp + r0 * w, w, C + c, D, add);
  }
}

float vmax(const float* x, int64_t n) {
  return at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, x, n);
}

constexpr int64_t VL = Vec::size();

// 32 floats (a, then b) as bf16 at out, the first n of them, rounded to nearest even: AVX512-BF16's
// one instruction where the kernel is built for it, else ATen's integer rounding (~8 instructions)
inline void store32(bf16* out, const Vec& a, const Vec& b, int64_t n) {
#if defined(__AVX512BF16__)
  const __m512i r = (__m512i)_mm512_cvtne2ps_pbh(b, a);
  if (n == 2 * VL) {
    _mm512_storeu_si512(out, r);
  } else {
    _mm512_mask_storeu_epi16(out, (__mmask32)((1ull << n) - 1), r);
  }
#else
  at::vec::convert_from_float<bf16>(a, b).store(out, n);
#endif
}

// out[0, n) = bf16 of f(i, count), f giving the Vec of elements [i, i + count), called in order
template <typename F>
inline void store_bf16(bf16* out, int64_t n, F f) {
  int64_t i = 0;
  for (; i + 2 * VL <= n; i += 2 * VL) {
    const Vec a = f(i, VL);
    const Vec b = f(i + VL, VL);
    store32(out + i, a, b, 2 * VL);
  }
  if (i < n) {
    const int64_t r = n - i, c0 = std::min(r, VL), c1 = r - c0;
    const Vec a = f(i, c0);
    const Vec b = c1 > 0 ? f(i + VL, c1) : Vec(0.0f);
    store32(out + i, a, b, r);
  }
}

inline Vec load(const float* p, int64_t i, int64_t c) { return c == VL ? Vec::loadu(p + i) : Vec::loadu(p + i, c); }

// exp(x * scale - sub) for elements [i, i + c) of x; zeros past c (a partial load's zeros would
// give exp(-sub)). On AVX-512 ATen's cubic exp (fexp_u20, meant for 16-bit results): P goes to
// bf16 anyway, and the forward's sum and the backward's P use the same one, so the errors
// against fp64 stayed the same to four digits (elsewhere ATen falls back to std::exp for it).
inline Vec exp_at(const float* x, int64_t i, int64_t c, float scale, float sub) {
#if defined(CPU_CAPABILITY_AVX512)
  const Vec e = (load(x, i, c) * Vec(scale) - Vec(sub)).fexp_u20();
#else
  const Vec e = (load(x, i, c) * Vec(scale) - Vec(sub)).exp_u20();
#endif
  return c == VL ? e : Vec::set(Vec(0.0f), e, c);
}

inline void store(float* p, int64_t i, int64_t c, const Vec& x) {
  if (c == VL) {
    x.store(p + i);
  } else {
    x.store(p + i, c);
  }
}

inline float vsum(const Vec& x) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x);
}

struct Dims {
  int64_t B, H, Hk, S, D, Sp, groups;
  float scale;
};

Dims dims_of(const at::Tensor& q, const at::Tensor& k, double scale) {
  Dims d{q.size(0), q.size(1), k.size(1), q.size(2), q.size(3), round_up(q.size(2), BLK), q.size(1) / k.size(1),
         static_cast<float>(scale)};
  TORCH_CHECK(d.H % d.Hk == 0, "query heads must be a multiple of key/value heads");
  TORCH_CHECK(d.D % 2 == 0, "head dim must be even");
  return d;
}

// strided (B, H, S, D) access: the row s of head h of batch b
struct Rows {
  const bf16* p;
  int64_t sb, sh, ss;
  explicit Rows(const at::Tensor& t)
      : p(t.data_ptr<bf16>()), sb(t.stride(0)), sh(t.stride(1)), ss(t.stride(2)) {
    TORCH_CHECK(t.stride(3) == 1, "the head dim must be contiguous");
  }
  const bf16* at(int64_t b, int64_t h) const { return p + b * sb + h * sh; }
};

}  // namespace

// out (B, S, H, D) memory as a (B, H, S, D) view, and the log-sum-exp (B, H, S) fp32
std::vector<at::Tensor> fused_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "bf16 inputs only");
  const Dims d = dims_of(q, k, scale);
  auto out = at::empty({d.B, d.S, d.H, d.D}, q.options());
  auto lse = at::empty({d.B, d.H, d.S}, q.options().dtype(at::kFloat));
  const Rows Q(q), K(k), V(v);
  bf16* O = out.data_ptr<bf16>();
  float* L = lse.data_ptr<float>();
  const int64_t Sp = d.Sp, D = d.D, nb = Sp / BLK, ldt = transposed_ld(Sp);
  // A task a (batch, query head), so grouped-query models have as many as heads to share out
  // (Llama-3-8B: 32 at micro batch 1, not 8); a thread packs k and v once for consecutive heads
  // of one group.
  at::parallel_for(0, d.B * d.H, 1, [&](int64_t t0, int64_t t1) {
    Packer pk;
    std::vector<bf16> kt(ldt * D), vp(Sp * D), p(BLK * Sp), scratch(d.S < Sp ? Sp * D : 0);
    std::vector<float> s(BLK * Sp), acc(BLK * D), inv(BLK);
    int64_t packed = -1;  // the (batch, kv head) packed in kt and vp
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / d.H, h = t % d.H, hk = h / d.groups;
      if (b * d.Hk + hk != packed) {
        packed = b * d.Hk + hk;
        pack_transposed(pk, K.at(b, hk), K.ss, d.S, Sp, D, kt.data(), ldt);
        pack_rows(pk, V.at(b, hk), V.ss, d.S, Sp, D, vp.data(), scratch.data());
      }
      {
        const bf16* qh = Q.at(b, h);
        for (int64_t i = 0; i < nb; ++i) {
          const int64_t q0 = i * BLK, rows = std::min(BLK, d.S - q0), e = (i + 1) * BLK;
          pk.gemm(rows, e, D, qh + q0 * Q.ss, Q.ss, kt.data(), ldt, s.data(), e, false);
          // P unnormalized (each row's exp against its max) straight to bf16, its fp32 sum kept:
          // O's rows are divided by it after the GEMM, D values a row instead of every key
          for (int64_t r = 0; r < rows; ++r) {
            const float* sr = s.data() + r * e;
            const int64_t seen = std::min(q0 + r + 1, d.S);  // keys [0, seen) are visible
            const float m = vmax(sr, seen) * d.scale;  // scale > 0
            bf16* pr = p.data() + r * e;
            Vec sum(0.0f);
            store_bf16(pr, seen, [&](int64_t c, int64_t n) {
              const Vec x = exp_at(sr, c, n, d.scale, m);
              sum = sum + x;
              return x;
            });
            std::fill(pr + seen, pr + e, bf16(0.0f));
            const float l = vsum(sum);
            inv[r] = 1.0f / l;
            L[(b * d.H + h) * d.S + q0 + r] = m + std::log(l);
          }
          gemm_rows(pk, rows, e, D, p.data(), e, vp.data(), Sp, 0, acc.data(), false);
          for (int64_t r = 0; r < rows; ++r) {
            const float* a = acc.data() + r * D;
            store_bf16(O + ((b * d.S + q0 + r) * d.H + h) * D, D,
                       [&](int64_t c, int64_t n) { return load(a, c, n) * Vec(inv[r]); });
          }
        }
      }
    }
    at::native::cpublas::brgemm_release(pk.vnni);
  });
  return {out.transpose(1, 2), lse};
}

// Where key block j's probabilities (or dS) start in the per-key-block store of one head: block
// j holds the queries that see it, [j * BLK, Sp), packed as a B operand ([queries x BLK keys]).
int64_t key_block_offset(int64_t j, int64_t Sp) { return j * Sp * BLK - BLK * BLK * j * (j - 1) / 2; }

// out (B, S, heads, D) bf16 rows of one head from acc^T [D x S] fp32 (rows ld_acc apart), times
// `mul`, through a BLK x D tile
void store_transposed(const float* acc, int64_t ld_acc, int64_t S, int64_t D, float mul, bf16* out, int64_t ld_out) {
  std::vector<float> tile(BLK * D);
  for (int64_t s0 = 0; s0 < S; s0 += BLK) {
    const int64_t n = std::min(BLK, S - s0);
    transpose(D, n, acc + s0, ld_acc, tile.data(), D);
    for (int64_t s = 0; s < n; ++s) {
      const float* t = tile.data() + s * D;
      store_bf16(out + (s0 + s) * ld_out, D, [&](int64_t c, int64_t w) { return load(t, c, w) * Vec(mul); });
    }
  }
}

// dq, dk, dv, each (B, S, heads, D) memory as a (B, heads, S, D) view
std::vector<at::Tensor> fused_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& lse, double scale) {
  const Dims d = dims_of(q, k, scale);
  auto dq = at::empty({d.B, d.S, d.H, d.D}, q.options());
  auto dk = at::empty({d.B, d.S, d.Hk, d.D}, q.options());
  auto dv = at::empty({d.B, d.S, d.Hk, d.D}, q.options());
  const Rows Q(q), K(k), V(v), G(grad_out);
  const float* L = lse.data_ptr<float>();
  bf16 *DQ = dq.data_ptr<bf16>(), *DK = dk.data_ptr<bf16>(), *DV = dv.data_ptr<bf16>();
  const int64_t Sp = d.Sp, D = d.D, nb = Sp / BLK, S = d.S;
  const int64_t stored = key_block_offset(nb, Sp);  // the causal blocks' elements
  // A task a (batch, kv head) and its group's query heads, summing their dK^T and dV^T (fp32) as
  // it goes; where that leaves threads idle (grouped queries at a small batch: Llama-3-8B has 8 kv
  // heads) a task a (batch, query head) instead, each head's sums in a slot of its own, which a
  // last loop adds up per group (at one thread 0.92x the other way, at Llama-3-8B's shape).
  const bool per_head = d.groups > 1 && d.B * d.Hk < at::get_num_threads();
  const int64_t heads = per_head ? 1 : d.groups;  // query heads a task
  const int64_t ldt = transposed_ld(Sp);
  std::vector<float> part(per_head ? d.B * d.H * 2 * D * ldt : 0);
  at::parallel_for(0, d.B * d.H / heads, 1, [&](int64_t t0, int64_t t1) {
    Packer pk;
    std::vector<bf16> kt(ldt * D), vt(ldt * D), kp(Sp * D), scratch(S < Sp ? Sp * D : 0);
    std::vector<bf16> qT(D * ldt), gT(D * ldt), pb(BLK * Sp), dsb(BLK * Sp);
    std::vector<bf16> p_store(stored), ds_store(stored);
    std::vector<float> s(BLK * Sp), dp(BLK * Sp), acc(BLK * D), own(per_head ? 0 : 2 * D * ldt);
    int64_t packed = -1;  // the (batch, kv head) packed in kt, vt and kp
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t * heads / d.H, h0 = t * heads % d.H, hk = h0 / d.groups;
      if (b * d.Hk + hk != packed) {
        packed = b * d.Hk + hk;
        pack_transposed(pk, K.at(b, hk), K.ss, S, Sp, D, kt.data(), ldt);
        pack_transposed(pk, V.at(b, hk), V.ss, S, Sp, D, vt.data(), ldt);
        pack_rows(pk, K.at(b, hk), K.ss, S, Sp, D, kp.data(), scratch.data());
      }
      float* dkT = per_head ? part.data() + t * 2 * D * ldt : own.data();
      float* dvT = dkT + D * ldt;
      std::fill(dkT, dkT + 2 * D * ldt, 0.0f);
      for (int64_t h = h0; h < h0 + heads; ++h) {
        const bf16 *qh = Q.at(b, h), *gh = G.at(b, h);  // read in place: A operands take strided rows
        const float* lse_h = L + (b * d.H + h) * S;
        // pass 1, a block of queries at a time against its keys: P from the log-sum-exp, dP,
        // dS = P * (dP - rowsum(P * dP)), dQ = scale * dS K; P and dS kept per key block for pass 2
        for (int64_t i = 0; i < nb; ++i) {
          const int64_t q0 = i * BLK, rows = std::min(BLK, S - q0), e = (i + 1) * BLK;
          pk.gemm(rows, e, D, qh + q0 * Q.ss, Q.ss, kt.data(), ldt, s.data(), e, false);
          pk.gemm(rows, e, D, gh + q0 * G.ss, G.ss, vt.data(), ldt, dp.data(), e, false);
          for (int64_t r = 0; r < rows; ++r) {
            float* sr = s.data() + r * e;
            const float* dr = dp.data() + r * e;
            const int64_t seen = std::min(q0 + r + 1, S);
            const float l = lse_h[q0 + r];
            bf16* pr = pb.data() + r * e;
            bf16* o = dsb.data() + r * e;
            Vec dot(0.0f);
            store_bf16(pr, seen, [&](int64_t c, int64_t n) {  // P, in bf16 and (for dS) in place of S
              const Vec x = exp_at(sr, c, n, d.scale, l);
              store(sr, c, n, x);
              dot = dot + x * load(dr, c, n);
              return x;
            });
            const Vec dl(vsum(dot));
            store_bf16(o, seen, [&](int64_t c, int64_t n) { return load(sr, c, n) * (load(dr, c, n) - dl); });
            std::fill(pr + seen, pr + e, bf16(0.0f));
            std::fill(o + seen, o + e, bf16(0.0f));
          }
          // the last block's rows past S: zeros in the stores
          std::fill(pb.begin() + rows * e, pb.begin() + BLK * e, bf16(0.0f));
          std::fill(dsb.begin() + rows * e, dsb.begin() + BLK * e, bf16(0.0f));
          gemm_rows(pk, rows, e, D, dsb.data(), e, kp.data(), Sp, 0, acc.data(), false);
          for (int64_t r = 0; r < rows; ++r) {
            float* a = acc.data() + r * D;
            at::vec::map([&](Vec x) { return x * Vec(d.scale); }, a, a, D);
            at::vec::convert(a, DQ + ((b * S + q0 + r) * d.H + h) * D, D);
          }
          for (int64_t j = 0; j <= i; ++j) {
            const int64_t at_ = key_block_offset(j, Sp) + (i - j) * BLK * BLK;
            pk(pb.data() + j * BLK, BLK, BLK, e, p_store.data() + at_);
            pk(dsb.data() + j * BLK, BLK, BLK, e, ds_store.data() + at_);
          }
        }
        // pass 2, a block of keys at a time: dV^T += dO^T P, dK^T += Q^T dS over the queries that see it
        transpose_rows(qh, Q.ss, S, Sp, D, qT.data(), ldt);
        transpose_rows(gh, G.ss, S, Sp, D, gT.data(), ldt);
        for (int64_t j = 0; j < nb; ++j) {
          const int64_t k0 = j * BLK, w = Sp - k0, at_ = key_block_offset(j, Sp);
          pk.gemm(D, BLK, w, gT.data() + k0, ldt, p_store.data() + at_, BLK, dvT + k0, ldt, true);
          pk.gemm(D, BLK, w, qT.data() + k0, ldt, ds_store.data() + at_, BLK, dkT + k0, ldt, true);
        }
      }
      if (!per_head) {
        store_transposed(dkT, ldt, S, D, d.scale, DK + (b * S * d.Hk + hk) * D, d.Hk * D);
        store_transposed(dvT, ldt, S, D, 1.0f, DV + (b * S * d.Hk + hk) * D, d.Hk * D);
      }
    }
    at::native::cpublas::brgemm_release(pk.vnni);
  });
  if (per_head) {
    at::parallel_for(0, d.B * d.Hk, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        float* sum = part.data() + t * d.groups * 2 * D * ldt;  // the group's first head's slot
        for (int64_t g = 1; g < d.groups; ++g) {
          const float* other = sum + g * 2 * D * ldt;
          at::vec::map2([](Vec a, Vec b) { return a + b; }, sum, sum, other, 2 * D * ldt);
        }
        const int64_t b = t / d.Hk, hk = t % d.Hk;
        store_transposed(sum, ldt, S, D, d.scale, DK + (b * S * d.Hk + hk) * D, d.Hk * D);
        store_transposed(sum + D * ldt, ldt, S, D, 1.0f, DV + (b * S * d.Hk + hk) * D, d.Hk * D);
      }
    });
  }
  return {dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)};
}

// An operator library (weight_grad.cpp says why); Python calls torch.ops.raytrain_fused_attention.
TORCH_LIBRARY(raytrain_fused_attention, m) {
  m.def("forward", &fused_forward);
  m.def("backward", &fused_backward);
}
