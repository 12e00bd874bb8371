// reshard_exec_bench: executor throughput against memcpy of the same bytes in the same
// process, and the cost of validating a param map of a billion-element tensor
// (DESIGN.md section 9), and what a verify's fingerprints cost an element (DESIGN.md 22).
// Prints figures; asserts nothing.
//
// Every executor figure is measured twice, with num_threads = 1 and num_threads = 2, and each
// is compared with memcpy on the same number of threads (the 2-thread memcpy splits the bytes
// in two halves, one per thread). A bar passes only when both like-for-like ratios meet it.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "reshard/base/dtype.h"
#include "reshard/exec/executor.h"
#include "reshard/exec/fingerprint.h"
#include "reshard/exec/strided_copy.h"
#include "reshard/ir/param_map.h"

namespace reshard {
namespace {

constexpr int kRepeats = 11;
constexpr Index kElements = Index{128} << 20;  // 256 MiB of bf16
constexpr DType kDType = DType::kBF16;

double BestSeconds(int repeats, const std::function<void()>& run) {
  run();  // warm up: page faults, caches, thread start-up paths
  double best = 1e300;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    run();
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
  }
  return best;
}

double GBps(double bytes, double seconds) { return bytes / seconds / 1e9; }

void Check(const Status& s, const char* what) {
  if (!s.ok()) {
    fmt::print(stderr, "{}: {}\n", what, s.ToString());
    std::exit(1);
  }
}

ParamMap MustFinalize(const ParamMapBuilder& b) {
  Result<ParamMap> m = b.Finalize();
  if (!m.ok()) {
    fmt::print(stderr, "map: {}\n", m.status().ToString());
    std::exit(1);
  }
  return std::move(m).value();
}

Piece MakePiece(Shape shape, Index src_off, Shape src_strides, Index dst_off, Shape dst_strides,
                std::vector<Rank> locations, double scale = 1.0) {
  return Piece{std::move(shape),
               {src_off, std::move(src_strides)},
               {dst_off, std::move(dst_strides)},
               std::move(locations),
               scale};
}

// Even split of `shape` along `dim` over `world` ranks.
ParamMapBuilder Split(Shape shape, size_t dim, int world, double scale = 1.0) {
  ParamMapBuilder b;
  b.set_logical_shape(shape);
  const Shape strides = RowMajorStrides(shape);
  const Index part = shape[dim] / world;
  for (Rank r = 0; r < world; ++r) {
    Shape shard = shape;
    shard[dim] = part;
    b.set_shard_shape(r, shard);
    b.add_piece(r, MakePiece(shard, r * part * strides[dim], strides, 0, RowMajorStrides(shard),
                             {r}, scale));
  }
  return b;
}

// CodeGen's fused-QKV interleave, scaled up: F viewed as (world, A, 3, B, C); rank r holds
// (A, B, 3, C) - one 4-D piece per rank, runs of C elements.
ParamMapBuilder Interleaved(int world, Index a, Index b, Index c) {
  ParamMapBuilder m;
  m.set_logical_shape({world * a * 3 * b, c});
  for (Rank r = 0; r < world; ++r) {
    m.set_shard_shape(r, {a * b * 3, c});
    m.add_piece(r, MakePiece({a, b, 3, c}, r * a * 3 * b * c, {3 * b * c, c, b * c, 1}, 0,
                             {3 * b * c, 3 * c, c, 1}, {r}));
  }
  return m;
}

// A buffer of bf16 values, all finite and normal (so a power-of-two scale round-trips).
std::vector<uint16_t> MakeTensor(Index n) {
  std::vector<uint16_t> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) {
    v[i] = static_cast<uint16_t>(0x3C00 + (i * 2654435761u >> 7) % 0x0800);
  }
  return v;
}

std::byte* B(uint16_t* p) { return reinterpret_cast<std::byte*>(p); }
const std::byte* B(const uint16_t* p) { return reinterpret_cast<const std::byte*>(p); }

struct Memcpy {
  double gbps[3] = {0, 0, 0};  // by thread count (index 1 and 2)
};

Memcpy MeasureMemcpy(const std::vector<uint16_t>& src, std::vector<uint16_t>& dst) {
  const size_t bytes = src.size() * 2;
  Memcpy m;
  m.gbps[1] = GBps(static_cast<double>(bytes),
                   BestSeconds(kRepeats, [&] { std::memcpy(dst.data(), src.data(), bytes); }));
  m.gbps[2] = GBps(static_cast<double>(bytes), BestSeconds(kRepeats, [&] {
                     const size_t half = src.size() / 2;
                     std::thread helper([&] {
                       std::memcpy(dst.data() + half, src.data() + half, bytes - half * 2);
                     });
                     std::memcpy(dst.data(), src.data(), half * 2);
                     helper.join();
                   }));
  return m;
}

struct Case {
  std::string name;
  ParamMap map;
  double bar;         // 0: informational, no bar
  bool exact = true;  // whether rebuild(extract(F)) must reproduce F bit for bit
  // Apply scales without checking that every value survives them (the check is on by
  // default and runs in the same pass as the scaling).
  bool allow_lossy_scale = false;
};

void PrintRow(const std::string& name, const char* op, double bytes, const double secs[3],
              const Memcpy& ref, double bar) {
  const double g1 = GBps(bytes, secs[1]), g2 = GBps(bytes, secs[2]);
  const double r1 = g1 / ref.gbps[1], r2 = g2 / ref.gbps[2];
  std::string verdict = "info";
  if (bar > 0) verdict = std::min(r1, r2) >= bar ? "PASS" : "MISS";
  fmt::print("{:<34} {:<8} {:>6.2f} GB/s {:>5.2f}x   {:>6.2f} GB/s {:>5.2f}x   {:>5}  {}\n", name,
             op, g1, r1, g2, r2, bar > 0 ? fmt::format("{:.2f}x", bar) : "-", verdict);
}

void RunCase(const Case& c, const std::vector<uint16_t>& full, std::vector<uint16_t>& rebuilt,
             const Memcpy& ref) {
  const ParamMap& map = c.map;
  const Index n = map.num_elements();
  std::vector<std::vector<uint16_t>> shards;
  std::vector<ConstBuffer> views;
  Index shard_elements = 0;
  for (Rank r = 0; r < map.world_size(); ++r) {
    shards.emplace_back(static_cast<size_t>(map.shard_num_elements(r)), uint16_t{0});
    shard_elements += map.shard_num_elements(r);
  }
  for (Rank r = 0; r < map.world_size(); ++r) {
    views.push_back({B(shards[static_cast<size_t>(r)].data()), map.shard_num_elements(r)});
  }
  double extract[3], rebuild[3];
  for (int threads : {1, 2}) {
    ExecOptions options;
    options.num_threads = threads;
    options.allow_lossy_scale = c.allow_lossy_scale;
    extract[threads] = BestSeconds(kRepeats, [&] {
      for (Rank r = 0; r < map.world_size(); ++r) {
        Check(
            Extract(map, kDType, r, {B(full.data()), n},
                    {B(shards[static_cast<size_t>(r)].data()), map.shard_num_elements(r)}, options),
            "extract");
      }
    });
    rebuild[threads] = BestSeconds(kRepeats, [&] {
      Check(Rebuild(map, kDType, views, {B(rebuilt.data()), n}, options), "rebuild");
    });
  }
  // Every byte of every shard is written by extract; rebuild reads every shard byte (the
  // holders' bytes are copied, the replicas' compared). Throughput counts those bytes.
  const double bytes = static_cast<double>(shard_elements) * 2;
  PrintRow(c.name, "extract", bytes, extract, ref, c.bar);
  PrintRow(c.name, "rebuild", bytes, rebuild, ref, c.bar);
  if (c.exact && std::memcmp(rebuilt.data(), full.data(), static_cast<size_t>(n) * 2) != 0) {
    fmt::print("  !! rebuilt tensor differs from the original\n");
  }
}

void ValidationBench() {
  fmt::print("\nValidation (ParamMapBuilder::Finalize), best of 50:\n");
  struct V {
    const char* name;
    ParamMapBuilder builder;
  };
  const std::vector<V> maps{
      {"32768x32768 column split over 64 ranks", Split({32768, 32768}, 1, 64)},
      {"32768x32768 row split over 64 ranks", Split({32768, 32768}, 0, 64)},
      {"32768x32768 split 8x8 (64 blocks)", [] {
         ParamMapBuilder b;
         b.set_logical_shape({32768, 32768});
         for (Rank r = 0; r < 64; ++r) {
           b.set_shard_shape(r, {4096, 4096});
           b.add_piece(r, MakePiece({4096, 4096}, (r / 8) * 4096 * 32768 + (r % 8) * 4096,
                                    {32768, 1}, 0, {4096, 1}, {r}));
         }
         return b;
       }()}};
  for (const V& v : maps) {
    Index pieces = 0;
    const double secs = BestSeconds(50, [&] {
      Result<ParamMap> m = v.builder.Finalize();
      if (!m.ok()) {
        fmt::print(stderr, "{}: {}\n", v.name, m.status().ToString());
        std::exit(1);
      }
      pieces = m->num_pieces();
    });
    fmt::print("  {:<42} {} elements, {} pieces: {:.1f} us\n", v.name, Index{32768} * 32768, pieces,
               secs * 1e6);
  }
}

// The fingerprint of a sub-box as a source process computes it for one target: half the
// columns of a 4096 x 4096 tensor (runs of 2048 elements), read as elements of 1, 2, 4 and 8
// bytes, on one thread and on every hardware thread.
void FingerprintBench(const std::vector<uint16_t>& full) {
  fmt::print("\nFingerprints (verify), 4096 x 2048 sub-box of a 4096 x 4096 tensor, best of {}:\n",
             kRepeats);
  const std::pair<DType, const char*> kinds[] = {
      {DType::kU8, "1-byte"}, {DType::kBF16, "bf16"}, {DType::kF32, "fp32"}, {DType::kF64, "fp64"}};
  for (const auto& [dtype, name] : kinds) {
    const Index cols = 4096, rows = 4096;
    const FingerprintView view{{rows, cols / 2}, B(full.data()), {cols, 1}, 0, {cols / 2, 1}};
    for (const int threads : {1, 0}) {
      uint64_t sum = 0;
      const double secs = BestSeconds(kRepeats, [&] {
        sum = 0;
        Check(AddFingerprints(dtype, {&view, 1}, 0x1234, {}, {&sum, 1}, threads), "fingerprint");
      });
      const auto elements = static_cast<double>(rows * cols / 2);
      fmt::print("  {:<7} {:<15} {:.3f} ns an element, {:.2f} GB/s\n", name,
                 threads == 1 ? "1 thread" : "every thread", secs * 1e9 / elements,
                 GBps(elements * static_cast<double>(DTypeSize(dtype)), secs));
    }
  }
}

int Main() {
  const unsigned hw = std::thread::hardware_concurrency();
  const std::vector<uint16_t> full = MakeTensor(kElements);
  std::vector<uint16_t> rebuilt(full.size(), 0);
  fmt::print("reshard_exec_bench: bf16 tensors of {} MiB, best of {} runs; {} hardware threads\n",
             kElements * 2 >> 20, kRepeats, hw);
  // Other processes on a 2-core machine halve a 2-thread figure: say how busy it was.
  if (std::FILE* f = std::fopen("/proc/loadavg", "r")) {
    double load = 0;
    if (std::fscanf(f, "%lf", &load) == 1)
      fmt::print("load average (1 min) at start: {:.2f}\n", load);
    std::fclose(f);
  }
  const Memcpy ref = MeasureMemcpy(full, rebuilt);
  fmt::print("memcpy of the same bytes: 1 thread {:.2f} GB/s, 2 threads {:.2f} GB/s\n", ref.gbps[1],
             ref.gbps[2]);
  fmt::print(
      "Executor with num_threads=1 is compared with 1-thread memcpy, num_threads=2 with\n"
      "2-thread memcpy; a bar passes when both ratios meet it. Bytes = shard bytes moved.\n\n");
  fmt::print("{:<34} {:<8} {:>17}   {:>17}   {:>5}  {}\n", "case", "op", "1 thread (ratio)",
             "2 threads (ratio)", "bar", "verdict");

  std::vector<Case> cases;
  cases.push_back(
      {"(a) row split, TP 4 along dim 0", MustFinalize(Split({16384, 8192}, 0, 4)), 0.8});
  cases.push_back(
      {"(b) column split, 2 KiB rows, TP 4", MustFinalize(Split({32768, 4096}, 1, 4)), 0.5});
  // World 4, A = 8, B = 1365, C = 1024: 2 KiB runs; F is 134,184,960 elements (255.9 MiB).
  cases.push_back(
      {"(c) 4-D interleaved (2,2,3,8)-like", MustFinalize(Interleaved(4, 8, 1365, 1024)), 0});
  cases.push_back(
      {"(d) row split TP 4, scale 0.5", MustFinalize(Split({16384, 8192}, 0, 4, 0.5)), 0.5});
  // The same without the round-trip check: what the check costs.
  cases.push_back({"(d') (d) with lossy scales allowed",
                   MustFinalize(Split({16384, 8192}, 0, 4, 0.5)), 0, /*exact=*/true,
                   /*allow_lossy_scale=*/true});
  // A non-power-of-two scale: extract multiplies by float(1/3), rebuild truly divides. It
  // rounds, so it runs with lossy scales allowed.
  cases.push_back({"(e) row split TP 4, scale 1/3",
                   MustFinalize(Split({16384, 8192}, 0, 4, 1.0 / 3)), 0, /*exact=*/false,
                   /*allow_lossy_scale=*/true});
  // Cases smaller than the full tensor use its prefix.
  for (const Case& c : cases) RunCase(c, full, rebuilt, ref);
  ValidationBench();
  FingerprintBench(full);
  return 0;
}

}  // namespace
}  // namespace reshard

int main() { return reshard::Main(); }
