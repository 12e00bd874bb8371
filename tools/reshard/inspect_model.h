// Model-level views of checkpoint directories for `reshard inspect DIR`: what a reshard sharded
// checkpoint (reshard.json) or a Hugging Face directory (config.json beside model.safetensors
// or model.safetensors.index.json) holds as one model, beside the list of its files.
#ifndef RESHARD_TOOLS_INSPECT_MODEL_H_
#define RESHARD_TOOLS_INSPECT_MODEL_H_

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "reshard/base/result.h"

namespace reshard::cli {

enum class ModelDir {
  kNone,         // neither
  kSharded,      // reshard.json
  kHuggingFace,  // config.json and model.safetensors or model.safetensors.index.json
};

ModelDir ModelDirOf(const std::string& dir);

/// Opens `dir` as the checkpoint `kind` says (every file checked as the checkpoint commands
/// check it) and returns its model view as JSON (null for kNone).
Result<nlohmann::ordered_json> ModelView(const std::string& dir, ModelDir kind);

/// Prints a view ModelView returned.
void PrintModelView(const std::string& dir, const nlohmann::ordered_json& view);

/// The files of the directory a view covers (by name).
std::vector<std::string> ModelFiles(const nlohmann::ordered_json& view);

}  // namespace reshard::cli

#endif  // RESHARD_TOOLS_INSPECT_MODEL_H_
