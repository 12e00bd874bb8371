// reshard demo [DIR]: the embedded default. Builds the maps of a small transformer block at
// TP 4 from layout descriptors, one parameter per family, extracts each rank's shard from
// random data, rebuilds the full tensors from the shards and proves the round trip is
// bit-exact.
#include <fmt/format.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <random>

#include "commands.h"
#include "exit_status.h"
#include "reshard/base/dtype.h"
#include "reshard/exec/executor.h"
#include "reshard/io/file.h"
#include "reshard/ir/map_json.h"
#include "reshard/ir/map_summary.h"
#include "reshard/layouts/descriptor.h"

namespace reshard::cli {

namespace {

constexpr int kWorld = 4;
constexpr Index kHidden = 512;
constexpr Index kHeadDim = 64;
constexpr Index kIntermediate = 1024;
constexpr Index kVocab = 1001;  // not a multiple of the world size: padded to 1004

struct DemoArgs {
  std::string dir;
  bool force = false;
  uint64_t seed = 20261129;
};

struct DemoParam {
  std::string name;
  std::string layout;
  std::string descriptor;  // JSON, docs/layouts.md
  Shape shape;
  DType dtype;
};

// One parameter per layout family (split twice: column- and row-parallel).
std::vector<DemoParam> DemoParams() {
  const Index kv = 4 * kHeadDim;  // 4 key/value heads
  return {
      {"block.attn.c_attn.weight",
       "segmented: multi-query QKV, query rows split, key/value on every rank",
       R"({"family": "segmented", "dim": 0, "parts": [{"size": 512, "heads": 8}, {"size": 128, "replicated": true}]})",
       {kHidden + 2 * kHeadDim, kHidden},
       DType::kBF16},
      {"block.attn.qkv_proj.weight",
       "fused: q (8 heads), k and v (4 heads each) split together",
       R"({"family": "fused", "dim": 0, "parts": [{"size": 512, "heads": 8}, {"size": 256, "heads": 4}, {"size": 256, "heads": 4}]})",
       {kHidden + 2 * kv, kHidden},
       DType::kBF16},
      {"block.attn.v_proj.weight",
       "block_gather: Yuan's shared-QK value heads, two runs per rank",
       R"({"family": "block_gather", "dim": 0, "pairing": "shared_qk", "heads": 8})",
       {kHidden, kHidden},
       DType::kBF16},
      {"block.attn.codegen_qkv.weight",
       "codegen_qkv: CodeGen's fused QKV, interleaved over ranks",
       R"({"family": "codegen_qkv", "dim": 0, "mp_num": 4, "heads": 16})",
       {3 * kHidden, kHidden / 2},
       DType::kBF16},
      {"block.mlp.up_proj.weight",
       "split: column-parallel along dim 0 (rows)",
       R"({"family": "split", "dim": 0})",
       {kIntermediate, kHidden},
       DType::kBF16},
      {"block.mlp.down_proj.weight",
       "split: row-parallel along dim 1 (columns)",
       R"({"family": "split", "dim": 1})",
       {kHidden, kIntermediate},
       DType::kBF16},
      {"block.mlp.down_proj.bias",
       "replicated: row-parallel bias, pre-divided by the world size",
       R"({"family": "replicated", "pre_divided": true})",
       {kHidden},
       DType::kF32},
      {"embed_tokens.weight",
       "padded_vocab: vocabulary padded to divide, split by rows",
       R"({"family": "padded_vocab", "dim": 0})",
       {kVocab, kHidden / 2},
       DType::kBF16},
  };
}

// Random weights of a plausible magnitude (normal, sigma 0.02), so that scaling by a power
// of two stays exact (no underflow to subnormals).
std::vector<std::byte> RandomTensor(DType dtype, Index n, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<std::byte> data(static_cast<size_t>(n) * DTypeSize(dtype));
  for (Index i = 0; i < n; ++i) {
    float v = normal(rng);
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    if (dtype == DType::kBF16) {
      const auto half = static_cast<uint16_t>(bits >> 16);
      std::memcpy(data.data() + 2 * i, &half, 2);
    } else {
      std::memcpy(data.data() + 4 * i, &bits, 4);
    }
  }
  return data;
}

double Ms(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

int RunDemo(const DemoArgs& args) {
  using Clock = std::chrono::steady_clock;
  fmt::print("reshard demo: one transformer block (hidden {}, head dim {}, intermediate {}) at "
             "TP {}\n\n",
             kHidden, kHeadDim, kIntermediate, kWorld);
  std::mt19937_64 rng(args.seed);
  MapDocument doc;
  bool all_exact = true;
  for (const DemoParam& p : DemoParams()) {
    Result<LayoutDescriptor> descriptor = ParseLayoutJson(p.descriptor);
    Result<ParamMap> built = descriptor.ok() ? BuildMap(*descriptor, p.shape, kWorld)
                                             : Result<ParamMap>(descriptor.status());
    if (!built.ok()) return Report("demo", built.status().Annotate(p.name), kExitInternal);
    const ParamMap& map = *built;
    const size_t elem = DTypeSize(p.dtype);
    std::vector<std::byte> full = RandomTensor(p.dtype, map.num_elements(), rng);
    // Padding is not data: a rebuilt F has zeros there, so the original does too.
    if (map.has_padding()) {
      for (Index i = 0; i < map.num_elements(); ++i) {
        if (map.IsPadding(i)) std::memset(full.data() + static_cast<size_t>(i) * elem, 0, elem);
      }
    }
    std::vector<std::vector<std::byte>> shards(static_cast<size_t>(map.world_size()));
    const auto t0 = Clock::now();
    for (Rank r = 0; r < map.world_size(); ++r) {
      auto& shard = shards[static_cast<size_t>(r)];
      shard.resize(static_cast<size_t>(map.shard_num_elements(r)) * elem);
      Status s = Extract(map, p.dtype, r, {full.data(), map.num_elements()},
                         {shard.data(), map.shard_num_elements(r)});
      if (!s.ok()) return Report("demo", s.Annotate(p.name), kExitInternal);
    }
    const auto t1 = Clock::now();
    std::vector<ConstBuffer> views;
    for (Rank r = 0; r < map.world_size(); ++r) {
      views.push_back({shards[static_cast<size_t>(r)].data(), map.shard_num_elements(r)});
    }
    std::vector<std::byte> rebuilt(full.size());
    Status s = Rebuild(map, p.dtype, views, {rebuilt.data(), map.num_elements()});
    if (!s.ok()) return Report("demo", s.Annotate(p.name), kExitInternal);
    const auto t2 = Clock::now();
    const bool exact = rebuilt == full;
    all_exact = all_exact && exact;
    const MapSummary summary = Summarize(map);
    fmt::print("{}\n  layout   {}\n           {}\n  F        {} {} ({} bytes){}\n", p.name, p.layout,
               LayoutToJson(*descriptor), DTypeName(p.dtype), FormatShape(map.logical_shape()), full.size(),
               map.has_padding() ? fmt::format(", real rows {}", FormatShape(map.valid_shape())) : "");
    std::string pieces;
    for (const RankSummary& rs : summary.ranks) pieces += fmt::format(" {}", rs.pieces);
    fmt::print("  pieces   per rank:{}; shards hold {} bytes ({} replicated, {} scaled)\n",
               pieces, summary.held_elements * static_cast<Index>(elem),
               summary.replicated_elements * static_cast<Index>(elem),
               summary.scaled_elements * static_cast<Index>(elem));
    fmt::print("  extract  {:.2f} ms for {} shards; rebuild {:.2f} ms with replica checks\n",
               Ms(t1 - t0), map.world_size(), Ms(t2 - t1));
    fmt::print("  result   {}\n\n", exact ? "rebuilt F is bit-identical to the original"
                                          : "MISMATCH: rebuilt F differs from the original");
    doc.params.emplace_back(p.name, map);
  }
  if (!args.dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(args.dir, ec);
    if (ec) {
      return Report("demo", UnavailableError(fmt::format("cannot create \"{}\": {}", args.dir, ec.message())), kExitInternal);
    }
    const std::string path = (std::filesystem::path(args.dir) / "maps.json").string();
    Status s = WriteFileAtomically(path, MapDocumentToJson(doc), {.overwrite = args.force});
    if (!s.ok()) return Report("demo", s, ExitStatusFor(s, Stage::kReading));
    fmt::print("wrote the map document to {} (try: reshard show {})\n", path, path);
  }
  fmt::print("{}\n", all_exact ? "all parameters round-tripped bit for bit"
                               : "some parameters did not round-trip");
  return all_exact ? kExitOk : kExitCheckFailed;
}

}  // namespace

void RegisterDemo(CLI::App& app, int& exit_status) {
  auto args = std::make_shared<DemoArgs>();
  CLI::App* cmd = app.add_subcommand(
      "demo",
      "Run the embedded example: build the maps of a small model at TP 4 from layout "
      "descriptors, one parameter per family (splits, fused and multi-query QKV, Yuan's "
      "shared-QK heads, CodeGen's QKV, a pre-divided bias, a padded vocabulary), extract shards "
      "from random data, rebuild and prove bit-exactness. With DIR, also write DIR/maps.json.");
  cmd->add_option("DIR", args->dir, "directory for the outputs (optional)");
  cmd->add_flag("--force", args->force, "replace existing outputs in DIR");
  cmd->add_option("--seed", args->seed, "random seed for the weights")->capture_default_str();
  cmd->callback([args, &exit_status] { exit_status = RunDemo(*args); });
}

}  // namespace reshard::cli
