// qiao CPU kernels: paged attention over the block table (no padded copies of the context),
// and fused one-pass RMSNorm, residual-add + RMSNorm and rotary embedding.
// Each has a plain-PyTorch reference in qiao (the test oracle and the fallback).
// Compute is float32 whatever the storage dtype (float32, bfloat16, float16).
// Plus the weight-only int8 matmul for few rows (decode), reading each int8 weight once, the
// float32 matmul over a weight packed in 32-feature column blocks (AVX-512), the fused SiLU gate
// (silu(gate) * up) and the greedy sampler's row argmax.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define QIAO_AVX512 1
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

// exp(x) for x <= 0 (softmax weights), written as plain arithmetic so loops over it vectorize.
// 2^(x log2 e) = 2^n * 2^f, n = round(.), f in [-0.5, 0.5]; 2^f by a degree-6 polynomial
// (relative error < 2e-7). x below -87 gives 0.
inline float exp_nonpositive(float x) {
  const float t = std::max(x, -87.f) * 1.4426950408889634f;
  // round(t) by adding and subtracting 1.5 * 2^23 (exact for |t| < 2^22): plain arithmetic that
  // vectorises, where std::nearbyint is a library call per element.
  const float n = (t + 12582912.f) - 12582912.f;
  const float f = t - n;
  float p = 1.5353362e-4f;
  p = p * f + 1.3398874e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022651e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.0f;
  int32_t bits;
  const float scale_bits = static_cast<float>(static_cast<int32_t>(n) + 127) * 8388608.f;
  bits = static_cast<int32_t>(scale_bits);
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return x < -87.f ? 0.f : p * two_n;
}

template <typename T>
inline T from_f(float v) { return static_cast<T>(v); }

constexpr int64_t kQueryTile = 16;  // query tokens of one sequence that share each K/V block

// (sequence, first query index of a tile of up to kQueryTile query tokens), over every sequence.
// E.g. query lens [1, 20] -> [(0,0), (1,0), (1,16)]
inline std::vector<std::pair<int32_t, int32_t>> query_tiles(const int32_t* qsl, int64_t num_seqs) {
  std::vector<std::pair<int32_t, int32_t>> tiles;
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int32_t j = 0; j < qsl[s + 1] - qsl[s]; j += kQueryTile) tiles.emplace_back(s, j);
  return tiles;
}

// One tile's query tokens [j0, j1) of sequence s and the context positions they see.
struct TileSpan {
  int64_t j0, j1;
  int64_t first_pos;  // position of the sequence's first new token
  int64_t last_pos;   // position of the tile's last token
  int64_t lowest;     // first position any of the tile's tokens sees (sliding window)
};

inline TileSpan tile_span(int64_t s, int64_t j0, const int32_t* qsl, const int32_t* sl, int64_t window) {
  const int64_t q_len = qsl[s + 1] - qsl[s];
  const int64_t j1 = std::min<int64_t>(j0 + kQueryTile, q_len);
  const int64_t first_pos = sl[s] - q_len;
  const int64_t lowest = window > 0 ? std::max<int64_t>(0, first_pos + j0 - window + 1) : 0;
  return {j0, j1, first_pos, first_pos + j1 - 1, lowest};
}

// qf row (j - j0) * heads + h = scale * q[token qsl[s] + j, head h0 + h], as float32.
template <typename T>
void load_queries(float* qf, const T* q_ptr, const int32_t* qsl, int64_t s, const TileSpan& t,
                  int64_t num_heads, int64_t h0, int64_t heads, int64_t head_dim, float scale) {
  for (int64_t j = t.j0; j < t.j1; ++j)
    for (int64_t h = 0; h < heads; ++h) {
      const T* src = q_ptr + ((qsl[s] + j) * num_heads + h0 + h) * head_dim;
      float* dst = qf + ((j - t.j0) * heads + h) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = to_f(src[d]) * scale;
    }
}

// out[token, head] = acc row / l row, for the rows load_queries laid out.
template <typename T>
void write_outputs(T* out_ptr, const float* acc, const float* l, const int32_t* qsl, int64_t s,
                   const TileSpan& t, int64_t num_heads, int64_t h0, int64_t heads, int64_t head_dim) {
  for (int64_t j = t.j0; j < t.j1; ++j)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t r = (j - t.j0) * heads + h;
      T* o = out_ptr + ((qsl[s] + j) * num_heads + h0 + h) * head_dim;
      const float inv = 1.f / l[r];
      for (int64_t d = 0; d < head_dim; ++d) o[d] = from_f<T>(acc[r * head_dim + d] * inv);
    }
}

// out[t, h, :] = softmax(q[t, h] . K[ctx]) V[ctx] for every new token t over its sequence's
// context, read block by block from the paged cache (no padded copy of the context).
//
// Work item = (sequence, kv head, tile of up to kQueryTile query tokens). Each K/V block of the
// context is loaded once per item and serves the whole tile and every query head of the kv
// head's group; scores are vectorised dot products over head_dim. (A variant that transposed each
// K block to vectorise over positions instead measured 2x slower here.)
// Softmax is online: running max m, sum l and output acc per (token, head), rescaled per block.
constexpr int64_t kMaxBlockSize = 128;

// block_size_c / head_dim_c > 0 fix the block and head size at compile time (the default block
// size 16 with head sizes 64 and 128 are instantiated), so the inner loops unroll and vectorise
// fully; 0 reads the size at run time (any other configuration, somewhat slower).
template <typename T, int64_t block_size_c, int64_t head_dim_c>
void paged_attention_impl(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& kv_cache,
                          const torch::Tensor& block_tables, const torch::Tensor& query_start_loc,
                          const torch::Tensor& seq_lens, double scale, int64_t window, double softcap) {
  const int64_t num_heads = q.size(1);
  const int64_t head_dim = head_dim_c > 0 ? head_dim_c : q.size(2);
  const int64_t block_size = block_size_c > 0 ? block_size_c : kv_cache.size(2);
  TORCH_CHECK(block_size <= kMaxBlockSize, "paged_attention: block size above ", kMaxBlockSize);
  const int64_t num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t max_blocks = block_tables.size(1);
  const int64_t row_stride = num_kv_heads * head_dim;              // between positions
  const int64_t block_stride = block_size * row_stride;            // between blocks
  const int64_t kv_plane = kv_cache.size(1) * block_stride;        // K plane -> V plane

  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = kv_cache.data_ptr<T>();
  const T* v_ptr = k_ptr + kv_plane;
  T* out_ptr = out.data_ptr<T>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();

  const auto tiles = query_tiles(qsl, num_seqs);

  const float fscale = static_cast<float>(scale);
  const float fsoftcap = static_cast<float>(softcap);  // > 0: scores become cap * tanh(s / cap)
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, static_cast<int64_t>(tiles.size()) * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    const int64_t width = kQueryTile * group;  // (token, head) rows of a tile
    std::vector<float> qf(width * head_dim), acc(width * head_dim), m(width), l(width);
    std::vector<float> kf(block_size * head_dim), vf(block_size * head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = tiles[item / num_kv_heads].first;
      const int64_t g = item % num_kv_heads;
      const TileSpan span = tile_span(s, tiles[item / num_kv_heads].second, qsl, sl, window);
      const auto [j0, j1, first_pos, last_pos, lowest] = span;
      load_queries(qf.data(), q_ptr, qsl, s, span, num_heads, g * group, group, head_dim, fscale);
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), neg_inf);
      std::fill(l.begin(), l.end(), 0.f);
      const int32_t* table = bt + s * max_blocks;
      for (int64_t start = lowest - lowest % block_size; start <= last_pos; start += block_size) {
        const int64_t block = table[start / block_size];
        const int64_t rows = std::min(block_size, last_pos - start + 1);
        const T* kb = k_ptr + block * block_stride + g * head_dim;
        const T* vb = v_ptr + block * block_stride + g * head_dim;
        // K rows as float32 (a copy only for 16-bit storage), read row-wise below.
        const float* krows = kf.data();
        if constexpr (std::is_same_v<T, float>) {
          krows = nullptr;
        } else {
          for (int64_t i = 0; i < rows; ++i)
            for (int64_t d = 0; d < head_dim; ++d) kf[i * head_dim + d] = to_f(kb[i * row_stride + d]);
        }
        const float* vrows = vf.data();
        if constexpr (std::is_same_v<T, float>) {
          vrows = nullptr;  // read V in place
        } else {
          for (int64_t i = 0; i < rows; ++i)
            for (int64_t d = 0; d < head_dim; ++d) vf[i * head_dim + d] = to_f(vb[i * row_stride + d]);
        }
        for (int64_t j = j0; j < j1; ++j) {
          const int64_t pos = first_pos + j;
          const int64_t lo = std::max(start, window > 0 ? pos - window + 1 : start) - start;
          const int64_t hi = std::min(start + block_size - 1, pos) - start;
          if (hi < lo) continue;
          for (int64_t h = 0; h < group; ++h) {
            const int64_t r = (j - j0) * group + h;
            const float* qv = &qf[r * head_dim];
            float sc[kMaxBlockSize];
            for (int64_t i = lo; i <= hi; ++i) {
              const float* kr = krows != nullptr ? krows + i * head_dim
                                                 : reinterpret_cast<const float*>(kb) + i * row_stride;
              float dot = 0.f;
#pragma omp simd reduction(+ : dot)
              for (int64_t d = 0; d < head_dim; ++d) dot += qv[d] * kr[d];
              sc[i] = fsoftcap > 0.f ? fsoftcap * std::tanh(dot / fsoftcap) : dot;
            }
            float bmax = m[r];
            for (int64_t i = lo; i <= hi; ++i) bmax = std::max(bmax, sc[i]);
            const float correction = m[r] == neg_inf ? 0.f : exp_nonpositive(m[r] - bmax);
            m[r] = bmax;
            float sum = l[r] * correction;
            float* a = &acc[r * head_dim];
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] *= correction;
            float probs[kMaxBlockSize];
#pragma omp simd
            for (int64_t i = lo; i <= hi; ++i) probs[i] = exp_nonpositive(sc[i] - bmax);
            for (int64_t i = lo; i <= hi; ++i) {
              const float p = probs[i];
              sum += p;
              const float* vr = vrows != nullptr ? vrows + i * head_dim
                                                 : reinterpret_cast<const float*>(vb) + i * row_stride;
#pragma omp simd
              for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vr[d];
            }
            l[r] = sum;
          }
        }
      }
      write_outputs(out_ptr, acc.data(), l.data(), qsl, s, span, num_heads, g * group, group, head_dim);
    }
  });
}

#ifdef QIAO_AVX512
// The vectorised form of the kernel above, for float32 / bfloat16 / float16 storage, head sizes that are
// a multiple of 16 and block sizes that are a multiple of 16 (the defaults). The context is
// walked 16 positions at a time, one position per lane: a query row's 16 scores come from 16
// independent dot products (accumulators over head_dim) folded into one vector by `sum16`, so
// the softmax (max, exp, sum) runs on whole vectors and P.V adds 16 V rows into accumulators
// held in registers. Lanes outside the row's visible range (causal, window, past the context)
// are masked to -inf before the softmax and their V rows are never read, so stale or NaN slots
// cannot leak in. Same math as the scalar kernel; only the float32 summation order differs.

// v[i] -> lane i of the result = sum of v[i]'s 16 lanes.
inline __m512 sum16(const __m512* v) {
  __m512 t[8], u[4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the partial sums of v[4i .. 4i+3]
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44),
                                   _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44),
                                   _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD));
}

// exp_nonpositive on 16 lanes; lanes below -87 (and -inf) give 0.
inline __m512 exp_nonpositive_ps(__m512 x) {
  const __m512 floor = _mm512_set1_ps(-87.f);
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, floor), _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5353362e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3398874e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, floor, _CMP_GE_OQ), _mm512_scalef_ps(p, n));
}

// cap * tanh(x / cap) on 16 lanes (Gemma 2's soft-capped scores): tanh(|y|) = (1 - e) / (1 + e)
// with e = exp(-2|y|) <= 1, the sign put back after.
inline __m512 softcap_ps(__m512 x, float cap) {
  const __m512 y = _mm512_div_ps(x, _mm512_set1_ps(cap));
  const __m512 abs_y = _mm512_abs_ps(y);
  const __m512 e = exp_nonpositive_ps(_mm512_mul_ps(abs_y, _mm512_set1_ps(-2.f)));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512 sign = _mm512_and_ps(y, _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(0x80000000u))));
  return _mm512_mul_ps(_mm512_or_ps(t, sign), _mm512_set1_ps(cap));
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bfloat16 is float32's top half
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {  // AVX-512F converts 16 halves in one instruction
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Q: the query / output dtype; T: the cache's (a float32 query over a bfloat16 or float16 cache
// is the `kv_cache_dtype` case: half the context bytes, float32 everywhere else).
template <typename Q, typename T, int64_t D>
void paged_attention_avx512(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& kv_cache,
                            const torch::Tensor& block_tables, const torch::Tensor& query_start_loc,
                            const torch::Tensor& seq_lens, double scale, int64_t window, double softcap) {
  constexpr int64_t C = D / 16;  // vectors per head row
  constexpr int64_t kLanes = 16;
  constexpr int64_t kPrefetchAhead = 3;
  const int64_t num_heads = q.size(1);
  const int64_t block_size = kv_cache.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t max_blocks = block_tables.size(1);
  const int64_t row_stride = num_kv_heads * D;
  const int64_t block_stride = block_size * row_stride;
  const int64_t kv_plane = kv_cache.size(1) * block_stride;

  const Q* q_ptr = q.data_ptr<Q>();
  const T* k_ptr = kv_cache.data_ptr<T>();
  const T* v_ptr = k_ptr + kv_plane;
  Q* out_ptr = out.data_ptr<Q>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();

  const auto tiles = query_tiles(qsl, num_seqs);
  // A work item is a tile with a range of kv heads. With tiles enough to keep every thread
  // busy, an item takes all kv heads, so it reads each 16-position K/V group as one contiguous
  // run (positions are rows of all kv heads) that the hardware prefetcher streams; with few
  // tiles (small batches) each kv head is its own item, to share the work out.
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  const int64_t heads_per_item = num_tiles >= 4 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t splits = num_kv_heads / heads_per_item;
  const int64_t row_floats = heads_per_item * D;  // floats of one position an item reads

  const float fscale = static_cast<float>(scale);
  const float fsoftcap = static_cast<float>(softcap);  // > 0: scores become cap * tanh(s / cap)
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, num_tiles * splits, 1, [&](int64_t begin, int64_t end) {
    const int64_t width = kQueryTile * heads_per_item * group;  // (token, head) rows of an item
    std::vector<float> qf(width * D), acc(width * D), m(width), l(width);
    // 16 positions of K and V as float32 (filled for 16-bit storage; float32 is read in place).
    std::vector<float> kf(std::is_same_v<T, float> ? 0 : kLanes * row_floats);
    std::vector<float> vf(kf.size());
    volatile float sink = 0.f;  // keeps the touching loads
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = tiles[item / splits].first;
      const int64_t g0 = (item % splits) * heads_per_item;  // first kv head of the item
      const int64_t heads = heads_per_item * group;           // query heads of the item
      const TileSpan span = tile_span(s, tiles[item / splits].second, qsl, sl, window);
      const auto [j0, j1, first_pos, last_pos, lowest] = span;
      // Row r = (token j - j0) * heads + head offset within the item.
      load_queries(qf.data(), q_ptr, qsl, s, span, num_heads, g0 * group, heads, D, fscale);
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), neg_inf);
      std::fill(l.begin(), l.end(), 0.f);
      const int32_t* table = bt + s * max_blocks;
      for (int64_t start = lowest - lowest % kLanes; start <= last_pos; start += kLanes) {
        const int64_t rows = std::min<int64_t>(kLanes, last_pos - start + 1);
        const int64_t first_row =
            table[start / block_size] * block_stride + (start % block_size) * row_stride + g0 * D;
        // The block table scatters the context, so the hardware prefetcher cannot see the next
        // group of positions coming: ask for it kPrefetchAhead groups early.
        if (const int64_t ahead = start + kPrefetchAhead * kLanes; ahead <= last_pos) {
          const int64_t next =
              table[ahead / block_size] * block_stride + (ahead % block_size) * row_stride + g0 * D;
          const int64_t next_rows = std::min<int64_t>(kLanes, last_pos - ahead + 1);
          for (int64_t i = 0; i < next_rows; ++i) {
            const char* kr = reinterpret_cast<const char*>(k_ptr + next + i * row_stride);
            const char* vr = reinterpret_cast<const char*>(v_ptr + next + i * row_stride);
            for (int64_t b = 0; b < row_floats * static_cast<int64_t>(sizeof(T)); b += 64) {
              _mm_prefetch(kr + b, _MM_HINT_T1);
              _mm_prefetch(vr + b, _MM_HINT_T1);
            }
          }
        }
        const float* krows;
        const float* vrows;
        int64_t kv_stride;
        if constexpr (std::is_same_v<T, float>) {
          // Load every line of the group once, in address order, before the dot products read
          // them head by head: one sequential pass that keeps many misses in flight (measured
          // 1.5x faster than letting the compute order fetch them).
          __m512 touch = _mm512_setzero_ps();
          for (int64_t i = 0; i < rows; ++i)
            for (int64_t c = 0; c < row_floats; c += 16)
              touch = _mm512_or_ps(touch, _mm512_or_ps(_mm512_loadu_ps(k_ptr + first_row + i * row_stride + c),
                                                       _mm512_loadu_ps(v_ptr + first_row + i * row_stride + c)));
          sink = _mm512_reduce_max_ps(touch);
          krows = k_ptr + first_row;
          vrows = v_ptr + first_row;
          kv_stride = row_stride;
        } else {
          for (int64_t i = 0; i < rows; ++i)
            for (int64_t c = 0; c < row_floats; c += 16) {
              _mm512_storeu_ps(&kf[i * row_floats + c], load16(k_ptr + first_row + i * row_stride + c));
              _mm512_storeu_ps(&vf[i * row_floats + c], load16(v_ptr + first_row + i * row_stride + c));
            }
          for (int64_t i = rows; i < kLanes; ++i)  // past the context: masked below, never NaN
            std::fill(kf.begin() + i * row_floats, kf.begin() + (i + 1) * row_floats, 0.f);
          krows = kf.data();
          vrows = vf.data();
          kv_stride = row_floats;
        }
        for (int64_t j = j0; j < j1; ++j) {
          const int64_t pos = first_pos + j;
          const int64_t lo = std::max<int64_t>(start, window > 0 ? pos - window + 1 : start) - start;
          const int64_t hi = std::min<int64_t>(kLanes - 1, pos - start);
          if (hi < lo) continue;
          const __mmask16 visible = static_cast<__mmask16>(((1u << (hi + 1)) - 1) & ~((1u << lo) - 1));
          for (int64_t h = 0; h < heads; ++h) {
            const int64_t r = (j - j0) * heads + h;
            const int64_t col = (h / group) * D;  // this head's kv head within a position's row
            __m512 qv[C];
#pragma GCC unroll 8
            for (int64_t c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(&qf[r * D + c * 16]);
            __m512 dots[kLanes];
#pragma GCC unroll 16
            for (int64_t i = 0; i < kLanes; ++i) {
              const float* kr = krows + i * kv_stride + col;
              __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
#pragma GCC unroll 8
              for (int64_t c = 1; c < C; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + c * 16), a);
              dots[i] = a;
            }
            __m512 raw = sum16(dots);
            if (fsoftcap > 0.f) raw = softcap_ps(raw, fsoftcap);
            const __m512 scores = _mm512_mask_mov_ps(_mm512_set1_ps(neg_inf), visible, raw);
            const float bmax = std::max(m[r], _mm512_reduce_max_ps(scores));
            const float correction = m[r] == neg_inf ? 0.f : exp_nonpositive(m[r] - bmax);
            m[r] = bmax;
            const __m512 probs = exp_nonpositive_ps(_mm512_sub_ps(scores, _mm512_set1_ps(bmax)));
            l[r] = l[r] * correction + _mm512_reduce_add_ps(probs);
            alignas(64) float p[kLanes];
            _mm512_store_ps(p, probs);
            __m512 a[C];
            const __m512 corr = _mm512_set1_ps(correction);
#pragma GCC unroll 8
            for (int64_t c = 0; c < C; ++c) a[c] = _mm512_mul_ps(_mm512_loadu_ps(&acc[r * D + c * 16]), corr);
            for (int64_t i = lo; i <= hi; ++i) {
              const __m512 pi = _mm512_set1_ps(p[i]);
              const float* vr = vrows + i * kv_stride + col;
#pragma GCC unroll 8
              for (int64_t c = 0; c < C; ++c) a[c] = _mm512_fmadd_ps(pi, _mm512_loadu_ps(vr + c * 16), a[c]);
            }
#pragma GCC unroll 8
            for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(&acc[r * D + c * 16], a[c]);
          }
        }
      }
      write_outputs(out_ptr, acc.data(), l.data(), qsl, s, span, num_heads, g0 * group, heads, D);
    }
  });
}
#endif

template <typename T>
void rms_norm_row(T* out, const T* x, const T* w, int64_t n, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) { const float v = to_f(x[i]); ss += v * v; }
  const float r = 1.f / std::sqrt(ss / n + eps);
  // As Hugging Face: normalise in float32, cast to the storage dtype, then multiply by w.
  for (int64_t i = 0; i < n; ++i) out[i] = from_f<T>(to_f(w[i]) * to_f(from_f<T>(to_f(x[i]) * r)));
}


// Weight-only int8: out[m, n] = scale[n] * bf16(sum_k x[m, k] * w[n, k]) (+ bias[n]), w int8
// [N, K]. The sum is rounded to bfloat16 as a bfloat16 matmul rounds its output, so few rows
// (this kernel) and many rows (bfloat16 matmul on the exact bfloat16 copy of w) agree.
// Bandwidth-bound for few rows, so each weight is loaded once and used for every row of x:
// a tile of kRowsW weight rows x MB rows of x keeps kRowsW * MB accumulators in registers.
constexpr int64_t kRowsW = 4;

inline float round_bf16(float v) { return static_cast<float>(c10::BFloat16(v)); }

#ifdef QIAO_AVX512
template <int MB, int NW>
void int8_tile(float* out, int64_t ldo, const float* x, int64_t K, const int8_t* w) {
  __m512 acc[NW][MB];
#pragma GCC unroll 4
  for (int j = 0; j < NW; ++j)
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) acc[j][m] = _mm512_setzero_ps();
  const __mmask16 tail = static_cast<__mmask16>((1u << (K & 15)) - 1);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = k + 16 <= K ? static_cast<__mmask16>(0xFFFF) : tail;
    __m512 xv[MB];
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) xv[m] = _mm512_maskz_loadu_ps(mask, x + m * K + k);
#pragma GCC unroll 4
    for (int j = 0; j < NW; ++j) {
      // The next tile's rows: four interleaved short streams defeat the hardware prefetcher.
      if ((k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + (NW + j) * K + k), _MM_HINT_T0);
      const __m128i wb = _mm_maskz_loadu_epi8(mask, w + j * K + k);
      const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(wb));
#pragma GCC unroll 4
      for (int m = 0; m < MB; ++m) acc[j][m] = _mm512_fmadd_ps(wv, xv[m], acc[j][m]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < NW; ++j)
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) out[m * ldo + j] = round_bf16(_mm512_reduce_add_ps(acc[j][m]));
}
#endif

template <int MB>
void int8_tile_scalar(float* out, int64_t ldo, const float* x, int64_t K, const int8_t* w,
                      int64_t nw) {
  for (int64_t j = 0; j < nw; ++j)
    for (int m = 0; m < MB; ++m) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += x[m * K + k] * static_cast<float>(w[j * K + k]);
      out[m * ldo + j] = round_bf16(acc);
    }
}

template <int MB>
void int8_rows(float* out, const float* x, const int8_t* w, int64_t N, int64_t K, int64_t n0,
               int64_t n1) {
  for (int64_t n = n0; n < n1; n += kRowsW) {
    const int64_t nw = std::min(kRowsW, n1 - n);
#ifdef QIAO_AVX512
    if (nw == kRowsW) {  // full tiles vectorised; the last partial one below
      int8_tile<MB, kRowsW>(out + n, N, x, K, w + n * K);
      continue;
    }
#endif
    int8_tile_scalar<MB>(out + n, N, x, K, w + n * K, nw);
  }
}


// float32 linear, out = x w^T (+ bias), over a weight packed once as [N/32, K, 32]: block b holds
// output features 32b..32b+31, feature-minor, so one k step of a block is two contiguous vectors
// (zero padding past N). A tile of up to kTileRows rows of x keeps 2 x rows accumulators in
// registers; each weight vector is loaded once per tile and used for every row (a broadcast FMA
// per row). Blocks are split across threads; rows go in panels of kPanelRows so a panel of x
// stays in cache while every block of its thread streams past it. At decode's few rows this
// reads the weight at close to memory bandwidth (oneDNN's prepacked float32 reached half of it
// on the 135M shapes); at a step's full token budget it computes at oneDNN's rate or better.
constexpr int64_t kPackCols = 32;
constexpr int64_t kTileRows = 8;
constexpr int64_t kPanelRows = 128;

#ifdef QIAO_AVX512
template <int MR>
inline void f32_tile(const float* x, int64_t K, const float* wb, float* out, int64_t N,
                     __mmask16 m0, __mmask16 m1, const float* bias) {
  __m512 a0[MR], a1[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    a0[r] = _mm512_setzero_ps();
    a1[r] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w0 = _mm512_loadu_ps(wb + k * kPackCols);
    const __m512 w1 = _mm512_loadu_ps(wb + k * kPackCols + 16);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * K + k]);
      a0[r] = _mm512_fmadd_ps(xb, w0, a0[r]);
      a1[r] = _mm512_fmadd_ps(xb, w1, a1[r]);
    }
  }
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    _mm512_mask_storeu_ps(out + r * N, m0, _mm512_add_ps(a0[r], b0));
    _mm512_mask_storeu_ps(out + r * N + 16, m1, _mm512_add_ps(a1[r], b1));
  }
}

// Rows [0, rows) of x against one packed block: full tiles, then one tile of the rest.
inline void f32_block_rows(const float* x, int64_t rows, int64_t K, const float* wb, float* out,
                           int64_t N, __mmask16 m0, __mmask16 m1, const float* bias) {
  for (; rows > 0; rows -= kTileRows, x += kTileRows * K, out += kTileRows * N) {
    switch (std::min(rows, kTileRows)) {
      case 1: f32_tile<1>(x, K, wb, out, N, m0, m1, bias); break;
      case 2: f32_tile<2>(x, K, wb, out, N, m0, m1, bias); break;
      case 3: f32_tile<3>(x, K, wb, out, N, m0, m1, bias); break;
      case 4: f32_tile<4>(x, K, wb, out, N, m0, m1, bias); break;
      case 5: f32_tile<5>(x, K, wb, out, N, m0, m1, bias); break;
      case 6: f32_tile<6>(x, K, wb, out, N, m0, m1, bias); break;
      case 7: f32_tile<7>(x, K, wb, out, N, m0, m1, bias); break;
      default: f32_tile<kTileRows>(x, K, wb, out, N, m0, m1, bias); break;
    }
  }
}

inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF)
                 : n <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << n) - 1);
}

// Masked loads and stores of 16 values as float32 lanes (lanes outside `m` read as 0, are not
// written). bfloat16 stores round to nearest even and keep NaN a quiet NaN, bit for bit as
// c10::BFloat16's conversion.
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m256i bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(c10::BFloat16* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, bf16_bits(v)); }
// v rounded to bfloat16 and back: what a bfloat16 tensor holds of a float32 result.
inline __m512 round_bf16_ps(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(v)), 16));
}

// silu(g) * u over one row [g (d) | u (d)], in float32 lanes. silu(g) = g * sigmoid(g), and
// sigmoid from e = exp(-|g|) <= 1 (no overflow): 1 / (1 + e) for g >= 0, e / (1 + e) below.
// In bfloat16 silu(g) is rounded to bfloat16 before the product, as `F.silu(g) * u` rounds.
template <typename T>
void silu_and_mul_row_avx512(T* out, const T* x, int64_t d) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < d; i += 16) {
    const __mmask16 m = lanes(d - i);
    const __m512 g = load16(x + i, m), u = load16(x + d + i, m);
    const __m512 e = exp_nonpositive_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    const __m512 num = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ), one);
    __m512 silu = _mm512_mul_ps(g, _mm512_div_ps(num, _mm512_add_ps(one, e)));
    if constexpr (std::is_same_v<T, c10::BFloat16>) silu = round_bf16_ps(silu);
    store16(out + i, _mm512_mul_ps(silu, u), m);
  }
}

// The index of the first largest value of a row (a NaN counts as largest, as torch.argmax).
// Lane j keeps the largest value it saw and where (strictly greater replaces, so each lane
// keeps its first); the row's answer is the smallest index among the lanes holding the max.
template <typename T>
int64_t argmax_row_avx512(const T* x, int64_t n) {
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i where = _mm512_setzero_si512(), index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    const __m512 v = load16(x + i, m);
    nan |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
    const __mmask16 gt = _mm512_mask_cmp_ps_mask(m, v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, gt, v);
    where = _mm512_mask_mov_epi32(where, gt, index);
    index = _mm512_add_epi32(index, step);
  }
  if (nan) {  // rare: the first NaN, by a plain scan
    for (int64_t i = 0; i < n; ++i) if (std::isnan(to_f(x[i]))) return i;
  }
  const float top = _mm512_reduce_max_ps(best);
  const __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(at_top, where);
}

// out = w * T(x * rsqrt(ss / n + eps)), ss the sum of squares of x: the normalising pass.
template <typename T>
void scale_row_avx512(T* out, const T* x, const T* w, int64_t n, float ss, float eps) {
  const __m512 r = _mm512_set1_ps(1.f / std::sqrt(ss / n + eps));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    __m512 v = _mm512_mul_ps(load16(x + i, m), r);
    if constexpr (std::is_same_v<T, c10::BFloat16>) v = round_bf16_ps(v);
    store16(out + i, _mm512_mul_ps(load16(w + i, m), v), m);
  }
}

// x * rsqrt(mean(x^2) + eps), cast to T, times w: rms_norm_row on 16 lanes (float32 / bfloat16).
template <typename T>
void rms_norm_row_avx512(T* out, const T* x, const T* w, int64_t n, float eps) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = load16(x + i, lanes(n - i));
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  scale_row_avx512(out, x, w, n, _mm512_reduce_add_ps(ss), eps);
}

// residual = T(residual + x), then x = rms_norm(residual): the sum of squares is taken over the
// rounded sums as they are stored, in the same pass that stores them.
template <typename T>
void add_rms_norm_row_avx512(T* x, T* residual, const T* w, int64_t n, float eps) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    __m512 v = _mm512_add_ps(load16(residual + i, m), load16(x + i, m));
    if constexpr (std::is_same_v<T, c10::BFloat16>) v = round_bf16_ps(v);
    store16(residual + i, v, m);
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  scale_row_avx512(x, residual, w, n, _mm512_reduce_add_ps(ss), eps);
}

// One head of rotary_ on 16 lanes: v = [x1 | x2] (half each) with cos c, sin s of length 2 * half.
template <typename T>
void rotary_head_avx512(T* v, const T* c, const T* s, int64_t half) {
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = lanes(half - i);
    const __m512 x1 = load16(v + i, m), x2 = load16(v + half + i, m);
    const __m512 c1 = load16(c + i, m), s1 = load16(s + i, m);
    const __m512 c2 = load16(c + half + i, m), s2 = load16(s + half + i, m);
    store16(v + i, _mm512_fmsub_ps(x1, c1, _mm512_mul_ps(x2, s1)), m);
    store16(v + half + i, _mm512_fmadd_ps(x2, c2, _mm512_mul_ps(x1, s2)), m);
  }
}
#endif

// One categorical draw from softmax(s) over the kept tokens of a row, s = x / t (t = 1: x as
// is), kept = s >= cutoff: the first token whose running sum of exp(s - max) reaches u * total,
// in vocabulary order (inverse-CDF sampling, as `inverse_cdf_sample` over `softmax`). Three
// passes, nothing allocated: the max, the total, then the walk, 16 tokens at a time until the
// block holding the target, resolved token by token. A row whose total is not a positive
// number (NaN logits) gives its first largest value, as argmax.
template <typename T>
int64_t sample_row_avx512(const T* x, int64_t n, float t, float cutoff, float u) {
  const __m512 tv = _mm512_set1_ps(t), cv = _mm512_set1_ps(cutoff);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  auto scaled = [&](int64_t i, __mmask16 m) {  // s, -inf outside the kept tokens and the row
    __m512 v = load16(x + i, m);
    if (t != 1.f) v = _mm512_div_ps(v, tv);
    return _mm512_mask_mov_ps(neg_inf, _mm512_mask_cmp_ps_mask(m, v, cv, _CMP_GE_OQ), v);
  };
  __m512 mx = neg_inf;
  for (int64_t i = 0; i < n; i += 16) mx = _mm512_max_ps(mx, scaled(i, lanes(n - i)));
  const float top = _mm512_reduce_max_ps(mx);
  const __m512 topv = _mm512_set1_ps(top);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16)
    sum = _mm512_add_ps(sum, exp_nonpositive_ps(_mm512_sub_ps(scaled(i, lanes(n - i)), topv)));
  const float total = _mm512_reduce_add_ps(sum);
  if (!(total > 0.f) || !std::isfinite(top)) return argmax_row_avx512(x, n);
  const float target = u * total;
  float running = 0.f;
  int64_t last_kept = -1;
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 e = exp_nonpositive_ps(_mm512_sub_ps(scaled(i, lanes(n - i)), topv));
    const float block = _mm512_reduce_add_ps(e);
    if (block > 0.f) {
      alignas(64) float w[16];
      _mm512_store_ps(w, e);
      if (running + block < target) {
        for (int j = 15; j >= 0; --j)
          if (w[j] > 0.f) { last_kept = i + j; break; }
        running += block;
        continue;
      }
      for (int64_t j = 0; j < 16 && i + j < n; ++j) {
        if (w[j] <= 0.f) continue;
        running += w[j];
        last_kept = i + j;
        if (running >= target) return i + j;
      }
    }
  }
  return last_kept;  // the block sums rounded below the total: the last token that could win
}

// float32 <-> a uint32 key in the same order (negative floats reversed below the positive ones).
inline uint32_t order_key(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
inline float from_order_key(uint32_t k) {
  const uint32_t u = (k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k;
  float v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

// The smallest and largest of a row's values at or above floor (NaN never counts); an empty
// set gives (inf, -inf).
inline std::pair<float, float> kept_range_avx512(const float* s, int64_t n, float floor) {
  const __m512 fv = _mm512_set1_ps(floor);
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 mn = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(m, s + i);
    const __mmask16 kept = _mm512_mask_cmp_ps_mask(m, v, fv, _CMP_GE_OQ);
    mx = _mm512_mask_max_ps(mx, kept, mx, v);
    mn = _mm512_mask_min_ps(mn, kept, mn, v);
  }
  return {_mm512_reduce_min_ps(mn), _mm512_reduce_max_ps(mx)};
}

// The largest float c in [bottom, top] with holds(c), for a `holds` that is true at bottom and,
// once false, stays false above: bisection over the float order (at most 32 halvings). Exact
// when `holds` only changes at a row's own values, as "the tokens >= c hold enough" does.
template <typename Holds>
inline float largest_holding(float bottom, float top, Holds holds) {
  if (holds(top)) return top;
  uint32_t lo = order_key(bottom), hi = order_key(top);  // holds(lo); not holds(hi)
  while (hi - lo > 1) {
    const uint32_t mid = lo + (hi - lo) / 2;
    if (holds(from_order_key(mid))) lo = mid; else hi = mid;
  }
  return from_order_key(lo);
}

// The top-p cutoff of one row of scaled logits s over the tokens s >= floor: the largest value
// c of the row such that the tokens s >= c hold at least p of the kept mass, i.e. the logit of
// the last token of the smallest prefix, most likely first, reaching p (ties kept together),
// as a sort would find it. The weights exp(s - max) are written once into `w`, then each
// bisection step is one pass summing w where s >= the midpoint.
inline float top_p_cutoff_row_avx512(const float* s, int64_t n, float floor, float p, float* w) {
  const auto [bottom, top] = kept_range_avx512(s, n, floor);
  if (!std::isfinite(top) || !(bottom <= top)) return floor;  // nothing finite kept: no cut
  const __m512 fv = _mm512_set1_ps(floor), topv = _mm512_set1_ps(top);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(m, s + i);
    const __mmask16 kept = _mm512_mask_cmp_ps_mask(m, v, fv, _CMP_GE_OQ);
    const __m512 e = _mm512_maskz_mov_ps(kept, exp_nonpositive_ps(_mm512_sub_ps(v, topv)));
    _mm512_storeu_ps(w + i, e);  // w has room for whole vectors
    sum = _mm512_add_ps(sum, e);
  }
  const float target = p * _mm512_reduce_add_ps(sum);
  return largest_holding(bottom, top, [&](float c) {  // the kept mass of the tokens s >= c
    const __m512 cv = _mm512_set1_ps(c);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = lanes(n - i);
      acc = _mm512_mask_add_ps(acc, _mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, s + i), cv, _CMP_GE_OQ),
                               acc, _mm512_loadu_ps(w + i));
    }
    return _mm512_reduce_add_ps(acc) >= target;
  });
}

// The k-th largest value of a row, counting repeats (torch.topk(k).values[k - 1]), 1 <= k <= n:
// the largest c with at least k values >= c, by the same bisection (counting passes). NaN never
// counts; fewer than k non-NaN values give -inf.
inline float kth_largest_row_avx512(const float* s, int64_t n, int64_t k) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const auto [bottom, top] = kept_range_avx512(s, n, neg_inf);
  auto at_least_k_from = [&](float c) {
    const __m512 cv = _mm512_set1_ps(c);
    int64_t count = 0;
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = lanes(n - i);
      count += __builtin_popcount(_mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, s + i), cv, _CMP_GE_OQ));
    }
    return count >= k;
  };
  if (!(bottom <= top) || !at_least_k_from(bottom)) return neg_inf;
  return largest_holding(bottom, top, at_least_k_from);
}

// A row's logprobs without the [V] log_softmax: lse = max + log(sum exp(x - max)), the sampled
// token's x - lse and rank (1 + how many tokens have a larger logit), and the k largest logits
// (ids ascending among equal values) as x - lse, largest first. The k best are kept sorted in
// `best` / `best_ids` (k + 1 slots); a block of 16 is looked at token by token only when one
// of its logits beats the current k-th.
template <typename T>
void logprob_row_avx512(const T* x, int64_t n, int64_t sampled, int64_t k, int64_t* ids, float* lps,
                        int64_t* rank, float* best, int64_t* best_ids) {
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 16) mx = _mm512_max_ps(mx, load16(x + i, lanes(n - i)));
  const float top = _mm512_reduce_max_ps(mx);
  const __m512 topv = _mm512_set1_ps(top);
  const float xs = to_f(x[sampled]);
  const __m512 xsv = _mm512_set1_ps(xs);
  __m512 sum = _mm512_setzero_ps();
  int64_t above = 0, held = 0;
  float kth = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    const __m512 v = load16(x + i, m);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, exp_nonpositive_ps(_mm512_sub_ps(v, topv))));
    above += __builtin_popcount(_mm512_mask_cmp_ps_mask(m, v, xsv, _CMP_GT_OQ));
    __mmask16 beats = k == 0 ? 0 : held < k ? m : _mm512_mask_cmp_ps_mask(m, v, _mm512_set1_ps(kth), _CMP_GT_OQ);
    while (beats) {
      const int j = __builtin_ctz(beats);
      beats &= beats - 1;
      const float value = to_f(x[i + j]);
      if (held == k && !(value > kth)) continue;
      int64_t pos = held < k ? held++ : k - 1;  // insert below the equal or larger ones
      while (pos > 0 && best[pos - 1] < value) {
        best[pos] = best[pos - 1];
        best_ids[pos] = best_ids[pos - 1];
        --pos;
      }
      best[pos] = value;
      best_ids[pos] = i + j;
      if (held == k) kth = best[k - 1];
    }
  }
  const float lse = top + std::log(_mm512_reduce_add_ps(sum));
  ids[0] = sampled;
  lps[0] = xs - lse;
  for (int64_t j = 0; j < k; ++j) {
    ids[1 + j] = best_ids[j];
    lps[1 + j] = best[j] - lse;
  }
  *rank = above + 1;
}

// Whether a row kernel has its AVX-512 form for storage dtype T.
template <typename T>
constexpr bool kVectorRows =
#ifdef QIAO_AVX512
    std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;
#else
    false;
#endif
}  // namespace

// Head sizes with an AVX-512 instantiation (the dispatch in paged_attention below).
constexpr int64_t kVectorHeadDims[] = {64, 128, 32, 256, 96, 80};

// Whether paged_attention takes the AVX-512 path for this cache (dtype, block and head size).
bool attention_vectorized(const torch::Tensor& kv_cache) {
#ifdef QIAO_AVX512
  const auto dtype = kv_cache.scalar_type();
  if (kv_cache.dim() != 5 || kv_cache.size(2) % 16 != 0) return false;
  if (dtype != torch::kFloat32 && dtype != torch::kBFloat16 && dtype != torch::kHalf) return false;
  return std::find(std::begin(kVectorHeadDims), std::end(kVectorHeadDims), kv_cache.size(4)) !=
         std::end(kVectorHeadDims);
#else
  return false;
#endif
}

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                              torch::Tensor query_start_loc, torch::Tensor seq_lens, double scale,
                              int64_t window, double softcap) {
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous() && block_tables.is_contiguous());
  // The AVX-512 path also takes a float32 query over a 16-bit cache; the scalar one does not.
  const auto cache_type = kv_cache.scalar_type();
  const bool mixed = q.scalar_type() == torch::kFloat32 && cache_type != torch::kFloat32 &&
                     attention_vectorized(kv_cache);
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && q.size(2) == kv_cache.size(4),
              "q [T, H, D] and the cache [2, blocks, block_size, Hkv, D] must share D");
  TORCH_CHECK(mixed || q.scalar_type() == kv_cache.scalar_type(),
              "q and the cache must share a dtype (or be float32 over a 16-bit cache with AVX-512)");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32 &&
              query_start_loc.scalar_type() == torch::kInt32);
  auto out = torch::empty_like(q);
#ifdef QIAO_AVX512
  if (attention_vectorized(kv_cache)) {
    bool done = false;
    const auto run = [&](auto head_dim_c) {
      constexpr int64_t D = decltype(head_dim_c)::value;
      if (done || q.size(2) != D) return;
      auto kernel = &paged_attention_avx512<float, float, D>;
      if (cache_type == torch::kBFloat16)
        kernel = mixed ? &paged_attention_avx512<float, c10::BFloat16, D>
                       : &paged_attention_avx512<c10::BFloat16, c10::BFloat16, D>;
      else if (cache_type == torch::kHalf)
        kernel = mixed ? &paged_attention_avx512<float, c10::Half, D> : &paged_attention_avx512<c10::Half, c10::Half, D>;
      kernel(out, q, kv_cache, block_tables, query_start_loc, seq_lens, scale, window, softcap);
      done = true;
    };
    run(std::integral_constant<int64_t, 64>{});
    run(std::integral_constant<int64_t, 128>{});
    run(std::integral_constant<int64_t, 32>{});
    run(std::integral_constant<int64_t, 256>{});
    run(std::integral_constant<int64_t, 96>{});
    run(std::integral_constant<int64_t, 80>{});
    if (done) return out;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    const auto run = [&](auto block_size_c, auto head_dim_c) {
      paged_attention_impl<scalar_t, decltype(block_size_c)::value, decltype(head_dim_c)::value>(
          out, q, kv_cache, block_tables, query_start_loc, seq_lens, scale, window, softcap);
    };
    using C0 = std::integral_constant<int64_t, 0>;
    using C16 = std::integral_constant<int64_t, 16>;
    if (kv_cache.size(2) != 16) return run(C0{}, C0{});
    if (q.size(2) == 64) return run(C16{}, std::integral_constant<int64_t, 64>{});
    if (q.size(2) == 128) return run(C16{}, std::integral_constant<int64_t, 128>{});
    run(C16{}, C0{});
  });
  return out;
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.scalar_type() == x.scalar_type());
  auto out = torch::empty_like(x);
  const int64_t n = x.size(-1), rows = x.numel() / n;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
#ifdef QIAO_AVX512
        if constexpr (kVectorRows<scalar_t>) {
          rms_norm_row_avx512(op + r * n, xp + r * n, wp, n, static_cast<float>(eps));
          continue;
        }
#endif
        rms_norm_row(op + r * n, xp + r * n, wp, n, static_cast<float>(eps));
      }
    });
  });
  return out;
}

// residual += x; x = rms_norm(residual) (both in place): the decoder layer's add + norm in one pass.
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes());
  const int64_t n = x.size(-1), rows = x.numel() / n;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
#ifdef QIAO_AVX512
        if constexpr (kVectorRows<scalar_t>) {
          add_rms_norm_row_avx512(xp + r * n, rp + r * n, wp, n, static_cast<float>(eps));
          continue;
        }
#endif
        for (int64_t i = 0; i < n; ++i) rp[r * n + i] = from_f<scalar_t>(to_f(rp[r * n + i]) + to_f(xp[r * n + i]));
        rms_norm_row(xp + r * n, rp + r * n, wp, n, static_cast<float>(eps));
      }
    });
  });
}

// In place, rotate_half layout: x = [x1 | x2] -> [x1 cos - x2 sin | x2 cos + x1 sin].
// x [T, heads, D]; cos, sin [T, D] (both halves equal, as the model computes them).
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous());
  TORCH_CHECK(x.stride(2) == 1, "rotary_: head_dim must be contiguous");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t st = x.stride(0), sh = x.stride(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, 16, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const scalar_t* c = cp + t * dim;
        const scalar_t* s = sp + t * dim;
        for (int64_t h = 0; h < heads; ++h) {
          scalar_t* v = xp + t * st + h * sh;
#ifdef QIAO_AVX512
          if constexpr (kVectorRows<scalar_t>) {
            rotary_head_avx512(v, c, s, half);
            continue;
          }
#endif
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = to_f(v[i]), x2 = to_f(v[i + half]);
            const float c1 = to_f(c[i]), s1 = to_f(s[i]);
            const float c2 = to_f(c[i + half]), s2 = to_f(s[i + half]);
            v[i] = from_f<scalar_t>(x1 * c1 - x2 * s1);
            v[i + half] = from_f<scalar_t>(x2 * c2 + x1 * s2);
          }
        }
      }
    });
  });
}


// Store the step's new K and V rows into their cache slots: key, value [T, Hkv, D] (rows may be
// strided views of the fused qkv output; each row's Hkv * D values contiguous), kv_cache
// [2, num_blocks, block_size, Hkv, D] contiguous, slot_mapping [T] int64 (a negative slot is
// skipped). Converts to the cache's dtype on the way. One pass over the rows, no index tensors.
void write_kv(torch::Tensor kv_cache, torch::Tensor key, torch::Tensor value, torch::Tensor slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "write_kv: kv_cache must be [2, blocks, block_size, Hkv, D] contiguous");
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.sizes() == value.sizes(),
              "write_kv: key and value must be [T, Hkv, D] of one shape");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "write_kv: key and value dtypes differ");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == torch::kInt64 &&
              slot_mapping.is_contiguous() && slot_mapping.size(0) == key.size(0),
              "write_kv: slot_mapping must be [T] int64");
  const int64_t tokens = key.size(0), heads = key.size(1), dim = key.size(2);
  TORCH_CHECK(kv_cache.size(3) == heads && kv_cache.size(4) == dim, "write_kv: head shape differs from the cache's");
  for (const auto& t : {key, value}) {
    TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == dim, "write_kv: each row's heads must be contiguous");
  }
  const int64_t row = heads * dim;
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] < num_slots, "write_kv: slot ", slots[t], " past the cache's ", num_slots);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv_cache.scalar_type(), "write_kv", [&] {
    using cache_t = scalar_t;
    cache_t* k_cache = kv_cache.data_ptr<cache_t>();
    cache_t* v_cache = k_cache + num_slots * row;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "write_kv_src", [&] {
      const scalar_t* kp = key.data_ptr<scalar_t>();
      const scalar_t* vp = value.data_ptr<scalar_t>();
      const int64_t ks = key.stride(0), vs = value.stride(0);
      // Parallel only when there is enough to copy: a decode step's few KiB are faster alone.
      at::parallel_for(0, tokens, 256, [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) {
          if (slots[t] < 0) continue;
          cache_t* kd = k_cache + slots[t] * row;
          cache_t* vd = v_cache + slots[t] * row;
          const scalar_t* ksrc = kp + t * ks;
          const scalar_t* vsrc = vp + t * vs;
          if constexpr (std::is_same_v<cache_t, scalar_t>) {
            std::memcpy(kd, ksrc, row * sizeof(cache_t));
            std::memcpy(vd, vsrc, row * sizeof(cache_t));
          } else {
            for (int64_t i = 0; i < row; ++i) kd[i] = static_cast<cache_t>(static_cast<float>(ksrc[i]));
            for (int64_t i = 0; i < row; ++i) vd[i] = static_cast<cache_t>(static_cast<float>(vsrc[i]));
          }
        }
      });
    });
  });
}


// x [M, K] float32, w [N, K] int8, scale [N] float32, bias [N] float32 or empty -> [M, N] float32.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scale, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32);
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == torch::kInt8);
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.numel() == w.size(0));
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "int8_linear: x has ", K, " features, w ", w.size(1));
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  float* op = out.data_ptr<float>();
  // Split the output features across threads; each thread streams its own weight rows once.
  at::parallel_for(0, (N + kRowsW - 1) / kRowsW, 8, [&](int64_t b, int64_t e) {
    const int64_t n0 = b * kRowsW, n1 = std::min(N, e * kRowsW);
    for (int64_t m = 0; m < M; m += 4) {
      const float* xm = xp + m * K;
      float* om = op + m * N;
      switch (std::min<int64_t>(4, M - m)) {
        case 1: int8_rows<1>(om, xm, wp, N, K, n0, n1); break;
        case 2: int8_rows<2>(om, xm, wp, N, K, n0, n1); break;
        case 3: int8_rows<3>(om, xm, wp, N, K, n0, n1); break;
        default: int8_rows<4>(om, xm, wp, N, K, n0, n1); break;
      }
    }
  });
  out.mul_(scale);
  if (bias.numel() > 0) out.add_(bias);
  return out;
}


// Whether linear_f32 has its vectorised form in this build (AVX-512); without it the packed
// weight is not used and the caller keeps its own matmul.
bool linear_f32_available() {
#ifdef QIAO_AVX512
  return true;
#else
  return false;
#endif
}

// w [N, K] float32 -> [ceil(N / 32), K, 32], the layout linear_f32 reads (zeros past N).
torch::Tensor pack_linear_f32(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32, "pack_linear_f32: w [N, K] float32");
  const int64_t N = w.size(0), K = w.size(1), NB = (N + kPackCols - 1) / kPackCols;
  torch::Tensor padded = w;
  if (N != NB * kPackCols) {
    padded = torch::zeros({NB * kPackCols, K}, w.options());
    padded.narrow(0, 0, N).copy_(w);
  }
  return padded.reshape({NB, kPackCols, K}).transpose(1, 2).contiguous();
}

// x [M, K] float32, packed [ceil(N / 32), K, 32] (pack_linear_f32), bias [N] or empty -> [M, N].
torch::Tensor linear_f32(torch::Tensor x, torch::Tensor packed, int64_t N, torch::Tensor bias) {
  TORCH_CHECK(linear_f32_available(), "linear_f32: this build has no AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32,
              "linear_f32: x must be contiguous [M, K] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == kPackCols &&
                  packed.scalar_type() == torch::kFloat32,
              "linear_f32: packed must come from pack_linear_f32");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "linear_f32: x has ", K, " features, the weight ", packed.size(1));
  TORCH_CHECK(N > (NB - 1) * kPackCols && N <= NB * kPackCols, "linear_f32: N ", N, " does not match the packed weight");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.is_contiguous() &&
                                    bias.scalar_type() == torch::kFloat32),
              "linear_f32: bias must be [N] float32 or empty");
  auto out = torch::empty({M, N}, x.options());
#ifdef QIAO_AVX512
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t m = 0; m < M; m += kPanelRows) {
      const int64_t rows = std::min(kPanelRows, M - m);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n = b * kPackCols;
        f32_block_rows(xp + m * K, rows, K, wp + b * K * kPackCols, op + m * N + n, N,
                       lanes(N - n), lanes(N - n - 16), bp ? bp + n : nullptr);
      }
    }
  });
#endif
  return out;
}

// silu(gate) * up for x [..., 2 * d] laid out [gate | up] -> [..., d] (float32 or bfloat16).
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.is_contiguous() && x.size(-1) % 2 == 0, "silu_and_mul: x must be contiguous [..., 2 * d]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "silu_and_mul: float32 or bfloat16, got ", x.scalar_type());
  auto sizes = x.sizes().vec();
  const int64_t d = sizes.back() / 2, rows = d ? x.numel() / (2 * d) : 0;
  sizes.back() = d;
  auto out = torch::empty(sizes, x.options());
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(d, 1));
  auto run = [&](auto* xp, auto* op) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(xp)>>;
    at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
#ifdef QIAO_AVX512
        silu_and_mul_row_avx512<T>(op + r * d, xp + r * 2 * d, d);
#else
        for (int64_t i = 0; i < d; ++i) {
          const float g = to_f(xp[r * 2 * d + i]);
          const float silu = to_f(from_f<T>(g / (1.f + std::exp(-g))));
          op[r * d + i] = from_f<T>(silu * to_f(xp[r * 2 * d + d + i]));
        }
#endif
      }
    });
  };
  if (x.scalar_type() == torch::kFloat32) run(x.data_ptr<float>(), out.data_ptr<float>());
  else run(x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>());
  return out;
}

// The index of each row's first largest value, int64 [rows], for logits [rows, V] in float32 or
// bfloat16 (torch.argmax(dim=-1), NaN counting as largest), one pass over each row.
torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "argmax_rows: logits must be [rows, V > 0] with contiguous rows");
  TORCH_CHECK(logits.scalar_type() == torch::kFloat32 || logits.scalar_type() == torch::kBFloat16,
              "argmax_rows: float32 or bfloat16, got ", logits.scalar_type());
  const int64_t rows = logits.size(0), n = logits.size(1), ld = logits.stride(0);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kInt64));
  int64_t* op = out.data_ptr<int64_t>();
  auto run = [&](auto* xp) {
    at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
#ifdef QIAO_AVX512
        op[r] = argmax_row_avx512(xp + r * ld, n);
#else
        const auto* x = xp + r * ld;
        int64_t best = 0;
        for (int64_t i = 1; i < n && !std::isnan(to_f(x[best])); ++i)
          if (to_f(x[i]) > to_f(x[best]) || std::isnan(to_f(x[i]))) best = i;
        op[r] = best;
#endif
      }
    });
  };
  if (logits.scalar_type() == torch::kFloat32) run(logits.data_ptr<float>());
  else run(logits.data_ptr<c10::BFloat16>());
  return out;
}

// One draw per row of logits [rows, V] (float32 or bfloat16): softmax of logits / temperature
// over the tokens whose scaled logit is at least the row's cutoff, inverse CDF at the row's
// uniform (see sample_row_avx512). temperature, cutoff: [rows] float32, or empty (1; keep all).
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor temperature, torch::Tensor cutoff,
                          torch::Tensor uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "sample_rows: logits must be [rows, V > 0] with contiguous rows");
  TORCH_CHECK(logits.scalar_type() == torch::kFloat32 || logits.scalar_type() == torch::kBFloat16,
              "sample_rows: float32 or bfloat16 logits, got ", logits.scalar_type());
  const int64_t rows = logits.size(0), n = logits.size(1), ld = logits.stride(0);
  auto row_values = [&](const torch::Tensor& t, const char* name) -> const float* {
    if (t.numel() == 0) return nullptr;
    TORCH_CHECK(t.numel() == rows && t.is_contiguous() && t.scalar_type() == torch::kFloat32,
                "sample_rows: ", name, " must be [rows] float32 or empty");
    return t.data_ptr<float>();
  };
  const float* tp = row_values(temperature, "temperature");
  const float* cp = row_values(cutoff, "cutoff");
  const float* up = row_values(uniforms, "uniforms");
  TORCH_CHECK(up != nullptr || rows == 0, "sample_rows: uniforms must be [rows] float32");
  auto out = torch::empty({rows}, logits.options().dtype(torch::kInt64));
  int64_t* op = out.data_ptr<int64_t>();
#ifdef QIAO_AVX512
  auto run = [&](auto* xp) {
    at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        op[r] = sample_row_avx512(xp + r * ld, n, tp ? tp[r] : 1.f,
                                  cp ? cp[r] : -std::numeric_limits<float>::infinity(), up[r]);
    });
  };
  if (logits.scalar_type() == torch::kFloat32) run(logits.data_ptr<float>());
  else run(logits.data_ptr<c10::BFloat16>());
#else
  TORCH_CHECK(false, "sample_rows: this build has no AVX-512 (check sample_rows_available())");
#endif
  return out;
}

bool sample_rows_available() {
#ifdef QIAO_AVX512
  return true;
#else
  return false;
#endif
}

// Top-p cutoffs [rows] of scaled float32 logits [rows, V]: per row the smallest logit kept by
// top-p over the tokens at or above floor[row] (top-k's cutoff; empty: every token), p < 1.
torch::Tensor top_p_cutoff_rows(torch::Tensor scaled, torch::Tensor floor, torch::Tensor top_p) {
  TORCH_CHECK(scaled.dim() == 2 && scaled.stride(1) == 1 && scaled.size(1) > 0 &&
                  scaled.scalar_type() == torch::kFloat32,
              "top_p_cutoff_rows: scaled must be float32 [rows, V > 0] with contiguous rows");
  const int64_t rows = scaled.size(0), n = scaled.size(1), ld = scaled.stride(0);
  TORCH_CHECK(top_p.numel() == rows && top_p.is_contiguous() && top_p.scalar_type() == torch::kFloat32,
              "top_p_cutoff_rows: top_p must be [rows] float32");
  TORCH_CHECK(floor.numel() == 0 || (floor.numel() == rows && floor.is_contiguous() &&
                                     floor.scalar_type() == torch::kFloat32),
              "top_p_cutoff_rows: floor must be [rows] float32 or empty");
  auto out = torch::empty({rows}, scaled.options());
#ifdef QIAO_AVX512
  const float* sp = scaled.data_ptr<float>();
  const float* fp = floor.numel() ? floor.data_ptr<float>() : nullptr;
  const float* pp = top_p.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    std::vector<float> w((n + 15) / 16 * 16);
    for (int64_t r = b; r < e; ++r)
      op[r] = top_p_cutoff_row_avx512(sp + r * ld, n, fp ? fp[r] : -std::numeric_limits<float>::infinity(),
                                      pp[r], w.data());
  });
#else
  TORCH_CHECK(false, "top_p_cutoff_rows: this build has no AVX-512 (check sample_rows_available())");
#endif
  return out;
}

// Top-k cutoffs [rows] of float32 logits [rows, V]: each row's k-th largest value (repeats
// counted), -inf where k >= V (top-k off). top_k: [rows] int64, each >= 1.
torch::Tensor top_k_cutoff_rows(torch::Tensor logits, torch::Tensor top_k) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0 &&
                  logits.scalar_type() == torch::kFloat32,
              "top_k_cutoff_rows: logits must be float32 [rows, V > 0] with contiguous rows");
  const int64_t rows = logits.size(0), n = logits.size(1), ld = logits.stride(0);
  TORCH_CHECK(top_k.numel() == rows && top_k.is_contiguous() && top_k.scalar_type() == torch::kInt64,
              "top_k_cutoff_rows: top_k must be [rows] int64");
  auto out = torch::empty({rows}, logits.options());
#ifdef QIAO_AVX512
  const float* sp = logits.data_ptr<float>();
  const int64_t* kp = top_k.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      TORCH_CHECK(kp[r] >= 1, "top_k_cutoff_rows: top_k must be >= 1, got ", kp[r]);
      op[r] = kp[r] >= n ? -std::numeric_limits<float>::infinity()
                         : kth_largest_row_avx512(sp + r * ld, n, kp[r]);
    }
  });
#else
  TORCH_CHECK(false, "top_k_cutoff_rows: this build has no AVX-512 (check sample_rows_available())");
#endif
  return out;
}

// Logprobs of logits [rows, V] (float32 or bfloat16, finite): (ids [rows, 1 + k] int64: the sampled
// token then the k most likely; their logprobs [rows, 1 + k] float32; the sampled tokens' ranks
// [rows] int64), as log_softmax, topk and a count would give them, with no [rows, V] tensor.
std::vector<torch::Tensor> logprob_rows(torch::Tensor logits, torch::Tensor sampled, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "logprob_rows: logits must be [rows, V > 0] with contiguous rows");
  TORCH_CHECK(logits.scalar_type() == torch::kFloat32 || logits.scalar_type() == torch::kBFloat16,
              "logprob_rows: float32 or bfloat16 logits, got ", logits.scalar_type());
  const int64_t rows = logits.size(0), n = logits.size(1), ld = logits.stride(0);
  TORCH_CHECK(k >= 0 && k <= n, "logprob_rows: k must be in [0, V], got ", k);
  TORCH_CHECK(sampled.numel() == rows && sampled.is_contiguous() && sampled.scalar_type() == torch::kInt64,
              "logprob_rows: sampled must be [rows] int64");
  auto ids = torch::empty({rows, 1 + k}, logits.options().dtype(torch::kInt64));
  auto lps = torch::empty({rows, 1 + k}, logits.options().dtype(torch::kFloat32));
  auto ranks = torch::empty({rows}, logits.options().dtype(torch::kInt64));
#ifdef QIAO_AVX512
  const int64_t* sp = sampled.data_ptr<int64_t>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* lp = lps.data_ptr<float>();
  int64_t* rp = ranks.data_ptr<int64_t>();
  auto run = [&](auto* xp) {
    at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
      std::vector<float> best(k + 1);
      std::vector<int64_t> best_ids(k + 1);
      for (int64_t r = b; r < e; ++r) {
        TORCH_CHECK(sp[r] >= 0 && sp[r] < n, "logprob_rows: sampled id ", sp[r], " outside [0, ", n, ")");
        logprob_row_avx512(xp + r * ld, n, sp[r], k, ip + r * (1 + k), lp + r * (1 + k), rp + r,
                           best.data(), best_ids.data());
      }
    });
  };
  if (logits.scalar_type() == torch::kFloat32) run(logits.data_ptr<float>());
  else run(logits.data_ptr<c10::BFloat16>());
#else
  TORCH_CHECK(false, "logprob_rows: this build has no AVX-512 (check sample_rows_available())");
#endif
  return {ids, lps, ranks};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("logprob_rows", &logprob_rows, "sampled and top-k logprobs and the sampled rank per row, no [rows, V] tensor");
  m.def("top_k_cutoff_rows", &top_k_cutoff_rows, "each row's k-th largest logit (-inf: top-k off)");
  m.def("top_p_cutoff_rows", &top_p_cutoff_rows, "each row's top-p cutoff logit (over tokens >= floor)");
  m.def("sample_rows", &sample_rows, "one inverse-CDF draw per row from softmax(logits / t) over kept tokens");
  m.def("sample_rows_available", &sample_rows_available, "whether sample_rows is compiled here");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of x = [gate | up], float32 / bfloat16");
  m.def("argmax_rows", &argmax_rows, "index of each row's first largest value (torch.argmax)");
  m.def("int8_linear", &int8_linear, "x @ (scale * w_int8)^T + bias, for few rows of x");
  m.def("linear_f32_available", &linear_f32_available, "whether linear_f32 is vectorised here");
  m.def("pack_linear_f32", &pack_linear_f32, "float32 weight [N, K] -> linear_f32's packed layout");
  m.def("linear_f32", &linear_f32, "x @ w^T + bias over a weight packed by pack_linear_f32");
  // softcap > 0: each score s becomes softcap * tanh(s / softcap) (Gemma 2); 0: plain scores.
  m.def("paged_attention", &paged_attention, "attention of new tokens over the paged KV cache",
        py::arg("q"), py::arg("kv_cache"), py::arg("block_tables"), py::arg("query_start_loc"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("window"), py::arg("softcap") = 0.0);
  m.def("attention_vectorized", &attention_vectorized,
        "whether paged_attention runs its AVX-512 path for this KV cache");
  m.def("write_kv", &write_kv, "store new K/V rows into their paged-cache slots");
  m.def("rms_norm", &rms_norm, "RMSNorm in one pass");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; x = RMSNorm(residual), in place");
  m.def("rotary_", &rotary_, "rotary embedding in place (rotate_half layout)");
}
