// Inference and canonicalisation speed (DESIGN 9): inference from index maps must be linear,
// at least 50 M entries per second per core; canonicalising an already-folded map costs in
// proportion to its pieces, not its elements.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <functional>

#include "reshard/ir/canonicalize.h"
#include "reshard/ir/infer.h"
#include "reshard/layouts/basic.h"

namespace reshard {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Best of `reps` runs of `fn`, in seconds.
double Best(int reps, const std::function<void()>& fn) {
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    fn();
    best = std::min(best, Seconds(Clock::now() - t0));
  }
  return best;
}

IndexMaps Observe(const ParamMap& map) { return ToIndexMaps(map); }

void BenchInfer(const char* name, const ParamMap& map) {
  const IndexMaps observed = Observe(map);
  Index entries = 0;
  for (const ObservedShard& s : observed.ranks) entries += static_cast<Index>(s.index_map.size());
  Index pieces = 0;
  const double t = Best(3, [&] {
    Result<ParamMap> m = Infer(observed);
    if (!m.ok()) {
      fmt::print(stderr, "infer failed: {}\n", m.status().message());
      std::exit(1);
    }
    pieces = m->num_pieces();
  });
  const double rate = static_cast<double>(entries) / t / 1e6;
  fmt::print(
      "infer {:<44} {:>6.1f} M entries in {:7.3f} s = {:6.1f} M entries/s  ({} pieces)  "
      "bar 50 M/s: {}\n",
      name, static_cast<double>(entries) / 1e6, t, rate, pieces, rate >= 50 ? "PASS" : "MISS");
}

void BenchCanonicalize(const char* name, const ParamMap& map) {
  const double t = Best(20, [&] {
    Result<ParamMap> m = Canonicalize(map);
    if (!m.ok()) std::exit(1);
  });
  fmt::print("canonicalize {:<37} {:>5} pieces, {:>13} elements: {:8.1f} us\n", name,
             map.num_pieces(), map.num_elements(), t * 1e6);
}

ParamMap CodeGenLike(Index hidden, Index cols, int tp) {
  const Index quarter = hidden / 4;
  const Index blocks = 4 / tp;
  ParamMapBuilder b;
  b.set_logical_shape({3 * hidden, cols});
  for (Rank r = 0; r < tp; ++r) {
    const Shape shape = {blocks, quarter, 3, cols};
    b.set_shard_shape(r, {3 * hidden / tp, cols});
    b.add_piece(
        r, Piece{shape,
                 {r * blocks * 3 * quarter * cols, {3 * quarter * cols, cols, quarter * cols, 1}},
                 {0, RowMajorStrides(shape)},
                 {r},
                 1.0});
  }
  return *b.Finalize();
}

}  // namespace
}  // namespace reshard

int main() {
  using namespace reshard;
  fmt::print("Inference from index maps (single thread; 64 M entries each)\n");
  BenchInfer("column split 8192x8192, TP 8 (dim 0)",
             *SplitMap({8192, 8192}, 0, EvenSplitSizes(8192, 8)));
  BenchInfer("row split 8192x8192, TP 8 (dim 1)",
             *SplitMap({8192, 8192}, 1, EvenSplitSizes(8192, 8)));
  BenchInfer("CodeGen fused QKV 3x4096 rows x 5461 cols, TP 4", CodeGenLike(4096, 5461, 4));
  BenchInfer("multi-query QKV 8192+1024 rows x 7282, TP 8",
             *SegmentedMap({9216, 7282}, 0,
                           {{8192, false, EvenSplitSizes(8192, 8)}, {1024, true, {}}}, 8));
  fmt::print("\nCanonicalising already-folded maps (cost follows pieces, not elements)\n");
  BenchCanonicalize("column split 32768x32768, TP 64",
                    *SplitMap({32768, 32768}, 1, EvenSplitSizes(32768, 64)));
  BenchCanonicalize("CodeGen 3x65536 rows x 8192, TP 4", CodeGenLike(65536, 8192, 4));
  BenchCanonicalize("multi-query 65536+8192 rows x 8192, TP 8",
                    *SegmentedMap({73728, 8192}, 0,
                                  {{65536, false, EvenSplitSizes(65536, 8)}, {8192, true, {}}}, 8));
  return 0;
}
