// Fused CPU ops for pdv_ext's aggregators. Built by pdv_ext/kernels/cpu.py through torch's C++ extension
// JIT (torch.utils.cpp_extension.load, cached under TORCH_EXTENSIONS_DIR) and called through a plain C
// ABI on raw buffers: the file includes no torch header, so the first build takes seconds, not minutes.
//
// Every op here has a pure-torch twin in pdv_ext/kernels/reference.py and the two must agree; the
// arithmetic is therefore spelled out, not left to the compiler: the build uses -ffp-contract=off (no fused
// multiply-add changes the rounding), reductions over tensors run in a fixed chunk order that does not
// depend on the thread count, and orderings are total (NaN above +inf, ties broken by lower index).
// See docs/kernels.md for the contract of each op. Every entry point returns 0, or -1 on failure.
#include <omp.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

namespace {

constexpr int64_t kChunk = 1 << 15;  // elements per work item of the multi-tensor ops

// ---- Adasum: dot product and squared norms, float64 accumulation --------------------------------
// 8 independent lanes (lane k sums the elements i + k), reduced in a fixed tree. The lanes make the sums
// vectorisable without reassociation; GCC does not vectorise the float -> double widening on its own, so
// with AVX the main loop is written out (same products, same additions per lane: bit-identical to the
// portable loop, which runs where AVX is absent and for the tail).
struct Lanes {
  double sd[8] = {0}, sa[8] = {0}, sb[8] = {0};
};

template <typename T>
int64_t dot3_main(const T* __restrict__ a, const T* __restrict__ b, int64_t n, Lanes& l) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) {
      const double x = static_cast<double>(a[i + k]);
      const double y = static_cast<double>(b[i + k]);
      l.sd[k] += x * y;
      l.sa[k] += x * x;
      l.sb[k] += y * y;
    }
  }
  return i;
}

#if defined(__AVX__)
// lanes 0-3 in the `lo` registers, 4-7 in `hi`; explicit mul then add (no FMA), as in the portable loop
struct AvxLanes {
  __m256d d0 = _mm256_setzero_pd(), d1 = _mm256_setzero_pd(), a0 = _mm256_setzero_pd(),
          a1 = _mm256_setzero_pd(), b0 = _mm256_setzero_pd(), b1 = _mm256_setzero_pd();
  void add(__m256d x0, __m256d x1, __m256d y0, __m256d y1) {
    d0 = _mm256_add_pd(d0, _mm256_mul_pd(x0, y0));
    d1 = _mm256_add_pd(d1, _mm256_mul_pd(x1, y1));
    a0 = _mm256_add_pd(a0, _mm256_mul_pd(x0, x0));
    a1 = _mm256_add_pd(a1, _mm256_mul_pd(x1, x1));
    b0 = _mm256_add_pd(b0, _mm256_mul_pd(y0, y0));
    b1 = _mm256_add_pd(b1, _mm256_mul_pd(y1, y1));
  }
#if defined(__FMA__)
  // for float inputs: a product of two widened floats is exact in float64 (24 + 24 bits < 53), so the
  // fused multiply-add rounds exactly where mul-then-add does; half the arithmetic, bit-identical
  void add_exact(__m256d x0, __m256d x1, __m256d y0, __m256d y1) {
    d0 = _mm256_fmadd_pd(x0, y0, d0);
    d1 = _mm256_fmadd_pd(x1, y1, d1);
    a0 = _mm256_fmadd_pd(x0, x0, a0);
    a1 = _mm256_fmadd_pd(x1, x1, a1);
    b0 = _mm256_fmadd_pd(y0, y0, b0);
    b1 = _mm256_fmadd_pd(y1, y1, b1);
  }
#else
  void add_exact(__m256d x0, __m256d x1, __m256d y0, __m256d y1) { add(x0, x1, y0, y1); }
#endif
  void store(Lanes& l) const {
    _mm256_storeu_pd(l.sd, d0), _mm256_storeu_pd(l.sd + 4, d1);
    _mm256_storeu_pd(l.sa, a0), _mm256_storeu_pd(l.sa + 4, a1);
    _mm256_storeu_pd(l.sb, b0), _mm256_storeu_pd(l.sb + 4, b1);
  }
};

template <>
int64_t dot3_main<float>(const float* __restrict__ a, const float* __restrict__ b, int64_t n, Lanes& l) {
  AvxLanes v;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(a + i), y = _mm256_loadu_ps(b + i);
    v.add_exact(_mm256_cvtps_pd(_mm256_castps256_ps128(x)), _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)),
                _mm256_cvtps_pd(_mm256_castps256_ps128(y)), _mm256_cvtps_pd(_mm256_extractf128_ps(y, 1)));
  }
  v.store(l);
  return i;
}

template <>
int64_t dot3_main<double>(const double* __restrict__ a, const double* __restrict__ b, int64_t n, Lanes& l) {
  AvxLanes v;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    v.add(_mm256_loadu_pd(a + i), _mm256_loadu_pd(a + i + 4), _mm256_loadu_pd(b + i), _mm256_loadu_pd(b + i + 4));
  }
  v.store(l);
  return i;
}
#endif

template <typename T>
void dot3(const T* __restrict__ a, const T* __restrict__ b, int64_t n, double* out) {
  Lanes l;
  int64_t i = dot3_main<T>(a, b, n, l);
  for (int k = 0; i < n; ++i, ++k) {
    const double x = static_cast<double>(a[i]);
    const double y = static_cast<double>(b[i]);
    l.sd[k] += x * y;
    l.sa[k] += x * x;
    l.sb[k] += y * y;
  }
  auto tree = [](const double* s) {
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  };
  out[0] = tree(l.sd);
  out[1] = tree(l.sa);
  out[2] = tree(l.sb);
}

struct Piece {
  int64_t tensor, start, len;
};

std::vector<Piece> pieces_of(int64_t n, const int64_t* sizes) {
  std::vector<Piece> pieces;
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t s = 0; s < sizes[t]; s += kChunk) pieces.push_back({t, s, std::min(kChunk, sizes[t] - s)});
  }
  return pieces;
}

template <typename T>
void adasum_dots_impl(int64_t n, const void* const* a, const void* const* b, const int64_t* sizes, double* out,
                      int threads) {
  const auto pieces = pieces_of(n, sizes);
  const int64_t np = static_cast<int64_t>(pieces.size());
  std::vector<double> partial(3 * np, 0.0);
#pragma omp parallel for schedule(static) num_threads(threads) if (np > 1 && threads > 1)
  for (int64_t p = 0; p < np; ++p) {
    const Piece& pc = pieces[p];
    dot3<T>(static_cast<const T*>(a[pc.tensor]) + pc.start, static_cast<const T*>(b[pc.tensor]) + pc.start,
            pc.len, &partial[3 * p]);
  }
  std::fill(out, out + 3 * n, 0.0);
  for (int64_t p = 0; p < np; ++p) {  // fixed order: independent of the thread count
    const int64_t t = pieces[p].tensor;
    out[t] += partial[3 * p];
    out[n + t] += partial[3 * p + 1];
    out[2 * n + t] += partial[3 * p + 2];
  }
}

// out_i = ca_i * a_i + cb_i * b_i, computed in float64 and rounded once to the tensor's dtype
template <typename T>
void scaled_add(const T* a, const T* b, T* out, int64_t n, double ca, double cb) {
  for (int64_t i = 0; i < n; ++i) {
    const double x = ca * static_cast<double>(a[i]);
    const double y = cb * static_cast<double>(b[i]);
    out[i] = static_cast<T>(x + y);
  }
}

#if defined(__AVX__)
// The same arithmetic written out for float (GCC's own vectorisation of the widening loop ran 45% slower
// than a plain in-place add of the same bytes): widen, multiply, add in float64, round once.
template <>
void scaled_add<float>(const float* a, const float* b, float* out, int64_t n, double ca, double cb) {
  const __m256d va = _mm256_set1_pd(ca), vb = _mm256_set1_pd(cb);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(a + i), y = _mm256_loadu_ps(b + i);
    const __m256d lo = _mm256_add_pd(_mm256_mul_pd(va, _mm256_cvtps_pd(_mm256_castps256_ps128(x))),
                                     _mm256_mul_pd(vb, _mm256_cvtps_pd(_mm256_castps256_ps128(y))));
    const __m256d hi = _mm256_add_pd(_mm256_mul_pd(va, _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1))),
                                     _mm256_mul_pd(vb, _mm256_cvtps_pd(_mm256_extractf128_ps(y, 1))));
    _mm256_storeu_ps(out + i, _mm256_insertf128_ps(_mm256_castps128_ps256(_mm256_cvtpd_ps(lo)),
                                                   _mm256_cvtpd_ps(hi), 1));
  }
  for (; i < n; ++i) {
    const double x = ca * static_cast<double>(a[i]);
    const double y = cb * static_cast<double>(b[i]);
    out[i] = static_cast<float>(x + y);
  }
}
#endif

template <typename T>
void adasum_combine_impl(int64_t n, const void* const* a, const void* const* b, void* const* out,
                         const int64_t* sizes, const double* ca, const double* cb, int threads) {
  const auto pieces = pieces_of(n, sizes);
  const int64_t np = static_cast<int64_t>(pieces.size());
#pragma omp parallel for schedule(static) num_threads(threads) if (np > 1 && threads > 1)
  for (int64_t p = 0; p < np; ++p) {
    const Piece& pc = pieces[p];
    const int64_t t = pc.tensor;
    scaled_add<T>(static_cast<const T*>(a[t]) + pc.start, static_cast<const T*>(b[t]) + pc.start,
                  static_cast<T*>(out[t]) + pc.start, pc.len, ca[t], cb[t]);
  }
}

// ---- top-k with error feedback --------------------------------------------------------------------
// Order key of |x| as an unsigned integer: the bit pattern of |x| orders like |x| for non-negative
// floats; every NaN maps to the canonical quiet NaN, which lies above +inf.
template <typename T> struct KeyOf;
template <> struct KeyOf<float> {
  using K = uint32_t;
  static constexpr int kShift = 16;
  static K key(float v) {
    if (std::isnan(v)) return 0x7fc00000u;
    K k;
    std::memcpy(&k, &v, sizeof k);
    return k & 0x7fffffffu;
  }
};
template <> struct KeyOf<double> {
  using K = uint64_t;
  static constexpr int kShift = 48;
  static K key(double v) {
    if (std::isnan(v)) return 0x7ff8000000000000ull;
    K k;
    std::memcpy(&k, &v, sizeof k);
    return k & 0x7fffffffffffffffull;
  }
};

// Radix select on the top 16 bits of the key (one fused pass with the error-feedback update), then an
// exact selection among the few candidates of the boundary bucket.
template <typename T>
void topk_ef_impl(const T* update, T* residual, int64_t n, int64_t k, int64_t* idx, T* vals) {
  using KO = KeyOf<T>;
  using K = typename KO::K;
  constexpr int S = KO::kShift;
  if (k == 0 || k == n) {
    for (int64_t i = 0; i < n; ++i) residual[i] = update[i] + residual[i];
    for (int64_t i = 0; i < k; ++i) idx[i] = i;
  } else {
    std::vector<int64_t> hist(1 << 16, 0);
    for (int64_t i = 0; i < n; ++i) {  // pass 1: acc = update + residual, histogram of the key's top bits
      const T v = update[i] + residual[i];
      residual[i] = v;
      hist[KO::key(v) >> S] += 1;
    }
    int64_t above = 0, bucket = (1 << 16) - 1;
    for (; bucket > 0; --bucket) {
      if (above + hist[bucket] >= k) break;
      above += hist[bucket];
    }
    const K B = static_cast<K>(bucket);
    std::vector<int64_t> sel, cand;  // pass 2: higher buckets are in; the boundary bucket holds candidates
    sel.reserve(above);
    cand.reserve(hist[bucket]);
    for (int64_t i = 0; i < n; ++i) {
      const K b = KO::key(residual[i]) >> S;
      if (b > B) sel.push_back(i);
      else if (b == B) cand.push_back(i);
    }
    const int64_t need = k - above;
    std::vector<K> ck(cand.size());
    for (size_t j = 0; j < cand.size(); ++j) ck[j] = KO::key(residual[cand[j]]);
    std::vector<K> tmp(ck);
    std::nth_element(tmp.begin(), tmp.begin() + (need - 1), tmp.end(), std::greater<K>());
    const K thr = tmp[need - 1];
    int64_t gt = 0;
    for (K v : ck) gt += v > thr;
    int64_t ties = need - gt;  // ties at the threshold: lowest indices first
    std::vector<int64_t> chosen;
    chosen.reserve(need);
    for (size_t j = 0; j < cand.size(); ++j) {
      if (ck[j] > thr) {
        chosen.push_back(cand[j]);
      } else if (ck[j] == thr && ties > 0) {
        chosen.push_back(cand[j]);
        --ties;
      }
    }
    std::merge(sel.begin(), sel.end(), chosen.begin(), chosen.end(), idx);
  }
  for (int64_t j = 0; j < k; ++j) {
    vals[j] = residual[idx[j]];
    residual[idx[j]] = 0;
  }
}

// ---- coordinate-wise median / trimmed mean over m vectors ----------------------------------------
// Order-preserving integer keys: ascending floats with -0.0 just below +0.0 and every NaN mapped to the
// largest key (after +inf). The map is its own inverse on non-NaN values; NaN comes back canonical.
template <typename T> struct OrdKey;
template <> struct OrdKey<float> {
  using I = int32_t;
  static I key(float x) {
    I b;
    std::memcpy(&b, &x, sizeof b);
    const I mag = b & 0x7fffffff;
    return mag > 0x7f800000 ? 0x7fffffff : (b ^ ((b >> 31) & 0x7fffffff));
  }
  static float value(I k) {
    const I b = k ^ ((k >> 31) & 0x7fffffff);
    float x;
    std::memcpy(&x, &b, sizeof x);
    return x;
  }
};
template <> struct OrdKey<double> {
  using I = int64_t;
  static constexpr I kMag = 0x7fffffffffffffffLL;
  static I key(double x) {
    I b;
    std::memcpy(&b, &x, sizeof b);
    const I mag = b & kMag;
    return mag > 0x7ff0000000000000LL ? kMag : (b ^ ((b >> 63) & kMag));
  }
  static double value(I k) {
    const I b = k ^ ((k >> 63) & kMag);
    double x;
    std::memcpy(&x, &b, sizeof x);
    return x;
  }
};

// Column-wise reduction of an (m, n) row-major stack: tiles of kBlock columns are converted to keys and
// sorted with an odd-even transposition network (branch-free min/max over contiguous rows, so it runs
// SIMD across columns) for m <= 32, or per column with std::sort beyond; `emit` then reads the sorted
// rows of the tile.
template <typename T, typename Emit>
void over_columns(const T* s, int64_t m, int64_t n, T* o, int threads, Emit emit) {
  using KO = OrdKey<T>;
  using I = typename KO::I;
  constexpr int64_t kBlock = 256;
  const int64_t nb = (n + kBlock - 1) / kBlock;
#pragma omp parallel num_threads(threads) if (nb > 1 && threads > 1)
  {
    std::vector<I> tile(m * kBlock), col(m);
    std::vector<T> vals(m * kBlock);
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < nb; ++blk) {
      const int64_t j0 = blk * kBlock, w = std::min(kBlock, n - j0);
      for (int64_t i = 0; i < m; ++i) {
        const T* src = s + i * n + j0;
        I* dst = &tile[i * kBlock];
        for (int64_t j = 0; j < w; ++j) dst[j] = KO::key(src[j]);
      }
      if (m <= 32) {
        for (int64_t r = 0; r < m; ++r) {
          for (int64_t i = r & 1; i + 1 < m; i += 2) {
            I* x = &tile[i * kBlock];
            I* y = &tile[(i + 1) * kBlock];
            for (int64_t j = 0; j < w; ++j) {
              const I lo = std::min(x[j], y[j]), hi = std::max(x[j], y[j]);
              x[j] = lo;
              y[j] = hi;
            }
          }
        }
      } else {
        for (int64_t j = 0; j < w; ++j) {
          for (int64_t i = 0; i < m; ++i) col[i] = tile[i * kBlock + j];
          std::sort(col.begin(), col.end());
          for (int64_t i = 0; i < m; ++i) tile[i * kBlock + j] = col[i];
        }
      }
      for (int64_t i = 0; i < m; ++i) {
        const I* src = &tile[i * kBlock];
        T* dst = &vals[i * kBlock];
        for (int64_t j = 0; j < w; ++j) dst[j] = KO::value(src[j]);
      }
      emit(vals.data(), kBlock, w, o + j0);
    }
  }
}

template <typename T>
void median_impl(const T* s, int64_t m, int64_t n, T* o, int threads) {
  over_columns<T>(s, m, n, o, threads, [m](const T* v, int64_t stride, int64_t w, T* out) {
    if (m % 2) {
      std::memcpy(out, v + (m / 2) * stride, w * sizeof(T));
      return;
    }
    const T* lo = v + (m / 2 - 1) * stride;
    const T* hi = v + (m / 2) * stride;
    for (int64_t j = 0; j < w; ++j) out[j] = (lo[j] + hi[j]) / static_cast<T>(2);
  });
}

template <typename T>
void trimmed_mean_impl(const T* s, int64_t m, int64_t n, int64_t trim, T* o, int threads) {
  const int64_t cnt = m - 2 * trim;
  over_columns<T>(s, m, n, o, threads, [trim, cnt](const T* v, int64_t stride, int64_t w, T* out) {
    double acc[256];
    for (int64_t j = 0; j < w; ++j) acc[j] = static_cast<double>(v[trim * stride + j]);  // ascending, float64
    for (int64_t i = trim + 1; i < trim + cnt; ++i)
      for (int64_t j = 0; j < w; ++j) acc[j] += static_cast<double>(v[i * stride + j]);
    for (int64_t j = 0; j < w; ++j) out[j] = static_cast<T>(acc[j] / static_cast<double>(cnt));
  });
}

template <typename F>
int guarded(F f) {
  try {
    f();
    return 0;
  } catch (...) {  // never let a C++ exception cross the C ABI
    return -1;
  }
}

}  // namespace

// dtype: 0 = float32, 1 = float64. Pointer arrays hold one data pointer per tensor.
extern "C" {

int pdv_adasum_dots(int dtype, int64_t n, const void* const* a, const void* const* b, const int64_t* sizes,
                    double* out3n, int threads) {
  return guarded([&] {
    if (dtype == 0) adasum_dots_impl<float>(n, a, b, sizes, out3n, threads);
    else adasum_dots_impl<double>(n, a, b, sizes, out3n, threads);
  });
}

int pdv_adasum_combine(int dtype, int64_t n, const void* const* a, const void* const* b, void* const* out,
                       const int64_t* sizes, const double* ca, const double* cb, int threads) {
  return guarded([&] {
    if (dtype == 0) adasum_combine_impl<float>(n, a, b, out, sizes, ca, cb, threads);
    else adasum_combine_impl<double>(n, a, b, out, sizes, ca, cb, threads);
  });
}

int pdv_topk_error_feedback(int dtype, const void* update, void* residual, int64_t n, int64_t k, int64_t* idx,
                            void* vals) {
  return guarded([&] {
    if (dtype == 0)
      topk_ef_impl<float>(static_cast<const float*>(update), static_cast<float*>(residual), n, k, idx,
                          static_cast<float*>(vals));
    else
      topk_ef_impl<double>(static_cast<const double*>(update), static_cast<double*>(residual), n, k, idx,
                           static_cast<double*>(vals));
  });
}

int pdv_coordinate_median(int dtype, const void* stack, int64_t m, int64_t n, void* out, int threads) {
  return guarded([&] {
    if (dtype == 0) median_impl<float>(static_cast<const float*>(stack), m, n, static_cast<float*>(out), threads);
    else median_impl<double>(static_cast<const double*>(stack), m, n, static_cast<double*>(out), threads);
  });
}

int pdv_trimmed_mean(int dtype, const void* stack, int64_t m, int64_t n, int64_t trim, void* out, int threads) {
  return guarded([&] {
    if (dtype == 0)
      trimmed_mean_impl<float>(static_cast<const float*>(stack), m, n, trim, static_cast<float*>(out), threads);
    else
      trimmed_mean_impl<double>(static_cast<const double*>(stack), m, n, trim, static_cast<double*>(out),
                                threads);
  });
}

}  // extern "C"
