// The decode attention on bf16 pages (attend_range<at::BFloat16, 64>: the split path the engine's AVX-512 BF16 step
// takes) of two versions of torch_engine/csrc/attention.h alternated in one process, one thread, best of `rounds`
// each: SmolLM2's heads (3 KV heads of 64, 3 query heads each), S sequences (default 8) of T tokens (default 290) on
// 16-token HND pages in shuffled order, 30 layers. Mode "s": each layer its own pool, and before each layer a 3.2 MB
// slice of a 96 MB buffer is read (the step's weights stream between layers: the K / V then come from L3 or DRAM);
// "h": every layer on the first pool, nothing else read (in cache). Prints old -> new ms, the ratio, the largest
// difference of the normalised outputs and the weights' stream alone. Session 40 (Emerald Rapids Xeon),
// attention_ab.txt:
//
//   git show 8c7c6c1:torch_engine/csrc/attention.h > /tmp/attention_old.h   # the header before session 40's change
//   g++ -O3 -march=native -ffast-math -fno-finite-math-only -std=c++17 -I. -Itorch_engine/csrc \
//       -I.venv/lib/python3.11/site-packages/torch/include -DOLD='"/tmp/attention_old.h"' \
//       -DNEW='"torch_engine/csrc/attention.h"' -o /tmp/attn_ab benchmarks/xeon-2026-12-07-s40/attention_ab.cpp
//   taskset -c 1 /tmp/attn_ab s 290 8 11; taskset -c 1 /tmp/attn_ab h 290 8 11   # mode T S rounds
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
int main(int argc, char** argv){
  const int64_t H=3,G=3,D=64,P=16,L=30;
  const char mode = argc>1 ? argv[1][0] : 's';  // s: a 3.2 MB slice of a 96 MB "weights" buffer read between layers; h: hot
  const int64_t T = argc>2 ? atoi(argv[2]) : 290;
  const int64_t S = argc>3 ? atoi(argv[3]) : 8;
  const int64_t pages_per_seq=(T+P-1)/P, NP=S*pages_per_seq;
  const int64_t page_stride=H*2*P*D, head_stride=2*P*D, kv_stride=P*D, token_stride=D;
  std::mt19937 rng(1); std::uniform_real_distribution<float> u(-1,1);
  std::vector<std::vector<c10::BFloat16>> pools(L, std::vector<c10::BFloat16>(NP*page_stride));
  for(auto& p: pools) for(auto& v: p) v=c10::BFloat16(u(rng)*0.3f);
  std::vector<int64_t> rows(NP); for(int64_t i=0;i<NP;i++) rows[i]=i; std::shuffle(rows.begin(),rows.end(),rng);
  std::vector<float> q(H*G*D); for(auto& v:q) v=u(rng)*0.5f;
  std::vector<float> acc(H*G*D), m(H*G), l(H*G), scratch(A::disagg_attn::scratch_floats(D,H*G)+1024);
  std::vector<float> outA(H*G*D), outB(H*G*D);
  const int64_t WB = 96<<20; std::vector<uint8_t> wbuf(WB, 1); const int64_t slice = WB / L;
  volatile uint64_t sinkv = 0;
  double ta=1e9, tb=1e9, tw=1e9;
  const int rounds = argc>4 ? atoi(argv[4]) : 11;
  for(int round=0;round<rounds;round++){
    for (int which=0; which<3; which++) {
    double t=now(), tws=0;
    for(int64_t layer=0;layer<L;layer++) {
      if (mode=='s') { double t0=now(); __m512i s=_mm512_setzero_si512(); const uint8_t* p=wbuf.data()+layer*slice;
        for(int64_t i=0;i<slice;i+=64) s=_mm512_or_si512(s,_mm512_loadu_si512(p+i)); sinkv += _mm512_reduce_or_epi64(s); tws+=now()-t0; }
      if (which==2) continue;
      for(int64_t s=0;s<S;s++){
      std::fill(acc.begin(),acc.end(),0.f); std::fill(m.begin(),m.end(),-INFINITY); std::fill(l.begin(),l.end(),0.f);
      const c10::BFloat16* pool = pools[mode=='h'?0:layer].data();
      if (which==0) A::disagg_attn::attend_range<c10::BFloat16,64>(q.data(), pool, H, head_stride, rows.data()+s*pages_per_seq, 0, T, G, D, P, page_stride, kv_stride, token_stride, acc.data(), m.data(), l.data(), scratch.data());
      else B::disagg_attn::attend_range<c10::BFloat16,64>(q.data(), pool, H, head_stride, rows.data()+s*pages_per_seq, 0, T, G, D, P, page_stride, kv_stride, token_stride, acc.data(), m.data(), l.data(), scratch.data());
      }
    }
    double e=now()-t-tws;
    if (which==2) { tw=std::min(tw,tws); continue; }
    auto& out = which==0?outA:outB;
    for (int64_t i=0;i<H*G*D;i++) out[i]=acc[i]/l[i/D];
    if(which==0) ta=std::min(ta,e); else tb=std::min(tb,e);
    }
  }
  double md=0; for(int64_t i=0;i<H*G*D;i++) md=std::max(md,(double)std::fabs(outA[i]-outB[i]));
  printf("attention bf16 %s T=%ld S=%ld: %.2f -> %.2f ms (%.3fx) maxdiff %.2e  (weights stream alone %.2f ms)\n", mode=='h'?"hot":"after-weights", T, S, ta*1e3, tb*1e3, ta/tb, md, tw*1e3);
}
