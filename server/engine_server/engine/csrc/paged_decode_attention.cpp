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

// Walks one sequence's positions in order, giving each one's row (all kv heads, contiguous) of a cache; the
// block table is read once per block (a division per position cost more than the arithmetic of its attention).
template <typename T>
class RowCursor {
 public:
  RowCursor(const T* cache, const Args<T>& a, const int64_t* table, int64_t start, int64_t len)
      : cache_(cache), table_(table), row_(a.kv_heads * a.d), block_size_(a.block_size), pos_(start), len_(len),
        block_(start / a.block_size), offset_(start % a.block_size) {}
  bool done() const { return pos_ >= len_; }
  const T* next() {
    const T* p = cache_ + (table_[block_] * block_size_ + offset_) * row_;
    ++pos_;
    if (++offset_ == block_size_) offset_ = 0, ++block_;
    return p;
  }

 private:
  const T* cache_;
  const int64_t* table_;
  int64_t row_, block_size_, pos_, len_, block_, offset_;
};

// Prefetches the cache lines of a run of rows a few at a time, between the computations that hide them.
// Blocks are scattered: with small heads the hardware prefetcher sees too little of each block to start, and
// every line is a miss waited for (a 2-vCPU AMD EPYC, 256 sequences of 150 positions, 2 kv heads of 16:
// ~115 ns per position cold, ~45 warm). Prefetching a whole block at once then stalled on the core's few
// line-fill buffers; spread over the work it overlaps it (an Intel Xeon, the tiny model's decode steps at
// 256 sequences, interleaved runs: ~25 -> ~22.5 ns per position).
template <typename T>
class LinePrefetcher {
 public:
  LinePrefetcher(RowCursor<T> rows, int64_t row_bytes) : rows_(rows), row_bytes_(row_bytes) {}
  void issue(int64_t lines) {
    for (; lines > 0; --lines) {
      if (left_ <= 0) {
        if (rows_.done()) return;
        line_ = reinterpret_cast<const char*>(rows_.next());
        left_ = row_bytes_;
      }
      __builtin_prefetch(line_, 0, 3);
      line_ += 64;
      left_ -= 64;
    }
  }

 private:
  RowCursor<T> rows_;
  int64_t row_bytes_;
  const char* line_ = nullptr;
  int64_t left_ = 0;
};

// The prefetches of one sequence's two passes, issued a share at a time: the key rows kAheadRows positions
// ahead of the score pass; the value rows during the score pass when they stay cached until the value pass
// (else kAheadRows ahead of it).
constexpr int64_t kAheadRows = 16;
constexpr int64_t kCachedValueBytes = 256 * 1024;

template <typename T>
struct PassPrefetch {
  LinePrefetcher<T> keys, values;
  int64_t row_lines, share;  // share: lines per call of each prefetcher (a group's lines over `calls` calls)
  bool values_with_keys;
  PassPrefetch(const Args<T>& a, const int64_t* table, int64_t start, int64_t len, int64_t group_rows,
               int64_t calls)
      : keys(RowCursor<T>(a.k_cache, a, table, start, len), row_bytes(a)),
        values(RowCursor<T>(a.v_cache, a, table, start, len), row_bytes(a)),
        row_lines((row_bytes(a) + 63) / 64),
        share((group_rows * row_lines + calls - 1) / calls),
        values_with_keys((len - start) * row_bytes(a) <= kCachedValueBytes) {
    keys.issue(row_lines * kAheadRows);  // the first rows: nothing to hide them behind
  }
  void score_step() {
    keys.issue(share);
    if (values_with_keys) values.issue(share);
  }
  void start_values() {
    if (!values_with_keys) values.issue(row_lines * kAheadRows);
  }
  void value_step() {
    if (!values_with_keys) values.issue(share);
  }
  static int64_t row_bytes(const Args<T>& a) { return a.kv_heads * a.d * static_cast<int64_t>(sizeof(T)); }
};

// Calls fn(pos, row of kv head h) for pos in [start, len) (the portable code's walk).
template <typename T, typename Fn>
inline void for_each_row(const T* cache, const Args<T>& a, const int64_t* table, int64_t start, int64_t len,
                         int64_t h, Fn&& fn) {
  RowCursor<T> rows(cache, a, table, start, len);
  const int64_t row_bytes = a.kv_heads * a.d * static_cast<int64_t>(sizeof(T)), row_lines = (row_bytes + 63) / 64;
  LinePrefetcher<T> ahead(RowCursor<T>(cache, a, table, start, len), row_bytes);
  ahead.issue(row_lines * kAheadRows);
  for (int64_t pos = start; pos < len; ++pos) {
    ahead.issue(row_lines);
    fn(pos, rows.next() + h * a.d);
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
  PassPrefetch<T> prefetch(a, table, start, len, 16, heads);
  RowCursor<T> keys(a.k_cache, a, table, start, len);
  const T* rows[16];
  for (int64_t first_pos = start; first_pos < len; first_pos += 16) {
    const int64_t num_rows = std::min<int64_t>(16, len - first_pos);
    for (int64_t p = 0; p < num_rows; ++p) rows[p] = keys.next();
    for (int64_t p = num_rows; p < 16; ++p) rows[p] = rows[0];  // padding lanes: computed, not stored
    for (int64_t h = 0; h < a.kv_heads; ++h) {
      for (int64_t j = 0; j < g; ++j) {
        prefetch.score_step();
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
  }
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
  prefetch.start_values();
  RowCursor<T> values(a.v_cache, a, table, start, len);
  for (int64_t first_pos = start; first_pos < len; first_pos += 16) {
    const int64_t num_rows = std::min<int64_t>(16, len - first_pos);
    for (int64_t p = 0; p < num_rows; ++p) rows[p] = values.next();
    for (int64_t p = num_rows; p < 16; ++p) rows[p] = rows[0];  // padding lanes: weight 0
    for (int64_t h = 0; h < a.kv_heads; ++h) {
      for (int64_t j = 0; j < g; ++j) {
        prefetch.value_step();
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
  }
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
  PassPrefetch<T> prefetch(a, table, start, len, 8, heads);
  RowCursor<T> keys(a.k_cache, a, table, start, len);
  const T* rows[8];
  for (int64_t first_pos = start; first_pos < len; first_pos += 8) {
    const int64_t num_rows = std::min<int64_t>(8, len - first_pos);
    for (int64_t p = 0; p < num_rows; ++p) rows[p] = keys.next();
    for (int64_t p = num_rows; p < 8; ++p) rows[p] = rows[0];  // padding lanes: computed, then masked
    for (int64_t h = 0; h < a.kv_heads; ++h) {
      for (int64_t j = 0; j < g; ++j) {
        prefetch.score_step();
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
  }
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
  prefetch.start_values();
  RowCursor<T> values(a.v_cache, a, table, start, len);
  for (int64_t first_pos = start; first_pos < len; first_pos += 8) {
    const int64_t num_rows = std::min<int64_t>(8, len - first_pos);
    for (int64_t p = 0; p < num_rows; ++p) rows[p] = values.next();
    for (int64_t p = num_rows; p < 8; ++p) rows[p] = rows[0];  // padding lanes: weight 0
    for (int64_t h = 0; h < a.kv_heads; ++h) {
      for (int64_t j = 0; j < g; ++j) {
        prefetch.value_step();
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
  }
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
