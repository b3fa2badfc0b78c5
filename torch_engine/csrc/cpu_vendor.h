// The CPU's vendor, read once, for the kernels whose best path differs between Intel's cores and AMD's (a path picked
// by it depends on the CPU, never on a timing): attention.h (vdpbf16ps runs one in two cycles on Intel's cores — an
// Emerald Rapids Xeon, family 6 model 207, session 40: 1.5 G/s against 6 G/s for 512-bit FMA, which two ports take; a
// Zen 4 runs it one a cycle beside one FMA) and qgemm.h (the 8- and 16-row tiles' rows side by side, faster on the
// Emerald Rapids, slower on a Zen 5). Benchmark drivers that include two versions of those headers inside namespaces
// include this one first, at global scope, so that both versions share it.
#ifndef DISAGG_CPU_VENDOR_H
#define DISAGG_CPU_VENDOR_H

namespace disagg_cpu {

inline bool intel_cores() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool intel = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") != 0;
  }();
  return intel;
#else
  return false;
#endif
}

}  // namespace disagg_cpu

#endif  // DISAGG_CPU_VENDOR_H
