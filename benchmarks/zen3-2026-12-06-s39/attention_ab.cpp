// The decode attention (attend_range, fp32 pages) of two versions of torch_engine/csrc/attention.h alternated in one
// process, one thread, best of 9 rounds each: SmolLM2's heads (3 KV heads of 64, 3 query heads each), 16 sequences of
// T tokens (default 290) on 16-token pages in shuffled order, 30 layers; "dram": each layer its own pool (214 MB at
// 290 tokens), "hot": every layer on the first one's pool (7 MB, in L3). Prints old -> new ms, the ratio and the
// largest difference of the normalised outputs. Session 39 (AVX2-only Zen 3), attention_ab.txt:
//
//   git show a3ea3d0:torch_engine/csrc/attention.h > /tmp/attention_old.h   # the header before 303c8f9
//   g++ -O3 -march=native -ffast-math -fno-finite-math-only -std=c++17 -I. -Itorch_engine/csrc \
//       -I.venv/lib/python3.11/site-packages/torch/include -DOLD='"/tmp/attention_old.h"' \
//       -DNEW='"torch_engine/csrc/attention.h"' -o /tmp/attention_ab benchmarks/zen3-2026-12-06-s39/attention_ab.cpp
//   taskset -c 1 /tmp/attention_ab dram; taskset -c 1 /tmp/attention_ab hot; taskset -c 1 /tmp/attention_ab dram 37
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
  const int64_t H=3,G=3,D=64,P=16,L=30,S=16;
  const int64_t T = argc>2 ? atoi(argv[2]) : 290;
  const int64_t pages_per_seq=(T+P-1)/P, NP=S*pages_per_seq;
  const int64_t page_stride=H*2*P*D, head_stride=2*P*D, kv_stride=P*D, token_stride=D;
  std::mt19937 rng(1); std::uniform_real_distribution<float> u(-1,1);
  std::vector<std::vector<float>> pools(L, std::vector<float>(NP*page_stride));
  for(auto& p: pools) for(auto& v: p) v=u(rng)*0.3f;
  std::vector<int64_t> rows(NP); for(int64_t i=0;i<NP;i++) rows[i]=i; std::shuffle(rows.begin(),rows.end(),rng);
  std::vector<float> q(H*G*D); for(auto& v:q) v=u(rng)*0.5f;
  std::vector<float> acc(H*G*D), m(H*G), l(H*G), scratch(A::disagg_attn::scratch_floats(D,H*G)+1024);
  std::vector<float> outA(H*G*D), outB(H*G*D);
  bool hot = argc>1 && argv[1][0]=='h';
  double ta=1e9, tb=1e9;
  for(int round=0;round<9;round++){
    for (int which=0; which<2; which++) {
    double t=now();
    for(int64_t layer=0;layer<L;layer++) for(int64_t s=0;s<S;s++){
      std::fill(acc.begin(),acc.end(),0.f); std::fill(m.begin(),m.end(),-INFINITY); std::fill(l.begin(),l.end(),0.f);
      if (which==0) A::disagg_attn::attend_range<float,64>(q.data(), pools[hot?0:layer].data(), H, head_stride, rows.data()+s*pages_per_seq, 0, T, G, D, P, page_stride, kv_stride, token_stride, acc.data(), m.data(), l.data(), scratch.data());
      else B::disagg_attn::attend_range<float,64>(q.data(), pools[hot?0:layer].data(), H, head_stride, rows.data()+s*pages_per_seq, 0, T, G, D, P, page_stride, kv_stride, token_stride, acc.data(), m.data(), l.data(), scratch.data());
    }
    double e=now()-t;
    auto& out = which==0?outA:outB;
    for (int64_t i=0;i<H*G*D;i++) out[i]=acc[i]/l[i/D];
    if(which==0) ta=std::min(ta,e); else tb=std::min(tb,e);
    }
  }
  double md=0; for(int64_t i=0;i<H*G*D;i++) md=std::max(md,(double)std::fabs(outA[i]-outB[i]));
  printf("attention %s T=%ld: %.2f -> %.2f ms (%.3fx) maxdiff %.2e\n", hot?"hot":"DRAM", T, ta*1e3, tb*1e3, ta/tb, md);
}
