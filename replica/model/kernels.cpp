// Fused CPU kernels for the decoder's elementwise work (residual add with RMSNorm, the gated
// activation SiLU(gate) * up, rotary embedding) and for decode attention over the paged KV pool.
// Eager PyTorch spends 3-12 ops on each of these, one pass over memory and one dispatch apiece;
// here each is one pass.
//
// Every kernel rounds where the eager ops round (to the model's dtype after each op, fp32 inside
// RMSNorm), so a bf16 result carries the same roundings as transformers' eager code. Rows are
// independent: a row's bits never depend on how many rows share the call.
//
// Compiled for the host CPU by replica/model/native.py (-O3 -march=native -ffp-contract=off: the
// loops vectorise, and no multiply-add is fused into an FMA the eager ops would not use).
// Tensors arrive as raw pointers, checked on the Python side.

#include <cmath>
#include <cstdint>

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

// out = weight * (x * rsqrt(mean(x^2) + eps)) for one row, as transformers' RMSNorm rounds it:
// the normalised row in fp32, rounded to the dtype, then scaled by the weight.
template <class D>
inline void norm_row(const typename D::T* x, const typename D::T* weight, typename D::T* out,
                     int64_t width, float eps) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < width; ++i) {
    float v = D::load(x[i]);
    sum += v * v;
  }
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(width) + eps);
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
// to the dtype after the scale, softmax in fp32, its weights to the dtype, the weighted sum
// accumulated in fp32. The query heads sharing a KV head are done together: each key and value
// row is read once for them all.
template <class D>
void decode_attention(const typename D::T* q, const typename D::T* kv, const int64_t* page_table,
                      const int64_t* lengths, typename D::T* out, int64_t decodes, int64_t heads,
                      int64_t kv_heads, int64_t dim, int64_t pages, int64_t page_size, int64_t width,
                      int64_t q_stride, float scale, int threads) {
  const int64_t group = heads / kv_heads;
  const int64_t head_stride = pages * page_size * dim;
  const typename D::T* values = kv + kv_heads * head_stride;
  int64_t longest = 0;
  for (int64_t d = 0; d < decodes; ++d) longest = lengths[d] > longest ? lengths[d] : longest;
#pragma omp parallel num_threads(threads) if (threads > 1 && decodes * kv_heads > 1)
  {
    float* scores = new float[group * longest];
    float* query = new float[group * dim];
    float* acc = new float[group * dim];
#pragma omp for schedule(static)
    for (int64_t task = 0; task < decodes * kv_heads; ++task) {
      const int64_t d = task / kv_heads, h = task % kv_heads, length = lengths[d];
      const int64_t* table = page_table + d * width;
      for (int64_t g = 0; g < group; ++g) {
        const typename D::T* src = q + d * q_stride + (h * group + g) * dim;
        for (int64_t i = 0; i < dim; ++i) query[g * dim + i] = D::load(src[i]);
      }
      for (int64_t j = 0; j < length; ++j) {
        const typename D::T* key = kv + h * head_stride + (table[j / page_size] * page_size + j % page_size) * dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = query + g * dim;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < dim; ++i) dot += qg[i] * D::load(key[i]);
          scores[g * length + j] = D::round(dot * scale);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* row = scores + g * length;
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
      for (int64_t i = 0; i < group * dim; ++i) acc[i] = 0.0f;
      for (int64_t j = 0; j < length; ++j) {
        const typename D::T* value = values + h * head_stride + (table[j / page_size] * page_size + j % page_size) * dim;
        for (int64_t g = 0; g < group; ++g) {
          const float weight = scores[g * length + j];
          float* a = acc + g * dim;
#pragma omp simd
          for (int64_t i = 0; i < dim; ++i) a[i] += weight * D::load(value[i]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        typename D::T* dst = out + (d * heads + h * group + g) * dim;
        for (int64_t i = 0; i < dim; ++i) dst[i] = D::store(acc[g * dim + i]);
      }
    }
    delete[] scores;
    delete[] query;
    delete[] acc;
  }
}

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
    decode_attention<D>(static_cast<const D::T*>(q), static_cast<const D::T*>(kv), page_table,     \
                        lengths, static_cast<D::T*>(out), decodes, heads, kv_heads, dim, pages,    \
                        page_size, width, q_stride, scale, threads);                               \
  }

KVROUTE_EXPORT(f32, Fp32)
KVROUTE_EXPORT(bf16, Bf16)

}  // extern "C"
