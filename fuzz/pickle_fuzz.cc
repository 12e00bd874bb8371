// Fuzz target for the pickle reader (io/pickle.h).
//
// The input is a whole pickle. Reading must return a Status, never crash, hang or read out of
// bounds. When it reads, the tree must be well formed: every reference inside the arena, a
// record's arguments a tuple, only allowed globals, and no cycle (walked to a bounded depth);
// and it must write back (SerializePickle) to a pickle that reads again and writes to the
// same bytes. A violation aborts.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

#include "reshard/io/pickle.h"

namespace {

void Require(bool ok, const char* what, const std::string& detail) {
  if (ok) return;
  std::fprintf(stderr, "pickle_fuzz: %s\n%s\n", what, detail.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using reshard::PickleKind;
  using reshard::PickleNodeId;
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  reshard::PickleOptions options;
  options.limits.max_nodes = 1 << 16;
  reshard::Result<reshard::PickleTree> tree = reshard::ParsePickle(bytes, options);
  if (!tree.ok()) {
    const reshard::StatusCode code = tree.status().code();
    Require(code == reshard::StatusCode::kDataLoss ||
                code == reshard::StatusCode::kInvalidArgument ||
                code == reshard::StatusCode::kUnimplemented ||
                code == reshard::StatusCode::kResourceExhausted,
            "unexpected refusal code", tree.status().ToString());
    return 0;
  }
  const size_t n = tree->size();
  Require(tree->root() < n, "root outside the tree", std::to_string(tree->root()));
  const auto valid = [n](PickleNodeId id) { return id == reshard::kNoPickleNode || id < n; };
  for (size_t i = 0; i < n; ++i) {
    const reshard::PickleNode& node = tree->node(static_cast<PickleNodeId>(i));
    Require(node.offset < size, "node offset outside the pickle", std::to_string(i));
    for (PickleNodeId c : node.items) Require(c < n, "item outside the tree", std::to_string(i));
    for (auto [k, v] : node.entries) Require(k < n && v < n, "entry outside", std::to_string(i));
    Require(valid(node.args) && valid(node.state), "args/state outside", std::to_string(i));
    if (node.kind == PickleKind::kRecord || node.kind == PickleKind::kGlobal) {
      Require(reshard::IsAllowedPickleGlobal(node.text), "global not on the allowlist", node.text);
    }
    if (node.kind == PickleKind::kRecord) {
      Require(node.args < n && tree->node(node.args).kind == PickleKind::kTuple,
              "record arguments not a tuple", node.text);
    }
  }
  // Nodes are created before anything refers to them, except through mutation (APPEND,
  // SETITEM, BUILD); the reader's own walk already refused cycles. Walk once more, bounded.
  std::vector<std::pair<PickleNodeId, size_t>> stack = {{tree->root(), 0}};
  size_t visits = 0;
  while (!stack.empty() && ++visits < (1u << 20)) {
    auto [id, depth] = stack.back();
    stack.pop_back();
    Require(depth <= options.limits.max_depth + 1, "tree deeper than the limit",
            std::to_string(id));
    const reshard::PickleNode& node = tree->node(id);
    for (PickleNodeId c : node.items) stack.push_back({c, depth + 1});
    for (auto [k, v] : node.entries) {
      stack.push_back({k, depth + 1});
      stack.push_back({v, depth + 1});
    }
    if (node.args != reshard::kNoPickleNode) stack.push_back({node.args, depth + 1});
    if (node.state != reshard::kNoPickleNode) stack.push_back({node.state, depth + 1});
  }
  const reshard::Result<std::string> written = reshard::SerializePickle(*tree, tree->root());
  Require(written.ok(), "a tree read cannot be written", written.status().ToString());
  const reshard::Result<reshard::PickleTree> again =
      reshard::ParsePickle(std::as_bytes(std::span(written->data(), written->size())));
  Require(again.ok(), "a tree written does not read again", again.status().ToString());
  const reshard::Result<std::string> rewritten = reshard::SerializePickle(*again, again->root());
  Require(rewritten.ok() && *rewritten == *written, "writing a tree read back changes it", "");
  return 0;
}
