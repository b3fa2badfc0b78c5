// Which pipes the integer GEMM's instructions compete for (AVX-512 VNNI CPUs): vpdpbusd alone, FMA alone, and
// 8 vpdpbusd beside 4 of another instruction (the integer GEMM's inner step per row and 32-block is 8 vpdpbusd,
// then a convert, a multiply and one or two FMAs). Independent chains in registers, so that only throughput shows.
//   g++ -O2 -march=native ports.cpp -o /tmp/ports && /tmp/ports
#include <immintrin.h>

#include <chrono>
#include <cstdio>

#define R4(X) X(0) X(1) X(2) X(3)
#define R8(X) R4(X) X(4) X(5) X(6) X(7)
#define R12(X) R8(X) X(8) X(9) X(10) X(11)

constexpr long N = 100000000;

template <typename F>
double seconds(F f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

#define DECL_I(i) __m512i a##i = _mm512_set1_epi32(i);
#define DECL_F(i) __m512 f##i = _mm512_set1_ps(static_cast<float>(i));
#define DOT(i) a##i = _mm512_dpbusd_epi32(a##i, w, x);
#define SUM_I(i) r = _mm512_add_epi32(r, a##i);
#define SUM_F(i) fr = _mm512_add_ps(fr, f##i);

// 8 vpdpbusd and 4 of OP(f) an iteration; prints its ns and that time in units of one vpdpbusd's (dot_ns)
#define MIX(NAME, OP)                                                                                         \
  {                                                                                                           \
    R8(DECL_I) R4(DECL_F) __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);                           \
    __m512 fa = _mm512_set1_ps(1.0f), fb = _mm512_set1_ps(0.0f);                                              \
    const double s = seconds([&] {                                                                            \
      for (long n = 0; n < N; ++n) {                                                                          \
        R8(DOT)                                                                                               \
        f0 = OP(f0); f1 = OP(f1); f2 = OP(f2); f3 = OP(f3);                                                   \
        __asm__ volatile("" : "+v"(w), "+v"(x), "+v"(fa), "+v"(fb));                                          \
      }                                                                                                       \
    });                                                                                                       \
    __m512i r = _mm512_setzero_si512(); R8(SUM_I) __m512 fr = _mm512_setzero_ps(); R4(SUM_F)               \
    std::printf("8 vpdpbusd + 4 %-4s %6.2f ns an iteration = %5.2f vpdpbusd-times  (%d %g)\n", NAME, s / N * 1e9, \
                s / N * 1e9 / dot_ns, _mm512_reduce_add_epi32(r), static_cast<double>(_mm512_reduce_add_ps(fr))); \
  }

int main() {
  double dot_ns = 0.0;
  {
    R12(DECL_I) __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
    const double s = seconds([&] {
      for (long n = 0; n < N; ++n) {
        R12(DOT)
        __asm__ volatile("" : "+v"(w), "+v"(x));
      }
    });
    __m512i r = _mm512_setzero_si512();
    R12(SUM_I)
    dot_ns = s / N * 1e9 / 12;
    std::printf("vpdpbusd zmm alone: %.2f G/s = %.1f GMAC/s (u8 x s8)  (%d)\n", 12 * N / s / 1e9, 12 * N * 64 / s / 1e9,
                _mm512_reduce_add_epi32(r));
  }
  {
    R12(DECL_F) __m512 fa = _mm512_set1_ps(1.0f), fb = _mm512_set1_ps(0.0f);
#define FMA(i) f##i = _mm512_fmadd_ps(f##i, fa, fb);
    const double s = seconds([&] {
      for (long n = 0; n < N; ++n) {
        R12(FMA)
        __asm__ volatile("" : "+v"(fa), "+v"(fb));
      }
    });
    __m512 fr = _mm512_setzero_ps();
    R12(SUM_F)
    std::printf("vfmadd zmm alone:   %.2f G/s  (%g)\n", 12 * N / s / 1e9, static_cast<double>(_mm512_reduce_add_ps(fr)));
  }
#define OP_FMA(v) _mm512_fmadd_ps(v, fa, fb)
#define OP_MUL(v) _mm512_mul_ps(v, fa)
#define OP_ADD(v) _mm512_add_ps(v, fa)
#define OP_CVT(v) _mm512_cvtepi32_ps(_mm512_castps_si512(v))
#define OP_NONE(v) (v)
  MIX("none", OP_NONE)
  MIX("fma", OP_FMA)
  MIX("mul", OP_MUL)
  MIX("add", OP_ADD)
  MIX("cvt", OP_CVT)
  return 0;
}
