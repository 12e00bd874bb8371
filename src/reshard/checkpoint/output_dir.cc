#include "reshard/checkpoint/output_dir.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <functional>
#include <regex>
#include <set>
#include <vector>

#include "reshard/base/json_reader.h"
#include "reshard/checkpoint/checkpoint.h"
#include "reshard/checkpoint/dcp/dcp.h"
#include "reshard/checkpoint/dcp/dcp_writer.h"
#include "reshard/checkpoint/peft.h"
#include "reshard/io/file.h"
#include "reshard/io/safetensors.h"
#include "reshard/io/temporaries.h"

namespace reshard {

namespace fs = std::filesystem;
using json::Json;

namespace {

constexpr char kIndexName[] = "model.safetensors.index.json";

// The output as a path without a trailing separator ("out/" names "out").
fs::path OutputPath(const std::string& path) {
  fs::path target(path);
  if (target.filename().empty() && target.has_parent_path()) target = target.parent_path();
  return target;
}

fs::path RealPath(const fs::path& p) {
  std::error_code ec;
  fs::path real = fs::weakly_canonical(fs::absolute(p, ec), ec);
  return ec ? fs::absolute(p, ec).lexically_normal() : real;
}

// True when `inner` lies strictly inside `outer` (both real, absolute paths).
bool IsInside(const fs::path& inner, const fs::path& outer) {
  const fs::path rel = inner.lexically_relative(outer);
  return !rel.empty() && rel != "." && *rel.begin() != "..";
}

bool IsRegularFile(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(fs::symlink_status(p, ec));
}

// "model-00001-of-00003.safetensors"
bool IsFullPartName(const std::string& name) {
  constexpr std::string_view kPattern = "model-#####-of-#####.safetensors";
  if (name.size() != kPattern.size()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const bool digit = name[i] >= '0' && name[i] <= '9';
    if (kPattern[i] == '#' ? !digit : name[i] != kPattern[i]) return false;
  }
  return true;
}

bool IsModelSideFile(const fs::path& dir, const std::string& name) {
  const auto files = ModelSideFiles();
  return std::find(files.begin(), files.end(), name) != files.end() && IsRegularFile(dir / name);
}

Status NotOurs(const std::string& path, std::string_view why) {
  return AlreadyExistsError(fmt::format(
      "\"{}\" exists and is not an output of reshard ({}); refusing to replace it: remove it "
      "yourself or choose another output directory",
      path, why));
}

// `names` (the entries of `dir`) are a sharded checkpoint reshard wrote and nothing else.
Status CheckShardedOutput(const std::string& path, const fs::path& dir,
                          const std::vector<std::string>& names) {
  Result<std::string> text = ReadFileToString((dir / kManifestName).string());
  Result<Manifest> manifest =
      text.ok() ? ParseManifestJson(*text) : Result<Manifest>(text.status());
  if (!manifest.ok()) {
    return NotOurs(path, fmt::format("its {} is not a manifest reshard can read: {}", kManifestName,
                                     manifest.status().message()));
  }
  std::set<std::string> allowed = {kManifestName};
  for (const auto& files : manifest->files) allowed.insert(files.begin(), files.end());
  for (const std::string& name : names) {
    if (IsModelSideFile(dir, name)) continue;
    if (!allowed.count(name) || !IsRegularFile(dir / name)) {
      return NotOurs(path, fmt::format("it holds \"{}\", which its manifest does not list", name));
    }
  }
  return Status::Ok();
}

// `names` are a full checkpoint reshard wrote (marked safetensors files, an index) only.
Status CheckFullOutput(const std::string& path, const fs::path& dir,
                       const std::vector<std::string>& names) {
  bool any_weights = false;
  for (const std::string& name : names) {
    if (IsModelSideFile(dir, name)) continue;
    const bool weights =
        name == "model.safetensors" || name == kAdapterWeightsName || IsFullPartName(name);
    if ((!weights && name != kIndexName) || !IsRegularFile(dir / name)) {
      return NotOurs(path, fmt::format("it holds \"{}\", which reshard did not write", name));
    }
    if (!weights) continue;
    Result<SafetensorsHeader> header = ReadSafetensorsHeader((dir / name).string());
    if (!header.ok() || header->metadata.count("producer") == 0 ||
        header->metadata.at("producer") != "reshard") {
      return NotOurs(path,
                     fmt::format("\"{}\" has no \"producer\": \"reshard\" in its metadata", name));
    }
    any_weights = true;
  }
  if (!any_weights) return NotOurs(path, "it holds no checkpoint");
  return Status::Ok();
}

// "__{r}_0.distcp", a rank's file as the DCP writer names it.
bool IsDcpRankFileName(std::string_view name) {
  constexpr std::string_view kPrefix = "__", kSuffix = "_0.distcp";
  if (!name.starts_with(kPrefix) || !name.ends_with(kSuffix)) return false;
  const std::string_view digits =
      name.substr(kPrefix.size(), name.size() - kPrefix.size() - kSuffix.size());
  return !digits.empty() && digits.size() <= 7 &&
         std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
         DcpFileName(static_cast<Rank>(std::stoi(std::string(digits)))) == name;
}

// `names` are a DCP checkpoint reshard wrote (convert --to dcp) only: a .metadata that reads as
// DCP metadata, marked with reshard's save_id (kDcpSaveId), the files it names, and empty rank
// files __{r}_0.distcp (of ranks that hold no rows; DCP's data files carry no mark of their
// own).
Status CheckDcpOutput(const std::string& path, const fs::path& dir,
                      const std::vector<std::string>& names) {
  const fs::path metadata_path = dir / kDcpMetadataName;
  if (!IsRegularFile(metadata_path)) {
    return NotOurs(path, fmt::format("its {} is not a regular file", kDcpMetadataName));
  }
  Result<std::string> bytes = ReadFileToString(metadata_path.string());
  Result<DcpMetadata> metadata =
      bytes.ok() ? ParseDcpMetadata(std::as_bytes(std::span(*bytes)), metadata_path.string())
                 : Result<DcpMetadata>(bytes.status());
  if (!metadata.ok() || metadata->save_id != kDcpSaveId) {
    return NotOurs(path, fmt::format("its {} was not written by reshard", kDcpMetadataName));
  }
  std::set<std::string> expected(metadata->files.begin(), metadata->files.end());
  expected.insert(kDcpMetadataName);
  size_t named = 0;
  for (const std::string& name : names) {
    std::error_code ec;
    const bool empty_rank_file = IsDcpRankFileName(name) && IsRegularFile(dir / name) &&
                                 fs::file_size(dir / name, ec) == 0 && !ec;
    if (expected.contains(name) && IsRegularFile(dir / name)) {
      ++named;
    } else if (!empty_rank_file) {
      return NotOurs(path, fmt::format("it holds \"{}\", which reshard did not write", name));
    }
  }
  if (named != expected.size()) {
    return NotOurs(path, fmt::format("it lacks files its {} names", kDcpMetadataName));
  }
  return Status::Ok();
}

// Whether every entry of `dir` is a regular file named by `ok`.
bool OnlyFiles(const fs::path& dir, const std::function<bool(const std::string&)>& ok,
               std::string& stray) {
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!ok(name) || !IsRegularFile(e.path())) {
      stray = name;
      return false;
    }
  }
  return !ec;
}

// `names` (the entries of `dir`) are an Orbax checkpoint as convert --to orbax writes it and
// nothing else: _CHECKPOINT_METADATA marked by reshard, the item's metadata files, its OCDBT
// databases (manifest.ocdbt, d/, ocdbt.process_0/) or, stored plain, one zarr array directory
// per array.
Status CheckOrbaxOutput(const std::string& path, const fs::path& dir,
                        const std::vector<std::string>& names) {
  Result<std::string> text = ReadFileToString((dir / kOrbaxCheckpointMetadata).string());
  Result<Json> j = text.ok() ? json::ParseJson(*text) : Result<Json>(text.status());
  const Json* custom = j.ok() && j->is_object() ? json::Find(*j, "custom_metadata") : nullptr;
  const Json* producer =
      custom != nullptr && custom->is_object() ? json::Find(*custom, kOrbaxProducerKey) : nullptr;
  if (producer == nullptr || !producer->is_string() || *producer != "reshard") {
    return NotOurs(path,
                   fmt::format("its {} was not written by reshard", kOrbaxCheckpointMetadata));
  }
  auto any = [](const std::string&) { return true; };
  std::string stray;
  for (const std::string& name : names) {
    const fs::path p = dir / name;
    std::error_code ec;
    const bool is_dir = fs::is_directory(fs::symlink_status(p, ec));
    bool ours = false;
    if (name == kOrbaxCheckpointMetadata || name == "_METADATA" || name == "_sharding" ||
        name == "manifest.ocdbt") {
      ours = IsRegularFile(p);
    } else if (name == "array_metadatas") {
      ours =
          is_dir && OnlyFiles(
                        p, [](const std::string& f) { return f.starts_with("process_"); }, stray);
    } else if (name == "d") {
      ours = is_dir && OnlyFiles(p, any, stray);
    } else if (name.starts_with("ocdbt.process_") && is_dir) {
      ours = IsRegularFile(p / "manifest.ocdbt");
      for (const fs::directory_entry& e : fs::directory_iterator(p, ec)) {
        const std::string f = e.path().filename().string();
        const bool data =
            f == "d" && fs::is_directory(e.symlink_status(ec)) && OnlyFiles(e.path(), any, stray);
        if (!data && !(f == "manifest.ocdbt" && IsRegularFile(e.path()))) {
          stray = stray.empty() ? f : fmt::format("{}/{}", f, stray);
          ours = false;
          break;
        }
      }
    } else if (is_dir) {  // stored plain: an array's zarr directory
      ours = IsRegularFile(p / ".zarray") || IsRegularFile(p / "zarr.json");
    }
    if (!ours) {
      return NotOurs(path, fmt::format("it holds \"{}\", which reshard did not write",
                                       stray.empty() ? name : fmt::format("{}/{}", name, stray)));
    }
    stray.clear();
  }
  return Status::Ok();
}

}  // namespace

std::span<const char* const> ModelSideFiles() {
  static constexpr const char* kFiles[] = {"config.json",        "generation_config.json",
                                           "tokenizer.json",     "tokenizer_config.json",
                                           "tokenizer.model",    "special_tokens_map.json",
                                           "added_tokens.json",  "vocab.json",
                                           "merges.txt",         "chat_template.jinja",
                                           "chat_template.json", "preprocessor_config.json",
                                           kAdapterConfigName};
  return kFiles;
}

const std::map<std::string, std::string>& ProducerMetadata() {
  static const std::map<std::string, std::string> metadata = {{"format", "pt"},
                                                              {"producer", "reshard"}};
  return metadata;
}

// `names` (the entries of `dir`) are a universal checkpoint and nothing else: latest_universal
// naming the one folder beside it, which holds model-states files and zero/, which holds
// optimizer_state.pt and one folder per parameter of state files (what convert --to universal
// writes; its files, being DeepSpeed's own format, carry no mark of who wrote them).
Status CheckUniversalOutput(const std::string& path, const fs::path& dir,
                            const std::vector<std::string>& names) {
  Result<std::string> folder = ReadFileToString((dir / "latest_universal").string());
  if (!folder.ok() || names.size() != 2 || folder->empty() || *folder == "latest_universal" ||
      std::find(names.begin(), names.end(), *folder) == names.end()) {
    return NotOurs(path, "its latest_universal does not name the one folder beside it");
  }
  std::error_code ec;
  auto entries = [&](const fs::path& d) {
    std::vector<fs::directory_entry> out;
    for (const fs::directory_entry& e : fs::directory_iterator(d, ec)) out.push_back(e);
    return out;
  };
  auto stray = [&](const fs::path& p) {
    return NotOurs(path, fmt::format("it holds \"{}\", which reshard did not write",
                                     fs::relative(p, dir, ec).string()));
  };
  const std::set<std::string> states = {"fp32.pt", "exp_avg.pt", "exp_avg_sq.pt", "step.pt"};
  for (const fs::directory_entry& e : entries(dir / *folder)) {
    const std::string name = e.path().filename().string();
    if (name.ends_with("_model_states.pt") && IsRegularFile(e.path())) continue;
    if (name != "zero" || !e.is_directory(ec) || e.is_symlink(ec)) return stray(e.path());
    for (const fs::directory_entry& p : entries(e.path())) {
      if (p.path().filename() == "optimizer_state.pt" && IsRegularFile(p.path())) continue;
      if (!p.is_directory(ec) || p.is_symlink(ec)) return stray(p.path());
      for (const fs::directory_entry& f : entries(p.path())) {
        if (!states.contains(f.path().filename().string()) || !IsRegularFile(f.path()))
          return stray(f.path());
      }
    }
  }
  if (ec) return ErrnoStatus(ec.value(), "cannot list", (dir / *folder).string());
  return Status::Ok();
}

// `names` (the entries of `dir`) are a DeepSpeed pipeline checkpoint as convert --pp writes it
// and nothing else: `latest` naming the one folder beside it, which holds only layer,
// model-states and ZeRO optimizer files (a save dir DeepSpeed wrote also holds its recovery
// scripts, zero_to_fp32.py, and is refused).
Status CheckPipelineOutput(const std::string& path, const fs::path& dir,
                           const std::vector<std::string>& names) {
  Result<std::string> folder = ReadFileToString((dir / "latest").string());
  if (!folder.ok() || folder->empty() || *folder == "latest" ||
      std::find(names.begin(), names.end(), *folder) == names.end()) {
    return NotOurs(path, "its latest does not name a folder beside it");
  }
  for (const std::string& name : names) {
    if (name != "latest" && name != *folder)
      return NotOurs(path, fmt::format("it holds \"{}\", which reshard did not write", name));
  }
  static const std::regex kFile(
      R"((layer_\d+(-model_\d+)?-model_states|mp_rank_\d+_model_states|(bf16_)?zero_pp_rank_\d+_mp_rank_\d+_optim_states)\.pt)");
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir / *folder, ec)) {
    const std::string name = e.path().filename().string();
    if (!std::regex_match(name, kFile) || !IsRegularFile(e.path())) {
      return NotOurs(path,
                     fmt::format("it holds \"{}/{}\", which reshard did not write", *folder, name));
    }
  }
  if (ec) return ErrnoStatus(ec.value(), "cannot list", (dir / *folder).string());
  return Status::Ok();
}

Status CheckReplaceable(const std::string& path) {
  const fs::path target = OutputPath(path);
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(target, ec);
  if (!fs::exists(st)) return Status::Ok();
  if (fs::is_symlink(st)) return NotOurs(path, "it is a symbolic link");
  if (!fs::is_directory(st)) return NotOurs(path, "it is not a directory");
  std::vector<std::string> names;
  for (const fs::directory_entry& e : fs::directory_iterator(target, ec)) {
    names.push_back(e.path().filename().string());
  }
  if (ec) {
    return ErrnoStatus(ec.value(), "cannot list", target.string());
  }
  if (names.empty()) return Status::Ok();
  for (const std::string& name : names) {
    if (name == kManifestName) return CheckShardedOutput(path, target, names);
    if (name == "latest_universal") return CheckUniversalOutput(path, target, names);
    if (name == "latest") return CheckPipelineOutput(path, target, names);
    if (name == kDcpMetadataName) return CheckDcpOutput(path, target, names);
    if (name == kOrbaxCheckpointMetadata) return CheckOrbaxOutput(path, target, names);
  }
  return CheckFullOutput(path, target, names);
}

Status CheckOutputAgainstInputs(const std::string& path, std::span<const std::string> inputs) {
  const fs::path target = OutputPath(path);
  std::error_code ec;
  if (fs::is_symlink(fs::symlink_status(target, ec))) {
    return InvalidArgumentError(
        fmt::format("output \"{}\" is a symbolic link (to \"{}\"); give a real directory path",
                    path, fs::read_symlink(target, ec).string()));
  }
  const fs::path real = RealPath(target);
  const fs::path cwd = RealPath(fs::current_path(ec));
  if (real == cwd || IsInside(cwd, real)) {
    return InvalidArgumentError(fmt::format(
        "output \"{}\" is the current directory or contains it, which cannot be replaced; give "
        "a new directory as the output",
        path));
  }
  for (const std::string& input : inputs) {
    const fs::path in = RealPath(input);
    std::string_view relation;
    if (in == real) {
      relation = "is";
    } else if (IsInside(in, real)) {
      relation = "contains";
    } else if (IsInside(real, in)) {
      relation = "lies inside";
    } else {
      continue;
    }
    return InvalidArgumentError(fmt::format(
        "output \"{}\" {} the input \"{}\"; inputs are never written, so choose an output "
        "directory outside them",
        path, relation, input));
  }
  return Status::Ok();
}

namespace {

// What a file that is not a regular one is, for a message.
std::string_view KindOfFile(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

}  // namespace

Status CheckOutputFile(const std::string& path, bool overwrite,
                       std::span<const std::string> inputs) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return CheckOutputAgainstInputs(path, inputs);
    return ErrnoStatus(errno, "cannot look at the output", path);
  }
  if (S_ISLNK(st.st_mode)) {
    std::error_code ec;
    return InvalidArgumentError(
        fmt::format("output \"{}\" is a symbolic link (to \"{}\"); give a real file path", path,
                    fs::read_symlink(path, ec).string()));
  }
  if (!S_ISREG(st.st_mode)) {
    return InvalidArgumentError(fmt::format(
        "output \"{}\" is {}; only a regular file is ever replaced: remove it yourself or choose "
        "another output file",
        path, KindOfFile(st.st_mode)));
  }
  for (const std::string& input : inputs) {
    struct stat in {};
    if (::stat(input.c_str(), &in) == 0 && in.st_dev == st.st_dev && in.st_ino == st.st_ino) {
      return InvalidArgumentError(fmt::format(
          "output \"{}\" is the input \"{}\"; inputs are never written, so choose another "
          "output file",
          path, input));
    }
  }
  RESHARD_RETURN_IF_ERROR(CheckOutputAgainstInputs(path, inputs));
  if (!overwrite) return AlreadyExistsError(fmt::format("\"{}\" already exists", path));
  return Status::Ok();
}

Status OutputDirectory::CheckTarget() const {
  RESHARD_RETURN_IF_ERROR(CheckOutputAgainstInputs(path_, inputs_));
  std::error_code ec;
  if (fs::exists(fs::symlink_status(path_, ec))) {
    if (!overwrite_) return AlreadyExistsError(fmt::format("\"{}\" already exists", path_));
    RESHARD_RETURN_IF_ERROR(CheckReplaceable(path_));
  }
  return Status::Ok();
}

Result<OutputDirectory> OutputDirectory::Create(const std::string& path, bool overwrite,
                                                std::span<const std::string> inputs,
                                                const std::string& temp) {
  OutputDirectory out;
  out.path_ = OutputPath(path).string();
  out.inputs_.assign(inputs.begin(), inputs.end());
  out.overwrite_ = overwrite;
  out.committed_ = true;  // nothing to remove until the temporary exists
  RESHARD_RETURN_IF_ERROR(out.CheckTarget());
  const fs::path target(out.path_);
  const fs::path parent = target.has_parent_path() ? target.parent_path() : fs::path(".");
  std::error_code ec;
  if (!fs::is_directory(parent, ec)) {
    return NotFoundError(
        fmt::format("cannot create \"{}\": \"{}\" is not a directory", path, parent.string()));
  }
  RemoveStaleTemporaries(out.path_);
  out.temp_ = temp.empty() ? TemporaryPathFor(out.path_) : temp;
  RESHARD_RETURN_IF_ERROR(CreateTemporary(out.temp_, [&]() -> Status {
    if (::mkdir(out.temp_.c_str(), 0755) != 0)
      return ErrnoStatus(errno, "cannot create", out.temp_);
    return Status::Ok();
  }));
  out.committed_ = false;
  return out;
}

OutputDirectory::OutputDirectory(OutputDirectory&& other) noexcept
    : path_(std::move(other.path_)),
      temp_(std::move(other.temp_)),
      inputs_(std::move(other.inputs_)),
      overwrite_(other.overwrite_),
      committed_(other.committed_),
      owner_(other.owner_),
      joined_(other.joined_) {
  other.committed_ = true;  // the moved-from object owns nothing
  other.joined_ = false;
}

Result<OutputDirectory> OutputDirectory::Join(const std::string& path, const std::string& temp) {
  OutputDirectory out;
  out.path_ = OutputPath(path).string();
  out.temp_ = temp;
  out.owner_ = false;
  out.committed_ = true;  // never removed through this object
  RESHARD_RETURN_IF_ERROR(CreateTemporary(temp, [] { return Status::Ok(); }));
  out.joined_ = true;
  return out;
}

void OutputDirectory::Leave() {
  if (!joined_) return;
  joined_ = false;
  (void)FinishTemporary(temp_, [] { return Status::Ok(); });
}

OutputDirectory::~OutputDirectory() {
  if (committed_ || temp_.empty()) return;
  (void)FinishTemporary(temp_, [&] {
    std::error_code ec;
    fs::remove_all(temp_, ec);
    return Status::Ok();
  });
}

std::string OutputDirectory::FilePath(const std::string& name) const {
  return (fs::path(temp_) / name).string();
}

Status OutputDirectory::Commit(bool sync) {
  if (!owner_) return InternalError("only the process that created an output commits it");
  RESHARD_RETURN_IF_ERROR(CheckTarget());
  RESHARD_RETURN_IF_ERROR(FinishTemporary(temp_, [&]() -> Status {
    std::error_code ec;
    const bool replace = fs::exists(fs::symlink_status(path_, ec));
    // One rename either way: the old output (if any) and the new one swap places, so the
    // path always holds a complete output.
    if (::renameat2(AT_FDCWD, temp_.c_str(), AT_FDCWD, path_.c_str(),
                    replace ? RENAME_EXCHANGE : RENAME_NOREPLACE) != 0) {
      const int err = errno;
      fs::remove_all(temp_, ec);
      return ErrnoStatus(err, "cannot rename the output into place at", path_);
    }
    committed_ = true;
    if (replace) fs::remove_all(temp_, ec);  // now the old output
    return Status::Ok();
  }));
  if (!sync) return Status::Ok();
  const fs::path target(path_);
  FileHandle dir(::open(target.has_parent_path() ? target.parent_path().c_str() : ".",
                        O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir.valid()) ::fsync(dir.get());
  return Status::Ok();
}

}  // namespace reshard
