// Fused CPU kernels for the decoder's elementwise work (residual add with RMSNorm, the gated
// activation SiLU(gate) * up, rotary embedding), for decode attention over the paged KV pool,
// and, on CPUs with AMX tiles or AVX512-BF16, for prefill attention over it. Eager PyTorch
// spends 3-12 ops on each of the elementwise steps, one pass over memory and one dispatch apiece;
// here each is one pass.
//
// Every kernel rounds where the eager ops round (to the model's dtype after each op, fp32 inside
// RMSNorm), so a bf16 result carries the same roundings as transformers' eager code; the
// attention kernels' dot products are fused multiply-adds, as the matmuls they replace compute
// them. Rows are independent: a row's bits never depend on how many rows share the call.
//
// Compiled for the host CPU by replica/model/native.py (-O3 -march=native -ffp-contract=off: the
// loops vectorise, and no multiply-add is fused into an FMA the eager ops would not use).
// Tensors arrive as raw pointers, checked on the Python side.

#include <cmath>
#include <cstdint>
#include <memory>
// KVROUTE_PORTABLE keeps the AVX-512 forms out, so tests run the portable loops on any CPU.
#if defined(__AVX512F__) && !defined(KVROUTE_PORTABLE)
#define KVROUTE_AVX512 1
#include <immintrin.h>
#endif
// Prefill attention needs bf16 dot products: AVX512-BF16's, or AMX tiles' where there are some.
#if defined(KVROUTE_AVX512) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define KVROUTE_EXTEND 1
#endif
#if defined(KVROUTE_EXTEND) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define KVROUTE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

struct Fp32 {
  using T = float;
  static inline float load(float v) { return v; }
  static inline float store(float v) { return v; }
  static inline float round(float v) { return v; }
};

struct Bf16 {
  using T = uint16_t;
  static inline float load(uint16_t v) { return __builtin_bit_cast(float, static_cast<uint32_t>(v) << 16); }
  // Round to nearest even, NaN kept quiet: c10::BFloat16's conversion.
  static inline uint16_t store(float v) {
    uint32_t bits = __builtin_bit_cast(uint32_t, v);
    uint32_t rounded = (bits + (((bits >> 16) & 1u) + 0x7fffu)) >> 16;
    return v != v ? static_cast<uint16_t>(0x7fc0) : static_cast<uint16_t>(rounded);
  }
  static inline float round(float v) { return load(store(v)); }
};

// exp(x) to ~1 ulp (Cephes' expf: range reduction by ln 2, degree-5 polynomial), written so the
// loops around it vectorise. Below ln(FLT_MIN) it returns ~FLT_MIN rather than a subnormal, above
// ln(FLT_MAX) +inf, as expf: for SiLU both ends give expf's result.
inline float fast_exp(float x) {
  const float hi = 88.3762626647949f, lo = -87.3365447504f;
  const float clamped = x > hi ? hi : (x < lo ? lo : x);
  // n = round(x / ln 2) by the 1.5 * 2^23 trick (floor would not vectorise without fast-math).
  const float n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const float scale = __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
  return x > hi ? INFINITY : y * scale;
}

// The squares of a row, summed in the order torch's CPU sum kernel adds them (SumKernel.cpp's
// cascade: 8-float vectors in 4 interleaved accumulators, flushed up 4 levels every 16 groups;
// leftover vectors, then the tail elements, then the lanes in turn; rows under 8 wide take the
// same cascade one float at a time). Any other order moves the mean by an fp32 ulp now and then,
// and over 30 bf16 layers that decides near-tied greedy tokens the other way from transformers
// (SmolLM2's "The"/"L" opening to "What is the capital of France?").
template <class D, int64_t kLanes>
inline float cascade_sum_squares(const typename D::T* x, int64_t width) {
  // A group is 4 vectors side by side; accumulator element k * kLanes + lane is vector k's lane,
  // so one flat loop over a group's kWide floats keeps every lane's order and vectorises.
  constexpr int64_t kInterleave = 4, kLevels = 4, kWide = kInterleave * kLanes;
  const int64_t vectors = width / kLanes, groups = vectors / kInterleave;
  float levels[kLevels][kWide] = {};
  const int64_t ceil_log2 = groups <= 2 ? 1 : 64 - __builtin_clzll(static_cast<uint64_t>(groups - 1));
  const int64_t power = ceil_log2 / kLevels > 4 ? ceil_log2 / kLevels : 4;
  const int64_t step = int64_t{1} << power, mask = step - 1;
  auto add_groups = [x, &levels](int64_t first, int64_t end) {
    for (int64_t group = first; group < end; ++group) {
      const typename D::T* v = x + group * kWide;
#pragma omp simd
      for (int64_t i = 0; i < kWide; ++i) {
        const float value = D::load(v[i]);
        levels[0][i] += value * value;
      }
    }
  };
  int64_t group = 0;
  for (; group + step <= groups; group += step) {
    add_groups(group, group + step);
    for (int64_t level = 1; level < kLevels; ++level) {
#pragma omp simd
      for (int64_t i = 0; i < kWide; ++i) {
        levels[level][i] += levels[level - 1][i];
        levels[level - 1][i] = 0.0f;
      }
      if (((group + step) & (mask << (level * power))) != 0) break;
    }
  }
  add_groups(group, groups);
  for (int64_t level = 1; level < kLevels; ++level) {
#pragma omp simd
    for (int64_t i = 0; i < kWide; ++i) levels[0][i] += levels[level][i];
  }
  float* total = levels[0];  // vector 0's lanes, where the leftover vectors and then the others go
  for (int64_t vector = groups * kInterleave; vector < vectors; ++vector) {
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      const float value = D::load(x[vector * kLanes + lane]);
      total[lane] += value * value;
    }
  }
  for (int64_t k = 1; k < kInterleave; ++k) {
    for (int64_t lane = 0; lane < kLanes; ++lane) total[lane] += total[k * kLanes + lane];
  }
  float sum = 0.0f;
  for (int64_t i = vectors * kLanes; i < width; ++i) {
    const float value = D::load(x[i]);
    sum += value * value;
  }
  for (int64_t lane = 0; lane < kLanes; ++lane) sum += total[lane];
  return sum;
}

template <class D>
inline float sum_squares(const typename D::T* x, int64_t width) {
  return width >= 8 ? cascade_sum_squares<D, 8>(x, width) : cascade_sum_squares<D, 1>(x, width);
}

// out = weight * (x * rsqrt(mean(x^2) + eps)) for one row, as transformers' RMSNorm rounds it:
// the normalised row in fp32, rounded to the dtype, then scaled by the weight.
template <class D>
inline void norm_row(const typename D::T* x, const typename D::T* weight, typename D::T* out,
                     int64_t width, float eps) {
  const float inv = 1.0f / std::sqrt(sum_squares<D>(x, width) / static_cast<float>(width) + eps);
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) {
    out[i] = D::store(D::load(weight[i]) * D::round(D::load(x[i]) * inv));
  }
}

template <class D>
void rms_norm(const typename D::T* x, const typename D::T* weight, typename D::T* out, int64_t rows,
              int64_t width, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows * width >= 65536)
  for (int64_t row = 0; row < rows; ++row) {
    norm_row<D>(x + row * width, weight, out + row * width, width, eps);
  }
}

// residual += delta (rounded to the dtype, as ``residual + delta`` is), then out = RMSNorm(residual).
template <class D>
void add_rms_norm(typename D::T* residual, const typename D::T* delta, const typename D::T* weight,
                  typename D::T* out, int64_t rows, int64_t width, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows * width >= 65536)
  for (int64_t row = 0; row < rows; ++row) {
    typename D::T* r = residual + row * width;
    const typename D::T* d = delta + row * width;
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) {
      r[i] = D::store(D::load(r[i]) + D::load(d[i]));
    }
    norm_row<D>(r, weight, out + row * width, width, eps);
  }
}

// out[row] = SiLU(gate) * up, where gate_up[row] is gate then up, each ``width`` wide. SiLU is
// x / (1 + exp(-x)) rounded to the dtype, then the product rounded: F.silu then a multiply.
template <class D>
void silu_and_mul(const typename D::T* gate_up, typename D::T* out, int64_t rows, int64_t width,
                  int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows * width >= 65536)
  for (int64_t row = 0; row < rows; ++row) {
    const typename D::T* gate = gate_up + row * 2 * width;
    const typename D::T* up = gate + width;
    typename D::T* o = out + row * width;
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) {
      float g = D::load(gate[i]);
      float silu = D::round(g / (1.0f + fast_exp(-g)));
      o[i] = D::store(silu * D::load(up[i]));
    }
  }
}

// In place, x[token, head] = x * cos + rotate_half(x) * sin over ``heads`` heads of ``dim`` per
// token, tokens ``token_stride`` elements apart; cos and signed_sin are [tokens, dim] (the first
// half of sin negated). Rounded as the eager form: each product, then their sum.
template <class D>
void rotary(typename D::T* x, const typename D::T* cos, const typename D::T* signed_sin, int64_t tokens,
            int64_t heads, int64_t dim, int64_t token_stride, int threads) {
  const int64_t half = dim / 2;
#pragma omp parallel for num_threads(threads) if (threads > 1 && tokens * heads * dim >= 65536)
  for (int64_t token = 0; token < tokens; ++token) {
    const typename D::T* c = cos + token * dim;
    const typename D::T* s = signed_sin + token * dim;
    for (int64_t head = 0; head < heads; ++head) {
      typename D::T* row = x + token * token_stride + head * dim;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        float a = D::load(row[i]), b = D::load(row[i + half]);
        row[i] = D::store(D::round(a * D::load(c[i])) + D::round(b * D::load(s[i])));
        row[i + half] = D::store(D::round(b * D::load(c[i + half])) + D::round(a * D::load(s[i + half])));
      }
    }
  }
}

// One new query token per sequence against its whole context, read straight from the paged KV
// pool: no gathered copy of the context. q [decodes, heads, dim] (tokens ``q_stride`` apart),
// kv the pool's layer [2, kv_heads, pages, page_size, dim], page_table [decodes, width], each
// context ``lengths[d]`` keys long; out [decodes, heads, dim]. Rounded as the eager form: scores
// to the dtype after the scale, softmax in fp32, its weights to the dtype, the weighted sums
// accumulated in fp32 (their products fused into the sums, as the eager form's matmuls do). The
// query heads sharing a KV head are done together, one task per sequence and KV head.
struct DecodeShape {
  int64_t heads, kv_heads, dim, pages, page_size, width, q_stride;
  float scale;
};

// A context's key (or value, from ``base`` the pool's value half) rows in order, page by page:
// one division to start, none per row (a row's page and offset by division cost more than
// reading it).
template <class T>
class ContextRows {
 public:
  template <class Shape>
  ContextRows(const T* base, const int64_t* table, int64_t head, int64_t first, const Shape& s)
      : head_(base + head * s.pages * s.page_size * s.dim), table_(table), page_size_(s.page_size),
        dim_(s.dim), page_(first / s.page_size), offset_(first % s.page_size) {}
  const T* row() const { return head_ + (table_[page_] * page_size_ + offset_) * dim_; }
  void next() {
    if (++offset_ == page_size_) {
      offset_ = 0;
      ++page_;
    }
  }

 private:
  const T* head_;
  const int64_t* table_;
  int64_t page_size_, dim_, page_, offset_;
};

// The scaled scores of ``group`` query heads over ``length`` keys into scores [group, length]:
// any CPU, any head size.
template <class D>
void decode_scores(const typename D::T* q, const typename D::T* kv, const int64_t* table, int64_t h,
                   int64_t length, int64_t group, const DecodeShape& s, float* query, float* scores) {
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t i = 0; i < s.dim; ++i) query[g * s.dim + i] = D::load(q[g * s.dim + i]);
  }
  ContextRows<typename D::T> keys(kv, table, h, 0, s);
  for (int64_t j = 0; j < length; ++j, keys.next()) {
    const typename D::T* key = keys.row();
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = query + g * s.dim;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < s.dim; ++i) dot += qg[i] * D::load(key[i]);
      scores[g * length + j] = dot;
    }
  }
}

// The weighted sums of ``length`` value rows for ``group`` heads: acc [group, dim], fp32.
template <class D>
void decode_values(const float* weights, const typename D::T* values, const int64_t* table, int64_t h,
                   int64_t length, int64_t group, const DecodeShape& s, float* acc) {
  for (int64_t i = 0; i < group * s.dim; ++i) acc[i] = 0.0f;
  ContextRows<typename D::T> rows(values, table, h, 0, s);
  for (int64_t j = 0; j < length; ++j, rows.next()) {
    const typename D::T* value = rows.row();
    for (int64_t g = 0; g < group; ++g) {
      const float weight = weights[g * length + j];
      float* a = acc + g * s.dim;
#pragma omp simd
      for (int64_t i = 0; i < s.dim; ++i) a[i] += weight * D::load(value[i]);
    }
  }
}

#if defined(KVROUTE_AVX512)
// AVX-512 forms of the two loops above for head sizes of 16 * C: a key's dot products run in
// C sixteen-lane registers and one horizontal sum (the generic loop's vectorised reduction spends
// most of its time in per-key bookkeeping), and a value row is widened once for all its heads.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// 2^x on sixteen lanes for finite x <= 0 (softmax weights): 2^round(x) times a degree-5 Taylor
// polynomial of 2^f, |f| <= 1/2 (relative error < 3e-6, far below the weights' bf16 rounding).
inline __m512 exp2_16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.33335581e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.61812911e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.55041087e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40226507e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93147181e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

template <class D, int C>
void decode_scores16(const typename D::T* q, const typename D::T* kv, const int64_t* table, int64_t h,
                     int64_t length, int64_t group, const DecodeShape& s, float* scores) {
  for (int64_t g = 0; g < group; ++g) {
    __m512 query[C];
    for (int c = 0; c < C; ++c) query[c] = load16(q + g * s.dim + 16 * c);
    ContextRows<typename D::T> keys(kv, table, h, 0, s);
    for (int64_t j = 0; j < length; ++j, keys.next()) {
      const typename D::T* key = keys.row();
      __m512 dot = _mm512_mul_ps(query[0], load16(key));
      for (int c = 1; c < C; ++c) dot = _mm512_fmadd_ps(query[c], load16(key + 16 * c), dot);
      scores[g * length + j] = _mm512_reduce_add_ps(dot);
    }
  }
}

template <class D, int C>
void decode_values16(const float* weights, const typename D::T* values, const int64_t* table, int64_t h,
                     int64_t length, int64_t group, const DecodeShape& s, float* acc) {
  for (int64_t g = 0; g < group; ++g) {
    __m512 sum[C];
    for (int c = 0; c < C; ++c) sum[c] = _mm512_setzero_ps();
    const float* w = weights + g * length;
    ContextRows<typename D::T> rows(values, table, h, 0, s);
    for (int64_t j = 0; j < length; ++j, rows.next()) {
      const typename D::T* value = rows.row();
      const __m512 weight = _mm512_set1_ps(w[j]);
      for (int c = 0; c < C; ++c) sum[c] = _mm512_fmadd_ps(weight, load16(value + 16 * c), sum[c]);
    }
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * s.dim + 16 * c, sum[c]);
  }
}
#endif

// In place, each of ``group`` rows of ``length`` scores: scaled and rounded to the dtype, then
// their softmax in fp32, rounded to the dtype.
template <class D>
void decode_softmax(float* scores, int64_t length, int64_t group, float scale) {
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores + g * length;
#pragma omp simd
    for (int64_t j = 0; j < length; ++j) row[j] = D::round(row[j] * scale);
    float top = row[0];
    for (int64_t j = 1; j < length; ++j) top = row[j] > top ? row[j] : top;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < length; ++j) {
      row[j] = fast_exp(row[j] - top);
      sum += row[j];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t j = 0; j < length; ++j) row[j] = D::round(row[j] * inv);
  }
}

// One task: query heads [h * group, (h + 1) * group) of sequence d; C > 0: the AVX-512 loops for
// head size 16 * C, 0: the portable ones.
template <class D, int C>
void decode_task(const typename D::T* q, const typename D::T* kv, const int64_t* table, int64_t h,
                 int64_t length, const DecodeShape& s, typename D::T* out, float* scores, float* work) {
  const int64_t group = s.heads / s.kv_heads;
  const typename D::T* values = kv + s.kv_heads * s.pages * s.page_size * s.dim;
#if defined(KVROUTE_AVX512)
  if constexpr (C > 0) {
    decode_scores16<D, C>(q, kv, table, h, length, group, s, scores);
    decode_softmax<D>(scores, length, group, s.scale);
    decode_values16<D, C>(scores, values, table, h, length, group, s, work);
  } else
#endif
  {
    decode_scores<D>(q, kv, table, h, length, group, s, work, scores);
    decode_softmax<D>(scores, length, group, s.scale);
    decode_values<D>(scores, values, table, h, length, group, s, work);
  }
  for (int64_t i = 0; i < group * s.dim; ++i) out[i] = D::store(work[i]);
}

template <class D, int C>
void decode_tasks(const typename D::T* q, const typename D::T* kv, const int64_t* page_table,
                  const int64_t* lengths, typename D::T* out, int64_t decodes, const DecodeShape& s, int threads) {
  const int64_t group = s.heads / s.kv_heads;
  int64_t longest = 0;
  for (int64_t d = 0; d < decodes; ++d) longest = lengths[d] > longest ? lengths[d] : longest;
#pragma omp parallel num_threads(threads) if (threads > 1 && decodes * s.kv_heads > 1)
  {
    float* scores = new float[group * longest];
    float* work = new float[group * s.dim];
#pragma omp for schedule(static)
    for (int64_t task = 0; task < decodes * s.kv_heads; ++task) {
      const int64_t d = task / s.kv_heads, h = task % s.kv_heads;
      decode_task<D, C>(q + d * s.q_stride + h * group * s.dim, kv, page_table + d * s.width, h, lengths[d], s,
                        out + (d * s.heads + h * group) * s.dim, scores, work);
    }
    delete[] scores;
    delete[] work;
  }
}

// The head size picks the loops once a call: AVX-512 ones for 16, 32, 64 and 128, else portable.
template <class D>
void decode_attention(const typename D::T* q, const typename D::T* kv, const int64_t* page_table,
                      const int64_t* lengths, typename D::T* out, int64_t decodes, const DecodeShape& s,
                      int threads) {
#if defined(KVROUTE_AVX512)
  switch (s.dim) {
    case 16: return decode_tasks<D, 1>(q, kv, page_table, lengths, out, decodes, s, threads);
    case 32: return decode_tasks<D, 2>(q, kv, page_table, lengths, out, decodes, s, threads);
    case 64: return decode_tasks<D, 4>(q, kv, page_table, lengths, out, decodes, s, threads);
    case 128: return decode_tasks<D, 8>(q, kv, page_table, lengths, out, decodes, s, threads);
    default: break;
  }
#endif
  decode_tasks<D, 0>(q, kv, page_table, lengths, out, decodes, s, threads);
}

#if defined(KVROUTE_EXTEND)
// Prefill attention: ``count`` chunks of ``length`` new queries each, the tails of
// ``context``-key contexts read from the paged pool (the chunks' own K/V already written there),
// each query seeing the keys up to its own position. Each KV head's context is packed once into
// AMX's tile layout, then every 16 query rows of a head take 32-key blocks up to the last one
// they see (SDPA's CPU kernel with a bottom-right mask computes the masked blocks too, and its
// small matmuls run at a fraction of the tiles' speed): scores Q K^T and sums P V are bf16
// products accumulated in fp32 (AMX tiles, else AVX512-BF16's pairwise dot products reading the
// same layout), the softmax in fp32 with each row's exact maximum, its weights rounded to bf16
// for the second product (as SDPA's flash kernel does).
struct ExtendShape : DecodeShape {
  int64_t count, length, context;
};

constexpr int64_t QUERY_TILE = 16, KEY_BLOCK = 32;

#if defined(KVROUTE_AMX)
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands out the tiles' state only on request (once per process; oneDNN asks the same).
bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return permitted;
}
#endif

// r[i] (row i of a 16 x 16 matrix of 32-bit elements) becomes column i.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // lane l of t[i], t[i + 1]: elements 4l, 4l + 1 / 4l + 2, 4l + 3 of two rows
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // lane l of r[i + j]: element 4l + j of rows i .. i + 3
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8) {  // then the four lanes holding one element come together
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// Block ``block`` (32 keys) of one chunk and KV head's keys as B tiles of Q K^T (16 keys x 32
// dims, pairs of dims side by side: [block][dim / 32][16][16] u32, the transpose of 16 keys' rows
// read as u32 pairs) and values as B tiles of P V (32 keys x 16 dims, pairs of keys side by side:
// [block of 32][dim / 16][16][32] u16, two keys' rows interleaved); zero past the context.
void pack_block(const uint16_t* kv, const int64_t* table, int64_t h, int64_t block, const ExtendShape& s,
                uint32_t* keys, uint16_t* values) {
  const uint16_t* value_half = kv + s.kv_heads * s.pages * s.page_size * s.dim;
  const int64_t key_chunks = s.dim / 32, value_chunks = s.dim / 16;
  const uint16_t* key[KEY_BLOCK];
  const uint16_t* value[KEY_BLOCK];
  ContextRows<uint16_t> key_rows(kv, table, h, block * KEY_BLOCK, s), value_rows(value_half, table, h, block * KEY_BLOCK, s);
  for (int64_t i = 0; i < KEY_BLOCK; ++i, key_rows.next(), value_rows.next()) {
    const bool real = block * KEY_BLOCK + i < s.context;
    key[i] = real ? key_rows.row() : nullptr;
    value[i] = real ? value_rows.row() : nullptr;
  }
  for (int64_t half = 0; half < 2; ++half) {
    for (int64_t c = 0; c < key_chunks; ++c) {
      __m512i rows[16];
      for (int64_t n = 0; n < 16; ++n) {
        const uint16_t* row = key[16 * half + n];
        rows[n] = row ? _mm512_loadu_si512(row + 32 * c) : _mm512_setzero_si512();
      }
      transpose16(rows);
      uint32_t* tile = keys + ((2 * block + half) * key_chunks + c) * 256;
      for (int64_t pair = 0; pair < 16; ++pair) _mm512_storeu_si512(tile + pair * 16, rows[pair]);
    }
  }
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t i = 0; i < KEY_BLOCK; i += 2) {
    for (int64_t c = 0; c < value_chunks; ++c) {
      const __m256i first = value[i] ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(value[i] + 16 * c))
                                     : _mm256_setzero_si256();
      const __m256i second = value[i + 1]
                                 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(value[i + 1] + 16 * c))
                                 : _mm256_setzero_si256();
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1);
      _mm512_storeu_si512(values + (block * value_chunks + c) * 512 + i / 2 * 32,
                          _mm512_permutexvar_epi16(interleave, both));
    }
  }
}

#if defined(KVROUTE_AMX)
// GCC's tile intrinsics take literal tile numbers (they become register names), so the two
// block steps below are macros, each used with two sets of tiles that alternate between blocks.

// Scores of one query tile (its 32-dim chunks in tiles 2-5) over a block of 32 keys: keys 0-15
// into tile S0, 16-31 into S1, stored to dst (row stride in bytes).
#define KVROUTE_SCORE_BLOCK(S0, S1, tile, key_chunks, dst, stride) \
  do {                                                             \
    const uint32_t* upper_ = (tile) + (key_chunks) * 256;          \
    _tile_zero(S0);                                                \
    _tile_zero(S1);                                                \
    for (int64_t c_ = 0; c_ < (key_chunks); ++c_) {                \
      _tile_loadd(6, (tile) + c_ * 256, 64);                       \
      _tile_loadd(7, upper_ + c_ * 256, 64);                       \
      switch (c_) {                                                \
        case 0: _tile_dpbf16ps(S0, 2, 6); _tile_dpbf16ps(S1, 2, 7); break; \
        case 1: _tile_dpbf16ps(S0, 3, 6); _tile_dpbf16ps(S1, 3, 7); break; \
        case 2: _tile_dpbf16ps(S0, 4, 6); _tile_dpbf16ps(S1, 4, 7); break; \
        default: _tile_dpbf16ps(S0, 5, 6); _tile_dpbf16ps(S1, 5, 7); break; \
      }                                                            \
    }                                                              \
    _tile_stored(S0, (dst), (stride));                             \
    _tile_stored(S1, (dst) + 16, (stride));                        \
  } while (0)

// P V for one block of 32 keys into the output tiles 0-3 (``chunks`` of 16 dims): the block's
// weights loaded into tile P, its value tiles into V in turn.
#define KVROUTE_VALUE_BLOCK(P, V, weights, stride, tile, chunks) \
  do {                                                           \
    _tile_loadd(P, (weights), (stride));                         \
    for (int64_t c_ = 0; c_ < (chunks); ++c_) {                  \
      _tile_loadd(V, (tile) + c_ * 512, 64);                     \
      switch (c_) {                                              \
        case 0: _tile_dpbf16ps(0, P, V); break;                  \
        case 1: _tile_dpbf16ps(1, P, V); break;                  \
        case 2: _tile_dpbf16ps(2, P, V); break;                  \
        default: _tile_dpbf16ps(3, P, V); break;                 \
      }                                                          \
    }                                                            \
  } while (0)
#else
inline __m512bh as_bf16_pairs(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// Without tiles: the scores of the 16 query rows (``query``, 2 * kPairs bf16 each) over one
// block's 32 keys, one key per lane: for each pair of dims, the two packed key vectors (B tiles'
// rows: 16 keys' pairs each) against each of eight rows' pair broadcast, 16 sums in registers.
// The head size is a template argument so every row's pair is a fixed offset from one pointer.
template <int64_t kPairs>
inline void score_block(const uint16_t* query, const uint32_t* tile, float* dst, int64_t width) {
  constexpr int64_t kRows = 8;
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(query);
  const uint32_t* high = tile + kPairs * 16;
  for (int64_t first = 0; first < QUERY_TILE; first += kRows) {
    __m512 low_sums[kRows], high_sums[kRows];
    for (int64_t r = 0; r < kRows; ++r) low_sums[r] = high_sums[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < kPairs; ++p) {
      const __m512bh low_keys = as_bf16_pairs(_mm512_loadu_si512(tile + p * 16));
      const __m512bh high_keys = as_bf16_pairs(_mm512_loadu_si512(high + p * 16));
      for (int64_t r = 0; r < kRows; ++r) {
        const int pair = static_cast<int>(pairs[(first + r) * kPairs + p]);
        const __m512bh q = as_bf16_pairs(_mm512_set1_epi32(pair));
        low_sums[r] = _mm512_dpbf16_ps(low_sums[r], q, low_keys);
        high_sums[r] = _mm512_dpbf16_ps(high_sums[r], q, high_keys);
      }
    }
    for (int64_t r = 0; r < kRows; ++r) {
      _mm512_store_ps(dst + (first + r) * width, low_sums[r]);
      _mm512_store_ps(dst + (first + r) * width + 16, high_sums[r]);
    }
  }
}

template <int64_t kPairs>
void score_blocks(const uint16_t* query, const uint32_t* keys, int64_t blocks, float* scores, int64_t width) {
  for (int64_t block = 0; block < blocks; ++block) {
    score_block<kPairs>(query, keys + 2 * block * kPairs * 16, scores + block * KEY_BLOCK, width);
  }
}

// Without tiles: P V of kRows rows' weights (bf16, ``width`` apart) over ``blocks`` blocks into
// ``sums`` (64 floats a row: kChunks chunks of 16 dims), each value vector (two keys' values of
// 16 dims, interleaved) read once for all the rows.
template <int64_t kRows, int64_t kChunks>
inline void value_rows(const uint16_t* weights, int64_t width, const uint16_t* values, int64_t value_chunks,
                       int64_t blocks, float* sums) {
  __m512 acc[kRows][kChunks];
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t c = 0; c < kChunks; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t block = 0; block < blocks; ++block) {
    const uint16_t* tile = values + block * value_chunks * 512;
    const uint16_t* block_weights = weights + block * KEY_BLOCK;
    for (int64_t pair = 0; pair < KEY_BLOCK / 2; ++pair) {
      __m512bh value[kChunks];
      for (int64_t c = 0; c < kChunks; ++c) value[c] = as_bf16_pairs(_mm512_loadu_si512(tile + c * 512 + pair * 32));
      for (int64_t r = 0; r < kRows; ++r) {
        uint32_t both;
        __builtin_memcpy(&both, block_weights + r * width + 2 * pair, 4);
        const __m512bh weight = as_bf16_pairs(_mm512_set1_epi32(static_cast<int>(both)));
        for (int64_t c = 0; c < kChunks; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], weight, value[c]);
      }
    }
  }
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t c = 0; c < kChunks; ++c) _mm512_store_ps(sums + r * 64 + 16 * c, acc[r][c]);
  }
}

// The ``rows`` real rows of a query tile (rows past them, up to 16, may be computed for nothing):
// six at a time, then four.
template <int64_t kChunks>
void value_tile(const uint16_t* weights, int64_t width, const uint16_t* values, int64_t value_chunks,
                int64_t blocks, int64_t rows, float* sums) {
  int64_t r = 0;
  for (; r + 6 <= rows || rows - r > 4; r += 6) {
    value_rows<6, kChunks>(weights + r * width, width, values, value_chunks, blocks, sums + r * 64);
  }
  for (; r < rows; r += 4) {
    value_rows<4, kChunks>(weights + r * width, width, values, value_chunks, blocks, sums + r * 64);
  }
}
#endif

// Sixteen query rows against the keys they see, in three passes with exact row maxima (no
// running rescale): every score of the rows (tiles Q K^T, stored), their softmax (AVX-512), then
// P V accumulated in tiles 0-3, sixty-four output dims at a time. ``scores`` and ``weights`` hold
// 16 x (visible keys rounded up to 32).
void extend_rows(const uint16_t* query, int64_t rows, int64_t first, const uint32_t* keys, const uint16_t* values,
                 const ExtendShape& s, float* scores, uint16_t* weights, uint16_t* out, int64_t out_stride) {
  const int64_t offset = s.context - s.length, key_chunks = s.dim / 32, value_chunks = s.dim / 16;
  const int64_t blocks = (offset + first + rows - 1) / KEY_BLOCK + 1, width = blocks * KEY_BLOCK;
#if defined(KVROUTE_AMX)
  // The query's 32-dim chunks stay in tiles 2-5 (head sizes up to 128), scores of 32 keys in 0-1
  // (and, up to 64 dims, the next 32 keys' in 4-5 meanwhile).
  _tile_loadd(2, query, s.dim * 2);
  if (key_chunks > 1) _tile_loadd(3, query + 32, s.dim * 2);
  if (key_chunks > 2) _tile_loadd(4, query + 64, s.dim * 2);
  if (key_chunks > 3) _tile_loadd(5, query + 96, s.dim * 2);
  for (int64_t block = 0; block < blocks; ++block) {
    const uint32_t* tile = keys + 2 * block * key_chunks * 256;
    float* dst = scores + block * KEY_BLOCK;
    if (key_chunks <= 2 && block % 2 == 1) {
      KVROUTE_SCORE_BLOCK(4, 5, tile, key_chunks, dst, width * 4);
    } else {
      KVROUTE_SCORE_BLOCK(0, 1, tile, key_chunks, dst, width * 4);
    }
  }
#else
  switch (key_chunks) {  // extend_attention_supported: head sizes of 32, 64, 96 or 128
    case 1: score_blocks<16>(query, keys, blocks, scores, width); break;
    case 2: score_blocks<32>(query, keys, blocks, scores, width); break;
    case 3: score_blocks<48>(query, keys, blocks, scores, width); break;
    default: score_blocks<64>(query, keys, blocks, scores, width); break;
  }
#endif
  // Scores go to base 2 with the scale folded in: p = 2^(t - max t), t = score * scale * log2(e).
  const __m512 scale = _mm512_set1_ps(s.scale * 1.44269504088896341f), minus_inf = _mm512_set1_ps(-INFINITY);
  float total[QUERY_TILE];
  for (int64_t r = 0; r < rows; ++r) {  // rows past ``rows`` give output rows nobody reads
    const int64_t visible = offset + first + r + 1;
    float* row = scores + r * width;
    __m512 top = minus_inf;
    for (int64_t k = 0; k < width; k += 16) {
      const __mmask16 seen = visible - k >= 16 ? 0xFFFF : visible > k ? static_cast<__mmask16>((1u << (visible - k)) - 1) : 0;
      const __m512 v = _mm512_mask_mov_ps(minus_inf, seen, _mm512_mul_ps(_mm512_load_ps(row + k), scale));
      _mm512_store_ps(row + k, v);
      top = _mm512_max_ps(top, v);
    }
    const __m512 shift = _mm512_set1_ps(visible > 0 ? _mm512_reduce_max_ps(top) : 0.0f);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t k = 0; k < width; k += 32) {
      const __mmask16 low = visible - k >= 16 ? 0xFFFF : visible > k ? static_cast<__mmask16>((1u << (visible - k)) - 1) : 0;
      const __mmask16 high = visible - k >= 32 ? 0xFFFF : visible > k + 16 ? static_cast<__mmask16>((1u << (visible - k - 16)) - 1) : 0;
      const __m512 p0 = _mm512_maskz_mov_ps(low, exp2_16(_mm512_sub_ps(_mm512_load_ps(row + k), shift)));
      const __m512 p1 = _mm512_maskz_mov_ps(high, exp2_16(_mm512_sub_ps(_mm512_load_ps(row + k + 16), shift)));
      sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
      _mm512_store_si512(weights + r * width + k, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0)));
    }
    total[r] = _mm512_reduce_add_ps(sum);
  }
  alignas(64) float sums[QUERY_TILE * 64];
  for (int64_t c0 = 0; c0 < value_chunks; c0 += 4) {
    const int64_t chunks = value_chunks - c0 < 4 ? value_chunks - c0 : 4;
#if defined(KVROUTE_AMX)
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t block = 0; block < blocks; ++block) {
      const uint16_t* tile = values + (block * value_chunks + c0) * 512;
      if (block % 2 == 0) {
        KVROUTE_VALUE_BLOCK(4, 5, weights + block * KEY_BLOCK, width * 2, tile, chunks);
      } else {
        KVROUTE_VALUE_BLOCK(7, 6, weights + block * KEY_BLOCK, width * 2, tile, chunks);
      }
    }
    _tile_stored(0, sums, 256);
    _tile_stored(1, sums + 16, 256);
    _tile_stored(2, sums + 32, 256);
    _tile_stored(3, sums + 48, 256);
#else
    if (chunks == 4) {  // head sizes of 64 and 128 (and 96's first 64 dims); else 32 dims left
      value_tile<4>(weights, width, values + c0 * 512, value_chunks, blocks, rows, sums);
    } else {
      value_tile<2>(weights, width, values + c0 * 512, value_chunks, blocks, rows, sums);
    }
#endif
    for (int64_t r = 0; r < rows; ++r) {
      const float inv = 1.0f / total[r];
      uint16_t* dst = out + (first + r) * out_stride + 16 * c0;
      for (int64_t c = 0; c < chunks; ++c) {
        const __m512 v = _mm512_mul_ps(_mm512_load_ps(sums + r * 64 + 16 * c), _mm512_set1_ps(inv));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * c), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
      }
    }
  }
}

// The calling thread's scratch buffer ``slot``, 64-byte aligned, at least ``bytes`` long: kept
// from call to call (fresh megabytes every layer cost more in page faults than the packing).
uint8_t* scratch(int slot, int64_t bytes) {
  thread_local std::unique_ptr<uint8_t[]> buffers[4];
  thread_local int64_t sizes[4] = {};
  if (sizes[slot] < bytes + 64) {
    sizes[slot] = bytes + 64 + bytes / 2;
    buffers[slot].reset(new uint8_t[sizes[slot]]);
  }
  const uintptr_t at = reinterpret_cast<uintptr_t>(buffers[slot].get());
  return buffers[slot].get() + ((64 - at % 64) % 64);
}

// q [tokens, heads, dim] (tokens q_stride apart), out [tokens, heads, dim]; chunk c's queries are
// tokens starts[c] .. + length, its context pages page_table[c] (width each).
void extend_attention(const uint16_t* q, const uint16_t* kv, const int64_t* page_table, const int64_t* starts,
                      uint16_t* out, const ExtendShape& s, int threads) {
  const int64_t group = s.heads / s.kv_heads, tiles = (s.length + QUERY_TILE - 1) / QUERY_TILE;
  const int64_t blocks = (s.context + KEY_BLOCK - 1) / KEY_BLOCK, packed = blocks * KEY_BLOCK * s.dim;
  uint32_t* keys = reinterpret_cast<uint32_t*>(scratch(0, s.count * s.kv_heads * packed * 2));
  uint16_t* values = reinterpret_cast<uint16_t*>(scratch(1, s.count * s.kv_heads * packed * 2));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(static)
    for (int64_t item = 0; item < s.count * s.kv_heads * blocks; ++item) {
      const int64_t task = item / blocks;
      pack_block(kv, page_table + (task / s.kv_heads) * s.width, task % s.kv_heads, item % blocks, s,
                 keys + task * packed / 2, values + task * packed);
    }
#if defined(KVROUTE_AMX)
    TileConfig config;
    for (int t = 0; t < 8; ++t) {
      config.rows[t] = 16;
      config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
#endif
    // 64-byte aligned (AVX-512 aligned loads); sizes are multiples of 64 bytes.
    float* scores = reinterpret_cast<float*>(scratch(2, QUERY_TILE * blocks * KEY_BLOCK * 4));
    uint16_t* weights = reinterpret_cast<uint16_t*>(scratch(3, QUERY_TILE * blocks * KEY_BLOCK * 2));
    alignas(64) uint16_t query[QUERY_TILE * 128] = {};
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < s.count * s.heads * tiles; ++task) {
      const int64_t c = task / (s.heads * tiles), head = task / tiles % s.heads, first = task % tiles * QUERY_TILE;
      const int64_t context_task = c * s.kv_heads + head / group;
      const int64_t rows = s.length - first < QUERY_TILE ? s.length - first : QUERY_TILE;
      const uint16_t* q_rows = q + (starts[c] + first) * s.q_stride + head * s.dim;
      for (int64_t r = 0; r < QUERY_TILE; ++r) {
        for (int64_t i = 0; i < s.dim; ++i) query[r * s.dim + i] = r < rows ? q_rows[r * s.q_stride + i] : 0;
      }
      extend_rows(query, rows, first, keys + context_task * packed / 2, values + context_task * packed, s, scores,
                  weights, out + (starts[c] * s.heads + head) * s.dim, s.heads * s.dim);
    }
#if defined(KVROUTE_AMX)
    _tile_release();
#endif
  }
}
#endif

}  // namespace

// The C entry points: ``_f32`` for float32 tensors, ``_bf16`` for bfloat16 ones.
extern "C" {

#define KVROUTE_EXPORT(suffix, D)                                                                  \
  void rms_norm_##suffix(const void* x, const void* weight, void* out, int64_t rows, int64_t width, \
                         float eps, int threads) {                                                 \
    rms_norm<D>(static_cast<const D::T*>(x), static_cast<const D::T*>(weight),                     \
                static_cast<D::T*>(out), rows, width, eps, threads);                               \
  }                                                                                                \
  void add_rms_norm_##suffix(void* residual, const void* delta, const void* weight, void* out,      \
                             int64_t rows, int64_t width, float eps, int threads) {                \
    add_rms_norm<D>(static_cast<D::T*>(residual), static_cast<const D::T*>(delta),                 \
                    static_cast<const D::T*>(weight), static_cast<D::T*>(out), rows, width, eps,   \
                    threads);                                                                      \
  }                                                                                                \
  void silu_and_mul_##suffix(const void* gate_up, void* out, int64_t rows, int64_t width,          \
                             int threads) {                                                        \
    silu_and_mul<D>(static_cast<const D::T*>(gate_up), static_cast<D::T*>(out), rows, width,       \
                    threads);                                                                      \
  }                                                                                                \
  void rotary_##suffix(void* x, const void* cos, const void* signed_sin, int64_t tokens,           \
                       int64_t heads, int64_t dim, int64_t token_stride, int threads) {            \
    rotary<D>(static_cast<D::T*>(x), static_cast<const D::T*>(cos),                                \
              static_cast<const D::T*>(signed_sin), tokens, heads, dim, token_stride, threads);    \
  }                                                                                                \
  void decode_attention_##suffix(const void* q, const void* kv, const int64_t* page_table,         \
                                 const int64_t* lengths, void* out, int64_t decodes, int64_t heads, \
                                 int64_t kv_heads, int64_t dim, int64_t pages, int64_t page_size,  \
                                 int64_t width, int64_t q_stride, float scale, int threads) {      \
    const DecodeShape shape{heads, kv_heads, dim, pages, page_size, width, q_stride, scale};       \
    decode_attention<D>(static_cast<const D::T*>(q), static_cast<const D::T*>(kv), page_table,     \
                        lengths, static_cast<D::T*>(out), decodes, shape, threads);                \
  }

KVROUTE_EXPORT(f32, Fp32)
KVROUTE_EXPORT(bf16, Bf16)

// Whether extend_attention_bf16 runs for this head size: built with AMX (tiles permitted) or
// AVX512-BF16.
int extend_attention_supported(int64_t dim) {
#if defined(KVROUTE_AMX)
  return dim % 32 == 0 && dim <= 128 && amx_permitted();
#elif defined(KVROUTE_EXTEND)
  return dim % 32 == 0 && dim <= 128;
#else
  (void)dim;
  return 0;
#endif
}

// Prefill attention on AMX tiles or AVX512-BF16 (bf16, head sizes a multiple of 32 up to 128), its arguments
// as decode_attention's (``starts`` where that has ``lengths``), then each chunk's length and
// context: returns 0 where extend_attention_supported does not hold, having written nothing.
int extend_attention_bf16(const void* q, const void* kv, const int64_t* page_table, const int64_t* starts, void* out,
                          int64_t count, int64_t heads, int64_t kv_heads, int64_t dim, int64_t pages,
                          int64_t page_size, int64_t width, int64_t q_stride, float scale, int threads,
                          int64_t length, int64_t context) {
  if (!extend_attention_supported(dim)) return 0;
#if defined(KVROUTE_EXTEND)
  const ExtendShape shape{{heads, kv_heads, dim, pages, page_size, width, q_stride, scale}, count, length, context};
  extend_attention(static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(kv), page_table, starts,
                   static_cast<uint16_t*>(out), shape, threads);
  return 1;
#else
  (void)q, (void)kv, (void)page_table, (void)starts, (void)out, (void)count, (void)heads, (void)kv_heads;
  (void)pages, (void)page_size, (void)width, (void)q_stride, (void)scale, (void)threads, (void)length;
  (void)context;
  return 0;
#endif
}

}  // extern "C"
