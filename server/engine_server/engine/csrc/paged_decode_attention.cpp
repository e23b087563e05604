// Decode attention over the paged KV cache, read in place (CPU).
//
// Why it exists: on CPU the torch-only path gathers every decoding sequence's blocks into a padded
// copy per layer and then runs SDPA over it. For 64 sequences of ~150 tokens on the 30M model that is
// ~9 MB written and read twice per layer, and the traffic also evicts the weights the next matmuls
// need (measured: the step's linears ran 2.5x slower with 20 MB touched between them). Here each
// sequence's key and value rows (all kv heads, contiguous) are read once, straight from the block table.
//
// Shapes: q [n, kv_heads, group, d] (query heads h*group..h*group+group-1 share kv head h);
// k_cache, v_cache [num_blocks, block_size, kv_heads, d]; block_tables [n, max_blocks] int64;
// context_lens [n] int64; out like q. All contiguous. window > 0: only the last `window` positions
// are attended; softcap > 0: scores become tanh(s / softcap) * softcap (Gemma2).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace engine_kernels {
namespace {

// Everything a sequence's attention needs, shared by both implementations below.
template <typename T>
struct Args {
  const T* q;
  const T* k_cache;
  const T* v_cache;
  const int64_t* tables;
  const int64_t* lens;
  T* out;
  int64_t n, kv_heads, group, d, block_size, max_blocks, window;
  float scale, softcap;
};

// Per-thread scratch: query heads of one kv head in float, their scores, a converted K/V row, outputs.
struct Scratch {
  std::vector<float> q, scores, row, acc;
};

// Asks for a cache block's rows ahead of their use. Blocks are scattered: with small heads the hardware
// prefetcher saw too little of each block to start, and every cache line was a miss waited for (on a 2-vCPU
// AMD EPYC, 256 sequences of 150 positions with 2 kv heads of 16: ~115 ns per position with the cache
// cold, ~45 ns with it warm).
template <typename T>
inline void prefetch_block(const T* cache, const Args<T>& a, int64_t block) {
  const int64_t bytes = a.block_size * a.kv_heads * a.d * static_cast<int64_t>(sizeof(T));
  const char* p = reinterpret_cast<const char*>(cache + block * a.block_size * a.kv_heads * a.d);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset, 0, 3);
}

// Calls fn(pos, row of kv head h) for pos in [start, len), walking the block table one block at a time
// (a division per position cost more than the arithmetic of its attention), the next block prefetched.
// companion: the other cache, whose block of the same positions is prefetched as each block starts (the key
// pass asks for the value rows the next pass reads: 256 sequences of 150 positions, cache cold, on an Intel
// Xeon: ~28 -> ~26 ns per position, interleaved runs).
template <typename T, typename Fn>
inline void for_each_row(const T* cache, const Args<T>& a, const int64_t* table, int64_t start, int64_t len,
                         int64_t h, Fn&& fn, const T* companion = nullptr) {
  const int64_t row = a.kv_heads * a.d;
  const int64_t last_block = (len - 1) / a.block_size;
  for (int64_t pos = start; pos < len;) {
    const int64_t block = pos / a.block_size, end = std::min(len, (block + 1) * a.block_size);
    if (block < last_block) prefetch_block(cache, a, table[block + 1]);
    if (companion != nullptr) prefetch_block(companion, a, table[block]);
    const T* p = cache + (table[block] * a.block_size + pos - block * a.block_size) * row + h * a.d;
    for (; pos < end; ++pos, p += row) fn(pos, p);
  }
}

#ifdef ENGINE_AVX512
template <typename T>
void attend(const Args<T>& a, int64_t s, Scratch& w) {
  const int64_t len = a.lens[s], start = a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0;
  const int64_t span = len - start, g = a.group, d = a.d, heads = a.kv_heads * g;
  const int64_t dp = (d + 15) / 16 * 16;  // scratch stride: whole 16-lane chunks, the tail lanes zero
  const int64_t* table = a.tables + s * a.max_blocks;
  w.scores.resize(heads * span);
  const T* qp = a.q + s * heads * d;
  for (int64_t i = 0; i < heads; ++i)
    for (int64_t e = 0; e < d; ++e) w.q[i * dp + e] = static_cast<float>(qp[i * d + e]) * a.scale;
  // 1) scores, 16 positions at a time: their key rows (all kv heads, contiguous) stay in L1 while each query
  // head takes 16 dot products, summed across lanes together (sum16) rather than one reduction per dot
  const T* rows[16];
  int64_t num_rows = 0, first_pos = start;
  const auto score_rows = [&] {
    for (int64_t p = num_rows; p < 16; ++p) rows[p] = rows[0];  // padding lanes: computed, not stored
    for (int64_t h = 0; h < a.kv_heads; ++h) {
      for (int64_t j = 0; j < g; ++j) {
        const float* qj = w.q.data() + (h * g + j) * dp;
        __m512 acc[16];
        for (int64_t p = 0; p < 16; ++p) acc[p] = _mm512_setzero_ps();
        for (int64_t e = 0; e < d; e += 16) {
          const __m512 qv = _mm512_loadu_ps(qj + e);
          const __mmask16 m = lanes(d - e);
          for (int64_t p = 0; p < 16; ++p) acc[p] = _mm512_fmadd_ps(qv, load16(rows[p] + h * d + e, m), acc[p]);
        }
        _mm512_mask_storeu_ps(w.scores.data() + (h * g + j) * span + first_pos - start, lanes(num_rows), sum16(acc));
      }
    }
    first_pos += num_rows;
    num_rows = 0;
  };
  for_each_row(a.k_cache, a, table, start, len, 0, [&](int64_t, const T* row) {
    rows[num_rows++] = row;
    if (num_rows == 16) score_rows();
  }, a.v_cache);
  if (num_rows > 0) score_rows();
  if (a.softcap > 0) {
    for (float& x : w.scores) x = std::tanh(x / a.softcap) * a.softcap;
  }
  // 2) softmax per query head
  for (int64_t i = 0; i < heads; ++i) {
    float* si = w.scores.data() + i * span;
    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t k = 0; k < span; k += 16)
      top = _mm512_mask_max_ps(top, lanes(span - k), top, _mm512_maskz_loadu_ps(lanes(span - k), si + k));
    const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t k = 0; k < span; k += 16) {
      const __mmask16 m = lanes(span - k);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, si + k), shift));
      _mm512_mask_storeu_ps(si + k, m, e);
      sum = _mm512_mask_add_ps(sum, m, sum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
    for (int64_t k = 0; k < span; k += 16) {
      const __mmask16 m = lanes(span - k);
      _mm512_mask_storeu_ps(si + k, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, si + k), inv));
    }
  }
  // 3) probability-weighted values, 16 positions at a time: each output chunk sums their 16 products in
  // registers (four chains, so no FMA waits on the previous one) and touches memory once
  std::fill(w.acc.begin(), w.acc.begin() + heads * dp, 0.f);
  const auto weigh_rows = [&] {
    for (int64_t p = num_rows; p < 16; ++p) rows[p] = rows[0];  // padding lanes: weight 0
    for (int64_t h = 0; h < a.kv_heads; ++h) {
      for (int64_t j = 0; j < g; ++j) {
        const float* sj = w.scores.data() + (h * g + j) * span + first_pos - start;
        float weight[16];
        for (int64_t p = 0; p < 16; ++p) weight[p] = p < num_rows ? sj[p] : 0.f;
        for (int64_t e = 0; e < d; e += 16) {
          const __mmask16 m = lanes(d - e);
          __m512 part[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
          for (int64_t p = 0; p < 16; ++p)
            part[p % 4] = _mm512_fmadd_ps(_mm512_set1_ps(weight[p]), load16(rows[p] + h * d + e, m), part[p % 4]);
          float* out = w.acc.data() + (h * g + j) * dp + e;
          const __m512 sum = _mm512_add_ps(_mm512_add_ps(part[0], part[1]), _mm512_add_ps(part[2], part[3]));
          _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(out), sum));
        }
      }
    }
    first_pos += num_rows;
    num_rows = 0;
  };
  first_pos = start;
  for_each_row(a.v_cache, a, table, start, len, 0, [&](int64_t, const T* row) {
    rows[num_rows++] = row;
    if (num_rows == 16) weigh_rows();
  });
  if (num_rows > 0) weigh_rows();
  T* op = a.out + s * heads * d;
  for (int64_t i = 0; i < heads; ++i)
    for (int64_t e = 0; e < d; ++e) op[i * d + e] = static_cast<T>(w.acc[i * dp + e]);
}
#elif defined(ENGINE_AVX2)
// The same three passes in 8-lane vectors, 8 positions at a time. Scores are kept in whole 8-lane chunks
// (stride `sp`); the padding positions of the last chunk score -inf, so softmax gives them weight 0.
template <typename T>
void attend(const Args<T>& a, int64_t s, Scratch& w) {
  const int64_t len = a.lens[s], start = a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0;
  const int64_t span = len - start, g = a.group, d = a.d, heads = a.kv_heads * g;
  const int64_t dp = (d + 7) / 8 * 8, sp = (span + 7) / 8 * 8;
  const int64_t* table = a.tables + s * a.max_blocks;
  w.scores.resize(heads * sp);
  const T* qp = a.q + s * heads * d;
  for (int64_t i = 0; i < heads; ++i)
    for (int64_t e = 0; e < d; ++e) w.q[i * dp + e] = static_cast<float>(qp[i * d + e]) * a.scale;
  // 1) scores: each query head takes 8 dot products against 8 key rows, summed across lanes together
  const T* rows[8];
  int64_t num_rows = 0, first_pos = start;
  const auto score_rows = [&] {
    for (int64_t p = num_rows; p < 8; ++p) rows[p] = rows[0];  // padding lanes: computed, then masked
    for (int64_t h = 0; h < a.kv_heads; ++h) {
      for (int64_t j = 0; j < g; ++j) {
        const float* qj = w.q.data() + (h * g + j) * dp;
        __m256 acc[8];
        for (int64_t p = 0; p < 8; ++p) acc[p] = _mm256_setzero_ps();
        for (int64_t e = 0; e < d; e += 8) {
          const __m256 qv = _mm256_loadu_ps(qj + e);
          for (int64_t p = 0; p < 8; ++p) acc[p] = _mm256_fmadd_ps(qv, load8(rows[p] + h * d + e, d - e), acc[p]);
        }
        _mm256_storeu_ps(w.scores.data() + (h * g + j) * sp + first_pos - start, sum8(acc));
      }
    }
    first_pos += num_rows;
    num_rows = 0;
  };
  for_each_row(a.k_cache, a, table, start, len, 0, [&](int64_t, const T* row) {
    rows[num_rows++] = row;
    if (num_rows == 8) score_rows();
  }, a.v_cache);
  if (num_rows > 0) score_rows();
  for (int64_t i = 0; i < heads; ++i) {
    float* si = w.scores.data() + i * sp;
    if (a.softcap > 0) {
      for (int64_t k = 0; k < span; ++k) si[k] = std::tanh(si[k] / a.softcap) * a.softcap;
    }
    for (int64_t k = span; k < sp; ++k) si[k] = -std::numeric_limits<float>::infinity();
  }
  // 2) softmax per query head
  for (int64_t i = 0; i < heads; ++i) {
    float* si = w.scores.data() + i * sp;
    __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t k = 0; k < sp; k += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(si + k));
    const __m256 shift = _mm256_set1_ps(reduce_max8(top));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t k = 0; k < sp; k += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(si + k), shift));
      _mm256_storeu_ps(si + k, e);
      sum = _mm256_add_ps(sum, e);
    }
    const __m256 inv = _mm256_set1_ps(1.f / reduce_add8(sum));
    for (int64_t k = 0; k < sp; k += 8) _mm256_storeu_ps(si + k, _mm256_mul_ps(_mm256_loadu_ps(si + k), inv));
  }
  // 3) probability-weighted values, 8 positions at a time, summed in registers (four chains)
  std::fill(w.acc.begin(), w.acc.begin() + heads * dp, 0.f);
  const auto weigh_rows = [&] {
    for (int64_t p = num_rows; p < 8; ++p) rows[p] = rows[0];  // padding lanes: weight 0
    for (int64_t h = 0; h < a.kv_heads; ++h) {
      for (int64_t j = 0; j < g; ++j) {
        const float* sj = w.scores.data() + (h * g + j) * sp + first_pos - start;
        for (int64_t e = 0; e < d; e += 8) {
          __m256 part[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
          for (int64_t p = 0; p < 8; ++p)
            part[p % 4] = _mm256_fmadd_ps(_mm256_set1_ps(sj[p]), load8(rows[p] + h * d + e, d - e), part[p % 4]);
          float* out = w.acc.data() + (h * g + j) * dp + e;
          const __m256 sum = _mm256_add_ps(_mm256_add_ps(part[0], part[1]), _mm256_add_ps(part[2], part[3]));
          _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), sum));
        }
      }
    }
    first_pos += num_rows;
    num_rows = 0;
  };
  first_pos = start;
  for_each_row(a.v_cache, a, table, start, len, 0, [&](int64_t, const T* row) {
    rows[num_rows++] = row;
    if (num_rows == 8) weigh_rows();
  });
  if (num_rows > 0) weigh_rows();
  T* op = a.out + s * heads * d;
  for (int64_t i = 0; i < heads; ++i)
    for (int64_t e = 0; e < d; ++e) op[i * d + e] = static_cast<T>(w.acc[i * dp + e]);
}
#else
// Portable version of the same three passes (CPUs without AVX2).
template <typename T>
void attend(const Args<T>& a, int64_t s, Scratch& w) {
  const int64_t len = a.lens[s], start = a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0;
  const int64_t span = len - start, g = a.group, d = a.d;
  const int64_t* table = a.tables + s * a.max_blocks;
  w.scores.resize(g * span);
  for (int64_t h = 0; h < a.kv_heads; ++h) {
    const T* qp = a.q + (s * a.kv_heads + h) * g * d;
    for (int64_t i = 0; i < g * d; ++i) w.q[i] = static_cast<float>(qp[i]) * a.scale;
    for_each_row(a.k_cache, a, table, start, len, h, [&](int64_t pos, const T* kp) {
      for (int64_t e = 0; e < d; ++e) w.row[e] = static_cast<float>(kp[e]);
      for (int64_t j = 0; j < g; ++j) {
        float score = 0.f;
        for (int64_t e = 0; e < d; ++e) score += w.q[j * d + e] * w.row[e];
        if (a.softcap > 0) score = std::tanh(score / a.softcap) * a.softcap;
        w.scores[j * span + pos - start] = score;
      }
    });
    for (int64_t j = 0; j < g; ++j) {
      float* sj = w.scores.data() + j * span;
      const float top = *std::max_element(sj, sj + span);
      float sum = 0.f;
      for (int64_t i = 0; i < span; ++i) sum += (sj[i] = std::exp(sj[i] - top));
      for (int64_t i = 0; i < span; ++i) sj[i] /= sum;
    }
    std::fill(w.acc.begin(), w.acc.begin() + g * d, 0.f);
    for_each_row(a.v_cache, a, table, start, len, h, [&](int64_t pos, const T* vp) {
      for (int64_t j = 0; j < g; ++j) {
        const float p = w.scores[j * span + pos - start];
        for (int64_t e = 0; e < d; ++e) w.acc[j * d + e] += p * static_cast<float>(vp[e]);
      }
    });
    T* op = a.out + (s * a.kv_heads + h) * g * d;
    for (int64_t i = 0; i < g * d; ++i) op[i] = static_cast<T>(w.acc[i]);
  }
}
#endif

template <typename T>
void decode(const Args<T>& a) {
  const int64_t num_threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), a.n));
  // NOTE: sequences arrive sorted by length; thread t takes every num_threads-th one, so each thread
  // gets a similar share of short and long contexts (contiguous chunks would not).
  at::parallel_for(0, num_threads, 1, [&](int64_t first, int64_t last) {
    Scratch w;
    const int64_t padded = (a.d + 15) / 16 * 16, heads = a.kv_heads * a.group;
    w.q.assign(heads * padded, 0.f);
    w.row.assign(padded, 0.f);
    w.acc.assign(heads * padded, 0.f);
    for (int64_t t = first; t < last; ++t) {
      for (int64_t s = t; s < a.n; s += num_threads) attend(a, s, w);
    }
  });
}

}  // namespace

void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            int64_t window, double softcap, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 4 && q.is_contiguous() && out.is_contiguous() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous(),
              "paged_decode_attention: contiguous q [n, kv_heads, group, d] and caches expected");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "paged_decode_attention: int64 block tables and lengths expected");
  const int64_t n = q.size(0), kv_heads = q.size(1), group = q.size(2), d = q.size(3);
  TORCH_CHECK(context_lens.numel() == n && block_tables.size(0) == n, "paged_decode_attention: one row per query");
  // NOTE: a loop, not context_lens.min().item(): that op took ~120 us per layer on a 2-vCPU machine
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(lens, lens + n, [](int64_t len) { return len > 0; }), "paged_decode_attention: empty context");
  TORCH_CHECK(k_cache.size(2) == kv_heads && k_cache.size(3) == d, "paged_decode_attention: cache shape");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
                  q.scalar_type() == out.scalar_type(), "paged_decode_attention: one dtype expected");
  ENGINE_DISPATCH_MODEL_DTYPES(q.scalar_type(), "paged_decode_attention", [&] {
    decode<scalar_t>(Args<scalar_t>{q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                    block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
                                    out.data_ptr<scalar_t>(), n, kv_heads, group, d, k_cache.size(1),
                                    block_tables.size(1), window, static_cast<float>(scale),
                                    static_cast<float>(softcap)});
  });
}

}  // namespace engine_kernels
