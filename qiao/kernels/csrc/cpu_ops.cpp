// qiao CPU kernels: paged attention over the block table (no padded copies of the context),
// and fused one-pass RMSNorm, residual-add + RMSNorm, SiLU-and-mul and rotary embedding.
// Each has a plain-PyTorch reference in qiao (the test oracle and the fallback).
// Compute is float32 whatever the storage dtype (float32, bfloat16, float16).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

template <typename T>
inline T from_f(float v) { return static_cast<T>(v); }

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Scratch: loads a row of any storage dtype as float32.
template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t n) {
  for (int64_t i = 0; i < n; ++i) buf[i] = to_f(src[i]);
  return buf;
}
template <>
inline const float* as_float<float>(const float* src, float*, int64_t) { return src; }

// out[t, h, :] = softmax(q[t, h] . K[ctx]) V[ctx] for every new token t over its sequence's
// context, read block by block from the paged cache. Work item = (token, kv head): the group of
// query heads that share one kv head reuses each K/V row it loads.
template <typename T>
void paged_attention_impl(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& kv_cache,
                          const torch::Tensor& block_tables, const torch::Tensor& query_start_loc,
                          const torch::Tensor& seq_lens, double scale, int64_t window) {
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t max_blocks = block_tables.size(1);
  const int64_t block_stride = block_size * num_kv_heads * head_dim;  // elements per block
  const int64_t kv_plane = kv_cache.size(1) * block_stride;           // K plane -> V plane

  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = kv_cache.data_ptr<T>();
  const T* v_ptr = k_ptr + kv_plane;
  T* out_ptr = out.data_ptr<T>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();

  // token -> sequence, once per call. E.g. query_start_loc [0, 2, 5] -> [0, 0, 1, 1, 1]
  std::vector<int32_t> seq_of(num_tokens);
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int32_t t = qsl[s]; t < qsl[s + 1]; ++t) seq_of[t] = static_cast<int32_t>(s);

  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, num_tokens * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), row(head_dim);
    std::vector<float> m(group), l(group), scores(group * block_size);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / num_kv_heads, g = item % num_kv_heads;
      const int64_t s = seq_of[t];
      const int64_t q_len = qsl[s + 1] - qsl[s];
      const int64_t pos = sl[s] - q_len + (t - qsl[s]);  // this token's position
      const int64_t first = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      for (int64_t h = 0; h < group; ++h) {
        const T* qh = q_ptr + (t * num_heads + g * group + h) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) qf[h * head_dim + d] = to_f(qh[d]) * fscale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      const int32_t* table = bt + s * max_blocks;
      for (int64_t start = first - first % block_size; start <= pos; start += block_size) {
        const int64_t block = table[start / block_size];
        const int64_t lo = std::max(start, first), hi = std::min(start + block_size - 1, pos);
        const int64_t n = hi - lo + 1;
        const T* kb = k_ptr + block * block_stride + g * head_dim;
        const T* vb = v_ptr + block * block_stride + g * head_dim;
        for (int64_t i = 0; i < n; ++i) {
          const float* kr = as_float(kb + (lo - start + i) * num_kv_heads * head_dim, row.data(), head_dim);
          for (int64_t h = 0; h < group; ++h) scores[h * block_size + i] = dot(&qf[h * head_dim], kr, head_dim);
        }
        // Online softmax: rescale the running sums once per block.
        for (int64_t h = 0; h < group; ++h) {
          float bmax = m[h];
          for (int64_t i = 0; i < n; ++i) bmax = std::max(bmax, scores[h * block_size + i]);
          const float correction = std::exp(m[h] - bmax);
          m[h] = bmax;
          l[h] *= correction;
          float* a = &acc[h * head_dim];
          for (int64_t d = 0; d < head_dim; ++d) a[d] *= correction;
          for (int64_t i = 0; i < n; ++i) {
            const float p = std::exp(scores[h * block_size + i] - bmax);
            scores[h * block_size + i] = p;
            l[h] += p;
          }
        }
        for (int64_t i = 0; i < n; ++i) {
          const float* vr = as_float(vb + (lo - start + i) * num_kv_heads * head_dim, row.data(), head_dim);
          for (int64_t h = 0; h < group; ++h) {
            const float p = scores[h * block_size + i];
            float* a = &acc[h * head_dim];
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vr[d];
          }
        }
      }
      for (int64_t h = 0; h < group; ++h) {
        T* o = out_ptr + (t * num_heads + g * group + h) * head_dim;
        const float inv = 1.f / l[h];
        for (int64_t d = 0; d < head_dim; ++d) o[d] = from_f<T>(acc[h * head_dim + d] * inv);
      }
    }
  });
}

template <typename T>
void rms_norm_row(T* out, const T* x, const T* w, int64_t n, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) { const float v = to_f(x[i]); ss += v * v; }
  const float r = 1.f / std::sqrt(ss / n + eps);
  // As Hugging Face: normalise in float32, cast to the storage dtype, then multiply by w.
  for (int64_t i = 0; i < n; ++i) out[i] = from_f<T>(to_f(w[i]) * to_f(from_f<T>(to_f(x[i]) * r)));
}

}  // namespace

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                              torch::Tensor query_start_loc, torch::Tensor seq_lens, double scale,
                              int64_t window) {
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous() && block_tables.is_contiguous());
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and the cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32 &&
              query_start_loc.scalar_type() == torch::kInt32);
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    paged_attention_impl<scalar_t>(out, q, kv_cache, block_tables, query_start_loc, seq_lens, scale, window);
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
      for (int64_t r = b; r < e; ++r) rms_norm_row(op + r * n, xp + r * n, wp, n, static_cast<float>(eps));
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
        for (int64_t i = 0; i < n; ++i) rp[r * n + i] = from_f<scalar_t>(to_f(rp[r * n + i]) + to_f(xp[r * n + i]));
        rms_norm_row(xp + r * n, rp + r * n, wp, n, static_cast<float>(eps));
      }
    });
  });
}

// [T, 2I] laid out [gate | up] -> silu(gate) * up, [T, I].
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.is_contiguous());
  const int64_t two_i = x.size(-1), inter = two_i / 2, rows = x.numel() / two_i;
  auto sizes = x.sizes().vec();
  sizes.back() = inter;
  auto out = torch::empty(sizes, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 4, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const scalar_t* gate = xp + r * two_i;
        const scalar_t* up = gate + inter;
        scalar_t* o = op + r * inter;
        for (int64_t i = 0; i < inter; ++i) {
          // Match torch: silu is computed and rounded in the storage dtype before the multiply.
          const float g = to_f(gate[i]);
          const float s = to_f(from_f<scalar_t>(g / (1.f + std::exp(-g))));
          o[i] = from_f<scalar_t>(s * to_f(up[i]));
        }
      }
    });
  });
  return out;
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "attention of new tokens over the paged KV cache");
  m.def("rms_norm", &rms_norm, "RMSNorm in one pass");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; x = RMSNorm(residual), in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a fused [gate | up] projection");
  m.def("rotary_", &rotary_, "rotary embedding in place (rotate_half layout)");
}
