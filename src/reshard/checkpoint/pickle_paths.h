// Internal to the checkpoint readers' .cc files (it pulls in nlohmann/json): paths into a
// pickle's object tree, and plain data as JSON, shared by the DeepSpeed readers.
#ifndef RESHARD_CHECKPOINT_PICKLE_PATHS_H_
#define RESHARD_CHECKPOINT_PICKLE_PATHS_H_

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>

#include "reshard/io/pickle.h"

namespace reshard::internal {

/// The value under str (or int) key `key` of dict `id` (a record's BUILD state when it is a
/// record), or kNoPickleNode.
PickleNodeId Get(const PickleTree& t, PickleNodeId id, std::string_view key);
/// Follows a dotted path of dict keys and list/tuple indices; kNoPickleNode when it breaks.
PickleNodeId Walk(const PickleTree& t, PickleNodeId id, std::string_view path);
bool IsNone(const PickleTree& t, PickleNodeId id);
std::optional<int64_t> IntAt(const PickleTree& t, PickleNodeId id);

/// Shared objects are copied into ToJson's output, so a tree that would expand past this many
/// objects (a pickle DAG reusing memo entries level after level) is not plain data.
inline constexpr uint64_t kMaxJsonObjects = uint64_t{1} << 20;
/// Plain data (dicts with str or int keys, lists, tuples, scalars) as JSON; anything else, and
/// a tree expanding past kMaxJsonObjects, is null.
nlohmann::json ToJson(const PickleTree& t, PickleNodeId id, int depth = 0);

}  // namespace reshard::internal

#endif  // RESHARD_CHECKPOINT_PICKLE_PATHS_H_
