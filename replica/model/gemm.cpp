// fp32 linear layers for CPUs with AVX2 and FMA: y = x @ W^T (+ bias), W pre-packed in panels.
//
// Why: oneDNN's fp32 inner product reads SmolLM2's weights at ~60 % of the memory's bandwidth for
// one row and reaches ~45 % of the FMA units' peak at sixteen (decoding), where an engine spends
// most of a step. Here W [N, K] is stored as panels of 16 output columns, each panel K rows of 16
// floats ([N / 16, K, 16]), so a panel is one sequential stream; a tile of up to 6 input rows
// by 16 or 32 columns keeps its sums in registers while the panels stream past once per tile of
// rows, the rows of x staying in cache between tiles.
//
// Every output y[m, n] is one chain of fused multiply-adds over k = 0..K-1 in order, whatever
// the tile, the number of rows or the threads: a row's result never depends on the rows beside it.

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

constexpr int64_t kPanel = 16;   // output columns per panel: two 8-float vectors
constexpr int64_t kGroup = 2;    // panels per unit of work (one thread's share is whole groups)
constexpr int kRowsPerTile = 6;  // 6 rows x 16 columns: 12 accumulators, 2 weight vectors, 1 broadcast

// Rows [0, MR) of x against NP consecutive panels starting at `panels`; where `ahead` is given,
// one line of it is fetched into L2 per k (the next panels, while these are read from cache).
template <int MR, int NP>
inline void tile(const float* x, int64_t lda, const float* panels, int64_t k_len, const float* bias,
                 float* out, int64_t ldc, const float* ahead) {
  __m256 acc[MR][2 * NP];
#pragma GCC unroll 4
  for (int p = 0; p < NP; ++p) {
    const __m256 b0 = bias ? _mm256_loadu_ps(bias + p * kPanel) : _mm256_setzero_ps();
    const __m256 b1 = bias ? _mm256_loadu_ps(bias + p * kPanel + 8) : _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      acc[m][2 * p] = b0;
      acc[m][2 * p + 1] = b1;
    }
  }
  const int64_t panel_stride = k_len * kPanel;
  for (int64_t k = 0; k < k_len; ++k) {
    __m256 w[2 * NP];
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      w[2 * p] = _mm256_loadu_ps(panels + p * panel_stride + k * kPanel);
      w[2 * p + 1] = _mm256_loadu_ps(panels + p * panel_stride + k * kPanel + 8);
    }
    if (ahead) _mm_prefetch(reinterpret_cast<const char*>(ahead + k * kPanel), _MM_HINT_T1);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_broadcast_ss(x + m * lda + k);
#pragma GCC unroll 8
      for (int v = 0; v < 2 * NP; ++v) acc[m][v] = _mm256_fmadd_ps(xv, w[v], acc[m][v]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int v = 0; v < 2 * NP; ++v) _mm256_storeu_ps(out + m * ldc + v * 8, acc[m][v]);
}

// The rows left after the 6-row tiles (1-5), against NP panels.
template <int NP>
inline void tail(int rows, const float* x, int64_t lda, const float* panels, int64_t k_len,
                 const float* bias, float* out, int64_t ldc, const float* ahead) {
  switch (rows) {
    case 1: tile<1, NP>(x, lda, panels, k_len, bias, out, ldc, ahead); break;
    case 2: tile<2, NP>(x, lda, panels, k_len, bias, out, ldc, ahead); break;
    case 3: tile<3, NP>(x, lda, panels, k_len, bias, out, ldc, ahead); break;
    case 4: tile<4, NP>(x, lda, panels, k_len, bias, out, ldc, ahead); break;
    case 5: tile<5, NP>(x, lda, panels, k_len, bias, out, ldc, ahead); break;
    default: break;
  }
}

// Every row of x against the panels [first, first + count) (count 1 or 2). The first tile of rows
// reads the panels from memory; while the second reads them again from cache, the next group's
// panels (`next`, or null) are fetched, so the memory streams under arithmetic.
void group(const float* x, int64_t lda, int64_t rows, const float* panels, int64_t first,
           int64_t count, int64_t k_len, const float* bias, float* out, int64_t ldc, const float* next) {
  const int64_t panel_size = k_len * kPanel;
  const float* w = panels + first * panel_size;
  const float* b = bias ? bias + first * kPanel : nullptr;
  float* y = out + first * kPanel;
  int64_t m = 0;
  for (; m + kRowsPerTile <= rows; m += kRowsPerTile)
    for (int64_t p = 0; p < count; ++p) {
      const float* ahead = m == kRowsPerTile && next ? next + p * panel_size : nullptr;
      tile<kRowsPerTile, 1>(x + m * lda, lda, w + p * panel_size, k_len, b ? b + p * kPanel : nullptr,
                            y + m * ldc + p * kPanel, ldc, ahead);
    }
  const int left = static_cast<int>(rows - m);
  if (left == 0) return;
  const float* ahead = m == kRowsPerTile ? next : nullptr;
  if (count == 2 && left <= 2) {  // few rows: both panels at once, for enough independent sums
    tail<2>(left, x + m * lda, lda, w, k_len, b, y + m * ldc, ldc, ahead);
    return;
  }
  for (int64_t p = 0; p < count; ++p)
    tail<1>(left, x + m * lda, lda, w + p * panel_size, k_len, b ? b + p * kPanel : nullptr,
            y + m * ldc + p * kPanel, ldc, ahead ? ahead + p * panel_size : nullptr);
}

}  // namespace

extern "C" {

int gemm_f32_supported() { return 1; }

// out [rows, n] = x [rows, k_len] (row stride lda) @ W^T + bias; panels from W [n, k_len] as
// [n / 16, k_len, 16]; bias [n] or null; n a multiple of 16. Returns 1 (0: not built for this CPU).
int gemm_f32(const float* x, int64_t lda, const float* panels, const float* bias, float* out,
              int64_t rows, int64_t n, int64_t k_len, int threads) {
  const int64_t panel_count = n / kPanel;
  const int64_t groups = (panel_count + kGroup - 1) / kGroup;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && groups > 1)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t first = g * kGroup;
    const int64_t count = panel_count - first < kGroup ? panel_count - first : kGroup;
    const bool whole_next = first + 2 * kGroup <= panel_count;
    const float* next = whole_next ? panels + (first + kGroup) * k_len * kPanel : nullptr;
    group(x, lda, rows, panels, first, count, k_len, bias, out, n, next);
  }
  return 1;
}
}

#else

extern "C" {
int gemm_f32_supported() { return 0; }
int gemm_f32(const float*, int64_t, const float*, const float*, float*, int64_t, int64_t, int64_t, int) {
  return 0;
}
}

#endif
