// Rates of single AVX2 instructions on this core (session 44, Zen 3): a dependent vpaddd chain (the clock), and 8
// independent vpmaddubsw / vpmaddwd / vfmadd231ps / vpaddw a loop. g++ -O2 -march=native; taskset -c 1.
// Zen 3 (family 25 model 1), 2.9 GHz: vpaddd chain 2.95 G/s; vpmaddubsw 5.81 G/s (2 a cycle); vpmaddwd 5.18;
// vfmadd231ps 5.38 (2 a cycle); vpaddw 8.78 (3 a cycle).
#include <immintrin.h>
#include <chrono>
#include <cstdio>
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main() {
  long N = 200000000;
  { __m256i a = _mm256_set1_epi32(1), b = _mm256_set1_epi32(2); double t = now();
  for (long i = 0; i < N; ++i) __asm__ volatile("vpaddd %1, %0, %0\n\tvpaddd %1, %0, %0\n\tvpaddd %1, %0, %0\n\tvpaddd %1, %0, %0" : "+x"(a) : "x"(b));
  double dt = now() - t; std::printf("vpaddd ymm chain: %.2f G/s\n", 4.0 * N / dt / 1e9); }
  { __m256i a0 = _mm256_set1_epi32(1), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, b = _mm256_set1_epi8(2); double t = now();
  for (long i = 0; i < N; ++i) __asm__ volatile("vpmaddubsw %8, %0, %0\n\tvpmaddubsw %8, %1, %1\n\tvpmaddubsw %8, %2, %2\n\tvpmaddubsw %8, %3, %3\n\tvpmaddubsw %8, %4, %4\n\tvpmaddubsw %8, %5, %5\n\tvpmaddubsw %8, %6, %6\n\tvpmaddubsw %8, %7, %7" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7) : "x"(b));
  double dt = now() - t; std::printf("vpmaddubsw ymm x8 indep: %.2f G/s\n", 8.0 * N / dt / 1e9); }
  { __m256i a0 = _mm256_set1_epi32(1), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, b = _mm256_set1_epi8(2); double t = now();
  for (long i = 0; i < N; ++i) __asm__ volatile("vpmaddwd %8, %0, %0\n\tvpmaddwd %8, %1, %1\n\tvpmaddwd %8, %2, %2\n\tvpmaddwd %8, %3, %3\n\tvpmaddwd %8, %4, %4\n\tvpmaddwd %8, %5, %5\n\tvpmaddwd %8, %6, %6\n\tvpmaddwd %8, %7, %7" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7) : "x"(b));
  double dt = now() - t; std::printf("vpmaddwd ymm x8 indep: %.2f G/s\n", 8.0 * N / dt / 1e9); }
  { __m256 a0 = _mm256_set1_ps(1), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, b = _mm256_set1_ps(1.0f); double t = now();
  for (long i = 0; i < N; ++i) __asm__ volatile("vfmadd231ps %8, %8, %0\n\tvfmadd231ps %8, %8, %1\n\tvfmadd231ps %8, %8, %2\n\tvfmadd231ps %8, %8, %3\n\tvfmadd231ps %8, %8, %4\n\tvfmadd231ps %8, %8, %5\n\tvfmadd231ps %8, %8, %6\n\tvfmadd231ps %8, %8, %7" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7) : "x"(b));
  double dt = now() - t; std::printf("vfmadd ymm x8 indep: %.2f G/s\n", 8.0 * N / dt / 1e9); }
  { __m256i a0 = _mm256_set1_epi32(1), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, b = _mm256_set1_epi8(2); double t = now();
  for (long i = 0; i < N; ++i) __asm__ volatile("vpaddw %8, %0, %0\n\tvpaddw %8, %1, %1\n\tvpaddw %8, %2, %2\n\tvpaddw %8, %3, %3\n\tvpaddw %8, %4, %4\n\tvpaddw %8, %5, %5\n\tvpaddw %8, %6, %6\n\tvpaddw %8, %7, %7" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7) : "x"(b));
  double dt = now() - t; std::printf("vpaddw ymm x8 indep: %.2f G/s\n", 8.0 * N / dt / 1e9); }
}
