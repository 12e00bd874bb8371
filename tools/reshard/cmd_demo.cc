// reshard demo [DIR]: the embedded default. Generates a small multi-layer model checkpoint
// with one parameter per layout family in every layer, scatters it to TP 4, converts it to
// TP 2 and then TP 3 through transfer plans, gathers it back and proves the result is
// bit-identical to the original, printing each step with its time.
#include <fmt/format.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <random>

#include "commands.h"
#include "exit_status.h"
#include "reshard/base/dtype.h"
#include "reshard/checkpoint/checkpoint.h"
#include "reshard/checkpoint/checkpoint_ops.h"
#include "reshard/checkpoint/output_dir.h"
#include "reshard/io/file.h"
#include "reshard/io/safetensors.h"
#include "reshard/ir/map_json.h"
#include "reshard/ir/map_summary.h"
#include "reshard/layouts/descriptor.h"
#include "reshard/layouts/layouts_document.h"

namespace reshard::cli {

namespace {

// Head counts divisible by 12 so that every family can be laid out at TP 2, 3 and 4.
constexpr Index kHidden = 768;
constexpr Index kHeads = 12;
constexpr Index kHeadDim = 64;
constexpr Index kKvHeads = 4;
constexpr Index kIntermediate = 2048;
constexpr Index kVocab = 32003;  // not a multiple of the world size: padded per degree

struct DemoArgs {
  std::string dir;
  bool force = false;
  int64_t seed = 20261129;
  int layers = 4;
};

struct DemoParam {
  std::string name;        // within a layer (or of the model)
  std::string layout;      // what it is
  std::string descriptor;  // JSON, docs/layouts.md
  Shape shape;
  DType dtype;
};

// One parameter per layout family (split twice: column- and row-parallel).
std::vector<DemoParam> LayerParams() {
  const Index kv = kKvHeads * kHeadDim;
  return {
      {"attn.c_attn.weight",
       "segmented: multi-query QKV, query rows split, key/value on every rank",
       fmt::format(
           R"({{"family": "segmented", "dim": 0, "parts": [{{"size": {}, "heads": {}}}, {{"size": {}, "replicated": true}}]}})",
           kHidden, kHeads, 2 * kHeadDim),
       {kHidden + 2 * kHeadDim, kHidden},
       DType::kBF16},
      {"attn.qkv_proj.weight",
       "fused: q, k and v split together, each by its heads",
       fmt::format(
           R"({{"family": "fused", "dim": 0, "parts": [{{"size": {}, "heads": {}}}, {{"size": {}, "heads": {}}}, {{"size": {}, "heads": {}}}]}})",
           kHidden, kHeads, kv, kKvHeads, kv, kKvHeads),
       {kHidden + 2 * kv, kHidden},
       DType::kBF16},
      {"attn.v_proj.weight",
       "block_gather: Yuan's shared-QK value heads",
       fmt::format(R"({{"family": "block_gather", "dim": 0, "pairing": "shared_qk", "heads": {}}})",
                   kHeads),
       {kHidden, kHidden},
       DType::kBF16},
      {"attn.codegen_qkv.weight",
       "codegen_qkv: CodeGen's fused QKV, interleaved over ranks",
       R"({"family": "codegen_qkv", "dim": 0, "mp_num": 4, "heads": 48})",
       {3 * kHidden, kHidden / 2},
       DType::kBF16},
      {"mlp.up_proj.weight",
       "split: column-parallel along dim 0",
       R"({"family": "split", "dim": 0})",
       {kIntermediate, kHidden},
       DType::kBF16},
      {"mlp.down_proj.weight",
       "split: row-parallel along dim 1",
       R"({"family": "split", "dim": 1})",
       {kHidden, kIntermediate},
       DType::kBF16},
      {"mlp.down_proj.bias",
       "replicated: row-parallel bias, pre-divided by the world size",
       R"({"family": "replicated", "pre_divided": true})",
       {kHidden},
       DType::kF32},
  };
}

DemoParam Embedding() {
  return {"embed_tokens.weight",
          "padded_vocab: vocabulary padded to divide, split by rows",
          R"({"family": "padded_vocab", "dim": 0})",
          {kVocab, kHidden / 2},
          DType::kBF16};
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

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string Mb(uint64_t bytes) {
  return fmt::format("{:.1f} MB", static_cast<double>(bytes) / 1e6);
}

uint64_t DirBytes(const std::filesystem::path& dir) {
  uint64_t n = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    if (e.is_regular_file(ec)) n += e.file_size(ec);
  }
  return n;
}

// Steps 2-5: scatter to TP 4, convert to TP 2 and TP 3, gather; records in `warned` the
// parameters whose values a scale rounds.
Status RunPipeline(const std::filesystem::path& root, const std::filesystem::path& full,
                   const std::map<std::string, LayoutDescriptor>& layouts,
                   std::map<std::string, std::string>& warned) {
  CheckpointOptions options;
  options.overwrite = true;
  options.warn = [&warned](const std::string& parameter, const std::string& message) {
    warned.emplace(parameter, message);
  };
  // TP 3 holds the pre-divided biases at a scale of 1/3, which rounds them: allowed here and
  // reported in step 6.
  options.allow_lossy_scale = true;
  auto t0 = Clock::now();
  if (Status s =
          Scatter(full.string(), 4, MapsFromLayouts(layouts, 4), (root / "tp4").string(), options);
      !s.ok())
    return s;
  fmt::print("2. scattered to TP 4               {:<28} {}, {:.2f} s\n", (root / "tp4").string(),
             Mb(DirBytes(root / "tp4")), Seconds(t0));
  t0 = Clock::now();
  if (Status s =
          Convert((root / "tp4").string(), 2, std::nullopt, (root / "tp2").string(), options);
      !s.ok())
    return s;
  fmt::print("3. converted TP 4 -> TP 2          {:<28} {}, {:.2f} s (no full tensor built)\n",
             (root / "tp2").string(), Mb(DirBytes(root / "tp2")), Seconds(t0));
  t0 = Clock::now();
  if (Status s =
          Convert((root / "tp2").string(), 3, std::nullopt, (root / "tp3").string(), options);
      !s.ok())
    return s;
  fmt::print("4. converted TP 2 -> TP 3          {:<28} {}, {:.2f} s\n", (root / "tp3").string(),
             Mb(DirBytes(root / "tp3")), Seconds(t0));
  t0 = Clock::now();
  if (Status s = Gather((root / "tp3").string(), (root / "gathered").string(), options); !s.ok())
    return s;
  fmt::print("5. gathered TP 3 (replicas checked) {:<27} {}, {:.2f} s\n\n",
             (root / "gathered").string(), Mb(DirBytes(root / "gathered")), Seconds(t0));

  return Status::Ok();
}

// Step 1: the full checkpoint, as reshard writes one (so --force may replace it).
Status WriteFullCheckpoint(const std::filesystem::path& full, std::vector<TensorToWrite> tensors) {
  RESHARD_ASSIGN_OR_RETURN(OutputDirectory out, OutputDirectory::Create(full.string(), true));
  RESHARD_RETURN_IF_ERROR(
      WriteSafetensors(out.FilePath("model.safetensors"), std::move(tensors), ProducerMetadata()));
  return out.Commit();
}

// Pieces per rank of layer 0's parameters (and the embedding) at each degree.
Status PrintPiecesPerRank(const std::filesystem::path& root,
                          const std::vector<std::pair<std::string, DemoParam>>& params) {
  std::vector<Result<ShardedCheckpoint>> ckpts;
  for (int tp : {4, 2, 3})
    ckpts.push_back(ShardedCheckpoint::Open((root / fmt::format("tp{}", tp)).string()));
  for (const auto& c : ckpts)
    if (!c.ok()) return c.status();
  fmt::print("{:<36} {:<8} {:<8} {:<8}  layout\n", "parameter (pieces per rank)", "TP 4", "TP 2",
             "TP 3");
  for (const auto& [name, p] : params) {
    if (name.rfind("layers.0.", 0) != 0 && name != Embedding().name) continue;
    std::vector<std::string> cells;
    for (const auto& c : ckpts) {
      for (const ShardedParam& sp : c->manifest().params) {
        if (sp.name != name) continue;
        std::string cell;
        for (const RankShard& r : sp.map.ranks()) cell += std::to_string(r.pieces.size());
        cells.push_back(cell);
      }
    }
    fmt::print("{:<36} {:<8} {:<8} {:<8}  {}\n", name, cells.size() > 0 ? cells[0] : "",
               cells.size() > 1 ? cells[1] : "", cells.size() > 2 ? cells[2] : "", p.layout);
  }

  return Status::Ok();
}

// The demo's working directory, created: DIR (refused if it holds something, unless forced)
// or a new temporary one.
Result<std::filesystem::path> PrepareRoot(const DemoArgs& args) {
  namespace fs = std::filesystem;
  fs::path root;
  bool temporary = args.dir.empty();
  std::error_code ec;
  if (temporary) {
    std::random_device rd;
    root = fs::temp_directory_path(ec) / fmt::format("reshard-demo-{:08x}", rd());
  } else {
    root = args.dir;
    const fs::file_status st = fs::symlink_status(root, ec);
    if (fs::is_symlink(st)) {
      return InvalidArgumentError(
          fmt::format("DIR \"{}\" is a symbolic link (to \"{}\"); give a real directory path",
                      args.dir, fs::read_symlink(root, ec).string()));
    }
    if (fs::exists(st) && !fs::is_directory(st)) {
      return InvalidArgumentError(fmt::format(
          "DIR \"{}\" exists and is not a directory, which the demo never replaces; remove it "
          "yourself or choose another DIR",
          args.dir));
    }
    if (fs::exists(st) && !fs::is_empty(root, ec) && !args.force) {
      return AlreadyExistsError(fmt::format(
          "\"{}\" already exists and is not empty; pass --force to replace its contents",
          args.dir));
    }
    // With --force, each output the demo writes in DIR replaces only what --force may replace,
    // all checked before anything is written.
    for (const char* name : {"full", "tp4", "tp2", "tp3", "gathered"}) {
      RESHARD_RETURN_IF_ERROR(CheckReplaceable((root / name).string()));
    }
    RESHARD_RETURN_IF_ERROR(CheckOutputFile((root / "layouts.json").string(), true));
  }
  fs::create_directories(root, ec);
  if (ec) return ErrnoStatus(ec.value(), "cannot create", root.string());
  return root;
}

Status RunDemo(const DemoArgs& args) {
  namespace fs = std::filesystem;
  // The working directory: DIR, or a temporary one removed at the end.
  const bool temporary = args.dir.empty();
  RESHARD_ASSIGN_OR_RETURN(const fs::path root, PrepareRoot(args));
  struct Cleanup {
    fs::path path;
    bool active;
    ~Cleanup() {
      std::error_code e;
      if (active) fs::remove_all(path, e);
    }
  } cleanup{root, temporary};

  fmt::print(
      "reshard demo: a {}-layer model (hidden {}, {} heads of {}, {} key/value heads, "
      "intermediate {}, vocabulary {}), one parameter per layout family in each layer\n\n",
      args.layers, kHidden, kHeads, kHeadDim, kKvHeads, kIntermediate, kVocab);

  // 1. The full checkpoint.
  std::map<std::string, LayoutDescriptor> layouts;
  std::vector<std::pair<std::string, DemoParam>> params = {{Embedding().name, Embedding()}};
  for (int l = 0; l < args.layers; ++l) {
    for (const DemoParam& p : LayerParams())
      params.emplace_back(fmt::format("layers.{}.{}", l, p.name), p);
  }
  for (const auto& [name, p] : params) {
    Result<LayoutDescriptor> d = ParseLayoutJson(p.descriptor);
    if (!d.ok()) return InternalError(d.status().Annotate(name).message());
    layouts.emplace(name, *d);
  }
  std::mt19937_64 rng(static_cast<uint64_t>(args.seed));
  std::map<std::string, std::vector<std::byte>> weights;
  std::vector<TensorToWrite> tensors;
  for (const auto& [name, p] : params) {
    weights[name] = RandomTensor(p.dtype, ProductOf(p.shape), rng);
    const std::vector<std::byte>* data = &weights[name];
    tensors.push_back({name, p.dtype, p.shape, [data](std::span<std::byte> out) -> Status {
                         std::memcpy(out.data(), data->data(), out.size());
                         return Status::Ok();
                       }});
  }
  const fs::path full = root / "full";
  auto t0 = Clock::now();
  RESHARD_RETURN_IF_ERROR(WriteFullCheckpoint(full, std::move(tensors)));
  fmt::print("1. wrote the full checkpoint       {:<28} {} tensors, {}, {:.2f} s\n",
             (full / "model.safetensors").string(), params.size(), Mb(DirBytes(full)), Seconds(t0));
  const std::string layouts_json = LayoutsDocumentToJson(LayoutsDocument{layouts});
  if (Status s =
          WriteFileAtomically((root / "layouts.json").string(), layouts_json, {.overwrite = true});
      !s.ok())
    return s;

  // 2-5. scatter, convert, convert, gather.
  std::map<std::string, std::string> warned;  // parameter -> why its values are rounded
  RESHARD_RETURN_IF_ERROR(RunPipeline(root, full, layouts, warned));

  RESHARD_RETURN_IF_ERROR(PrintPiecesPerRank(root, params));

  // 6. Bit-exactness against the original weights.
  Result<FullCheckpoint> back = FullCheckpoint::Open((root / "gathered").string());
  if (!back.ok()) return back.status();
  size_t exact = 0;
  size_t rounded = 0;
  bool ok = true;
  for (const auto& [name, data] : weights) {
    const TensorRef* t = back->Find(name);
    if (t && t->data.size() == data.size() &&
        std::memcmp(t->data.data(), data.data(), data.size()) == 0) {
      ++exact;
      continue;
    }
    // A parameter moved through a scale that is not a power of two is rounded, as warned:
    // accept it within 4 units in the last place.
    bool close =
        t && t->data.size() == data.size() && warned.count(name) && t->info->dtype == DType::kF32;
    for (size_t i = 0; close && i + 4 <= data.size(); i += 4) {
      int32_t a, b;
      std::memcpy(&a, data.data() + i, 4);
      std::memcpy(&b, t->data.data() + i, 4);
      close = std::abs(static_cast<int64_t>(a) - b) <= 4;
    }
    if (close) {
      ++rounded;
    } else {
      ok = false;
      fmt::print("MISMATCH: {} differs from the original\n", name);
    }
  }
  fmt::print("\n6. {} of {} tensors are bit-identical to the original after TP 4 -> 2 -> 3 -> full",
             exact, weights.size());
  if (rounded > 0) {
    fmt::print(";\n   {} are within 4 units in the last place: {}", rounded,
               warned.begin()->second);
  }
  fmt::print("\n");
  if (!temporary) {
    fmt::print("   outputs in {} (try: reshard show {}/tp4/reshard.json)\n", root.string(),
               root.string());
  }
  fmt::print("{}\n",
             !ok ? "some parameters did not round-trip"
             : rounded == 0
                 ? "all parameters round-tripped bit for bit"
                 : "every parameter round-tripped: bit for bit, or as exactly as its scales allow");
  return ok ? Status::Ok() : AlreadyReportedCheckFailure();
}

void AddDemoOptions(CLI::App* cmd, DemoArgs* args) {
  cmd->add_option("DIR", args->dir, "directory for the outputs (optional)");
  cmd->add_flag("--force", args->force, "replace existing outputs in DIR");
  cmd->add_option("--layers", args->layers, "number of layers")
      ->capture_default_str()
      ->check(IntegerIn(1, 64));
  cmd->add_option("--seed", args->seed, "random seed for the weights (0 to 2^63-1)")
      ->capture_default_str()
      ->check(IntegerIn(0, std::numeric_limits<int64_t>::max()));
}

}  // namespace

CommandBody DemoCommand() { return {AddDemoOptions, RunDemo}; }

}  // namespace reshard::cli
