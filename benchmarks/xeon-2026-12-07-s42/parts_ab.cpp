// The decode attention as the fused step runs it on bf16 pages (attention.h's attend_split<64> over a sequence's
// parts, the query prepared once a sequence, the parts merged) of two versions of torch_engine/csrc/attention.h
// alternated in one process, one thread, best of `rounds` each: SmolLM2's heads (3 KV heads of 64, 3 query heads
// each), S sequences of T tokens on 16-token HND pages in shuffled order, 30 layers. Each version runs the sequences
// in parts of 2 chunks (the engine's split at 290 tokens: part_chunks() in decode_step.cpp) and whole. Mode "s": each
// layer its own pool and a 3.2 MB slice of a 96 MB buffer read before it (the weights' stream between layers); "h":
// every layer on the first pool, nothing else read. Prints old / new ms and the ratio, and the largest difference of
// the two versions' outputs. Session 42 (Emerald Rapids Xeon), parts_ab.txt:
//
//   git show 0f6efd5:torch_engine/csrc/attention.h > /tmp/attention_old.h   # the header before session 42
//   g++ -O3 -march=native -ffast-math -fno-finite-math-only -std=c++17 -I. -Itorch_engine/csrc \
//       -I.venv/lib/python3.11/site-packages/torch/include -DOLD='"/tmp/attention_old.h"' \
//       -DNEW='"torch_engine/csrc/attention.h"' -o /tmp/parts_ab benchmarks/xeon-2026-12-07-s42/parts_ab.cpp
//   taskset -c 1 /tmp/parts_ab 290 8 11 h; taskset -c 1 /tmp/parts_ab 290 8 11 s   # T S rounds mode
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <vector>
#include <random>
// Since session 44 both header versions may share the vendor check (cpu_vendor.h): included once here, at global
// scope, so that a header included inside namespace A or B finds it already defined (-Itorch_engine/csrc lets a copy
// of a header outside the tree find it too).
#if __has_include("torch_engine/csrc/cpu_vendor.h")
#include "torch_engine/csrc/cpu_vendor.h"
#endif
namespace A {
#include OLD
}
namespace B {
#include NEW
}
static double now(){return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();}
template <int V> struct NS;
template <> struct NS<0> { template <class... X> static void att(X... x) { A::disagg_attn::attend_split<64>(x...); }
  static void prep(const float* q, int64_t Q, int64_t D, float* qs, uint16_t* qhl) { A::disagg_attn::prepare_query(q, Q, D, qs, qhl); }
  static void merge(const float* p, int64_t S, int64_t part, int64_t G, int64_t D, float* out) { A::disagg_attn::merge(p, S, part, G, D, out); } };
template <> struct NS<1> { template <class... X> static void att(X... x) { B::disagg_attn::attend_split<64>(x...); }
  static void prep(const float* q, int64_t Q, int64_t D, float* qs, uint16_t* qhl) { B::disagg_attn::prepare_query(q, Q, D, qs, qhl); }
  static void merge(const float* p, int64_t S, int64_t part, int64_t G, int64_t D, float* out) { B::disagg_attn::merge(p, S, part, G, D, out); } };
int main(int argc, char** argv){
  const int64_t H=3,G=3,D=64,P=16,L=30, A_=H*G*D, CH=16;
  const int64_t T = argc>1 ? atoi(argv[1]) : 290;
  const int64_t S = argc>2 ? atoi(argv[2]) : 8;
  const int rounds = argc>3 ? atoi(argv[3]) : 9;
  const bool hot = argc>4 && argv[4][0]=='h';
  const int64_t pages_per_seq=(T+P-1)/P, NP=S*pages_per_seq;
  const int64_t page_stride=H*2*P*D, head_stride=2*P*D, kv_stride=P*D, token_stride=D;
  std::mt19937 rng(1); std::uniform_real_distribution<float> u(-1,1);
  std::vector<std::vector<c10::BFloat16>> pools(L, std::vector<c10::BFloat16>(NP*page_stride));
  for(auto& p: pools) for(auto& v: p) v=c10::BFloat16(u(rng)*0.3f);
  std::vector<int64_t> rows(NP); for(int64_t i=0;i<NP;i++) rows[i]=i; std::shuffle(rows.begin(),rows.end(),rng);
  std::vector<float> q(A_); for(auto& v:q) v=u(rng)*0.5f;
  std::vector<float> qs(A_), scratch(A::disagg_attn::scratch_floats(D,H*G)+1024), parts(64*(A_+2*H*G)), out(A_);
  std::vector<uint16_t> qhl(2*A_);
  const int64_t WB = 96<<20; std::vector<uint8_t> wbuf(WB, 1); const int64_t slice = WB / L;
  volatile uint64_t sinkv = 0;
  double best[2][2] = {{1e9,1e9},{1e9,1e9}}; std::vector<float> res[2][2];
  auto run = [&](auto ns, int pcv) {
    using N = decltype(ns);
    const int64_t pc = pcv;
    double t=now(), tws=0;
    for(int64_t layer=0;layer<L;layer++) {
      double t0=now(); if (!hot) { __m512i s=_mm512_setzero_si512(); const uint8_t* p=wbuf.data()+layer*slice;
      for(int64_t i=0;i<slice;i+=64) s=_mm512_or_si512(s,_mm512_loadu_si512(p+i)); sinkv += _mm512_reduce_or_epi64(s); } tws+=now()-t0;
      const c10::BFloat16* pool = pools[hot ? 0 : layer].data();
      for(int64_t sq=0;sq<S;sq++){
        N::prep(q.data(), H*G, D, qs.data(), qhl.data());
        int64_t j = 0;
        for (int64_t c0 = 0; c0 * CH < T; c0 += pc, ++j) {
          float* part = parts.data() + j * (A_ + 2*H*G);
          std::fill(part, part + A_, 0.f); std::fill(part + A_, part + A_ + H*G, -INFINITY); std::fill(part + A_ + H*G, part + A_ + 2*H*G, 0.f);
          N::att(qs.data(), qhl.data(), pool, H, head_stride, rows.data()+sq*pages_per_seq, c0*CH, std::min((c0+pc)*CH, T), T, G, D, P, page_stride, kv_stride, token_stride, part, part + A_, part + A_ + H*G, scratch.data());
        }
        N::merge(parts.data(), j, A_ + 2*H*G, H*G, D, out.data());
      }
    }
    return now()-t-tws;
  };
  for(int round=0;round<rounds;round++) for (int k=0;k<4;++k) {
    const int w = (k + round) % 4, v = w / 2, pi = w % 2; const int pc = pi == 0 ? 2 : 64;
    const double e = v == 0 ? run(NS<0>{}, pc) : run(NS<1>{}, pc);
    best[v][pi] = std::min(best[v][pi], e); res[v][pi] = out;
  }
  double md=0; for (int i=0;i<A_;++i) md = std::max(md, (double)std::fabs(res[0][0][i]-res[1][0][i]));
  printf("T=%ld S=%ld %s: parts of 2: old %.2f new %.2f ms (%.3fx); whole: old %.2f new %.2f (%.3fx); maxdiff parts %.1e\n", T, S, hot?"hot":"after-weights",
    best[0][0]*1e3, best[1][0]*1e3, best[0][0]/best[1][0], best[0][1]*1e3, best[1][1]*1e3, best[0][1]/best[1][1], md);
}
