"""The CPU's multiply-add roof per instruction the kernels use, and where the linear kernels stand against it.

The weight-streaming floor (``runtime/bench/floor.py``) bounds a step that is bound by memory. A step with many
rows (a prefill, a mixed step, a batch-8 decode step on two cores) is bound by arithmetic instead, and its floor
is its multiply-adds over the rate the instructions can retire. This compiles a loop of 16 independent
accumulators per instruction (8-12 with AVX2's 16 registers), runs it on 1 and on ``--threads`` threads (the best
of ``PROBES`` short probes each), and reports multiply-adds per second:

- ``vpdpbusd`` (AVX512-VNNI, 64 int8 multiply-adds per instruction): the int8 linear kernel's;
- ``vpmaddubsw`` (AVX2: vpsignb + vpmaddubsw + vpmaddwd + vpaddd, 32 int8 multiply-adds per four instructions):
  the int8 linear kernel's on CPUs without VNNI;
- ``vdpbf16ps`` (AVX512_BF16, 32 bf16 multiply-adds summed in fp32): the bf16 linear and attention kernels';
- ``vfmadd231ps`` (16 fp32 multiply-adds), or ``vfmadd231ps ymm`` (8, AVX2): the float32 kernels'.

A format's roof is its first instruction this CPU has. Then the model's linear layers (SmolLM2-135M's four shapes,
4 layers' worth) through ``PackedLinear`` at several row counts, in int8 (integer dot products), weight-only int8
(each weight widened to fp32, the path without them), bf16 and float32, as multiply-adds per second and as a share
of that format's roof; and int8 at the largest row count with coarser activation blocks than the runtime's 32,
which shows what the per-block rescaling of the integer sums costs (a coarser block changes the numerics: it is a
measurement, not an option).

    python benchmarks/bench_compute_peak.py [--threads 2] [--rows 1 8 16 64 169] [--act-blocks 64 128 0]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from bench_kernel_ab import LINEAR_SHAPES, linear_case
from engine_steps import cpu_simd, emit

from runtime.kernels.build import load_kernels

SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <chrono>
#include <thread>
#include <vector>

// `iters` rounds of step() on N independent accumulators (each starting at init(i)), then read() of each into
// `sink`; returns the multiply-adds, `per` per step. Fully unrolled, so every accumulator is a register.
template <int N, typename V, typename Init, typename Step, typename Read>
static double run_probe(int64_t iters, double per, float& sink, Init init, Step step, Read read) {
  V a[N];
#pragma GCC unroll 16
  for (int i = 0; i < N; ++i) a[i] = init(i);
  for (int64_t n = 0; n < iters; ++n) {
#pragma GCC unroll 16
    for (int i = 0; i < N; ++i) a[i] = step(a[i]);
  }
#pragma GCC unroll 16
  for (int i = 0; i < N; ++i) sink += read(a[i]);
  return N * per * iters;
}

// Multiply-adds per second of one thread running `iters` rounds of 8-16 independent instructions.
static double one_thread(const std::string& kind, int64_t iters) {
  const auto t0 = std::chrono::steady_clock::now();
  double macs = 0;
  float sink = 0;
#if defined(__AVX512VNNI__)
  if (kind == "vpdpbusd") {
    const __m512i w = _mm512_set1_epi32(0x01010101), x = _mm512_set1_epi32(0x02020202);
    macs = run_probe<16, __m512i>(iters, 64, sink, [](int i) { return _mm512_set1_epi32(i); },
                                  [&](__m512i a) { return _mm512_dpbusd_epi32(a, w, x); },
                                  [](__m512i a) { return static_cast<float>(_mm512_reduce_add_epi32(a)); });
  }
#endif
#if defined(__AVX512BF16__)
  if (kind == "vdpbf16ps") {
    const __m512bh w = (__m512bh)_mm512_set1_epi32(0x3f803f80);
    macs = run_probe<16, __m512>(iters, 32, sink, [](int i) { return _mm512_set1_ps(i); },
                                 [&](__m512 a) { return _mm512_dpbf16_ps(a, w, w); },
                                 [](__m512 a) { return _mm512_reduce_add_ps(a); });
  }
#endif
#if defined(__AVX2__)
  // AVX2 has 16 registers: fewer accumulators, so that none lives in memory (16 of them made the fp32 probe half
  // as fast as the kernels). Each step's signed operand is its own accumulator's bytes, so no part of it is the same
  // every iteration (a constant one was hoisted out of the loop, leaving only the adds).
  if (kind == "vpmaddubsw") {  // linear_int8's AVX2 step: the sign onto the weight, pairs, int32, accumulate
    const __m256i x = _mm256_set1_epi32(0x02020202), mag = _mm256_abs_epi8(x), ones = _mm256_set1_epi16(1);
    macs = run_probe<8, __m256i>(
        iters, 32, sink, [](int i) { return _mm256_set1_epi32(i); },
        [&](__m256i a) {
          return _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(mag, _mm256_sign_epi8(a, x)), ones));
        },
        [](__m256i a) { return static_cast<float>(_mm256_extract_epi32(a, 0)); });
  }
  if (kind == "vfmadd231ps ymm") {
    const __m256 w = _mm256_set1_ps(1.0f), x = _mm256_set1_ps(1e-9f);
    macs = run_probe<12, __m256>(iters, 8, sink, [](int i) { return _mm256_set1_ps(i); },
                                 [&](__m256 a) { return _mm256_fmadd_ps(w, x, a); },
                                 [](__m256 a) { return _mm256_cvtss_f32(a); });
  }
#endif
#if defined(__AVX512F__)
  if (kind == "vfmadd231ps") {
    const __m512 w = _mm512_set1_ps(1.0f), x = _mm512_set1_ps(1e-9f);
    macs = run_probe<16, __m512>(iters, 16, sink, [](int i) { return _mm512_set1_ps(i); },
                                 [&](__m512 a) { return _mm512_fmadd_ps(w, x, a); },
                                 [](__m512 a) { return _mm512_reduce_add_ps(a); });
  }
#endif
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (sink == 42.0f) macs += 1;  // keeps the accumulators live
  return macs / s;
}

// Summed over `threads` threads at once; 0 where this build's target lacks the instruction.
double peak_macs(const std::string& kind, int64_t iters, int64_t threads) {
  std::vector<double> rate(threads);
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t) pool.emplace_back([&, t] { rate[t] = one_thread(kind, iters); });
  for (auto& th : pool) th.join();
  double total = 0;
  for (double r : rate) total += r;
  return total;
}
"""

# Per format, the instructions of its kernels in order of preference (a CPU's roof is the first it has).
KINDS = {"int8": ("vpdpbusd", "vpmaddubsw"), "bfloat16": ("vdpbf16ps",), "float32": ("vfmadd231ps", "vfmadd231ps ymm")}
PROBES = 7


def roof_macs(mod: Any, kind: str, threads: int) -> float:
    """An instruction's roof on ``threads`` threads: the best of several short probes. A probe can only lose time
    (the first ones while the cores ramp up their clock, any one to another tenant of the host), never gain it, so
    the fastest is the roof; a single probe measured 235-470 G/s for ``vpdpbusd`` on a busy evening."""
    return max(mod.peak_macs(kind, 20_000_000, threads) for _ in range(PROBES))


def probe_module() -> Any:
    from torch.utils.cpp_extension import load_inline

    return load_inline("radixserve_bench_compute_peak", cpp_sources=SOURCE, functions=["peak_macs"],
                       extra_cflags=["-O2", "-march=native"], verbose=False)


def linear_rate(fmt: str, rows: int, g: torch.Generator, act_block: int = 32, layout: str | None = None) -> float:
    """Multiply-adds per second of 4 layers' linear layers through PackedLinear at ``rows`` rows (median of 7);
    ``act_block``: int8's activation block (the runtime's is 32; 0: one scale per row); ``layout``: the packed
    layout (None: the format's own kernel's)."""
    run = linear_case(fmt, rows, g, layers=4, act_block=act_block, layout=layout)
    k = load_kernels("fastcpu")
    run(k)
    times = []
    for _ in range(7):
        t = time.perf_counter()
        run(k)
        times.append(time.perf_counter() - t)
    return rows * 4 * sum(n * kk for n, kk in LINEAR_SHAPES) / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="Threads of the roof probe and of the kernels.")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 64, 169], help="Row counts of the linears.")
    ap.add_argument("--act-blocks", type=int, nargs="*", default=[64, 128, 0],
                    help="Other int8 activation blocks to time at the largest row count (what the per-block rescaling "
                         "costs; 0: one scale per row). The runtime uses 32.")
    ap.add_argument("--json", help="Save the result here.")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    mod = probe_module()
    roof: dict[str, dict[str, float]] = {}
    for kind in (kind for kinds in KINDS.values() for kind in kinds):
        rates = {f"{n} thread(s)": roof_macs(mod, kind, n) / 1e9 for n in sorted({1, args.threads})}
        if any(rates.values()):  # 0: this CPU lacks the instruction
            roof[kind] = {k: round(v, 1) for k, v in rates.items()}
    # the roof each format's kernels run against: its first instruction this CPU has (fp32's for weight-only int8)
    tops = {fmt: next((roof[k][f"{args.threads} thread(s)"] for k in kinds if k in roof), 0.0)
            for fmt, kinds in KINDS.items()}
    fast = load_kernels("fastcpu")
    linears: dict[str, dict[str, Any]] = {}
    g = torch.Generator().manual_seed(0)
    cases = (("int8", None, "int8", fast.int8_dot()), ("int8 weight-only", "kmajor", "float32", True),
             ("bfloat16", None, "bfloat16", fast.bf16_dot()), ("float32", None, "float32", True))
    for name, layout, roof_of, available in cases:
        if not available:
            continue
        fmt, top = name.split()[0], tops[roof_of]
        for rows in args.rows:
            rate = linear_rate(fmt, rows, g, layout=layout) / 1e9
            linears[f"{name}, {rows} row(s)"] = {"g_mac_s": round(rate, 1),
                                                  "share_of_roof": round(rate / top, 3) if top else None}
        if name == "int8":
            rows = max(args.rows)
            for block in args.act_blocks:
                rate = linear_rate(fmt, rows, g, block) / 1e9
                linears[f"int8, {rows} row(s), activation block {block or 'whole row'}"] = {
                    "g_mac_s": round(rate, 1), "share_of_roof": round(rate / top, 3) if top else None}
    emit({"cpu": cpu_simd(), "threads": args.threads, "roof_g_mac_s": roof, "linears": linears}, args.json)


if __name__ == "__main__":
    main()
