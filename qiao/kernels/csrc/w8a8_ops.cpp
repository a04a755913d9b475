// W8A8 linear for the CPU: activations quantized per row to int8, int8 x int8 products summed in
// int32 with AVX-512 VNNI (vpdpbusd), dequantized by row scale x column scale. Built as its own
// extension (qiao/layers/quant_w8a8.py loads it); the PyTorch reference there is its oracle.
//
// vpdpbusd multiplies unsigned by signed bytes, so activations are stored shifted to uint8
// (q + 128) and the shift is taken back out per output column: sum_k (q_k + 128) w_k
// = sum_k q_k w_k + 128 colsum(w), with comp[n] = 128 colsum(w[n]) precomputed at pack time.
//
// Weight layout (packed in Python, pack_w8a8): [NB, K4, 16, 4] int8, NB = ceil(N / 16),
// K4 = ceil(K / 4): block b holds output features 16b..16b+15, and one k4 step of a block is one
// 64-byte vector whose int32 lane j holds w[16b + j][4 k4 .. 4 k4 + 3] (zeros past N and K).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define QIAO_VNNI 1
#endif

namespace {

constexpr int64_t kBlockCols = 16;  // output features per packed block (one zmm of int32)
constexpr int64_t kGroupBlocks = 3;  // blocks per register tile: 3 x 16 columns
constexpr int64_t kTileRows = 8;     // rows per register tile: 8 x 3 int32 accumulators
constexpr int64_t kPanelRows = 128;  // rows whose activations stay in cache across a group

enum class OutKind { kInt32, kFloat32, kBFloat16 };

// The per-column and per-row data the epilogue applies to a tile's int32 sums.
struct Epilogue {
  const int32_t* comp;     // [N] 128 * colsum(w)
  const float* row_scale;  // [M]
  const float* col_scale;  // [N]
  const float* bias;       // [N] or nullptr
  void* out;               // [M, N] of OutKind
  int64_t N;
};

// float32 -> bfloat16 bits, round to nearest even (torch's .to(torch.bfloat16) for finite values).
inline uint16_t bf16_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// The output value of one column: float32 as the reference, (acc * row) * col + bias.
inline float dequant(int32_t acc, float row, float col, const float* bias, int64_t n) {
  const float v = static_cast<float>(acc) * row * col;
  return bias ? v + bias[n] : v;
}

#ifdef QIAO_VNNI
inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
}

template <OutKind kind>
inline void store_vec(const Epilogue& e, int64_t m, int64_t n, __m512i acc) {
  const __mmask16 mask = lanes(e.N - n);
  const __m512i sum = _mm512_sub_epi32(acc, _mm512_maskz_loadu_epi32(mask, e.comp + n));
  if constexpr (kind == OutKind::kInt32) {
    _mm512_mask_storeu_epi32(static_cast<int32_t*>(e.out) + m * e.N + n, mask, sum);
  } else {
    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(e.row_scale[m]));
    v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, e.col_scale + n));
    if (e.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, e.bias + n));
    if constexpr (kind == OutKind::kFloat32) {
      _mm512_mask_storeu_ps(static_cast<float*>(e.out) + m * e.N + n, mask, v);
    } else {
      __m512i bits = _mm512_castps_si512(v);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
      bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
      const __m256i half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(e.out) + m * e.N + n, mask, half);
    }
  }
}

// MR rows of activations (uint8, row stride Kp) against NV packed blocks starting at block `b`:
// MR x NV int32 accumulators in registers over the whole K; each weight vector is loaded once
// and used for every row, each activation quadruple broadcast once and used for every block.
template <int MR, int NV, OutKind kind>
inline void vnni_tile(const uint8_t* a, int64_t Kp, const int8_t* w, int64_t m, int64_t b,
                      const Epilogue& e) {
  const int64_t K4 = Kp / 4, block_bytes = Kp * kBlockCols;
  const int8_t* wb = w + b * block_bytes;
  __m512i acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_si512();
  for (int64_t k = 0; k < K4; ++k) {
    __m512i wv[NV];
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) wv[v] = _mm512_loadu_si512(wb + v * block_bytes + k * 64);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      int32_t quad;
      std::memcpy(&quad, a + r * Kp + k * 4, 4);
      const __m512i av = _mm512_set1_epi32(quad);
#pragma GCC unroll 3
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], av, wv[v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 3
    for (int v = 0; v < NV; ++v) store_vec<kind>(e, m + r, (b + v) * kBlockCols, acc[r][v]);
}

template <int NV, OutKind kind>
inline void vnni_rows(const uint8_t* a, int64_t rows, int64_t Kp, const int8_t* w, int64_t m,
                      int64_t b, const Epilogue& e) {
  for (; rows > 0; rows -= kTileRows, a += kTileRows * Kp, m += kTileRows) {
    switch (std::min(rows, kTileRows)) {
      case 1: vnni_tile<1, NV, kind>(a, Kp, w, m, b, e); break;
      case 2: vnni_tile<2, NV, kind>(a, Kp, w, m, b, e); break;
      case 3: vnni_tile<3, NV, kind>(a, Kp, w, m, b, e); break;
      case 4: vnni_tile<4, NV, kind>(a, Kp, w, m, b, e); break;
      case 5: vnni_tile<5, NV, kind>(a, Kp, w, m, b, e); break;
      case 6: vnni_tile<6, NV, kind>(a, Kp, w, m, b, e); break;
      case 7: vnni_tile<7, NV, kind>(a, Kp, w, m, b, e); break;
      default: vnni_tile<8, NV, kind>(a, Kp, w, m, b, e); break;
    }
  }
}
#endif

// Plain loops over the same layout, for builds without VNNI (w8a8_available() is false there and
// qiao uses torch's int8 matmul instead; kept so the extension builds and runs anywhere).
template <OutKind kind>
void scalar_rows(const uint8_t* a, int64_t rows, int64_t Kp, const int8_t* w, int64_t m,
                 int64_t b, int64_t nv, const Epilogue& e) {
  const int64_t K4 = Kp / 4, block_bytes = Kp * kBlockCols;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t v = 0; v < nv; ++v) {
      const int8_t* wb = w + (b + v) * block_bytes;
      for (int64_t j = 0; j < kBlockCols; ++j) {
        const int64_t n = (b + v) * kBlockCols + j;
        if (n >= e.N) break;
        int32_t acc = 0;
        for (int64_t k = 0; k < K4; ++k)
          for (int64_t i = 0; i < 4; ++i)
            acc += static_cast<int32_t>(a[r * Kp + 4 * k + i]) * wb[k * 64 + 4 * j + i];
        acc -= e.comp[n];
        const int64_t at = (m + r) * e.N + n;
        if constexpr (kind == OutKind::kInt32) {
          static_cast<int32_t*>(e.out)[at] = acc;
        } else if constexpr (kind == OutKind::kFloat32) {
          static_cast<float*>(e.out)[at] = dequant(acc, e.row_scale[m + r], e.col_scale[n], e.bias, n);
        } else {
          static_cast<uint16_t*>(e.out)[at] =
              bf16_bits(dequant(acc, e.row_scale[m + r], e.col_scale[n], e.bias, n));
        }
      }
    }
  }
}

template <OutKind kind>
void run_gemm(const uint8_t* a, int64_t M, int64_t Kp, const int8_t* w, int64_t NB,
              const Epilogue& e) {
  const int64_t NG = (NB + kGroupBlocks - 1) / kGroupBlocks;
  const int64_t MP = (M + kPanelRows - 1) / kPanelRows;
  // Tasks are (row panel, column group) pairs, panel-major: a thread's range walks the column
  // groups of one panel while that panel's activations stay in cache. Few rows: one panel, the
  // groups split across threads, each reading its share of the weight once.
  at::parallel_for(0, MP * NG, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m = (t / NG) * kPanelRows, b = (t % NG) * kGroupBlocks;
      const int64_t rows = std::min(kPanelRows, M - m), nv = std::min(kGroupBlocks, NB - b);
      const uint8_t* ap = a + m * Kp;
#ifdef QIAO_VNNI
      switch (nv) {
        case 1: vnni_rows<1, kind>(ap, rows, Kp, w, m, b, e); break;
        case 2: vnni_rows<2, kind>(ap, rows, Kp, w, m, b, e); break;
        default: vnni_rows<3, kind>(ap, rows, Kp, w, m, b, e); break;
      }
#else
      scalar_rows<kind>(ap, rows, Kp, w, m, b, nv, e);
#endif
    }
  });
}

// kOffset 128: uint8 q + 128 (this file's GEMM); 0: int8 q (torch._int_mm).
template <int kOffset, typename scalar_t, typename q_t>
void quantize_row(const scalar_t* x, int64_t K, int64_t Kp, q_t* q, float* scale) {
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(static_cast<float>(x[k])));
  // The reference's arithmetic exactly: inv = 127 / amax in float32, q = round-half-even(x inv).
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  *scale = amax / 127.f;
  for (int64_t k = 0; k < K; ++k) {
    const float v = std::nearbyint(static_cast<float>(x[k]) * inv);
    q[k] = static_cast<q_t>(static_cast<int32_t>(std::min(127.f, std::max(-127.f, v))) + kOffset);
  }
  for (int64_t k = K; k < Kp; ++k) q[k] = kOffset;  // zero, against the weight's zero padding
}

#ifdef QIAO_VNNI
inline __m512 load16(const float* x, __mmask16 m) { return _mm512_maskz_loadu_ps(m, x); }
inline __m512 load16(const c10::BFloat16* x, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// quantize_row vectorised: the same float32 operations, so the same bytes.
template <int kOffset, typename scalar_t, typename q_t>
void quantize_row_avx512(const scalar_t* x, int64_t K, int64_t Kp, q_t* q, float* scale) {
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16)
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16(x + k, lanes(K - k))));
  const float amax = _mm512_reduce_max_ps(vmax);
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  *scale = amax / 127.f;
  const __m512 vinv = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  const __m512i shift = _mm512_set1_epi32(kOffset);
  for (int64_t k = 0; k < Kp; k += 16) {
    const __mmask16 m = lanes(Kp - k);
    __m512 v = _mm512_mul_ps(load16(x + k, lanes(K - k)), vinv);  // zeros past K -> 128
    v = _mm512_min_ps(hi, _mm512_max_ps(lo, v));
    const __m512i i = _mm512_add_epi32(_mm512_cvtps_epi32(v), shift);  // round half even
    _mm_mask_storeu_epi8(q + k, m, _mm512_cvtepi32_epi8(i));
  }
}
#endif

}  // namespace

bool w8a8_available() {
#ifdef QIAO_VNNI
  return true;
#else
  return false;
#endif
}

template <int kOffset, typename q_t>
void quantize_all(const torch::Tensor& x, int64_t Kp, q_t* qp, float* sp) {
  const int64_t M = x.size(0), K = x.size(1);
  AT_DISPATCH_SWITCH(x.scalar_type(), "quantize_rows",
    AT_DISPATCH_CASE(torch::kFloat32, [&] {
      const scalar_t* xp = x.data_ptr<scalar_t>();
      at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
        for (int64_t m = b; m < e; ++m)
#ifdef QIAO_VNNI
          quantize_row_avx512<kOffset>(xp + m * K, K, Kp, qp + m * Kp, sp + m);
#else
          quantize_row<kOffset>(xp + m * K, K, Kp, qp + m * Kp, sp + m);
#endif
      });
    })
    AT_DISPATCH_CASE(torch::kBFloat16, [&] {
      const scalar_t* xp = x.data_ptr<scalar_t>();
      at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
        for (int64_t m = b; m < e; ++m)
#ifdef QIAO_VNNI
          quantize_row_avx512<kOffset>(xp + m * K, K, Kp, qp + m * Kp, sp + m);
#else
          quantize_row<kOffset>(xp + m * K, K, Kp, qp + m * Kp, sp + m);
#endif
      });
    }));
}

// x [M, K] float32 / bfloat16 -> (q, float32 scale [M]): q = round(x * 127 / max|x_row|),
// symmetric per row (a zero row quantizes to zeros, scale 0). `shifted`: uint8 [M, Kp] = q + 128,
// Kp = ceil(K/4)*4 (this file's GEMM); else int8 [M, K] = q (torch._int_mm).
std::vector<torch::Tensor> quantize_rows(torch::Tensor x, bool shifted) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "quantize_rows: x must be contiguous [M, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "quantize_rows: x must be float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), Kp = shifted ? (K + 3) / 4 * 4 : K;
  auto q = torch::empty({M, Kp}, x.options().dtype(shifted ? torch::kUInt8 : torch::kInt8));
  auto scale = torch::empty({M}, x.options().dtype(torch::kFloat32));
  if (shifted) {
    quantize_all<128>(x, Kp, q.data_ptr<uint8_t>(), scale.data_ptr<float>());
  } else {
    quantize_all<0>(x, Kp, q.data_ptr<int8_t>(), scale.data_ptr<float>());
  }
  return {q, scale};
}

// acc int32 [M, N] (torch._int_mm's sums) -> (acc * x_scale[m]) * w_scale[n] + bias[n] in
// `out_dtype` (float32 / bfloat16), in one pass: the same epilogue as w8a8_linear's.
torch::Tensor dequantize_rows(torch::Tensor acc, torch::Tensor x_scale, torch::Tensor w_scale,
                              torch::Tensor bias, torch::ScalarType out_dtype) {
  TORCH_CHECK(acc.dim() == 2 && acc.is_contiguous() && acc.scalar_type() == torch::kInt32,
              "dequantize_rows: acc must be contiguous int32 [M, N]");
  const int64_t M = acc.size(0), N = acc.size(1);
  TORCH_CHECK(out_dtype == torch::kFloat32 || out_dtype == torch::kBFloat16,
              "dequantize_rows: out_dtype must be float32 or bfloat16");
  TORCH_CHECK(x_scale.scalar_type() == torch::kFloat32 && x_scale.numel() == M &&
                  x_scale.is_contiguous(), "dequantize_rows: x_scale must be float32 [M]");
  TORCH_CHECK(w_scale.scalar_type() == torch::kFloat32 && w_scale.numel() == N &&
                  w_scale.is_contiguous(), "dequantize_rows: w_scale must be float32 [N]");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.is_contiguous() &&
                                    bias.scalar_type() == torch::kFloat32),
              "dequantize_rows: bias must be [N] float32 or empty");
  auto out = torch::empty({M, N}, acc.options().dtype(out_dtype));
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* xs = x_scale.data_ptr<float>();
  const float* ws = w_scale.data_ptr<float>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  const bool bf16 = out_dtype == torch::kBFloat16;
  void* op = out.data_ptr();
  at::parallel_for(0, M, 8, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      int64_t n = 0;
#ifdef QIAO_VNNI
      const __m512 row = _mm512_set1_ps(xs[m]);
      for (; n + 16 <= N; n += 16) {
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(ap + m * N + n)), row);
        v = _mm512_mul_ps(v, _mm512_loadu_ps(ws + n));
        if (bp) v = _mm512_add_ps(v, _mm512_loadu_ps(bp + n));
        if (!bf16) {
          _mm512_storeu_ps(static_cast<float*>(op) + m * N + n, v);
          continue;
        }
        __m512i bits = _mm512_castps_si512(v);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(op) + m * N + n),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
      }
#endif
      for (; n < N; ++n) {
        const float v = dequant(ap[m * N + n], xs[m], ws[n], bp, n);
        if (bf16) static_cast<uint16_t*>(op)[m * N + n] = bf16_bits(v);
        else static_cast<float*>(op)[m * N + n] = v;
      }
    }
  });
  return out;
}

// xq [M, Kp] uint8 (quantize_rows), packed [NB, Kp/4, 16, 4] int8 and comp [NB*16] int32
// (pack_w8a8) -> [M, N]: `out_dtype` int32 gives the exact sums sum_k q[m,k] w[n,k]; float32 /
// bfloat16 give (sum * x_scale[m]) * w_scale[n] + bias[n] (x_scale, w_scale, bias float32; bias
// may be empty).
torch::Tensor w8a8_linear(torch::Tensor xq, torch::Tensor x_scale, torch::Tensor packed,
                          torch::Tensor comp, torch::Tensor w_scale, torch::Tensor bias, int64_t N,
                          torch::ScalarType out_dtype) {
  TORCH_CHECK(xq.dim() == 2 && xq.is_contiguous() && xq.scalar_type() == torch::kUInt8,
              "w8a8_linear: xq must be contiguous uint8 [M, Kp] from quantize_rows");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(2) == kBlockCols &&
                  packed.size(3) == 4 && packed.scalar_type() == torch::kInt8,
              "w8a8_linear: packed must come from pack_w8a8");
  const int64_t M = xq.size(0), Kp = xq.size(1), NB = packed.size(0);
  TORCH_CHECK(packed.size(1) * 4 == Kp, "w8a8_linear: xq has ", Kp, " padded features, the weight ",
              packed.size(1) * 4);
  TORCH_CHECK(N > (NB - 1) * kBlockCols && N <= NB * kBlockCols, "w8a8_linear: N ", N,
              " does not match the packed weight");
  TORCH_CHECK(comp.scalar_type() == torch::kInt32 && comp.is_contiguous() && comp.numel() >= N,
              "w8a8_linear: comp must be int32 [>= N]");
  const bool dequantize = out_dtype != torch::kInt32;
  if (dequantize) {
    TORCH_CHECK(out_dtype == torch::kFloat32 || out_dtype == torch::kBFloat16,
                "w8a8_linear: out_dtype must be int32, float32 or bfloat16");
    TORCH_CHECK(x_scale.scalar_type() == torch::kFloat32 && x_scale.numel() == M &&
                    x_scale.is_contiguous(), "w8a8_linear: x_scale must be float32 [M]");
    TORCH_CHECK(w_scale.scalar_type() == torch::kFloat32 && w_scale.numel() >= N &&
                    w_scale.is_contiguous(), "w8a8_linear: w_scale must be float32 [N]");
    TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.is_contiguous() &&
                                      bias.scalar_type() == torch::kFloat32),
                "w8a8_linear: bias must be [N] float32 or empty");
  }
  auto out = torch::empty({M, N}, xq.options().dtype(out_dtype));
  const Epilogue e{comp.data_ptr<int32_t>(),
                   dequantize ? x_scale.data_ptr<float>() : nullptr,
                   dequantize ? w_scale.data_ptr<float>() : nullptr,
                   dequantize && bias.numel() ? bias.data_ptr<float>() : nullptr,
                   out.data_ptr(), N};
  const uint8_t* a = xq.data_ptr<uint8_t>();
  const int8_t* w = packed.data_ptr<int8_t>();
  if (M == 0) return out;
  switch (out_dtype) {
    case torch::kInt32: run_gemm<OutKind::kInt32>(a, M, Kp, w, NB, e); break;
    case torch::kFloat32: run_gemm<OutKind::kFloat32>(a, M, Kp, w, NB, e); break;
    default: run_gemm<OutKind::kBFloat16>(a, M, Kp, w, NB, e); break;
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("w8a8_available", &w8a8_available, "whether this build has the AVX-512 VNNI kernel");
  m.def("quantize_rows", &quantize_rows, "x -> (q: uint8 q + 128 if shifted else int8, scale) per row");
  m.def("dequantize_rows", &dequantize_rows, "int32 sums -> (sum * x_scale) * w_scale + bias");
  m.def("w8a8_linear", &w8a8_linear, "int8 rows x int8 packed weight, int32 sums, dequantized");
}
