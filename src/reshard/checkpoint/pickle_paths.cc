#include "reshard/checkpoint/pickle_paths.h"

#include <string>

namespace reshard::internal {

using Value = nlohmann::json;

// The value under str key `key` of dict `id` (a record's BUILD state when it is a record), or
// kNoPickleNode.
PickleNodeId Get(const PickleTree& t, PickleNodeId id, std::string_view key) {
  if (id == kNoPickleNode) return kNoPickleNode;
  const PickleNode* n = &t.node(id);
  if (n->kind == PickleKind::kRecord && n->state != kNoPickleNode) n = &t.node(n->state);
  if (n->kind != PickleKind::kDict) return kNoPickleNode;
  for (const auto& [k, v] : n->entries) {
    const PickleNode& kn = t.node(k);
    if ((kn.kind == PickleKind::kStr && kn.text == key) ||
        (kn.kind == PickleKind::kInt && std::to_string(kn.int_value) == key)) {
      return v;
    }
  }
  return kNoPickleNode;
}

// Follows a dotted path of keys and list indices ("optimizer_state_dict.fp32_flat_groups.0").
PickleNodeId Walk(const PickleTree& t, PickleNodeId id, std::string_view path) {
  while (!path.empty() && id != kNoPickleNode) {
    const size_t dot = path.find('.');
    const std::string_view key = path.substr(0, dot);
    const PickleNode& n = t.node(id);
    if (n.kind == PickleKind::kList || n.kind == PickleKind::kTuple) {
      size_t i = 0;
      for (char c : key) i = i * 10 + static_cast<size_t>(c - '0');
      id = i < n.items.size() ? n.items[i] : kNoPickleNode;
    } else {
      id = Get(t, id, key);
    }
    path = dot == std::string_view::npos ? std::string_view() : path.substr(dot + 1);
  }
  return id;
}

bool IsNone(const PickleTree& t, PickleNodeId id) {
  return id == kNoPickleNode || t.node(id).kind == PickleKind::kNone;
}

std::optional<int64_t> IntAt(const PickleTree& t, PickleNodeId id) {
  if (id == kNoPickleNode || t.node(id).kind != PickleKind::kInt) return std::nullopt;
  return t.node(id).int_value;
}

// Plain data (dicts with str keys, lists, tuples, scalars) as JSON; anything else is null.
// Shared objects are copied into the JSON, so a tree that would expand past this many objects
// (a pickle DAG whose memo entries are reused level after level) is not plain data either:
// its cost is bounded before any of it is expanded.

Value ToJson(const PickleTree& t, PickleNodeId id, int depth) {
  if (id == kNoPickleNode || depth > 64) return nullptr;
  if (depth == 0 && t.expanded_size(id) > kMaxJsonObjects) return nullptr;
  const PickleNode& n = t.node(id);
  switch (n.kind) {
    case PickleKind::kBool:
      return n.bool_value;
    case PickleKind::kInt:
      return n.int_value;
    case PickleKind::kFloat:
      return n.float_value;
    case PickleKind::kStr:
      return n.text;
    case PickleKind::kList:
    case PickleKind::kTuple: {
      Value a = Value::array();
      for (PickleNodeId c : n.items) a.push_back(ToJson(t, c, depth + 1));
      return a;
    }
    case PickleKind::kDict: {
      Value o = Value::object();
      for (const auto& [k, v] : n.entries) {
        // Int keys (rank numbers) become decimal strings, as Python's json.dumps writes them.
        const PickleNode& key = t.node(k);
        if (key.kind == PickleKind::kStr) o[key.text] = ToJson(t, v, depth + 1);
        if (key.kind == PickleKind::kInt)
          o[std::to_string(key.int_value)] = ToJson(t, v, depth + 1);
      }
      return o;
    }
    default:
      return nullptr;
  }
}

}  // namespace reshard::internal
