// Fused causal attention for the CPU: the `fp32` policy's dense attention and the online
// (FlashAttention-2) attention of the policies whose softmax is fp32, in one pass per block of query
// rows, so the block's scores stay in cache (XLA's CPU backend materialises every op's output, which
// costs the oracle more than the arithmetic at long lengths).
//
// Inputs are fp32 arrays holding the values the policy gives them (q and k already rounded to its
// qk_in dtype, v to its pv_in dtype); the products are exact in fp32 for 16-bit operands and summed
// in fp32 (qk_acc = pv_acc = fp32). Per row, with s[i, j] = q_i . k_j (masked: -inf):
//
//   dense, fp32 logits and p (the `fp32` policy; `logits_bf16 = pv_bf16 = kv_block = 0`):
//     e[i, j] = exp(s[i, j] * scale - max_j s[i, :] * scale), o_i = (sum_j e[i, j] v_j) / sum_j e[i, j]
//     the division after p.v (as in FlashAttention and torch's CPU kernel) rather than before.
//   online (`kv_block` > 0: fa2_bf16, paper_bf16): x = logits(s) (fp32: s * scale rounded to fp32;
//     bf16: bf16(bf16(s) * scale)); over key blocks of kv_block keys, running max m,
//     sum l (of the unrounded p) and accumulator acc: m' = max(m, max x_blk), p = exp(x - m'),
//     c = exp(m - m'), l = l * c + sum p, acc = acc * c + bf16(p) . v_blk; o = acc / l
//     (jaxref.attention.online_attention).
// Only rounding differs from the JAX paths: the summation order of the matmuls and the sums, and the
// exp polynomial (Cephes, about 1 ulp). The dense softmax of the bf16 policies (`hf_bf16`: p
// normalised, then rounded to bf16) is not here: its JAX path is bit for bit torch's eager attention
// (parity_tests/test_fidelity.py), and these exps and sums would flip some of those roundings.
//
// Layout: q [B,T,N,D], k/v [B,T,K,D], doc_ids [B,T] int32, out [B,T,N,D]; query head n reads kv
// head n / (N/K). Mask (docs/DESIGN.md §2, jaxref.variants.allowed): query i sees key j iff i == j, or
// j <= i, both real (doc >= 0) and the variant's rule: full: always; intra_doc: same document;
// anchor: same document or j == 0.
//
// Work: one task per (batch, kv head, block of query rows); a task packs the block's queries for
// all G heads of its kv head (M = G*rows rows), computes their scores against keys 0..e-1 (e = the
// block's last row + 1: later keys are masked for all of it) into a per-thread buffer, then takes
// the exponentials and multiplies them by v a slice of keys at a time. The matmuls run on a 6x16
// register-blocked kernel; k and v are packed for it once per call (per batch and kv head).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define JAXREF_AVX2 1
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int MR = 6;   // rows of the register tile
constexpr int NR = 16;  // columns of the register tile (two 8-float vectors)
constexpr int TARGET_ROWS = 48;  // packed query rows per task (G heads x block rows)
constexpr int KC = 256;          // keys per slice of the p.v product

enum Variant : int32_t { FULL = 0, INTRA_DOC = 1, ANCHOR = 2 };

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// C[MR x NR] (row stride ldc) = (ACC ? C : 0) + A[MR x kdim] (row stride lda) * B[kdim x NR]
// (rows of NR floats, contiguous). With MAX, mx8[8r..8r+7] <- max(mx8[..], row r of C) too.
// Under AVX-512 a row of the tile is one 16-float vector, else two 8-float ones: every entry of C is
// the same chain of fused multiply-adds over p in either, so both give the same bits (the vector
// width only decides how many columns advance at once).
template <bool ACC, bool MAX = false>
inline void tile_kernel(const float* A, int64_t lda, const float* B, int64_t kdim, float* C, int64_t ldc,
                        float* mx8 = nullptr) {
#if defined(JAXREF_AVX2) && defined(__AVX512F__) && defined(__AVX512DQ__)
  static_assert(NR == 16, "one AVX-512 vector per tile row");
#define JAXREF_INIT(r) (ACC ? _mm512_loadu_ps(C + (r) * ldc) : _mm512_setzero_ps())
  __m512 c0 = JAXREF_INIT(0), c1 = JAXREF_INIT(1), c2 = JAXREF_INIT(2), c3 = JAXREF_INIT(3), c4 = JAXREF_INIT(4),
         c5 = JAXREF_INIT(5);
#undef JAXREF_INIT
  const float *a0 = A, *a1 = A + lda, *a2 = A + 2 * lda, *a3 = A + 3 * lda, *a4 = A + 4 * lda,
              *a5 = A + 5 * lda;
  for (int64_t p = 0; p < kdim; ++p) {
    const __m512 b = _mm512_loadu_ps(B + p * NR);
    c0 = _mm512_fmadd_ps(_mm512_set1_ps(a0[p]), b, c0);
    c1 = _mm512_fmadd_ps(_mm512_set1_ps(a1[p]), b, c1);
    c2 = _mm512_fmadd_ps(_mm512_set1_ps(a2[p]), b, c2);
    c3 = _mm512_fmadd_ps(_mm512_set1_ps(a3[p]), b, c3);
    c4 = _mm512_fmadd_ps(_mm512_set1_ps(a4[p]), b, c4);
    c5 = _mm512_fmadd_ps(_mm512_set1_ps(a5[p]), b, c5);
  }
  _mm512_storeu_ps(C + 0 * ldc, c0); _mm512_storeu_ps(C + 1 * ldc, c1); _mm512_storeu_ps(C + 2 * ldc, c2);
  _mm512_storeu_ps(C + 3 * ldc, c3); _mm512_storeu_ps(C + 4 * ldc, c4); _mm512_storeu_ps(C + 5 * ldc, c5);
  if (MAX) {
#define JAXREF_MAX(r) _mm256_storeu_ps(mx8 + 8 * r, _mm256_max_ps(_mm256_loadu_ps(mx8 + 8 * r), \
    _mm256_max_ps(_mm512_castps512_ps256(c##r), _mm512_extractf32x8_ps(c##r, 1))))
    JAXREF_MAX(0); JAXREF_MAX(1); JAXREF_MAX(2); JAXREF_MAX(3); JAXREF_MAX(4); JAXREF_MAX(5);
#undef JAXREF_MAX
  }
#elif defined(JAXREF_AVX2)
#define JAXREF_INIT(r, h) (ACC ? _mm256_loadu_ps(C + (r) * ldc + 8 * (h)) : _mm256_setzero_ps())
  __m256 c00 = JAXREF_INIT(0, 0), c01 = JAXREF_INIT(0, 1);
  __m256 c10 = JAXREF_INIT(1, 0), c11 = JAXREF_INIT(1, 1);
  __m256 c20 = JAXREF_INIT(2, 0), c21 = JAXREF_INIT(2, 1);
  __m256 c30 = JAXREF_INIT(3, 0), c31 = JAXREF_INIT(3, 1);
  __m256 c40 = JAXREF_INIT(4, 0), c41 = JAXREF_INIT(4, 1);
  __m256 c50 = JAXREF_INIT(5, 0), c51 = JAXREF_INIT(5, 1);
#undef JAXREF_INIT
  const float *a0 = A, *a1 = A + lda, *a2 = A + 2 * lda, *a3 = A + 3 * lda, *a4 = A + 4 * lda,
              *a5 = A + 5 * lda;
  for (int64_t p = 0; p < kdim; ++p) {
    const __m256 b0 = _mm256_loadu_ps(B + p * NR), b1 = _mm256_loadu_ps(B + p * NR + 8);
    __m256 a;
    a = _mm256_broadcast_ss(a0 + p); c00 = _mm256_fmadd_ps(a, b0, c00); c01 = _mm256_fmadd_ps(a, b1, c01);
    a = _mm256_broadcast_ss(a1 + p); c10 = _mm256_fmadd_ps(a, b0, c10); c11 = _mm256_fmadd_ps(a, b1, c11);
    a = _mm256_broadcast_ss(a2 + p); c20 = _mm256_fmadd_ps(a, b0, c20); c21 = _mm256_fmadd_ps(a, b1, c21);
    a = _mm256_broadcast_ss(a3 + p); c30 = _mm256_fmadd_ps(a, b0, c30); c31 = _mm256_fmadd_ps(a, b1, c31);
    a = _mm256_broadcast_ss(a4 + p); c40 = _mm256_fmadd_ps(a, b0, c40); c41 = _mm256_fmadd_ps(a, b1, c41);
    a = _mm256_broadcast_ss(a5 + p); c50 = _mm256_fmadd_ps(a, b0, c50); c51 = _mm256_fmadd_ps(a, b1, c51);
  }
  _mm256_storeu_ps(C + 0 * ldc, c00); _mm256_storeu_ps(C + 0 * ldc + 8, c01);
  _mm256_storeu_ps(C + 1 * ldc, c10); _mm256_storeu_ps(C + 1 * ldc + 8, c11);
  _mm256_storeu_ps(C + 2 * ldc, c20); _mm256_storeu_ps(C + 2 * ldc + 8, c21);
  _mm256_storeu_ps(C + 3 * ldc, c30); _mm256_storeu_ps(C + 3 * ldc + 8, c31);
  _mm256_storeu_ps(C + 4 * ldc, c40); _mm256_storeu_ps(C + 4 * ldc + 8, c41);
  _mm256_storeu_ps(C + 5 * ldc, c50); _mm256_storeu_ps(C + 5 * ldc + 8, c51);
  if (MAX) {
#define JAXREF_MAX(r) _mm256_storeu_ps(mx8 + 8 * r, _mm256_max_ps(_mm256_loadu_ps(mx8 + 8 * r), _mm256_max_ps(c##r##0, c##r##1)))
    JAXREF_MAX(0); JAXREF_MAX(1); JAXREF_MAX(2); JAXREF_MAX(3); JAXREF_MAX(4); JAXREF_MAX(5);
#undef JAXREF_MAX
  }
#else
  float acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = ACC ? C[r * ldc + c] : 0.0f;
  for (int64_t p = 0; p < kdim; ++p)
    for (int r = 0; r < MR; ++r) {
      const float a = A[r * lda + p];
      for (int c = 0; c < NR; ++c) acc[r][c] += a * B[p * NR + c];
    }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) {
      C[r * ldc + c] = acc[r][c];
      if (MAX) mx8[8 * r + c % 8] = std::max(mx8[8 * r + c % 8], acc[r][c]);
    }
#endif
}

#ifdef JAXREF_AVX2
// exp(x) for x <= 0 (Cephes' expf: range reduction by ln 2 in two parts, degree-6 polynomial,
// about 1 ulp). Inputs below -87.3 return ~1e-38 instead of smaller values; callers zero masked
// entries themselves. NaN in, NaN out.
inline __m256 exp_ps(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f), hi = _mm256_set1_ps(88.3762626647949f);
  x = _mm256_min_ps(hi, _mm256_max_ps(lo, x));  // operand order: a NaN x comes through
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, z, x);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  __m256i n = _mm256_cvttps_epi32(fx);
  n = _mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}
#endif

// The row maxima of unscaled scores, kept as 8 lanes per row while tiles are stored.
inline void update_max(float* mx8, const float* row, int n) {
#ifdef JAXREF_AVX2
  __m256 m = _mm256_loadu_ps(mx8);
  for (int c = 0; c < n; c += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(row + c));
  _mm256_storeu_ps(mx8, m);
#else
  for (int c = 0; c < n; ++c) mx8[c % 8] = std::max(mx8[c % 8], row[c]);
#endif
}

inline float lanes_max(const float* mx8) {
  float m = mx8[0];
  for (int t = 1; t < 8; ++t) m = std::max(m, mx8[t]);
  return m;
}

// Exponentials of one row's unscaled scores s[0..n) in place (n a multiple of 8; masked entries
// -inf): s <- exp(s*scale - mx*scale) with mx the row's largest score (each product rounded to
// fp32, as the scaled scores are; scale > 0, so mx*scale is the largest scaled score), masked
// entries 0. Returns their sum, NaN if a score is NaN (the row then comes out NaN, as in the
// dense path).
inline float exp_row(float* s, int64_t n, float mx, float scale) {
#ifdef JAXREF_AVX2
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), vsc = _mm256_set1_ps(scale);
  const __m256 vmx = _mm256_set1_ps(mx * scale);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) {
    const __m256 x = _mm256_loadu_ps(s + j);
    // NaN passes exp_ps and the unordered compare, so it reaches the sum.
    const __m256 e = _mm256_and_ps(exp_ps(_mm256_sub_ps(_mm256_mul_ps(x, vsc), vmx)), _mm256_cmp_ps(x, ninf, _CMP_NEQ_UQ));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  float av[8];
  _mm256_storeu_ps(av, acc);
  float sum = 0.0f;
  for (int t = 0; t < 8; ++t) sum += av[t];
  return sum;
#else
  const float m = mx * scale;
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    if (std::isnan(s[j])) return std::numeric_limits<float>::quiet_NaN();
    s[j] = std::isinf(s[j]) && s[j] < 0 ? 0.0f : std::exp(s[j] * scale - m);
    sum += s[j];
  }
  return sum;
#endif
}

// x rounded to bfloat16 (to nearest, ties to even), as a float; NaN stays NaN.
inline float round_bf16(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  if ((b & 0x7F800000u) == 0x7F800000u && (b & 0x007FFFFFu)) return x;
  b = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
  float y;
  std::memcpy(&y, &b, sizeof y);
  return y;
}

#ifdef JAXREF_AVX2
inline __m256 round_bf16_ps(__m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)),
                                     _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
#endif

// One row's unscaled scores s[0..n) (n a multiple of 8) replaced by the logits the policy stores:
// fp32: s * scale rounded to fp32; bf16: bf16(bf16(s) * scale) (the product formed in fp32, as
// torch's bf16 tensor times a Python float). Masked entries stay -inf. Returns the row's largest.
inline float logits_row(float* s, int64_t n, float scale, bool bf16) {
#ifdef JAXREF_AVX2
  const __m256 vsc = _mm256_set1_ps(scale);
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < n; j += 8) {
    __m256 x = _mm256_loadu_ps(s + j);
    if (bf16) x = round_bf16_ps(x);
    x = _mm256_mul_ps(x, vsc);
    if (bf16) x = round_bf16_ps(x);
    _mm256_storeu_ps(s + j, x);
    m = _mm256_max_ps(m, x);
  }
  float mv[8];
  _mm256_storeu_ps(mv, m);
  return lanes_max(mv);
#else
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    float x = bf16 ? round_bf16(s[j]) : s[j];
    x = x * scale;
    if (bf16) x = round_bf16(x);
    s[j] = x;
    m = std::max(m, x);
  }
  return m;
#endif
}

// p[0..n) <- p / sum (n a multiple of 8).
inline void normalize_row(float* p, int64_t n, float sum) {
#ifdef JAXREF_AVX2
  const __m256 vs = _mm256_set1_ps(sum);
  for (int64_t j = 0; j < n; j += 8) _mm256_storeu_ps(p + j, _mm256_div_ps(_mm256_loadu_ps(p + j), vs));
#else
  for (int64_t j = 0; j < n; ++j) p[j] = p[j] / sum;
#endif
}

inline void round_row(float* p, int64_t n) {
#ifdef JAXREF_AVX2
  for (int64_t j = 0; j < n; j += 8) _mm256_storeu_ps(p + j, round_bf16_ps(_mm256_loadu_ps(p + j)));
#else
  for (int64_t j = 0; j < n; ++j) p[j] = round_bf16(p[j]);
#endif
}

// Grow-only float buffers handed out to calls and given back, so that repeated calls (one per
// layer) do not fault in fresh pages each time (buffers over KEEP_FLOATS, 2^26 bytes, are freed instead).
class BufferPool {
 public:
  std::vector<float>* take(size_t n) {
    std::vector<float>* b;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (free_.empty()) {
        b = new std::vector<float>();
      } else {
        b = free_.back();
        free_.pop_back();
      }
    }
    if (b->size() < n) b->resize(n);
    return b;
  }
  void give(std::vector<float>* b) {
    if (b->size() > KEEP_FLOATS) {  // long contexts: do not hold on to gigabytes between calls
      delete b;
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(b);
  }
  static constexpr size_t KEEP_FLOATS = size_t(1) << 24;  // floats: 2^26 bytes

 private:
  std::mutex mu_;
  std::vector<std::vector<float>*> free_;
};

BufferPool& buffers() {
  static BufferPool* pool = new BufferPool();  // never destroyed: calls may outlive static teardown
  return *pool;
}

struct Problem {
  const float *q, *k, *v;
  const int32_t* doc;
  float* out;
  int64_t B, T, N, K, D, G;
  int64_t rows;        // query rows per task
  int64_t Mp;          // packed rows per task (G * rows rounded up to MR)
  int64_t T16, D16;    // T and D rounded up to NR
  int64_t lds;         // row stride of the score buffer: T16 + NR, so that rows 16 KiB apart do not
                       // fall in the same L1 sets
  int32_t variant;
  float scale;
  bool logits_bf16, pv_bf16;  // online: the logits / the probabilities before p.v rounded to bf16
  int64_t kv_block;           // 0: dense; else the online softmax's key block (a multiple of NR, or >= T)
  std::vector<float>* kv;  // per (b, kv head): k^T in panels [T16/NR][D][NR], then v in panels [D16/NR][T16][NR]
  std::unique_ptr<std::once_flag[]> packed;  // per (b, kv head)
  std::vector<int32_t> panel_doc;  // [B][T16/NR]: the document of all NR keys of a panel, else -2
  std::vector<int64_t> tasks;  // (b, kh, block) flattened, longest first
  int64_t kv_stride() const { return T16 * D + D16 * T16; }
};

inline bool allowed(const Problem& P, int32_t dq, int32_t dk, int64_t i, int64_t j) {
  if (i == j) return true;
  if (j > i || dq < 0 || dk < 0) return false;
  switch (P.variant) {
    case FULL: return true;
    case INTRA_DOC: return dq == dk;
    default: return dq == dk || j == 0;
  }
}

void panel_docs(Problem& P) {
  const int64_t np = P.T16 / NR;
  P.panel_doc.assign(P.B * np, -2);
  for (int64_t b = 0; b < P.B; ++b)
    for (int64_t p = 0; p < np; ++p) {
      const int32_t* d = P.doc + b * P.T + p * NR;
      bool same = (p + 1) * NR <= P.T && d[0] >= 0;
      for (int c = 1; same && c < NR; ++c) same = d[c] == d[0];
      if (same) P.panel_doc[b * np + p] = d[0];
    }
}

// How the keys j0..j0+NR-1 look from query slot i of document dq: all visible, none, or mixed.
// Whole panels before the diagonal are decided from the panel's document (pdoc, -2 if it mixes
// documents or padding); the diagonal and mixed panels are MIXED (decided key by key).
enum PanelView { ALL, NONE, MIXED };

// Rows of document dq (real: none is padding) see all of a panel of document pdoc that lies
// before them. The one rule behind both the per-row view and the per-group shortcut.
inline bool sees_whole_panel(const Problem& P, int32_t dq, bool real, int32_t pdoc) {
  return real && pdoc >= 0 && (P.variant == FULL || pdoc == dq);
}

inline PanelView panel_view(const Problem& P, int64_t i, int32_t dq, int64_t j0, int32_t pdoc) {
  if (j0 > i) return NONE;
  if (j0 + NR - 1 < i && dq >= 0 && pdoc >= 0) {
    if (sees_whole_panel(P, dq, true, pdoc)) return ALL;
    if (!(P.variant == ANCHOR && j0 == 0)) return NONE;
  }
  return MIXED;
}

// k and v of (batch b, kv head h) in the kernels' panel layouts; padding keys and columns are 0.
void pack_kv(const Problem& P, int64_t b, int64_t h) {
  const int64_t T = P.T, K = P.K, D = P.D;
  float* kp = P.kv->data() + (b * K + h) * P.kv_stride();
  float* vp = kp + P.T16 * D;
  std::fill_n(kp, P.kv_stride(), 0.0f);
  for (int64_t j = 0; j < T; ++j) {
    const float* kr = P.k + ((b * T + j) * K + h) * D;
    const float* vr = P.v + ((b * T + j) * K + h) * D;
    float* kpanel = kp + (j / NR) * D * NR + j % NR;
    for (int64_t d = 0; d < D; ++d) kpanel[d * NR] = kr[d];
    for (int64_t d = 0; d < D; ++d) vp[((d / NR) * P.T16 + j) * NR + d % NR] = vr[d];
  }
}

// Scratch of one worker thread, kept between calls: packed queries [Mp][D], scores/exponentials
// [Mp][lds], context [Mp][D16], row maxima (8 lanes each) and sums, per row group its document
// and whether it has padding, one tile.
struct Scratch {
  std::vector<float> qp, s, o, t, mx8, sum, mrun, corr;
  std::vector<int32_t> group_doc;
  std::vector<uint8_t> group_real;
  float tile[MR * NR];
  void fit(const Problem& P) {
    group_doc.resize(P.Mp / MR);
    group_real.resize(P.Mp / MR);
    qp.resize(P.Mp * P.D);
    s.resize(std::max<size_t>(s.size(), P.Mp * P.lds));
    o.resize(P.Mp * P.D16);
    if (P.kv_block > 0) t.resize(P.Mp * P.D16), mrun.resize(P.Mp), corr.resize(P.Mp);
    mx8.resize(P.Mp * 8);
    sum.resize(P.Mp);
  }
};

// o[Mt x D16] (+)= p[rows, k0..k0+kc) . v[k0..k0+kc) for the block's packed rows (ACC: add to o).
inline void pv_slice(const Problem& P, const float* s, int64_t lds, const float* vp, int64_t k0, int64_t kc,
                     int64_t Mt, float* o, bool acc) {
  for (int64_t m0 = 0; m0 < Mt; m0 += MR)
    for (int64_t d0 = 0; d0 < P.D16; d0 += NR) {
      const float* A = s + m0 * lds + k0;
      const float* Bv = vp + ((d0 / NR) * P.T16 + k0) * NR;
      if (acc)
        tile_kernel<true>(A, lds, Bv, kc, o + m0 * P.D16 + d0, P.D16);
      else
        tile_kernel<false>(A, lds, Bv, kc, o + m0 * P.D16 + d0, P.D16);
    }
}

// The block's context rows o [M x D16] to out, each divided by its row sum.
inline void write_rows(const Problem& P, const float* o, int64_t b, int64_t h, int64_t r0, int64_t R, int64_t M,
                       const float* sum) {
  for (int64_t m = 0; m < M; ++m) {
    const int64_t g = m / R, i = r0 + m % R;
    float* orow = P.out + ((b * P.T + i) * P.N + h * P.G + g) * P.D;
    for (int64_t d = 0; d < P.D; ++d) orow[d] = o[m * P.D16 + d] / sum[m];
  }
}

// FlashAttention-2's online softmax over key blocks of P.kv_block (the last one cut at e16; one
// block when kv_block >= e16): running max and sum per row, p rounded before p.v when pv_bf16.
void online_softmax_pv(const Problem& P, Scratch& W, int64_t b, int64_t h, int64_t r0, int64_t R, int64_t M,
                       int64_t Mt, int64_t e16, const float* vp) {
  const int64_t lds = P.lds, blk = P.kv_block >= P.T ? e16 : std::min(P.kv_block, e16);
  const float ninf = -std::numeric_limits<float>::infinity();
  std::fill_n(W.mrun.begin(), Mt, ninf);
  std::fill_n(W.sum.begin(), Mt, 0.0f);
  std::fill_n(W.o.begin(), Mt * P.D16, 0.0f);
  for (int64_t j0 = 0; j0 < e16; j0 += blk) {
    const int64_t n = std::min(blk, e16 - j0);
    for (int64_t m = 0; m < M; ++m) {
      float* row = &W.s[m * lds + j0];
      const float m_old = W.mrun[m];
      const float m_new = std::max(m_old, logits_row(row, n, P.scale, P.logits_bf16));
      const float m_safe = std::isfinite(m_new) ? m_new : 0.0f;  // nothing visible yet: exp() gives 0
      const float psum = exp_row(row, n, m_safe, 1.0f);
      if (P.pv_bf16) round_row(row, n);
      const float c = std::exp((std::isfinite(m_old) ? m_old : m_safe) - m_safe);
      W.sum[m] = W.sum[m] * c + psum;
      W.mrun[m] = m_new;
      W.corr[m] = c;
    }
    for (int64_t m = M; m < Mt; ++m) std::fill_n(&W.s[m * lds + j0], n, 0.0f);
    for (int64_t k0 = j0; k0 < j0 + n; k0 += KC)
      pv_slice(P, W.s.data(), lds, vp, k0, std::min<int64_t>(KC, j0 + n - k0), Mt, W.t.data(), k0 > j0);
    for (int64_t m = 0; m < M; ++m) {
      float* o = &W.o[m * P.D16];
      const float* t = &W.t[m * P.D16];
      const float c = W.corr[m];
      for (int64_t d = 0; d < P.D; ++d) o[d] = o[d] * c + t[d];
    }
  }
  write_rows(P, W.o.data(), b, h, r0, R, M, W.sum.data());
}

void run_task(const Problem& P, int64_t task, Scratch& W) {
  const int64_t nblk = (P.T + P.rows - 1) / P.rows;
  const int64_t b = task / (P.K * nblk), h = (task / nblk) % P.K, blk = task % nblk;
  std::call_once(P.packed[b * P.K + h], pack_kv, std::cref(P), b, h);
  const int64_t r0 = blk * P.rows, R = std::min(P.rows, P.T - r0), M = P.G * R;
  const int64_t e = r0 + R, e16 = round_up(e, NR), D = P.D, T16 = P.T16, lds = P.lds;
  const int32_t* doc = P.doc + b * P.T;
  const int64_t Mt = round_up(M, MR);
  // Packed row m = g * R + r is query slot r0 + r of head h * G + g; rows M..Mt-1 are zero.
  for (int64_t g = 0; g < P.G; ++g)
    for (int64_t r = 0; r < R; ++r)
      std::memcpy(&W.qp[(g * R + r) * D], P.q + ((b * P.T + r0 + r) * P.N + h * P.G + g) * D, D * sizeof(float));
  std::fill(W.qp.begin() + M * D, W.qp.begin() + Mt * D, 0.0f);
  const float* kp = P.kv->data() + (b * P.K + h) * P.kv_stride();
  const float* vp = kp + T16 * D;
  const float ninf = -std::numeric_limits<float>::infinity();
  std::fill_n(W.mx8.begin(), Mt * 8, ninf);
  // Unscaled scores q.k for keys 0..e16-1 (keys >= e are after every row of the block), masked
  // entries -inf; a tile whose rows all see the whole panel goes straight to the buffer (decided
  // once per row group for the panels before the block's first row). Key panel outer, row groups
  // inner: the panel (D x NR) and the packed queries stay in L1.
  const int32_t* pdoc = P.panel_doc.data() + b * (T16 / NR);
  int32_t* group_doc = W.group_doc.data();  // per row group: the document all its rows share, else -1
  uint8_t* group_real = W.group_real.data();  // per row group: no row is padding
  for (int64_t m0 = 0; m0 < Mt; m0 += MR) {
    int32_t d0 = doc[r0 + m0 % R];
    bool real = true;
    for (int64_t mr = 0; mr < MR && m0 + mr < M; ++mr) {
      const int32_t d = doc[r0 + (m0 + mr) % R];
      real = real && d >= 0;
      if (d != d0) d0 = -1;
    }
    group_doc[m0 / MR] = d0 >= 0 ? d0 : -1;
    group_real[m0 / MR] = real;
  }
  for (int64_t j0 = 0; j0 < e16; j0 += NR) {
    const float* kpanel = kp + (j0 / NR) * D * NR;
    const int32_t pd = pdoc[j0 / NR];
    const bool before = j0 + NR - 1 < r0;  // the panel lies before every row of the block
    for (int64_t m0 = 0; m0 < Mt; m0 += MR) {
      float* s0 = &W.s[m0 * lds + j0];
      if (before && sees_whole_panel(P, group_doc[m0 / MR], group_real[m0 / MR], pd)) {
        tile_kernel<false, true>(&W.qp[m0 * D], D, kpanel, D, s0, lds, &W.mx8[m0 * 8]);
        continue;
      }
      PanelView view[MR];
      bool none = true;
      for (int64_t mr = 0; mr < MR; ++mr) {
        const int64_t i = r0 + (m0 + mr) % R;
        view[mr] = m0 + mr < M ? panel_view(P, i, doc[i], j0, pd) : NONE;
        none = none && view[mr] == NONE;
      }
      if (!none) tile_kernel<false>(&W.qp[m0 * D], D, kpanel, D, W.tile, NR);
      for (int64_t mr = 0; mr < MR; ++mr) {
        float* srow = s0 + mr * lds;
        if (view[mr] == ALL) {
          std::memcpy(srow, W.tile + mr * NR, NR * sizeof(float));
        } else if (view[mr] == NONE) {
          std::fill_n(srow, NR, ninf);
          continue;
        } else {
          const int64_t i = r0 + (m0 + mr) % R;
          for (int c = 0; c < NR; ++c) {
            const int64_t j = j0 + c;
            srow[c] = (j < P.T && allowed(P, doc[i], doc[j], i, j)) ? W.tile[mr * NR + c] : ninf;
          }
        }
        update_max(&W.mx8[(m0 + mr) * 8], srow, NR);
      }
    }
  }
  if (P.kv_block > 0) return online_softmax_pv(P, W, b, h, r0, R, M, Mt, e16, vp);
  // Softmax numerators and p.v, KC keys at a time: the slice's exponentials are taken just before
  // they are multiplied by v (that slice of the buffer and of v stays in L2); the context
  // accumulates in W.o [Mt x D16] and is divided by the row sums at the end, as FlashAttention
  // and torch's CPU kernel do.
  std::fill_n(W.sum.begin(), Mt, 0.0f);
  for (int64_t k0 = 0; k0 < e16; k0 += KC) {
    const int64_t kc = std::min<int64_t>(KC, e16 - k0);
    for (int64_t m = 0; m < M; ++m) W.sum[m] += exp_row(&W.s[m * lds + k0], kc, lanes_max(&W.mx8[m * 8]), P.scale);
    for (int64_t m = M; m < Mt; ++m) std::fill_n(&W.s[m * lds + k0], kc, 0.0f);
    for (int64_t m0 = 0; m0 < Mt; m0 += MR)
      for (int64_t d0 = 0; d0 < P.D16; d0 += NR) {
        const float* A = &W.s[m0 * lds + k0];
        const float* B = vp + ((d0 / NR) * T16 + k0) * NR;
        if (k0 == 0)
          tile_kernel<false>(A, lds, B, kc, &W.o[m0 * P.D16 + d0], P.D16);
        else
          tile_kernel<true>(A, lds, B, kc, &W.o[m0 * P.D16 + d0], P.D16);
      }
  }
  for (int64_t m = 0; m < M; ++m) {
    const int64_t g = m / R, i = r0 + m % R;
    float* orow = P.out + ((b * P.T + i) * P.N + h * P.G + g) * D;
    for (int64_t d = 0; d < D; ++d) orow[d] = W.o[m * P.D16 + d] / W.sum[m];
  }
}

// Tasks are shared through an atomic counter by the calling thread and the pool's workers; a
// worker that starts after the last task is taken finds nothing to do. The caller waits for the
// tasks to be *done* (not for workers to start), so it finishes even if no worker ever runs. Each
// thread keeps one Scratch (per kind of problem) between calls.
template <class Problem, class Scratch, void (*RUN)(const Problem&, int64_t, Scratch&)>
struct Tasks {
  std::shared_ptr<Problem> P;
  std::atomic<int64_t> next{0}, done{0};
  std::mutex mu;
  std::condition_variable cv;

  void work() {
    const int64_t n = static_cast<int64_t>(P->tasks.size());
    thread_local Scratch W;
    bool fitted = false;
    for (int64_t t; (t = next.fetch_add(1)) < n;) {
      if (!fitted) W.fit(*P), fitted = true;
      RUN(*P, P->tasks[t], W);
      if (done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(mu);
        cv.notify_all();
      }
    }
  }
};

// Runs every task of P->tasks (RUN(P, task, scratch)) on the calling thread and the pool's workers.
template <class Problem, class Scratch, void (*RUN)(const Problem&, int64_t, Scratch&)>
void run_tasks(ffi::ThreadPool& pool, std::shared_ptr<Problem> P) {
  auto S = std::make_shared<Tasks<Problem, Scratch, RUN>>();
  S->P = std::move(P);
  const int64_t n = static_cast<int64_t>(S->P->tasks.size());
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([S] { S->work(); });
  S->work();
  std::unique_lock<std::mutex> lock(S->mu);
  S->cv.wait(lock, [&] { return S->done.load() == n; });
}

ffi::Error Attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                     ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> doc_ids, ffi::ResultBuffer<ffi::F32> out,
                     int32_t variant, float scale, int32_t logits_bf16, int32_t pv_bf16, int32_t kv_block) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), dd = doc_ids.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || dd.size() != 2)
    return ffi::Error::InvalidArgument("attention: q, k, v must be rank 4 and doc_ids rank 2");
  auto P = std::make_shared<Problem>();
  P->B = qd[0]; P->T = qd[1]; P->N = qd[2]; P->D = qd[3]; P->K = kd[2];
  if (kd[0] != P->B || kd[1] != P->T || kd[3] != P->D || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2] ||
      vd[3] != kd[3] || dd[0] != P->B || dd[1] != P->T || P->K <= 0 || P->N % P->K != 0)
    return ffi::Error::InvalidArgument("attention: shapes of q [B,T,N,D], k/v [B,T,K,D], doc_ids [B,T] disagree");
  if (variant < FULL || variant > ANCHOR) return ffi::Error::InvalidArgument("attention: unknown variant code");
  if (kv_block < 0 || (kv_block > 0 && kv_block < qd[1] && kv_block % NR != 0))
    return ffi::Error::InvalidArgument("attention: kv_block must be 0 (dense), a multiple of 16 or >= T");
  if (kv_block == 0 && (logits_bf16 || pv_bf16))
    return ffi::Error::InvalidArgument("attention: the dense softmax is fp32 only (logits_bf16 = pv_bf16 = 0)");
  if (P->B * P->T * P->N * P->D == 0) return ffi::Error::Success();
  P->q = q.typed_data(); P->k = k.typed_data(); P->v = v.typed_data(); P->doc = doc_ids.typed_data();
  P->out = out->typed_data();
  P->G = P->N / P->K;
  P->rows = std::max<int64_t>(1, TARGET_ROWS / P->G);
  P->Mp = round_up(P->G * P->rows, MR);
  P->T16 = round_up(P->T, NR);
  P->D16 = round_up(P->D, NR);
  P->lds = P->T16 + NR;
  P->variant = variant;
  P->scale = scale;
  P->logits_bf16 = logits_bf16 != 0;
  P->pv_bf16 = pv_bf16 != 0;
  P->kv_block = kv_block;
  P->kv = buffers().take(P->B * P->K * P->kv_stride());
  P->packed.reset(new std::once_flag[P->B * P->K]);
  panel_docs(*P);
  const int64_t nblk = (P->T + P->rows - 1) / P->rows;
  // Longest tasks (last row blocks) first, so the workers finish together.
  for (int64_t blk = nblk - 1; blk >= 0; --blk)
    for (int64_t b = 0; b < P->B; ++b)
      for (int64_t h = 0; h < P->K; ++h) P->tasks.push_back((b * P->K + h) * nblk + blk);
  run_tasks<Problem, Scratch, run_task>(pool, P);
  buffers().give(P->kv);
  return ffi::Error::Success();
}


// ---------------------------------------------------------------------------------------------
// The precision audit's probe (jaxref/audit/maps.py): the causal attention maps of every shift of
// a window against the reference shift's, reduced inside the kernel so that no map leaves it.
// Batch element b = w * S + g is window w under shift g (g = 0 the reference). Per layer:
//   first[w, g-1, i] = sum_n |A_g[n, i, 0] - A_0[n, i, 0]|          (A: the logits, in float64)
//   col[w, g-1, j]   = sum_n sum_i |P_g[n, i, j] - P_0[n, i, j]|     (P: the probabilities; the
//                      difference in fp32, its absolute value summed in float64)
// with A = logits(q . k) as the attention takes them (fp32: rounded product with the scale; bf16:
// bf16(bf16(s) * scale)) and P = exp(A - max A) / sum over the row's keys j <= i, in fp32 — the
// same numbers as jaxref.audit.maps.group_probe on jaxref.attention.full_probs, up to rounding.
// Work: one task per (window, block of query rows), all kv heads and shifts inside it; the
// reference's probabilities of the block are kept while each shift's are formed. Each task sums its
// column differences into its own slab, and the slabs are added in block order at the end (the same
// result whatever thread ran a task).

struct ProbeProblem {
  const float *q, *k;
  double *first, *col;
  int64_t B, T, N, K, D, G, S, W;  // G query heads per kv head, S shifts per window, W windows
  int64_t rows, Mp, T16;
  int64_t lds;
  float scale;
  bool logits_bf16, first_only;
  std::vector<float>* kp;                     // per (b, kv head): k^T in panels [T16/NR][D][NR]
  std::unique_ptr<std::once_flag[]> packed;  // per (b, kv head)
  mutable std::vector<double> slab;          // per task: [S-1][e16 of its block] column sums
  std::vector<int64_t> slab_at;              // per row block: where its slab starts (per window: + w * slab_per_window)
  int64_t slab_per_window = 0;
  std::vector<int64_t> tasks;                // (w, block) flattened, longest first
};

// With first_only only the first panel is read (probe_maps), so only it is packed.
void pack_k(const ProbeProblem& P, int64_t b, int64_t h) {
  float* kp = P.kp->data() + (b * P.K + h) * P.T16 * P.D;
  const int64_t keys = P.first_only ? std::min<int64_t>(P.T, NR) : P.T;
  std::fill_n(kp, round_up(keys, NR) * P.D, 0.0f);
  for (int64_t j = 0; j < keys; ++j) {
    const float* kr = P.k + ((b * P.T + j) * P.K + h) * P.D;
    float* kpanel = kp + (j / NR) * P.D * NR + j % NR;
    for (int64_t d = 0; d < P.D; ++d) kpanel[d * NR] = kr[d];
  }
}

struct ProbeScratch {
  std::vector<float> qp, s, ref, a0;
  float tile[MR * NR];
  void fit(const ProbeProblem& P) {
    qp.resize(P.Mp * P.D);
    s.resize(P.Mp * P.lds);
    ref.resize(P.Mp * P.lds);
    a0.resize(P.Mp);
  }
};

// The probabilities (and first logits) of rows r0..r0+R-1 of all G heads of kv head h in batch
// element b, into W.s (rows of lds) and a[M]. With first_only, the first logits alone: the scores of
// the first panel of keys only (each score is its own dot product, the same number whatever else
// the row holds, and the logits are formed element by element).
void probe_maps(const ProbeProblem& P, ProbeScratch& W, int64_t b, int64_t h, int64_t r0, int64_t R, float* a) {
  std::call_once(P.packed[b * P.K + h], pack_k, std::cref(P), b, h);
  const int64_t M = P.G * R, Mt = round_up(M, MR), D = P.D, lds = P.lds;
  const int64_t e16 = P.first_only ? NR : round_up(r0 + R, NR);
  for (int64_t g = 0; g < P.G; ++g)
    for (int64_t r = 0; r < R; ++r)
      std::memcpy(&W.qp[(g * R + r) * D], P.q + ((b * P.T + r0 + r) * P.N + h * P.G + g) * D, D * sizeof(float));
  std::fill(W.qp.begin() + M * D, W.qp.begin() + Mt * D, 0.0f);
  const float* kp = P.kp->data() + (b * P.K + h) * P.T16 * D;
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t j0 = 0; j0 < e16; j0 += NR) {
    const float* kpanel = kp + (j0 / NR) * D * NR;
    for (int64_t m0 = 0; m0 < Mt; m0 += MR) {
      tile_kernel<false>(&W.qp[m0 * D], D, kpanel, D, W.tile, NR);
      for (int64_t mr = 0; mr < MR && m0 + mr < M; ++mr) {
        const int64_t i = r0 + (m0 + mr) % R;
        float* srow = &W.s[(m0 + mr) * lds + j0];
        for (int c = 0; c < NR; ++c) srow[c] = j0 + c <= i ? W.tile[mr * NR + c] : ninf;
      }
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    float* row = &W.s[m * lds];
    const float mx = logits_row(row, e16, P.scale, P.logits_bf16);
    a[m] = row[0];
    if (!P.first_only) normalize_row(row, e16, exp_row(row, e16, mx, 1.0f));
  }
}

void probe_task(const ProbeProblem& P, int64_t task, ProbeScratch& W) {
  const int64_t nblk = (P.T + P.rows - 1) / P.rows;
  const int64_t w = task / nblk, blk = task % nblk;
  const int64_t r0 = blk * P.rows, R = std::min(P.rows, P.T - r0), M = P.G * R, e16 = round_up(r0 + R, NR);
  double* slab = P.slab.data() + w * P.slab_per_window + P.slab_at[blk];
  if (!P.first_only) std::fill_n(slab, (P.S - 1) * e16, 0.0);
  std::vector<double> first((P.S - 1) * R, 0.0);
  std::vector<float> a(M);
  for (int64_t h = 0; h < P.K; ++h) {
    probe_maps(P, W, w * P.S, h, r0, R, W.a0.data());
    if (!P.first_only) std::swap(W.s, W.ref);
    for (int64_t g = 1; g < P.S; ++g) {
      probe_maps(P, W, w * P.S + g, h, r0, R, a.data());
      for (int64_t m = 0; m < M; ++m) first[(g - 1) * R + m % R] += std::fabs(double(a[m]) - double(W.a0[m]));
      if (P.first_only) continue;
      double* c = slab + (g - 1) * e16;
      for (int64_t m = 0; m < M; ++m) {
        const float* p = &W.s[m * P.lds];
        const float* p0 = &W.ref[m * P.lds];
        for (int64_t j = 0; j < e16; ++j) c[j] += double(std::fabs(p[j] - p0[j]));
      }
    }
  }
  for (int64_t g = 1; g < P.S; ++g)
    std::memcpy(P.first + (w * (P.S - 1) + g - 1) * P.T + r0, &first[(g - 1) * R], R * sizeof(double));
}

ffi::Error Probe(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                 ffi::ResultBuffer<ffi::F64> first, ffi::ResultBuffer<ffi::F64> col, int64_t shifts, float scale,
                 int32_t logits_bf16, int32_t first_only) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4) return ffi::Error::InvalidArgument("probe: q and k must be rank 4");
  auto P = std::make_shared<ProbeProblem>();
  P->B = qd[0]; P->T = qd[1]; P->N = qd[2]; P->D = qd[3]; P->K = kd[2]; P->S = shifts;
  if (kd[0] != P->B || kd[1] != P->T || kd[3] != P->D || P->K <= 0 || P->N % P->K != 0 || P->S < 2 ||
      P->B % P->S != 0)
    return ffi::Error::InvalidArgument("probe: q [B,T,N,D], k [B,T,K,D] with B a multiple of the shifts (>= 2)");
  P->W = P->B / P->S;
  const int64_t out_n = P->W * (P->S - 1) * P->T;
  std::fill_n(first->typed_data(), out_n, 0.0);
  std::fill_n(col->typed_data(), out_n, 0.0);
  if (out_n * P->N * P->D == 0) return ffi::Error::Success();
  P->q = q.typed_data(); P->k = k.typed_data(); P->first = first->typed_data(); P->col = col->typed_data();
  P->G = P->N / P->K;
  P->rows = std::max<int64_t>(1, TARGET_ROWS / P->G);
  P->Mp = round_up(P->G * P->rows, MR);
  P->T16 = round_up(P->T, NR);
  P->lds = P->T16 + NR;
  P->scale = scale;
  P->logits_bf16 = logits_bf16 != 0;
  P->first_only = first_only != 0;
  P->kp = buffers().take(P->B * P->K * P->T16 * P->D);
  P->packed.reset(new std::once_flag[P->B * P->K]);
  const int64_t nblk = (P->T + P->rows - 1) / P->rows;
  for (int64_t blk = 0; blk < nblk; ++blk) {
    P->slab_at.push_back(P->slab_per_window);
    if (!P->first_only) P->slab_per_window += (P->S - 1) * round_up(std::min(P->T, (blk + 1) * P->rows), NR);
  }
  P->slab.resize(P->W * P->slab_per_window);
  for (int64_t blk = nblk - 1; blk >= 0; --blk)
    for (int64_t w = 0; w < P->W; ++w) P->tasks.push_back(w * nblk + blk);
  run_tasks<ProbeProblem, ProbeScratch, probe_task>(pool, P);
  buffers().give(P->kp);
  if (!P->first_only)  // the blocks' column sums, added in block order
    for (int64_t w = 0; w < P->W; ++w)
      for (int64_t blk = 0; blk < nblk; ++blk) {
        const int64_t e16 = round_up(std::min(P->T, (blk + 1) * P->rows), NR), e = std::min(e16, P->T);
        const double* slab = P->slab.data() + w * P->slab_per_window + P->slab_at[blk];
        for (int64_t g = 1; g < P->S; ++g) {
          double* c = P->col + (w * (P->S - 1) + g - 1) * P->T;
          for (int64_t j = 0; j < e; ++j) c[j] += slab[(g - 1) * e16 + j];
        }
      }
  return ffi::Error::Success();
}


// ---------------------------------------------------------------------------------------------
// The decoder's projections, y[M, N] = x[M, K] . w[N, K]^T in fp32 or fp64 (jaxref.model.linear),
// by a private copy of the OpenBLAS numpy uses (jaxref.kernels loads it, sets its thread count to 1
// and hands its entry points to jaxref_set_blas; numpy's own instance keeps its threads). XLA's CPU
// matmuls ran 10-30% below that BLAS at the decoder's shapes on 2 cores. The BLAS runs
// single-threaded on the threads of XLA's pool (its own threads would compete with the pool's, and
// OpenBLAS's thread count is one global), each call on a part of x [B, R, K] (B the leading axes,
// R rows each), cut so that a row's result depends on R and the row alone, never on the batch
// around it (a window under the same shift twice gives identical rows; a batch of one gives what a
// batch of many does):
//   * every batch element's rows are cut alike, by R alone, in chunks of at most GEMM_CHUNK rows;
//   * whole elements are grouped into one call (g of them, g the largest divisor of B leaving a call
//     per thread, at most GEMM_ROWS rows a call) only when one element's call is large
//     (R N K >= GEMM_GROUP_MNK) and jaxref.kernels found this BLAS position-exact (`group_rows`): the
//     BLAS picks its kernel by the call's shape, and the blocked kernel of OpenBLAS's AVX-512 builds,
//     which large calls get, gives a row the same result whatever rows the call holds; small calls get
//     other kernels, so they always hold one chunk. Its Haswell kernels (AVX2 CPUs) do not: a row's
//     last bits change with its place in the call, so there every element has calls of its own
//     (tests/jaxref/test_blas_matmul.py).

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
struct Blas {
  void *sgemm = nullptr, *dgemm = nullptr;  // cblas_sgemm / cblas_dgemm
  bool ilp64 = true;                        // their integers 64-bit (else 32-bit)
  bool group_rows = false;                  // whole elements may share a call (position-exact BLAS)
};
Blas& blas() {
  static Blas b;
  return b;
}

// y[m, n] = x[m, k] . w[n, k]^T, row-major, by cblas_?gemm with integers of type I.
template <class I, class T>
void gemm_as(void* fn, const T* x, const T* w, T* y, int64_t m, int64_t n, int64_t k) {
  using gemm_t = void (*)(int, int, int, I, I, I, T, const T*, I, const T*, I, T, T*, I);
  reinterpret_cast<gemm_t>(fn)(ROW_MAJOR, NO_TRANS, TRANS, I(m), I(n), I(k), T(1), x, I(k), w, I(k), T(0), y, I(n));
}
template <class T>
void gemm(const T* x, const T* w, T* y, int64_t m, int64_t n, int64_t k) {
  const Blas& b = blas();
  void* fn = std::is_same<T, float>::value ? b.sgemm : b.dgemm;
  if (b.ilp64)
    gemm_as<int64_t>(fn, x, w, y, m, n, k);
  else
    gemm_as<int>(fn, x, w, y, m, n, k);
}

template <class T>
struct GemmProblem {
  const T *x, *w;
  T* y;
  int64_t R, N, K;       // rows per batch element, outputs, inputs
  int64_t group;         // batch elements per call (1: one chunk of one element per call)
  int64_t chunk, chunks;  // rows per chunk, chunks per element
  std::vector<int64_t> tasks;  // (first element of the call) * chunks + chunk
};
struct NoScratch {
  template <class P>
  void fit(const P&) {}
};

template <class T>
void gemm_task(const GemmProblem<T>& P, int64_t t, NoScratch&) {
  const int64_t c = t % P.chunks, r0 = (t / P.chunks) * P.R + c * P.chunk;
  const int64_t m = P.group > 1 ? P.group * P.R : std::min(P.chunk, P.R - c * P.chunk);
  gemm(P.x + r0 * P.K, P.w, P.y + r0 * P.N, m, P.N, P.K);
}

constexpr int64_t GEMM_CHUNK = 1024;          // rows of one element in one call at most
constexpr int64_t GEMM_ROWS = 4096;           // rows of a call of grouped elements at most
constexpr double GEMM_GROUP_MNK = 8e6;        // an element's R N K from which elements are grouped

template <ffi::DataType DT>
ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<DT> x, ffi::Buffer<DT> w, ffi::ResultBuffer<DT> y) {
  using T = ffi::NativeType<DT>;
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() < 1 || wd.size() != 2 || xd.back() != wd[1])
    return ffi::Error::InvalidArgument("matmul: x [..., K] and w [N, K] disagree");
  if (blas().sgemm == nullptr) return ffi::Error::Internal("matmul: no BLAS (jaxref_set_blas was not called)");
  auto P = std::make_shared<GemmProblem<T>>();
  P->K = wd[1];
  P->N = wd[0];
  P->R = xd.size() >= 2 ? xd[xd.size() - 2] : 1;
  int64_t batch = 1;
  for (size_t i = 0; i + 2 < xd.size(); ++i) batch *= xd[i];
  if (batch * P->R * P->N == 0) return ffi::Error::Success();
  if (P->K == 0) {
    std::fill(y->typed_data(), y->typed_data() + batch * P->R * P->N, T(0));
    return ffi::Error::Success();
  }
  P->x = x.typed_data();
  P->w = w.typed_data();
  P->y = y->typed_data();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  P->chunks = (P->R + GEMM_CHUNK - 1) / GEMM_CHUNK;
  P->chunk = (P->R + P->chunks - 1) / P->chunks;  // every chunk `chunk` rows but the last, shorter by < chunks
  P->group = 1;
  if (blas().group_rows && P->chunks == 1 && double(P->R) * double(P->N) * double(P->K) >= GEMM_GROUP_MNK)
    for (int64_t g = batch / threads; g > 1; --g)
      if (batch % g == 0 && g * P->R <= GEMM_ROWS) {
        P->group = g;
        break;
      }
  for (int64_t e = 0; e < batch; e += P->group)
    for (int64_t c = 0; c < P->chunks; ++c) P->tasks.push_back(e * P->chunks + c);
  run_tasks<GemmProblem<T>, NoScratch, gemm_task<T>>(pool, P);
  return ffi::Error::Success();
}

template <ffi::DataType DT>
auto matmul_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .template Arg<ffi::Buffer<DT>>()
      .template Arg<ffi::Buffer<DT>>()
      .template Ret<ffi::Buffer<DT>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrefCausalAttention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("variant")
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("logits_bf16")
                                  .Attr<int32_t>("pv_bf16")
                                  .Attr<int32_t>("kv_block"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrefAuditProbe, Probe,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F64>>()
                                  .Ret<ffi::Buffer<ffi::F64>>()
                                  .Attr<int64_t>("shifts")
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("logits_bf16")
                                  .Attr<int32_t>("first_only"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrefMatmulF32, Matmul<ffi::F32>, matmul_binding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrefMatmulF64, Matmul<ffi::F64>, matmul_binding<ffi::F64>());

// The BLAS entry points (cblas_sgemm / cblas_dgemm with 64-bit integers when ilp64, else 32-bit) of a
// single-threaded BLAS instance, and whether its results are position-exact (group_rows), from
// jaxref.kernels before the first matmul.
extern "C" void jaxref_set_blas(void* sgemm, void* dgemm, int ilp64, int group_rows) {
  Blas& b = blas();
  b.sgemm = sgemm;
  b.dgemm = dgemm;
  b.ilp64 = ilp64 != 0;
  b.group_rows = group_rows != 0;
}
