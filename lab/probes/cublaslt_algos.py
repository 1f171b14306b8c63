"""Decode-step GEMMs at M ~ 256-512 rows: every algorithm cuBLASLt's heuristic offers
(and its split-K variants) against torch's matmul, each chain of 32 layers' weights
captured in one CUDA graph (weights read from HBM, as a decode step reads them).

torch picks one cuBLAS(Lt) algorithm per shape and its TunableOp offers nothing else on
CUDA; this probe asks whether another algorithm of the same library runs the 8B shape's
projections faster at the row counts of a large decode step. It builds a small C++
extension against cuBLASLt on the machine it runs on (nvcc and the CUDA headers needed).

    python lab/probes/cublaslt_algos.py                    # needs CUDA
    python lab/probes/cublaslt_algos.py --m 476 512 --json lt.json
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import sysconfig
from pathlib import Path

import torch
from decode_attention import graph_time_ms
from gemms import SHAPES
from tma_gemm import LAYERS, layer_weights, write_rows

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # bench/common

from common import measure_matmul  # noqa: E402

WORKSPACE_BYTES = 32 * 2**20
# Config attributes reported for each algorithm (cublasLtMatmulAlgoConfigAttributes_t).
CONFIG_NAMES = ("algo", "tile", "stages", "splitk", "reduction", "swizzle", "cluster", "inner")

_SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <cublasLt.h>
#include <cstring>

#define LT_CHECK(expr)                                                              \
  do {                                                                              \
    cublasStatus_t status_ = (expr);                                                \
    TORCH_CHECK(status_ == CUBLAS_STATUS_SUCCESS, #expr " failed: ", (int)status_); \
  } while (0)

static cublasLtHandle_t handle() {
  static cublasLtHandle_t h = nullptr;
  if (h == nullptr) LT_CHECK(cublasLtCreate(&h));
  return h;
}

// out[m, n] = x[m, k] @ w[n, k]^T, i.e. column-major C(n x m) = W^T (n x k) X (k x m).
struct Desc {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  Desc(int64_t m, int64_t n, int64_t k) {
    LT_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    LT_CHECK(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, k, n, k));
    LT_CHECK(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, k, m, k));
    LT_CHECK(cublasLtMatrixLayoutCreate(&c, CUDA_R_16BF, n, m, n));
  }
  ~Desc() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

static int64_t config(const cublasLtMatmulAlgo_t* algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  size_t size = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(algo, attr, nullptr, 0, &size) != CUBLAS_STATUS_SUCCESS ||
      size > 8)
    return -1;
  uint64_t value = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(algo, attr, &value, size, &size) != CUBLAS_STATUS_SUCCESS)
    return -1;
  return (int64_t)value;
}

static std::vector<int64_t> describe(const cublasLtMatmulAlgo_t* algo) {
  return {config(algo, CUBLASLT_ALGO_CONFIG_ID),          config(algo, CUBLASLT_ALGO_CONFIG_TILE_ID),
          config(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID),   config(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
          config(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
          config(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
          config(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
          config(algo, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID)};
}

static torch::Tensor pack(const cublasLtMatmulAlgo_t* algo) {
  auto t = torch::empty({(int64_t)sizeof(cublasLtMatmulAlgo_t)}, torch::kUInt8);
  std::memcpy(t.data_ptr(), algo, sizeof(cublasLtMatmulAlgo_t));
  return t;
}

static void unpack(const torch::Tensor& t, cublasLtMatmulAlgo_t* algo) {
  TORCH_CHECK(t.numel() == (int64_t)sizeof(cublasLtMatmulAlgo_t), "not an algorithm");
  std::memcpy(algo, t.data_ptr(), sizeof(cublasLtMatmulAlgo_t));
}

// The heuristic's algorithms for this shape: (packed algo, config, workspace bytes, waves).
std::vector<std::tuple<torch::Tensor, std::vector<int64_t>, int64_t, double>> heuristics(
    int64_t m, int64_t n, int64_t k, int64_t count, int64_t workspace) {
  Desc d(m, n, k);
  cublasLtMatmulPreference_t pref;
  LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t ws = (uint64_t)workspace;
  LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                sizeof(ws)));
  std::vector<cublasLtMatmulHeuristicResult_t> results(count);
  int found = 0;
  cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle(), d.op, d.a, d.b, d.c, d.c, pref,
                                                          (int)count, results.data(), &found);
  cublasLtMatmulPreferenceDestroy(pref);
  LT_CHECK(status);
  std::vector<std::tuple<torch::Tensor, std::vector<int64_t>, int64_t, double>> out;
  for (int i = 0; i < found; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
    out.emplace_back(pack(&results[i].algo), describe(&results[i].algo),
                     (int64_t)results[i].workspaceSize, (double)results[i].wavesCount);
  }
  return out;
}

// A variant of `algo` with split-K `splits` (and swizzle), if cuBLASLt accepts it for this
// shape and workspace: (packed algo, config, workspace bytes); an empty tensor if not.
std::tuple<torch::Tensor, std::vector<int64_t>, int64_t> variant(torch::Tensor packed, int64_t m,
                                                                 int64_t n, int64_t k, int64_t splits,
                                                                 int64_t swizzle, int64_t workspace) {
  cublasLtMatmulAlgo_t algo;
  unpack(packed, &algo);
  int32_t s = (int32_t)splits;
  uint32_t sw = (uint32_t)swizzle;
  uint32_t scheme = splits > 1 ? CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE : CUBLASLT_REDUCTION_SCHEME_NONE;
  auto none = std::make_tuple(torch::Tensor(), std::vector<int64_t>(), (int64_t)0);
  if (cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &s, sizeof(s)) !=
          CUBLAS_STATUS_SUCCESS ||
      cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme,
                                           sizeof(scheme)) != CUBLAS_STATUS_SUCCESS ||
      cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &sw, sizeof(sw)) !=
          CUBLAS_STATUS_SUCCESS)
    return none;
  Desc d(m, n, k);
  cublasLtMatmulHeuristicResult_t result;
  if (cublasLtMatmulAlgoCheck(handle(), d.op, d.a, d.b, d.c, d.c, &algo, &result) != CUBLAS_STATUS_SUCCESS)
    return none;
  if ((int64_t)result.workspaceSize > workspace) return none;
  return std::make_tuple(pack(&algo), describe(&algo), (int64_t)result.workspaceSize);
}

// out = x @ w^T through `algo` (an empty tensor: cuBLASLt's own choice) on torch's stream.
void matmul(torch::Tensor x, torch::Tensor w, torch::Tensor out, torch::Tensor packed,
            torch::Tensor workspace) {
  int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  Desc d(m, n, k);
  cublasLtMatmulAlgo_t algo;
  const cublasLtMatmulAlgo_t* chosen = nullptr;
  if (packed.defined() && packed.numel() > 0) {
    unpack(packed, &algo);
    chosen = &algo;
  }
  float alpha = 1.0f, beta = 0.0f;
  LT_CHECK(cublasLtMatmul(handle(), d.op, &alpha, w.data_ptr(), d.a, x.data_ptr(), d.b, &beta,
                          out.data_ptr(), d.c, out.data_ptr(), d.c, chosen, workspace.data_ptr(),
                          (size_t)workspace.numel(), c10::cuda::getCurrentCUDAStream().stream()));
}
"""


def _cublaslt_paths() -> tuple[list[str], str]:
    """Include directories holding cublasLt.h and the libcublasLt torch itself loaded."""
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")  # loads cuBLAS(Lt)
    with open("/proc/self/maps") as maps:
        libs = sorted({line.split()[-1] for line in maps if "libcublasLt.so" in line})
    if not libs:
        raise SystemExit("libcublasLt is not loaded in this process")
    site = sysconfig.get_paths()["purelib"]
    roots = [os.environ.get("CUDA_HOME", "/usr/local/cuda"), *glob.glob(f"{site}/nvidia/*")]
    roots += glob.glob(f"{site}/nvidia/*/*")
    includes = sorted(
        {os.path.join(r, "include") for r in roots if glob.glob(f"{r}/include/cublasLt.h")}
    )
    if not includes:
        raise SystemExit("cublasLt.h not found (CUDA_HOME or the nvidia-cublas wheel)")
    return includes, libs[0]


def build():  # type: ignore[no-untyped-def]
    from torch.utils.cpp_extension import load_inline

    includes, lib = _cublaslt_paths()
    print(f"cuBLASLt {lib}; headers {includes}", flush=True)
    return load_inline(
        name="radixserve_cublaslt_probe",
        cpp_sources=_SOURCE,
        functions=["heuristics", "variant", "matmul"],
        extra_include_paths=includes,
        extra_ldflags=[lib],
        with_cuda=True,
        extra_cflags=["-O2"],
    )


def confirm(lt, contenders, x, out, weights, workspace, args) -> dict[str, list[float]]:  # type: ignore[no-untyped-def]
    """Each contender's 32-layer chain captured once, then timed in turn for
    `args.confirm` rounds (this machine's GEMM timings drift by up to ~15% over seconds,
    so only side-by-side figures compare): us a layer, per round."""
    graphs = {}
    for label, packed in contenders.items():
        torch.backends.cuda.preferred_blas_library("cublaslt")

        def chain(packed=packed):  # type: ignore[no-untyped-def]
            for w in weights:
                if packed is None:
                    torch.matmul(x, w.t(), out=out)
                else:
                    lt.matmul(x, w, out, packed, workspace)

        for _ in range(3):
            chain()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain()
        graphs[label] = graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    results: dict[str, list[float]] = {label: [] for label in graphs}
    for _ in range(args.confirm):
        for label, graph in graphs.items():
            times = []
            for _ in range(args.reps):
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3 / LAYERS)
            results[label].append(statistics.median(times[2:]))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--m", type=int, nargs="+", default=[476, 512])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--count", type=int, default=32, help="algorithms asked of the heuristic")
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--top", type=int, default=4, help="algorithms shown per shape")
    ap.add_argument("--shapes", nargs="+", default=[name for name, _, _ in SHAPES])
    ap.add_argument(
        "--confirm",
        type=int,
        default=0,
        help="rounds alternating torch (cuBLASLt), the heuristic's first and the best three",
    )
    ap.add_argument("--json")
    args = ap.parse_args()
    lt = build()
    torch.manual_seed(0)
    rate = measure_matmul(repeats=args.reps) / 1e12
    print(f"matmul rate {rate:.0f} TFLOP/s ({torch.cuda.get_device_name()})", flush=True)
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    rows = []
    for name, k, n in [shape for shape in SHAPES if shape[0] in args.shapes]:
        weights = layer_weights(n, k)
        for m in args.m:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            flop = 2 * m * n * k * LAYERS
            ref = torch.nn.functional.linear(x, weights[0]).float()

            def torch_chain(x=x, out=out, weights=weights):
                for w in weights:
                    torch.matmul(x, w.t(), out=out)

            def torch_ms() -> dict[str, float]:
                """torch's matmul through each library (the engine prefers cuBLASLt)."""
                times = {}
                for library in ("cublas", "cublaslt"):
                    torch.backends.cuda.preferred_blas_library(library)
                    times[library] = graph_time_ms(torch_chain, args.reps, calls=1)
                return times

            candidates = []
            seen = set()
            offered = lt.heuristics(m, n, k, args.count, WORKSPACE_BYTES)
            for index, (packed, cfg, _ws, waves) in enumerate(offered):
                seen.add(tuple(cfg))  # as offered first (the heuristic's first: torch's choice)
                candidates.append((packed, [index, *cfg], waves))
                for splits in args.splits:
                    for swizzle in sorted({cfg[5], 0, 1}):
                        got = lt.variant(packed, m, n, k, splits, swizzle, WORKSPACE_BYTES)
                        if got[0] is None or got[0].numel() == 0 or tuple(got[1]) in seen:
                            continue
                        seen.add(tuple(got[1]))
                        candidates.append((got[0], [index, *got[1]], waves))
            before = torch_ms()
            timed = []
            for packed, cfg, waves in candidates:
                lt.matmul(x, weights[0], out, packed, workspace)
                err = (out.float() - ref).abs().max().item()
                if err > 3e-2 * max(1.0, ref.abs().max().item()):
                    print(f"  {name} M={m} {cfg}: differs from torch by {err}", flush=True)
                    continue

                def chain(x=x, out=out, weights=weights, packed=packed):
                    for w in weights:
                        lt.matmul(x, w, out, packed, workspace)

                timed.append((graph_time_ms(chain, args.reps, calls=1), cfg, waves))
            after = torch_ms()
            timed.sort(key=lambda t: t[0])
            base = statistics.mean([before["cublaslt"], after["cublaslt"]])
            row = {
                "m": m,
                "proj": name,
                "torch_ms": {lib: [before[lib], after[lib]] for lib in before},
                "torch_share": flop / base / 1e9 / rate,
                "candidates": len(candidates),
                "best": [
                    {
                        "ms": ms,
                        "config": dict(zip(("index", *CONFIG_NAMES), cfg, strict=True)),
                        "waves": w,
                    }
                    for ms, cfg, w in timed[: args.top]
                ],
            }
            if args.confirm:
                contenders = {"torch-cublaslt": None, "first": candidates[0][0]}
                for _ms, cfg, _w in timed[:3]:
                    packed = next(p for p, c, _ in candidates if c == cfg)
                    contenders.setdefault(str(cfg), packed)
                confirmed = confirm(lt, contenders, x, out, weights, workspace, args)
                row["confirmed_us"] = confirmed
                print(
                    f"M {m:4d} {name:8s} alternating {args.confirm} rounds, median us: "
                    + "  ".join(f"{k} {statistics.median(v):.1f}" for k, v in confirmed.items()),
                    flush=True,
                )
            rows.append(row)
            shown = "  ".join(
                f"{ms * 1e3 / LAYERS:6.1f} us ({flop / ms / 1e9 / rate:.2f}) {cfg}"
                for ms, cfg, _ in timed[: args.top]
            )
            lib_us = "  ".join(
                f"{lib} {before[lib] * 1e3 / LAYERS:6.1f} / {after[lib] * 1e3 / LAYERS:6.1f}"
                for lib in before
            )
            first = [f"{ms * 1e3 / LAYERS:.1f}" for ms, cfg, _ in timed if cfg == candidates[0][1]]
            print(
                f"M {m:4d} {name:8s} torch: {lib_us} us (cublaslt {row['torch_share']:.2f}); "
                f"heuristic's first {first}; {len(candidates)} algos; best {shown}",
                flush=True,
            )
        del weights
        torch.cuda.empty_cache()
    write_rows(args.json, rate, rows)


if __name__ == "__main__":
    main()
