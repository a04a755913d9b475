// qiao int4 kernels: the weight-only group-wise 4-bit matmul for few rows (decode), and the
// tile-wise dequantization that larger matmuls (prefill) multiply by, to float32 or to
// bfloat16 (rounded once, as torch rounds; the tile a CPU with bfloat16 hardware multiplies).
// Plain-PyTorch references in qiao/layers/quant_int4.py (the test oracle and the fallback).
//
// Packed layout (pack_int4 in quant_int4.py): output features in blocks of 16, input features in
// chunks of 8. Block b, chunk c is 64 bytes, 4 per output feature r = 0..15; byte j of feature r
// holds q[16 b + r, 8 c + j] in its low nibble and q[16 b + r, 8 c + 4 + j] in its high one.
// Scales and offsets are [blocks, groups, 16] float32 (w = q * scale - offset).
//
// int4_linear quantizes each row of x per group to int8 (d = max |x| / 127, xq = round(x / d))
// and sums xq * q exactly in int32 with AVX-512 VNNI (vpdpbusd: unsigned codes times signed
// activations, 4 products per lane, one lane per output feature), then per group in float32:
// y += sum * (scale * d) - offset * (d * sum xq). That is x rounded per group to 8 bits times the
// exact weights; the reference computes the same with F.linear.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define QIAO_INT4_VNNI 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBlock = 16;   // output features per block (one per 32-bit lane)
constexpr int64_t kChunk = 8;    // input features per 64-byte chunk of a block
constexpr int64_t kChunkBytes = kBlock * kChunk / 2;
constexpr int64_t kRowTile = 4;  // rows of x sharing each weight load

// One row of x per group: int8 codes, the step d and d * sum of the codes.
struct QuantizedRows {
  std::vector<int8_t> codes;  // [M, K]
  std::vector<float> step;    // [M, G]
  std::vector<float> sums;    // [M, G]
};

QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K, int64_t group) {
  const int64_t G = K / group;
  QuantizedRows q{std::vector<int8_t>(M * K), std::vector<float>(M * G), std::vector<float>(M * G)};
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = x + m * K + g * group;
      float amax = 0.f;
      for (int64_t i = 0; i < group; ++i) amax = std::max(amax, std::fabs(xg[i]));
      const float d = amax / 127.f;
      const float divisor = std::max(d, 1e-30f);
      int32_t total = 0;
      int8_t* out = q.codes.data() + m * K + g * group;
      for (int64_t i = 0; i < group; ++i) {
        const float r = std::nearbyint(xg[i] / divisor);  // ties to even, as torch.round
        const int32_t v = static_cast<int32_t>(std::min(127.f, std::max(-127.f, r)));
        out[i] = static_cast<int8_t>(v);
        total += v;
      }
      q.step[m * G + g] = d;
      q.sums[m * G + g] = d * static_cast<float>(total);
    }
  }
  return q;
}

#ifdef QIAO_INT4_VNNI
// Output features of blocks b0..b1 for rows m..m+MT of x.
template <int MT>
void int4_block_rows(float* out, int64_t N, const QuantizedRows& q, int64_t m, int64_t K,
                     int64_t group, const uint8_t* packed, const float* scales,
                     const float* offsets, const float* bias, int64_t b0, int64_t b1) {
  const int64_t G = K / group, chunks = K / kChunk, per_group = group / kChunk;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const int32_t* xw[MT];  // row mt's int8 codes as 32-bit words: 4 codes each
  for (int mt = 0; mt < MT; ++mt)
    xw[mt] = reinterpret_cast<const int32_t*>(q.codes.data() + (m + mt) * K);
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* wb = packed + b * chunks * kChunkBytes;
    __m512 acc[MT];
    for (int mt = 0; mt < MT; ++mt) acc[mt] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m512i lo_sum[MT], hi_sum[MT];
      for (int mt = 0; mt < MT; ++mt) lo_sum[mt] = hi_sum[mt] = _mm512_setzero_si512();
      for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c) {
        const __m512i v = _mm512_loadu_si512(wb + c * kChunkBytes);
        const __m512i lo = _mm512_and_si512(v, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        for (int mt = 0; mt < MT; ++mt) {
          lo_sum[mt] = _mm512_dpbusd_epi32(lo_sum[mt], lo, _mm512_set1_epi32(xw[mt][2 * c]));
          hi_sum[mt] = _mm512_dpbusd_epi32(hi_sum[mt], hi, _mm512_set1_epi32(xw[mt][2 * c + 1]));
        }
      }
      const __m512 s = _mm512_loadu_ps(scales + (b * G + g) * kBlock);
      const __m512 o = _mm512_loadu_ps(offsets + (b * G + g) * kBlock);
      for (int mt = 0; mt < MT; ++mt) {
        const int64_t i = (m + mt) * G + g;
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(lo_sum[mt], hi_sum[mt]));
        acc[mt] = _mm512_fmadd_ps(sum, _mm512_mul_ps(s, _mm512_set1_ps(q.step[i])), acc[mt]);
        acc[mt] = _mm512_fnmadd_ps(o, _mm512_set1_ps(q.sums[i]), acc[mt]);
      }
    }
    const int64_t n = b * kBlock, valid = std::min(kBlock, N - n);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    for (int mt = 0; mt < MT; ++mt)
      _mm512_mask_storeu_ps(out + (m + mt) * N + n, mask, _mm512_add_ps(acc[mt], bv));
  }
}
#endif

void check_packed(const torch::Tensor& packed, const torch::Tensor& scales,
                  const torch::Tensor& offsets, int64_t K, int64_t group, int64_t N) {
  TORCH_CHECK(group > 0 && group % kChunk == 0 && K % group == 0,
              "int4: group size ", group, " must be a multiple of 8 dividing K ", K);
  const int64_t blocks = (N + kBlock - 1) / kBlock, G = K / group;
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
                  packed.numel() == blocks * K * kBlock / 2,
              "int4: packed weight must come from pack_int4 for ", N, " x ", K);
  for (const auto* t : {&scales, &offsets})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() &&
                    t->numel() == blocks * G * kBlock,
                "int4: scales and offsets must be [blocks, groups, 16] float32");
}

}  // namespace

// Whether int4_linear is compiled here (AVX-512 with VNNI).
bool int4_linear_available() {
#ifdef QIAO_INT4_VNNI
  return true;
#else
  return false;
#endif
}

// x [M, K] float32, a weight packed by pack_int4 (N output features, groups of `group`),
// bias [N] float32 or empty -> [M, N] float32.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                          torch::Tensor offsets, int64_t group, int64_t N, torch::Tensor bias) {
  TORCH_CHECK(int4_linear_available(), "int4_linear: this build has no AVX-512 VNNI");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32,
              "int4_linear: x must be contiguous [M, K] float32");
  const int64_t M = x.size(0), K = x.size(1);
  check_packed(packed, scales, offsets, K, group, N);
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.is_contiguous() &&
                                    bias.scalar_type() == torch::kFloat32),
              "int4_linear: bias must be [N] float32 or empty");
  auto out = torch::empty({M, N}, x.options());
#ifdef QIAO_INT4_VNNI
  const QuantizedRows q = quantize_rows(x.data_ptr<float>(), M, K, group);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* opp = offsets.data_ptr<float>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  // Output blocks split across threads; each streams its own weight bytes once per row tile.
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t m = 0; m < M; m += kRowTile) {
      switch (std::min(kRowTile, M - m)) {
        case 1: int4_block_rows<1>(op, N, q, m, K, group, wp, sp, opp, bp, b0, b1); break;
        case 2: int4_block_rows<2>(op, N, q, m, K, group, wp, sp, opp, bp, b0, b1); break;
        case 3: int4_block_rows<3>(op, N, q, m, K, group, wp, sp, opp, bp, b0, b1); break;
        default: int4_block_rows<4>(op, N, q, m, K, group, wp, sp, opp, bp, b0, b1); break;
      }
    }
  });
#endif
  return out;
}

// Output features 16 * block0 .. 16 * (block0 + blocks) of a packed weight, dequantized and
// transposed: float32 [K, 16 * blocks], the right operand of x @ W^T (features past N are
// their zero padding: zeros). One 64-byte chunk gives 8 input features of 16 outputs.
torch::Tensor int4_dequantize(torch::Tensor packed, torch::Tensor scales, torch::Tensor offsets,
                              int64_t group, int64_t N, int64_t K, int64_t block0, int64_t blocks) {
  TORCH_CHECK(int4_linear_available(), "int4_dequantize: this build has no AVX-512 VNNI");
  check_packed(packed, scales, offsets, K, group, N);
  TORCH_CHECK(block0 >= 0 && blocks >= 0 && 16 * (block0 + blocks) < N + kBlock,
              "int4_dequantize: blocks out of range");
  auto out = torch::empty({K, blocks * kBlock}, scales.options());
#ifdef QIAO_INT4_VNNI
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* opp = offsets.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t G = K / group, chunks = K / kChunk, ld = blocks * kBlock;
  const __m512i low4 = _mm512_set1_epi32(0x0F);
  at::parallel_for(0, blocks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = block0 + i;
      const uint8_t* wb = wp + b * chunks * kChunkBytes;
      float* col = op + i * kBlock;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t g = c * kChunk / group;
        const __m512 s = _mm512_loadu_ps(sp + (b * G + g) * kBlock);
        const __m512 o = _mm512_loadu_ps(opp + (b * G + g) * kBlock);
        const __m512i v = _mm512_loadu_si512(wb + c * kChunkBytes);
        // Byte j of each 32-bit lane: input feature 8c + j low, 8c + 4 + j high.
        for (int j = 0; j < 4; ++j) {
          const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(v, 8 * j), low4);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(v, 8 * j + 4), low4);
          _mm512_storeu_ps(col + (c * kChunk + j) * ld,
                           _mm512_sub_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(lo), s), o));
          _mm512_storeu_ps(col + (c * kChunk + 4 + j) * ld,
                           _mm512_sub_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(hi), s), o));
        }
      }
    }
  });
#endif
  return out;
}

#ifdef QIAO_INT4_VNNI
namespace {

// float32 -> bfloat16 bits in the low half of each lane, rounded to nearest even as torch's
// conversion (denormals kept, NaN -> 0xFFFF): bits + 0x7FFF + (bit 16), shifted down.
inline __m256i bf16_exact(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(
      _mm512_mask_mov_epi32(_mm512_srli_epi32(rounded, 16), nan, _mm512_set1_epi32(0xFFFF)));
}

// Lanes where the hardware conversion (vcvtne2ps2bf16: nearest even, but denormals flushed to
// zero and its own NaN) can differ from torch's: denormals and NaNs.
inline __mmask16 not_hardware_exact(__m512 v) {
  return _mm512_fpclass_ps_mask(v, 0x01 | 0x20 | 0x80);  // quiet NaN, denormal, signalling NaN
}

#ifdef __AVX512BF16__
constexpr bool kHardwareBf16 = true;
#else
constexpr bool kHardwareBf16 = false;
#endif

// The 8 input features of one 64-byte chunk for 16 output features, as bfloat16 rows of the
// transposed tile (row j at out + j * ld).
inline void dequantize_chunk_bf16(const uint8_t* chunk, __m512 s, __m512 o, uint16_t* out,
                                  int64_t ld) {
  const __m512i low4 = _mm512_set1_epi32(0x0F);
  const __m512i v = _mm512_loadu_si512(chunk);
  __m512 w[kChunk];
  __mmask16 odd_lanes = 0;
  for (int j = 0; j < kChunk; ++j) {  // input feature j: nibble j % 4 of byte j / 4
    const int shift = 8 * (j % 4) + 4 * (j / 4);
    const __m512i q = _mm512_and_si512(_mm512_srli_epi32(v, shift), low4);
    w[j] = _mm512_sub_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q), s), o);
    odd_lanes |= not_hardware_exact(w[j]);
  }
#ifdef __AVX512BF16__
  if (kHardwareBf16 && !odd_lanes) {
    for (int j = 0; j < kChunk; j += 2) {
      const __m512i pair = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(w[j + 1], w[j]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j * ld),
                          _mm512_castsi512_si256(pair));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (j + 1) * ld),
                          _mm512_extracti64x4_epi64(pair, 1));
    }
    return;
  }
#endif
  for (int j = 0; j < kChunk; ++j)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j * ld), bf16_exact(w[j]));
}

}  // namespace
#endif

// int4_dequantize's tile in bfloat16, written into `out` (bfloat16 [K, 16 * blocks], a buffer
// the caller reuses: a fresh one per tile costs page faults that outweigh the work): each weight
// q * scale - offset computed in float32 (a product, then a difference: the reference's two
// roundings, never fused) and rounded once to bfloat16, bit for bit torch's
// dequantize_int4(...).to(torch.bfloat16).
void int4_dequantize_bf16(torch::Tensor packed, torch::Tensor scales, torch::Tensor offsets,
                          int64_t group, int64_t N, int64_t K, int64_t block0, int64_t blocks,
                          torch::Tensor out) {
  TORCH_CHECK(int4_linear_available(), "int4_dequantize_bf16: this build has no AVX-512 VNNI");
  check_packed(packed, scales, offsets, K, group, N);
  TORCH_CHECK(block0 >= 0 && blocks >= 0 && 16 * (block0 + blocks) < N + kBlock,
              "int4_dequantize_bf16: blocks out of range");
  TORCH_CHECK(out.scalar_type() == torch::kBFloat16 && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == K && out.size(1) == blocks * kBlock,
              "int4_dequantize_bf16: out must be contiguous [K, 16 * blocks] bfloat16");
#ifdef QIAO_INT4_VNNI
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* opp = offsets.data_ptr<float>();
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t G = K / group, chunks = K / kChunk, ld = blocks * kBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = block0 + i;
      const uint8_t* wb = wp + b * chunks * kChunkBytes;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t g = c * kChunk / group;
        dequantize_chunk_bf16(wb + c * kChunkBytes, _mm512_loadu_ps(sp + (b * G + g) * kBlock),
                              _mm512_loadu_ps(opp + (b * G + g) * kBlock),
                              op + c * kChunk * ld + i * kBlock, ld);
      }
    }
  });
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_linear_available", &int4_linear_available, "whether int4_linear is compiled here");
  m.def("int4_linear", &int4_linear, "x @ W^T + bias over a pack_int4 weight, for few rows of x");
  m.def("int4_dequantize", &int4_dequantize, "W^T [K, 16 * blocks] float32 of a pack_int4 weight");
  m.def("int4_dequantize_bf16", &int4_dequantize_bf16,
        "W^T [K, 16 * blocks] bfloat16 of a pack_int4 weight into out, each value rounded once");
}
