// SerializePickle: a PickleTree back to the protocol-2 pickle Python's pickle (and torch.save)
// writes. Opcodes written: PROTO 2, STOP, MARK, the memo (BINPUT LONG_BINPUT BINGET
// LONG_BINGET), NONE NEWTRUE NEWFALSE BININT1 BININT2 BININT LONG1 LONG4 BINFLOAT BINUNICODE,
// EMPTY_DICT EMPTY_LIST EMPTY_TUPLE TUPLE TUPLE1-3 SETITEMS APPENDS, GLOBAL REDUCE NEWOBJ BUILD
// BINPERSID: all read by io/pickle.h, by Python's pickle and (for the globals torch allows) by
// torch.load(weights_only=True).
#include <bit>
#include <string>
#include <unordered_map>
#include <vector>

#include "reshard/io/pickle.h"

namespace reshard {
namespace {

// `bytes` little-endian bytes of `v`.
void PutLe(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}

// The UTF-8 of a string whose code points are the bytes of `raw` (Python's
// bytes.decode("latin1")), as protocol 2 spells bytes: _codecs.encode(that, "latin1").
std::string Latin1ToUtf8(std::string_view raw) {
  std::string out;
  for (char c : raw) {
    const auto b = static_cast<uint8_t>(c);
    if (b < 0x80) {
      out.push_back(c);
    } else {
      out.push_back(static_cast<char>(0xC0 | (b >> 6)));
      out.push_back(static_cast<char>(0x80 | (b & 0x3F)));
    }
  }
  return out;
}

class PickleWriter {
 public:
  PickleWriter(const PickleTree& tree, size_t max_depth) : tree_(tree), max_depth_(max_depth) {}

  Result<std::string> Run(PickleNodeId root) {
    out_ = "\x80\x02";
    refs_.assign(tree_.size(), 0);
    state_.assign(tree_.size(), kUnseen);
    RESHARD_RETURN_IF_ERROR(Count(root, 0));
    RESHARD_RETURN_IF_ERROR(Write(root));
    out_ += '.';
    return std::move(out_);
  }

 private:
  enum : uint8_t { kUnseen, kOnPath, kDone };

  Status Error(const std::string& message) const {
    std::string path;
    for (const std::string& label : path_) path += (path.empty() ? "" : ".") + label;
    return InvalidArgumentError(
        "writing a pickle: " + (path.empty() ? std::string("the root") : "\"" + path + "\"") +
        ": " + message);
  }
  Status Count(PickleNodeId id, size_t depth);
  Status Check(const PickleNode& n);
  Status Write(PickleNodeId id);
  Status WriteScalar(const PickleNode& n);
  Status WriteContainer(PickleNodeId id, const PickleNode& n);
  Status WriteItems(const std::vector<PickleNodeId>& items) {
    for (PickleNodeId item : items) RESHARD_RETURN_IF_ERROR(Write(item));
    return Status::Ok();
  }
  void Global(std::string_view name);
  void Int(int64_t v);
  void Str(std::string_view s) {
    out_ += 'X';
    PutLe(out_, s.size(), 4);
    out_ += s;
  }
  // Memoizes the object on top of the stack if it is reached more than once.
  void Memoize(PickleNodeId id) {
    if (refs_[id] < 2) return;
    const auto index = static_cast<uint32_t>(memo_.size());
    memo_.emplace(id, index);
    out_ += index < 256 ? 'q' : 'r';
    PutLe(out_, index, index < 256 ? 1 : 4);
  }

  const PickleTree& tree_;
  size_t max_depth_;
  std::string out_;
  std::vector<uint8_t> refs_;   // parents referencing each node, capped at 2
  std::vector<uint8_t> state_;  // of the counting walk
  std::vector<std::string> path_;
  std::unordered_map<PickleNodeId, uint32_t> memo_;
};

// What Write needs of a node beyond its children.
Status PickleWriter::Check(const PickleNode& n) {
  const auto global = [&](std::string_view name) -> Status {
    const size_t dot = name.rfind('.');
    if (dot == std::string_view::npos || dot == 0 || dot + 1 == name.size() ||
        name.find('\n') != std::string_view::npos) {
      return Error("global \"" + std::string(name) + "\" is not \"module.name\"");
    }
    return Status::Ok();
  };
  switch (n.kind) {
    case PickleKind::kStr:
      if (!IsValidPickleString(n.text)) return Error("a string that is not valid UTF-8");
      return Status::Ok();
    case PickleKind::kGlobal:
      return global(n.text);
    case PickleKind::kRecord:
      if (n.args >= tree_.size() || tree_.node(n.args).kind != PickleKind::kTuple) {
        return Error("record " + n.text + " without a tuple of arguments");
      }
      return global(n.text);
    case PickleKind::kPersistentId:
      if (n.items.size() != 1) return Error("a persistent id without exactly one value");
      return Status::Ok();
    default:
      return Status::Ok();
  }
}

// Checks ids, cycles, depth and each node, and counts the references to each node.
Status PickleWriter::Count(PickleNodeId id, size_t depth) {
  if (id >= tree_.size()) {
    return Error("refers to node " + std::to_string(id) + " of a tree of " +
                 std::to_string(tree_.size()));
  }
  if (state_[id] == kOnPath) {
    return Error("cyclic structure: a " + std::string(PickleKindName(tree_.node(id).kind)) +
                 " contains itself");
  }
  if (refs_[id] < 2) ++refs_[id];
  if (state_[id] == kDone) return Status::Ok();
  if (depth > max_depth_) return Error("objects nested deeper than " + std::to_string(max_depth_));
  state_[id] = kOnPath;
  const PickleNode& n = tree_.node(id);
  RESHARD_RETURN_IF_ERROR(Check(n));
  const auto child = [&](PickleNodeId c, std::string label) -> Status {
    const bool labelled = !label.empty();
    if (labelled) path_.push_back(std::move(label));
    RESHARD_RETURN_IF_ERROR(Count(c, depth + 1));
    if (labelled) path_.pop_back();
    return Status::Ok();
  };
  for (size_t i = 0; i < n.items.size(); ++i) {
    RESHARD_RETURN_IF_ERROR(
        child(n.items[i], n.kind == PickleKind::kPersistentId ? "" : std::to_string(i)));
  }
  for (size_t i = 0; i < n.entries.size(); ++i) {
    const std::string label = PickleKeyName(tree_, n.entries[i].first, i);
    RESHARD_RETURN_IF_ERROR(child(n.entries[i].first, label + " (key)"));
    RESHARD_RETURN_IF_ERROR(child(n.entries[i].second, label));
  }
  if (n.args != kNoPickleNode) RESHARD_RETURN_IF_ERROR(child(n.args, ""));
  if (n.state != kNoPickleNode) RESHARD_RETURN_IF_ERROR(child(n.state, ""));
  state_[id] = kDone;
  return Status::Ok();
}

// GLOBAL "module\nname\n", split at the last dot (checked by Check).
void PickleWriter::Global(std::string_view name) {
  const size_t dot = name.rfind('.');
  out_ += 'c';
  out_ += name.substr(0, dot);
  out_ += '\n';
  out_ += name.substr(dot + 1);
  out_ += '\n';
}

void PickleWriter::Int(int64_t v) {
  if (v >= 0 && v < 256) {
    out_ += 'K';
    PutLe(out_, static_cast<uint64_t>(v), 1);
  } else if (v >= 0 && v < 65536) {
    out_ += 'M';
    PutLe(out_, static_cast<uint64_t>(v), 2);
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    out_ += 'J';
    PutLe(out_, static_cast<uint64_t>(v), 4);
  } else {
    out_ += "\x8a\x08";
    PutLe(out_, static_cast<uint64_t>(v), 8);
  }
}

Status PickleWriter::WriteScalar(const PickleNode& n) {
  switch (n.kind) {
    case PickleKind::kNone:
      out_ += 'N';
      return Status::Ok();
    case PickleKind::kBool:
      out_ += n.bool_value ? '\x88' : '\x89';
      return Status::Ok();
    case PickleKind::kInt:
      Int(n.int_value);
      return Status::Ok();
    case PickleKind::kBigInt:  // LONG1 / LONG4: the two's-complement bytes as they are
      out_ += n.text.size() < 256 ? '\x8a' : '\x8b';
      PutLe(out_, n.text.size(), n.text.size() < 256 ? 1 : 4);
      out_ += n.text;
      return Status::Ok();
    case PickleKind::kFloat: {
      out_ += 'G';
      const auto bits = std::bit_cast<uint64_t>(n.float_value);
      for (int i = 7; i >= 0; --i) out_.push_back(static_cast<char>(bits >> (8 * i)));
      return Status::Ok();
    }
    case PickleKind::kStr:
      Str(n.text);
      return Status::Ok();
    case PickleKind::kBytes:
      Global("_codecs.encode");
      Str(Latin1ToUtf8(n.text));
      Str("latin1");
      out_ += "\x86R";
      return Status::Ok();
    case PickleKind::kGlobal:
      Global(n.text);
      return Status::Ok();
    default:
      return InternalError("not a scalar");
  }
}

Status PickleWriter::WriteContainer(PickleNodeId id, const PickleNode& n) {
  switch (n.kind) {
    case PickleKind::kTuple:
      if (n.torch_size) Global("torch.Size");
      if (n.items.size() > 3) out_ += '(';
      RESHARD_RETURN_IF_ERROR(WriteItems(n.items));
      if (n.items.empty()) {
        out_ += ')';
      } else {
        out_ += n.items.size() > 3 ? 't' : static_cast<char>(0x84 + n.items.size());
      }
      if (n.torch_size) out_ += "\x85R";
      break;
    case PickleKind::kList:
      out_ += ']';
      Memoize(id);
      if (!n.items.empty()) {
        out_ += '(';
        RESHARD_RETURN_IF_ERROR(WriteItems(n.items));
        out_ += 'e';
      }
      return Status::Ok();
    case PickleKind::kSet:  // builtins.set([items]), as protocol 2 writes a set
      Global(n.frozen ? "builtins.frozenset" : "builtins.set");
      out_ += "](";
      RESHARD_RETURN_IF_ERROR(WriteItems(n.items));
      out_ += "e\x85R";
      break;
    case PickleKind::kDict:
      if (n.ordered) {
        Global("collections.OrderedDict");
        out_ += ")R";
      } else {
        out_ += '}';
      }
      Memoize(id);
      if (!n.entries.empty()) {
        out_ += '(';
        for (const auto& [k, v] : n.entries) {
          RESHARD_RETURN_IF_ERROR(Write(k));
          RESHARD_RETURN_IF_ERROR(Write(v));
        }
        out_ += 'u';
      }
      return Status::Ok();
    default:
      return InternalError("not a container");
  }
  Memoize(id);
  return Status::Ok();
}

Status PickleWriter::Write(PickleNodeId id) {
  if (const auto it = memo_.find(id); it != memo_.end()) {
    out_ += it->second < 256 ? 'h' : 'j';
    PutLe(out_, it->second, it->second < 256 ? 1 : 4);
    return Status::Ok();
  }
  const PickleNode& n = tree_.node(id);
  switch (n.kind) {
    case PickleKind::kTuple:
    case PickleKind::kList:
    case PickleKind::kSet:
      return WriteContainer(id, n);
    case PickleKind::kDict:
      RESHARD_RETURN_IF_ERROR(WriteContainer(id, n));
      break;
    case PickleKind::kPersistentId:
      RESHARD_RETURN_IF_ERROR(Write(n.items[0]));
      out_ += 'Q';
      Memoize(id);
      return Status::Ok();
    case PickleKind::kRecord:
      Global(n.text);
      RESHARD_RETURN_IF_ERROR(Write(n.args));
      out_ += n.newobj ? '\x81' : 'R';
      Memoize(id);
      break;
    default:
      return WriteScalar(n);
  }
  if (n.state != kNoPickleNode) {  // dicts and records: BUILD with what it set
    RESHARD_RETURN_IF_ERROR(Write(n.state));
    out_ += 'b';
  }
  return Status::Ok();
}

}  // namespace

Result<std::string> SerializePickle(const PickleTree& tree, PickleNodeId root, size_t max_depth) {
  PickleWriter writer(tree, max_depth);
  return writer.Run(root);
}

}  // namespace reshard
