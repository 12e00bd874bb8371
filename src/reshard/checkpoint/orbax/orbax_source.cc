// Orbax checkpoints as the library takes every format: detection, inspect's summary, the
// ShardSource, and the opener of the table of formats.
#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <filesystem>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <span>
#include <utility>

#include "reshard/base/json_reader.h"
#include "reshard/checkpoint/dcp/dcp.h"
#include "reshard/checkpoint/orbax/maxtext.h"
#include "reshard/checkpoint/orbax/orbax.h"
#include "reshard/checkpoint/self_described.h"
#include "reshard/io/file.h"

namespace reshard {

namespace fs = std::filesystem;

namespace {

bool HasFile(const fs::path& dir, const char* name) {
  std::error_code ec;
  return fs::is_regular_file(dir / name, ec);
}

bool ItemOrStep(const fs::path& dir) {
  return HasFile(dir, "_METADATA") || HasFile(dir, "_CHECKPOINT_METADATA");
}

std::string SpecText(const OrbaxArray& a) {
  if (!a.sharding) return "(no sharding recorded)";
  if (a.sharding->type != "NamedSharding") return a.sharding->type;
  std::string out = "P(";
  for (size_t d = 0; d < a.sharding->spec.size(); ++d) {
    const auto& axes = a.sharding->spec[d];
    if (d > 0) out += ", ";
    if (axes.empty()) out += "None";
    if (axes.size() == 1) out += "'" + axes[0] + "'";
    if (axes.size() > 1) {
      out += "(";
      for (size_t k = 0; k < axes.size(); ++k) out += (k ? ", '" : "'") + axes[k] + "'";
      out += ")";
    }
  }
  return out + ")";
}

std::string MeshText(const OrbaxSharding& s) {
  std::string out;
  for (size_t a = 0; a < s.axis_names.size(); ++a) {
    out += fmt::format("{}{}={}", a ? "," : "", s.axis_names[a], s.mesh_shape[a]);
  }
  return out;
}

}  // namespace

bool IsOrbaxCheckpoint(const std::string& path) {
  const fs::path dir(path);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return false;
  if (ItemOrStep(dir)) return true;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::error_code type_error;
    if (!e.is_directory(type_error)) continue;
    if (ItemOrStep(e.path())) return true;
  }
  return false;
}

std::string OrbaxSummaryText(const OrbaxCheckpoint& c) {
  std::string out = fmt::format("Orbax checkpoint \"{}\": {}, {} array{}, {} device{}\n", c.path(),
                                c.storage(), c.arrays().size(), c.arrays().size() == 1 ? "" : "s",
                                c.world_size(), c.world_size() == 1 ? "" : "s");
  std::string last_mesh;
  const OrbaxMoments moments = FindOrbaxMoments(c);
  for (size_t i = 0; i < c.arrays().size(); ++i) {
    const OrbaxArray& a = c.arrays()[i];
    std::string note = a.optimizer_state ? "  (optimizer state)" : "";
    if (const auto it = moments.moments.find(i); it != moments.moments.end()) {
      note = fmt::format("  (optimizer state: {} of {})", it->second.second,
                         c.arrays()[it->second.first].name);
    }
    if (a.sharding && a.sharding->type == "NamedSharding") {
      const std::string mesh = MeshText(*a.sharding);
      if (mesh != last_mesh) out += fmt::format("  mesh {}\n", mesh);
      last_mesh = mesh;
    }
    out += fmt::format("  {}  {} {}  {}  write {} chunk {}{}{}\n", a.name, DTypeName(a.zarr.dtype),
                       FormatShape(a.zarr.shape), SpecText(a), FormatShape(a.write_shape),
                       FormatShape(a.zarr.chunk_shape),
                       a.zarr.sharded ? " inner " + FormatShape(a.zarr.inner_shape) : "", note);
  }
  for (const auto& [name, type] : c.others()) {
    out += fmt::format("  {}  {} (not an array: left out)\n", name, type);
  }
  return out;
}

std::string OrbaxSummaryJson(const OrbaxCheckpoint& c) {
  nlohmann::ordered_json doc = {{"path", c.path()},
                                {"storage", c.storage()},
                                {"items", c.items()},
                                {"devices", c.device_ids()}};
  nlohmann::ordered_json arrays = nlohmann::ordered_json::array();
  const OrbaxMoments moments = FindOrbaxMoments(c);
  for (size_t i = 0; i < c.arrays().size(); ++i) {
    const OrbaxArray& a = c.arrays()[i];
    nlohmann::ordered_json one = {{"name", a.name},
                                  {"path", a.path},
                                  {"value_type", a.value_type},
                                  {"dtype", DTypeName(a.zarr.dtype)},
                                  {"shape", a.zarr.shape},
                                  {"write_shape", a.write_shape},
                                  {"chunk_shape", a.zarr.chunk_shape},
                                  {"zarr_format", a.zarr.zarr_format},
                                  {"zstd", a.zarr.zstd},
                                  {"optimizer_state", a.optimizer_state}};
    if (a.zarr.sharded) one["inner_chunk_shape"] = a.zarr.inner_shape;
    if (const auto it = moments.moments.find(i); it != moments.moments.end()) {
      one["moment_of"] = {{"param", c.arrays()[it->second.first].name},
                          {"state", it->second.second}};
    }
    if (a.sharding) {
      nlohmann::ordered_json s = {{"type", a.sharding->type}};
      if (a.sharding->type == "NamedSharding") {
        s["mesh_shape"] = a.sharding->mesh_shape;
        s["axis_names"] = a.sharding->axis_names;
        s["partition_spec"] = a.sharding->spec;
        s["device_ids"] = a.sharding->device_ids;
      }
      one["sharding"] = std::move(s);
    }
    arrays.push_back(std::move(one));
  }
  doc["arrays"] = std::move(arrays);
  nlohmann::ordered_json others = nlohmann::ordered_json::array();
  for (const auto& [name, type] : c.others())
    others.push_back({{"name", name}, {"value_type", type}});
  doc["left_out"] = std::move(others);
  return doc.dump();
}

namespace {

// Whether `path` ends with `suffix`, element by element.
bool EndsWith(const std::vector<std::string>& path, std::span<const std::string> suffix) {
  return suffix.size() <= path.size() &&
         std::equal(suffix.begin(), suffix.end(),
                    path.end() - static_cast<ptrdiff_t>(suffix.size()));
}

}  // namespace

OrbaxMoments FindOrbaxMoments(const OrbaxCheckpoint& c) {
  const std::vector<OrbaxArray>& arrays = c.arrays();
  // Per moment: where its state sits (the path before mu/nu), which, and the model arrays it
  // may belong to, each with the prefix its parameter path is found under.
  struct Candidate {
    size_t array;
    std::vector<std::string> prefix;
  };
  struct Moment {
    size_t array;
    std::vector<std::string> state;
    std::string which;
    std::vector<Candidate> candidates;
  };
  std::vector<Moment> moments;
  std::map<std::vector<std::string>, size_t> prefix_votes;
  for (size_t i = 0; i < arrays.size(); ++i) {
    const OrbaxArray& a = arrays[i];
    if (!a.optimizer_state) continue;
    // The last "mu" or "nu" dict key with a parameter path after it.
    size_t k = a.path.size();
    while (k-- > 1) {
      if (!a.path_is_index[k] && (a.path[k] == "mu" || a.path[k] == "nu")) break;
    }
    if (k == 0 || k + 1 >= a.path.size()) continue;
    Moment m{i,
             std::vector<std::string>(a.path.begin(), a.path.begin() + static_cast<ptrdiff_t>(k)),
             a.path[k] == "mu" ? "exp_avg" : "exp_avg_sq",
             {}};
    const std::span<const std::string> param_path(a.path.begin() + static_cast<ptrdiff_t>(k) + 1,
                                                  a.path.end());
    for (size_t j = 0; j < arrays.size(); ++j) {
      const OrbaxArray& p = arrays[j];
      if (p.optimizer_state || p.zarr.shape != a.zarr.shape || !EndsWith(p.path, param_path)) {
        continue;
      }
      std::vector<std::string> prefix(p.path.begin(),
                                      p.path.end() - static_cast<ptrdiff_t>(param_path.size()));
      ++prefix_votes[prefix];
      m.candidates.push_back({j, std::move(prefix)});
    }
    if (!m.candidates.empty()) moments.push_back(std::move(m));
  }
  // Each moment's model array; a state of a model array that two moments claim (two Adam
  // states over the same parameters, as two chains keep) is no one's: which one an optimizer
  // reading it back would take is not known.
  std::vector<const Candidate*> best_of(moments.size(), nullptr);
  std::map<std::pair<size_t, std::string>, int> claims;  // (model array, state)
  for (size_t k = 0; k < moments.size(); ++k) {
    const Moment& m = moments[k];
    const Candidate*& best = best_of[k];
    for (const Candidate& cand : m.candidates) {
      if (best == nullptr || prefix_votes[cand.prefix] > prefix_votes[best->prefix] ||
          (prefix_votes[cand.prefix] == prefix_votes[best->prefix] &&
           cand.prefix.size() < best->prefix.size())) {
        best = &cand;
      }
    }
    ++claims[{best->array, m.which}];
  }
  OrbaxMoments out;
  for (size_t k = 0; k < moments.size(); ++k) {
    const Moment& m = moments[k];
    const Candidate* best = best_of[k];
    if (claims[{best->array, m.which}] != 1) continue;
    out.moments.emplace(m.array, std::pair{best->array, m.which});
    if (m.which != "exp_avg") continue;
    // The count beside mu: the optimizer's step.
    for (size_t j = 0; j < arrays.size(); ++j) {
      const OrbaxArray& n = arrays[j];
      if (n.optimizer_state && n.path.size() == m.state.size() + 1 && n.path.back() == "count" &&
          std::equal(m.state.begin(), m.state.end(), n.path.begin()) && n.zarr.shape.empty() &&
          DTypeKindOf(n.zarr.dtype) == DTypeKind::kInt) {
        out.counts.emplace(best->array, j);
      }
    }
  }
  return out;
}

namespace {

// The most stored chunks of one array that StoredChunks lists (a plan over more is not made).
constexpr Index kMaxPlannedChunks = 4096;

class OrbaxShardSource : public ShardSource {
 public:
  OrbaxShardSource(std::shared_ptr<const OrbaxCheckpoint> ckpt, bool weights_only)
      : ckpt_(std::move(ckpt)) {
    manifest_.world_size = ckpt_->world_size();
    const std::vector<OrbaxArray>& arrays = ckpt_->arrays();
    std::set<std::string> names;
    for (const OrbaxArray& a : arrays) names.insert(a.name);
    const OrbaxMoments moments = FindOrbaxMoments(*ckpt_);
    // A parameter's moments are its optimizer state only both together: one alone keeps its own
    // name (an optimizer reading the parameter's state would find half of it).
    std::map<size_t, int> found;
    for (const auto& [m, of] : moments.moments) ++found[of.first];
    for (size_t i = 0; i < arrays.size(); ++i) {
      const OrbaxArray& a = arrays[i];
      if (weights_only && a.optimizer_state) continue;
      std::string name = a.name;
      if (const auto it = moments.moments.find(i);
          it != moments.moments.end() && found[it->second.first] == 2) {
        std::string state = arrays[it->second.first].name + "." + it->second.second;
        if (!names.contains(state)) name = std::move(state);
      }
      manifest_.params.push_back(ShardedParam{std::move(name), a.zarr.dtype, ckpt_->map(i),
                                              DcpDefaultLayout(a.zarr.shape), 1});
      which_.push_back(i);
    }
  }
  const Manifest& manifest() const override { return manifest_; }
  std::vector<std::string> inputs() const override { return ckpt_->inputs(); }
  bool ReadsRegions() const override { return true; }
  Status ReadRegion(size_t i, const Shape& offsets, const Shape& sizes, std::span<std::byte> out,
                    int threads) override {
    const size_t a = which_[i];
    const OrbaxArray& array = ckpt_->arrays()[a];
    const size_t want = static_cast<size_t>(ProductOf(sizes)) * DTypeSize(array.zarr.dtype);
    if (offsets.size() != array.zarr.shape.size() || sizes.size() != offsets.size() ||
        out.size() < want) {
      return InvalidArgumentError(
          fmt::format("\"{}\": a region of rank {} and {} bytes of {} {}", array.name, sizes.size(),
                      out.size(), DTypeName(array.zarr.dtype), FormatShape(array.zarr.shape)));
    }
    for (size_t d = 0; d < sizes.size(); ++d) {
      if (offsets[d] < 0 || sizes[d] < 0 || offsets[d] + sizes[d] > array.zarr.shape[d]) {
        return OutOfRangeError(fmt::format("\"{}\": region at {} of {} is outside {}", array.name,
                                           FormatShape(offsets), FormatShape(sizes),
                                           FormatShape(array.zarr.shape)));
      }
    }
    return ckpt_->ReadBox(a, offsets, sizes, out.first(want), threads);
  }

  Index RegionRows(size_t i, uint64_t band_bytes) const override {
    const ZarrArray& z = ckpt_->arrays()[which_[i]].zarr;
    if (z.shape.empty() || z.chunk_shape.empty() || z.chunk_shape[0] <= 0) return 0;
    const uint64_t row =
        static_cast<uint64_t>(ProductOf(Shape(z.shape.begin() + 1, z.shape.end()))) *
        DTypeSize(z.dtype);
    const uint64_t chunk_rows = static_cast<uint64_t>(z.chunk_shape[0]);
    const uint64_t per_band = std::max<uint64_t>(row * chunk_rows, 1);
    return static_cast<Index>(chunk_rows * std::max<uint64_t>(1, band_bytes / per_band));
  }

  std::vector<std::pair<Shape, Shape>> StoredChunks(size_t i) const override {
    const ZarrArray& z = ckpt_->arrays()[which_[i]].zarr;
    std::vector<std::pair<Shape, Shape>> out;
    if (z.shape.empty() || z.chunk_shape.size() != z.shape.size() || ProductOf(z.shape) == 0) {
      return out;
    }
    const size_t rank = z.shape.size();
    Shape grid(rank);
    for (size_t d = 0; d < rank; ++d) {
      if (z.chunk_shape[d] <= 0) return {};
      grid[d] = (z.shape[d] + z.chunk_shape[d] - 1) / z.chunk_shape[d];
    }
    if (ProductOf(grid) > kMaxPlannedChunks) return {};
    for (Shape at(rank, 0);;) {
      Shape offsets(rank), sizes(rank);
      for (size_t d = 0; d < rank; ++d) {
        offsets[d] = at[d] * z.chunk_shape[d];
        sizes[d] = std::min(z.chunk_shape[d], z.shape[d] - offsets[d]);
      }
      out.emplace_back(std::move(offsets), std::move(sizes));
      size_t d = rank;
      while (d-- > 0) {
        if (++at[d] < grid[d]) break;
        at[d] = 0;
      }
      if (d == static_cast<size_t>(-1)) return out;
    }
  }

  Result<std::vector<ConstBuffer>> AcquireShards(size_t i) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = cache_.find(i);
      if (it != cache_.end()) {
        ++it->second->users;
        return it->second->buffers;
      }
    }
    auto e = std::make_shared<Entry>();
    RESHARD_RETURN_IF_ERROR(Read(i, *e));
    std::lock_guard<std::mutex> lock(mu_);
    auto [it, inserted] = cache_.emplace(i, e);
    ++it->second->users;
    return it->second->buffers;
  }

  void ReleaseShards(size_t i) override {
    std::shared_ptr<Entry> done;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cache_.find(i);
    if (it == cache_.end() || --it->second->users > 0) return;
    done = std::move(it->second);
    cache_.erase(it);
  }

 private:
  struct Entry {
    int users = 0;
    std::vector<ConstBuffer> buffers;                                 // per rank
    std::map<std::pair<Shape, Shape>, std::vector<std::byte>> boxes;  // each box read once
  };

  Status Read(size_t i, Entry& e) {
    const size_t a = which_[i];
    const size_t esize = DTypeSize(ckpt_->arrays()[a].zarr.dtype);
    const auto world = static_cast<size_t>(manifest_.world_size);
    e.buffers.assign(world, {});
    for (size_t r = 0; r < world; ++r) {
      auto box = ckpt_->Box(a, static_cast<Rank>(r));
      const Index n = ProductOf(box.second);
      if (n == 0 || manifest_.params[i].map.shard_num_elements(static_cast<Rank>(r)) == 0) {
        continue;
      }
      auto it = e.boxes.find(box);
      if (it == e.boxes.end()) {
        std::vector<std::byte> data;
        try {
          data.resize(static_cast<size_t>(n) * esize);
        } catch (const std::bad_alloc&) {
          return DataLossError(
              fmt::format("{}: a box of {} bytes is more memory than this process can have",
                          manifest_.params[i].name, static_cast<size_t>(n) * esize));
        }
        RESHARD_RETURN_IF_ERROR(ckpt_->ReadBox(a, box.first, box.second, data));
        it = e.boxes.emplace(box, std::move(data)).first;
      }
      e.buffers[r] = {it->second.data(), n};
    }
    return Status::Ok();
  }

  std::shared_ptr<const OrbaxCheckpoint> ckpt_;
  Manifest manifest_;
  std::vector<size_t> which_;
  std::mutex mu_;
  std::map<size_t, std::shared_ptr<Entry>> cache_;
};

}  // namespace

std::unique_ptr<ShardSource> OrbaxSource(std::shared_ptr<const OrbaxCheckpoint> ckpt,
                                         bool weights_only) {
  return std::make_unique<OrbaxShardSource>(std::move(ckpt), weights_only);
}

ParallelRun OrbaxRunOf(const OrbaxCheckpoint& c) {
  ParallelRun run = FlatRun(c.world_size(), ParallelDim::kRank, "JAX devices in id order");
  const bool states = std::any_of(c.arrays().begin(), c.arrays().end(),
                                  [](const OrbaxArray& a) { return a.optimizer_state; });
  run.optimizer = states ? OptimizerSharding::kAsTensors : OptimizerSharding::kNone;
  run.unknown = {"tp", "dp", "pp"};
  run.files = "zarr chunks of each array (a box of its NamedSharding per device)";
  return run;
}

Status CheckOrbaxOptions(const std::string& path, const SourceOptions& options) {
  if (!options.names.empty() && options.names != "maxtext") {
    return InvalidArgumentError(
        fmt::format("names \"{}\": an Orbax checkpoint's arrays have their own names or "
                    "MaxText's (\"maxtext\")",
                    options.names));
  }
  if (options.names == "maxtext") {
    if (options.config_path.empty()) {
      return InvalidArgumentError(fmt::format(
          "\"{}\" read with MaxText's names needs the model's config.json: it gives the Hugging "
          "Face shapes and the layers",
          path));
    }
    if (options.optimizer_state) {
      return InvalidArgumentError(
          "MaxText's names are read for the model's parameters: a gather with them writes no "
          "optimizer state");
    }
  } else if (!options.config_path.empty()) {
    return InvalidArgumentError(fmt::format(
        "\"{}\" is an Orbax checkpoint, which names and shapes its arrays itself: it takes no "
        "config.json (unless it is read with MaxText's names)",
        path));
  }
  // The config, when MaxText's names take one, is checked above; the rest as DCP's.
  SourceOptions rest = options;
  rest.config_path.clear();
  return internal::CheckSelfDescribedOptions(path, rest, {"an Orbax checkpoint", "arrays"});
}

Result<OpenedCheckpoint> OpenOrbax(const std::string& path, const SourceOptions& options) {
  RESHARD_RETURN_IF_ERROR(CheckOrbaxOptions(path, options));
  RESHARD_ASSIGN_OR_RETURN(std::shared_ptr<const OrbaxCheckpoint> ckpt,
                           OrbaxCheckpoint::Open(path));
  OpenedCheckpoint out;
  out.format = "orbax";
  out.run = OrbaxRunOf(*ckpt);
  if (options.names == "maxtext") {
    RESHARD_ASSIGN_OR_RETURN(std::string config, ReadFileToString(options.config_path));
    RESHARD_ASSIGN_OR_RETURN(
        const MaxTextModelConfig model,
        ParseMaxTextModelConfig(config, fmt::format("\"{}\"", options.config_path)));
    const auto state = std::find_if(ckpt->arrays().begin(), ckpt->arrays().end(),
                                    [](const OrbaxArray& a) { return a.optimizer_state; });
    if (options.use == SourceUse::kConvert && !options.weights_only &&
        state != ckpt->arrays().end()) {
      return FailedPreconditionError(fmt::format(
          "\"{}\" holds optimizer state (\"{}\"...), which MaxText's names do not map to Hugging "
          "Face tensors: convert its weights alone",
          path, state->name));
    }
    out.run.optimizer = OptimizerSharding::kNone;
    RESHARD_ASSIGN_OR_RETURN(out.source, MaxTextSourceOf(std::move(ckpt), model));
    out.extra_files.push_back({"config.json", std::move(config)});
    return out;
  }
  const bool weights_only =
      options.use == SourceUse::kGather ? !options.optimizer_state : options.weights_only;
  out.source = OrbaxSource(std::move(ckpt), weights_only);
  return out;
}

}  // namespace reshard
