#include "reshard/io/pickle.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>

namespace reshard {

// What an allowed global becomes when it is called (REDUCE / NEWOBJ).
enum class GlobalRole { kRecord, kOrderedDict, kSet, kSize, kCodecsEncode };

namespace {

// clang-format off
constexpr std::string_view kRecordGlobals[] = {
    "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3",
    "torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state",
    "torch._tensor._rebuild_from_type_v2", "torch.Tensor", "torch.nn.parameter.Parameter",
    "torch.storage.UntypedStorage",
    "torch.DoubleStorage", "torch.FloatStorage", "torch.HalfStorage", "torch.BFloat16Storage",
    "torch.LongStorage", "torch.IntStorage", "torch.ShortStorage", "torch.CharStorage",
    "torch.ByteStorage", "torch.BoolStorage", "torch.ComplexFloatStorage",
    "torch.ComplexDoubleStorage", "torch.QInt8Storage", "torch.QUInt8Storage",
    "torch.QInt32Storage", "torch.QUInt4x2Storage", "torch.QUInt2x4Storage",
    "torch.float64", "torch.float32", "torch.float16", "torch.bfloat16", "torch.int64",
    "torch.int32", "torch.int16", "torch.int8", "torch.uint8", "torch.uint16", "torch.uint32",
    "torch.uint64", "torch.bool", "torch.complex32", "torch.complex64", "torch.complex128",
    "torch.float8_e4m3fn", "torch.float8_e5m2", "torch.float8_e4m3fnuz", "torch.float8_e5m2fnuz",
    "torch.float8_e8m0fnu", "torch.float4_e2m1fn_x2",
    "torch.device",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "argparse.Namespace",
};
// clang-format on

std::optional<GlobalRole> RoleOf(std::string_view name, const std::vector<std::string>& extra) {
  if (name == "collections.OrderedDict") return GlobalRole::kOrderedDict;
  if (name == "builtins.set" || name == "builtins.frozenset" || name == "__builtin__.set" ||
      name == "__builtin__.frozenset") {
    return GlobalRole::kSet;
  }
  if (name == "torch.Size") return GlobalRole::kSize;
  if (name == "_codecs.encode") return GlobalRole::kCodecsEncode;
  for (std::string_view allowed : kRecordGlobals) {
    if (name == allowed) return GlobalRole::kRecord;
  }
  for (const std::string& allowed : extra) {
    if (name == allowed) return GlobalRole::kRecord;
  }
  return std::nullopt;
}

std::string Hex2(uint8_t v) {
  static constexpr char kDigits[] = "0123456789ABCDEF";
  return std::string{'0', 'x', kDigits[v >> 4], kDigits[v & 15]};
}

// Decodes well-formed UTF-8 (surrogates allowed, as Python's pickle writes them with
// "surrogatepass") into code points; nullopt if malformed.
std::optional<std::vector<uint32_t>> DecodeUtf8(std::string_view s) {
  std::vector<uint32_t> out;
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<uint8_t>(s[i]);
    int n = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      cp = c;
    } else if ((c & 0xE0) == 0xC0) {
      n = 1, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3, cp = c & 0x07;
    } else {
      return std::nullopt;
    }
    if (n > 0 && i + static_cast<size_t>(n) >= s.size()) return std::nullopt;
    for (int k = 1; k <= n; ++k) {
      const auto d = static_cast<uint8_t>(s[i + static_cast<size_t>(k)]);
      if ((d & 0xC0) != 0x80) return std::nullopt;
      cp = (cp << 6) | (d & 0x3F);
    }
    static constexpr uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF) return std::nullopt;
    out.push_back(cp);
    i += static_cast<size_t>(n) + 1;
  }
  return out;
}

}  // namespace

class PickleMachine {
 public:
  PickleMachine(std::span<const std::byte> bytes, const PickleOptions& options)
      : in_(bytes), options_(options) {}

  Result<PickleTree> Run();

 private:
  Status Step(uint8_t op);
  Status ControlOp(uint8_t op);  // PROTO FRAME STOP MARK POP DUP memo
  Status ScalarOp(uint8_t op);
  Status ContainerOp(uint8_t op);
  Status ObjectOp(uint8_t op);  // GLOBAL STACK_GLOBAL REDUCE NEWOBJ BUILD BINPERSID
  Status Error(std::string message) const {
    return DataLossError("pickle byte " + std::to_string(op_at_) + ": " + std::move(message));
  }
  // Operands.
  Result<std::span<const std::byte>> Take(uint64_t n);
  Result<uint64_t> TakeUint(int bytes);
  Result<std::string_view> TakeLine();
  // Stack.
  Result<PickleNodeId> Pop();
  Result<PickleNodeId> Top();
  Result<std::vector<PickleNodeId>> PopToMark();
  Result<PickleNodeId> New(PickleKind kind);
  PickleNode& N(PickleNodeId id) { return tree_.nodes_[id]; }
  // A new node pushed on the stack; its id, to fill in.
  Result<PickleNodeId> PushNew(PickleKind kind) {
    RESHARD_ASSIGN_OR_RETURN(const PickleNodeId id, New(kind));
    stack_.push_back(id);
    return id;
  }
  Status Push(PickleKind kind) { return PushNew(kind).status(); }
  // Opcode groups.
  Status PushInt(int64_t v);
  Status PushLong(uint64_t n);
  Status PushText(PickleKind kind, uint64_t n);
  Status PushGlobal(std::string name);
  Status Memo(uint64_t index);
  Status Recall(uint64_t index);
  Status SetItems(PickleNodeId dict, const std::vector<PickleNodeId>& kv);
  Status Extend(PickleNodeId target, const std::vector<PickleNodeId>& items);
  Status Call(bool newobj);
  Status Build();
  Status CheckAcyclic();
  // A str or int dict key: its hash (computed once per node), and whether two keys are equal.
  std::optional<size_t> KeyHash(PickleNodeId id);
  bool SameKey(PickleNodeId a, PickleNodeId b) const;
  // Counts `n` items or bytes that set/frozenset/torch.Size/_codecs.encode copy; in all they
  // may not pass the pickle's size (each made by an opcode of its own in any pickle that
  // Python writes), so that a container recalled from the memo cannot be copied over and over.
  Status Copying(uint64_t n, const char* what);

  std::span<const std::byte> in_;
  const PickleOptions& options_;
  uint64_t pos_ = 0;
  uint64_t op_at_ = 0;
  bool stopped_ = false;
  PickleTree tree_;
  std::vector<PickleNodeId> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, PickleNodeId> memo_;
  std::unordered_map<PickleNodeId, GlobalRole> roles_;
  // Per dict, the position of each str/int key in its entries (so a repeated key replaces).
  std::unordered_map<PickleNodeId, std::unordered_multimap<size_t, size_t>> keys_;
  std::unordered_map<PickleNodeId, size_t> key_hash_;
  uint64_t copied_ = 0;
};

Result<std::span<const std::byte>> PickleMachine::Take(uint64_t n) {
  if (n > in_.size() - pos_) {
    return Error("operand of " + std::to_string(n) + " bytes runs past the end of the pickle (" +
                 std::to_string(in_.size() - pos_) + " bytes left)");
  }
  const auto out = in_.subspan(pos_, n);
  pos_ += n;
  return out;
}

Result<uint64_t> PickleMachine::TakeUint(int bytes) {
  RESHARD_ASSIGN_OR_RETURN(const auto b, Take(static_cast<uint64_t>(bytes)));
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i)
    v = (v << 8) | static_cast<uint8_t>(b[static_cast<size_t>(i)]);
  return v;
}

Result<std::string_view> PickleMachine::TakeLine() {
  const auto* begin = reinterpret_cast<const char*>(in_.data()) + pos_;
  const auto* nl = static_cast<const char*>(std::memchr(begin, '\n', in_.size() - pos_));
  if (nl == nullptr) return Error("GLOBAL operand has no newline before the end of the pickle");
  const std::string_view line(begin, static_cast<size_t>(nl - begin));
  pos_ += line.size() + 1;
  return line;
}

Result<PickleNodeId> PickleMachine::New(PickleKind kind) {
  if (tree_.nodes_.size() >= options_.limits.max_nodes) {
    return Error("more than " + std::to_string(options_.limits.max_nodes) +
                 " objects (PickleLimits::max_nodes)");
  }
  tree_.nodes_.emplace_back();
  tree_.nodes_.back().kind = kind;
  tree_.nodes_.back().offset = op_at_;
  return static_cast<PickleNodeId>(tree_.nodes_.size() - 1);
}

Result<PickleNodeId> PickleMachine::Pop() {
  if (stack_.empty() || (!marks_.empty() && marks_.back() == stack_.size())) {
    return Error("stack underflow");
  }
  const PickleNodeId id = stack_.back();
  stack_.pop_back();
  return id;
}

Result<PickleNodeId> PickleMachine::Top() {
  if (stack_.empty() || (!marks_.empty() && marks_.back() == stack_.size())) {
    return Error("stack underflow");
  }
  return stack_.back();
}

Result<std::vector<PickleNodeId>> PickleMachine::PopToMark() {
  if (marks_.empty()) return Error("no MARK on the stack");
  const size_t mark = marks_.back();
  marks_.pop_back();
  std::vector<PickleNodeId> items(stack_.begin() + static_cast<ptrdiff_t>(mark), stack_.end());
  stack_.resize(mark);
  return items;
}

Status PickleMachine::PushInt(int64_t v) {
  RESHARD_ASSIGN_OR_RETURN(const PickleNodeId id, PushNew(PickleKind::kInt));
  N(id).int_value = v;
  return Status::Ok();
}

// LONG1 / LONG4: n bytes of little-endian two's complement.
Status PickleMachine::PushLong(uint64_t n) {
  RESHARD_ASSIGN_OR_RETURN(const auto b, Take(n));
  if (n <= 8) {
    uint64_t v = 0;
    for (uint64_t i = n; i-- > 0;) v = (v << 8) | static_cast<uint8_t>(b[i]);
    if (n > 0 && n < 8 && (static_cast<uint8_t>(b[n - 1]) & 0x80)) v |= ~uint64_t{0} << (8 * n);
    return PushInt(static_cast<int64_t>(v));
  }
  RESHARD_ASSIGN_OR_RETURN(const PickleNodeId id, PushNew(PickleKind::kBigInt));
  N(id).text.assign(reinterpret_cast<const char*>(b.data()), b.size());
  return Status::Ok();
}

Status PickleMachine::PushText(PickleKind kind, uint64_t n) {
  RESHARD_ASSIGN_OR_RETURN(const auto b, Take(n));
  std::string text(reinterpret_cast<const char*>(b.data()), b.size());
  if (kind == PickleKind::kStr && !DecodeUtf8(text)) return Error("string is not valid UTF-8");
  RESHARD_ASSIGN_OR_RETURN(const PickleNodeId id, PushNew(kind));
  N(id).text = std::move(text);
  return Status::Ok();
}

Status PickleMachine::PushGlobal(std::string name) {
  const std::optional<GlobalRole> role = RoleOf(name, options_.extra_record_classes);
  if (!role) {
    return InvalidArgumentError("pickle byte " + std::to_string(op_at_) + ": global " + name +
                                " is not allowed (only tensors, storages, containers and known "
                                "data-only classes are read; nothing in the file is run)");
  }
  RESHARD_ASSIGN_OR_RETURN(const PickleNodeId id, New(PickleKind::kGlobal));
  N(id).text = std::move(name);
  roles_[id] = *role;
  stack_.push_back(id);
  return Status::Ok();
}

Status PickleMachine::Memo(uint64_t index) {
  RESHARD_ASSIGN_OR_RETURN(const PickleNodeId top, Top());
  if (memo_.size() >= options_.limits.max_memo && !memo_.contains(index)) {
    return Error("more than " + std::to_string(options_.limits.max_memo) +
                 " memo entries (PickleLimits::max_memo)");
  }
  memo_[index] = top;
  return Status::Ok();
}

Status PickleMachine::Recall(uint64_t index) {
  const auto it = memo_.find(index);
  if (it == memo_.end()) return Error("memo entry " + std::to_string(index) + " was never set");
  stack_.push_back(it->second);
  return Status::Ok();
}

std::optional<size_t> PickleMachine::KeyHash(PickleNodeId id) {
  const PickleNode& n = tree_.nodes_[id];
  if (n.kind != PickleKind::kStr && n.kind != PickleKind::kInt) return std::nullopt;
  const auto it = key_hash_.find(id);
  if (it != key_hash_.end()) return it->second;
  const size_t h = n.kind == PickleKind::kStr
                       ? std::hash<std::string_view>{}(n.text)
                       : std::hash<int64_t>{}(n.int_value) ^ size_t { 0x9e3779b97f4a7c15u };
  key_hash_.emplace(id, h);
  return h;
}

bool PickleMachine::SameKey(PickleNodeId a, PickleNodeId b) const {
  if (a == b) return true;
  const PickleNode& x = tree_.nodes_[a];
  const PickleNode& y = tree_.nodes_[b];
  if (x.kind != y.kind) return false;
  return x.kind == PickleKind::kStr ? x.text == y.text : x.int_value == y.int_value;
}

Status PickleMachine::Copying(uint64_t n, const char* what) {
  copied_ += n;
  if (copied_ > in_.size()) {
    return Error(std::string(what) + " would copy more than the pickle's " +
                 std::to_string(in_.size()) +
                 " bytes in all: a container or string recalled from the memo and copied "
                 "again and again");
  }
  return Status::Ok();
}

Status PickleMachine::SetItems(PickleNodeId dict, const std::vector<PickleNodeId>& kv) {
  if (N(dict).kind != PickleKind::kDict) {
    return Error("SETITEM(S) on a " + std::string(PickleKindName(N(dict).kind)) + ", not a dict");
  }
  if (kv.size() % 2 != 0) return Error("SETITEMS with an odd number of stack items");
  auto& keys = keys_[dict];
  for (size_t i = 0; i < kv.size(); i += 2) {
    const std::optional<size_t> hash = KeyHash(kv[i]);
    auto& entries = N(dict).entries;
    if (hash) {
      bool replaced = false;
      for (auto [it, end] = keys.equal_range(*hash); it != end && !replaced; ++it) {
        if (SameKey(entries[it->second].first, kv[i])) {
          entries[it->second].second = kv[i + 1];
          replaced = true;
        }
      }
      if (replaced) continue;
      keys.emplace(*hash, entries.size());
    }
    entries.emplace_back(kv[i], kv[i + 1]);
  }
  return Status::Ok();
}

Status PickleMachine::Extend(PickleNodeId target, const std::vector<PickleNodeId>& items) {
  PickleNode& n = N(target);
  if (n.kind != PickleKind::kList && n.kind != PickleKind::kSet) {
    return Error("APPEND(S)/ADDITEMS on a " + std::string(PickleKindName(n.kind)));
  }
  n.items.insert(n.items.end(), items.begin(), items.end());
  return Status::Ok();
}

// REDUCE (callable, args) and NEWOBJ (class, args): only allowed globals are callable, and
// calling one builds a value; nothing runs.
Status PickleMachine::Call(bool newobj) {
  const char* op = newobj ? "NEWOBJ" : "REDUCE";
  RESHARD_ASSIGN_OR_RETURN(const PickleNodeId args, Pop());
  RESHARD_ASSIGN_OR_RETURN(const PickleNodeId callee, Pop());
  if (N(callee).kind != PickleKind::kGlobal) {
    return Error(std::string(op) + " of a " + std::string(PickleKindName(N(callee).kind)) +
                 ", not a global");
  }
  if (N(args).kind != PickleKind::kTuple) {
    return Error(std::string(op) + " of " + N(callee).text + " with a " +
                 std::string(PickleKindName(N(args).kind)) + " for arguments, not a tuple");
  }
  // The arguments, not copied (a large tuple recalled from the memo for many calls would make
  // that quadratic); read again after New(), which may move the arena.
  const size_t num_args = N(args).items.size();
  const auto arg = [this, args](size_t i) -> const PickleNode& { return N(N(args).items[i]); };
  const std::string name = N(callee).text;
  const auto bad = [&](const char* expected) {
    return Error(name + " called with arguments other than " + expected);
  };
  switch (roles_.at(callee)) {
    case GlobalRole::kOrderedDict: {
      if (num_args != 0) return bad("()");
      RESHARD_ASSIGN_OR_RETURN(const PickleNodeId id, PushNew(PickleKind::kDict));
      N(id).ordered = true;
      return Status::Ok();
    }
    case GlobalRole::kSet:
    case GlobalRole::kSize: {
      const PickleKind from =
          roles_.at(callee) == GlobalRole::kSet ? PickleKind::kList : PickleKind::kTuple;
      if (num_args != 1 || arg(0).kind != from) {
        return bad(from == PickleKind::kList ? "(list,)" : "(tuple,)");
      }
      RESHARD_RETURN_IF_ERROR(Copying(arg(0).items.size(), name.c_str()));
      RESHARD_ASSIGN_OR_RETURN(
          const PickleNodeId id,
          New(roles_.at(callee) == GlobalRole::kSet ? PickleKind::kSet : PickleKind::kTuple));
      N(id).items = arg(0).items;
      N(id).torch_size = roles_.at(callee) == GlobalRole::kSize;
      N(id).frozen = name.ends_with(".frozenset");
      stack_.push_back(id);
      return Status::Ok();
    }
    case GlobalRole::kCodecsEncode: {
      if (num_args != 2 || arg(0).kind != PickleKind::kStr || arg(1).kind != PickleKind::kStr ||
          arg(1).text != "latin1") {
        return bad("(str, \"latin1\")");
      }
      RESHARD_RETURN_IF_ERROR(Copying(arg(0).text.size(), name.c_str()));
      std::string bytes;
      const std::optional<std::vector<uint32_t>> code_points = DecodeUtf8(arg(0).text);
      for (uint32_t cp : code_points.value_or(std::vector<uint32_t>{})) {
        if (cp > 0xFF) return Error("_codecs.encode of a character beyond latin-1");
        bytes.push_back(static_cast<char>(cp));
      }
      RESHARD_ASSIGN_OR_RETURN(const PickleNodeId id, PushNew(PickleKind::kBytes));
      N(id).text = std::move(bytes);
      return Status::Ok();
    }
    case GlobalRole::kRecord: {
      RESHARD_ASSIGN_OR_RETURN(const PickleNodeId id, PushNew(PickleKind::kRecord));
      N(id).text = name;
      N(id).args = args;
      N(id).newobj = newobj;
      return Status::Ok();
    }
  }
  return InternalError("unhandled global role");
}

Status PickleMachine::Build() {
  RESHARD_ASSIGN_OR_RETURN(const PickleNodeId state, Pop());
  RESHARD_ASSIGN_OR_RETURN(const PickleNodeId target, Top());
  const PickleKind kind = N(target).kind;
  if (kind != PickleKind::kRecord && kind != PickleKind::kDict) {
    return Error("BUILD on a " + std::string(PickleKindName(kind)));
  }
  N(target).state = state;
  return Status::Ok();
}

Status PickleMachine::ControlOp(uint8_t op) {
  switch (op) {
    case 0x80: {  // PROTO
      RESHARD_ASSIGN_OR_RETURN(const uint64_t v, TakeUint(1));
      if (v < 2 || v > 5) return Error("protocol " + std::to_string(v) + " (2 to 5 are read)");
      return Status::Ok();
    }
    case 0x95: {  // FRAME: a hint for buffered readers; the bytes are read as they come
      RESHARD_ASSIGN_OR_RETURN(const uint64_t n, TakeUint(8));
      if (n > in_.size() - pos_)
        return Error("FRAME of " + std::to_string(n) + " bytes runs past the end");
      return Status::Ok();
    }
    case '.': {  // STOP
      RESHARD_ASSIGN_OR_RETURN(tree_.root_, Pop());
      stopped_ = true;
      return Status::Ok();
    }
    case '(':  // MARK
      if (marks_.size() >= options_.limits.max_depth) {
        return Error("more than " + std::to_string(options_.limits.max_depth) +
                     " nested MARKs (PickleLimits::max_depth)");
      }
      marks_.push_back(stack_.size());
      return Status::Ok();
    case '0':  // POP (a MARK on top is popped itself)
      if (!marks_.empty() && marks_.back() == stack_.size()) {
        marks_.pop_back();
        return Status::Ok();
      }
      return Pop().status();
    case '1': {  // DUP
      RESHARD_ASSIGN_OR_RETURN(const PickleNodeId top, Top());
      stack_.push_back(top);
      return Status::Ok();
    }
    case '2':  // POP_MARK
      return PopToMark().status();
    case 'q':
    case 'r':
    case 'h':
    case 'j': {  // BINPUT LONG_BINPUT BINGET LONG_BINGET: a 1- or 4-byte memo index
      RESHARD_ASSIGN_OR_RETURN(const uint64_t i, TakeUint(op == 'q' || op == 'h' ? 1 : 4));
      return op == 'q' || op == 'r' ? Memo(i) : Recall(i);
    }
    case 0x94:  // MEMOIZE
      return Memo(memo_.size());
    default:
      return InternalError("opcode routed to the wrong group");
  }
}

Status PickleMachine::ScalarOp(uint8_t op) {
  switch (op) {
    case 'N':
      return Push(PickleKind::kNone);
    case 0x88:
    case 0x89: {
      RESHARD_ASSIGN_OR_RETURN(const PickleNodeId id, PushNew(PickleKind::kBool));
      N(id).bool_value = op == 0x88;
      return Status::Ok();
    }
    case 'K':
    case 'M':
    case 'J': {  // BININT1 BININT2 (unsigned), BININT (signed 32-bit)
      RESHARD_ASSIGN_OR_RETURN(const uint64_t v, TakeUint(op == 'K' ? 1 : op == 'M' ? 2 : 4));
      return PushInt(op == 'J' ? static_cast<int32_t>(static_cast<uint32_t>(v))
                               : static_cast<int64_t>(v));
    }
    case 0x8a:
    case 0x8b: {  // LONG1 LONG4: a 1- or 4-byte length, then the bytes
      RESHARD_ASSIGN_OR_RETURN(const uint64_t n, TakeUint(op == 0x8a ? 1 : 4));
      return PushLong(n);
    }
    case 'G': {
      RESHARD_ASSIGN_OR_RETURN(const auto b, Take(8));
      uint64_t bits = 0;
      for (size_t i = 0; i < 8; ++i) bits = (bits << 8) | static_cast<uint8_t>(b[i]);
      RESHARD_ASSIGN_OR_RETURN(const PickleNodeId id, PushNew(PickleKind::kFloat));
      N(id).float_value = std::bit_cast<double>(bits);
      return Status::Ok();
    }
    case 0x8c:
    case 'X':
    case 0x8d:
    case 'C':
    case 'B':
    case 0x8e:
    case 0x96: {
      const bool str = op == 0x8c || op == 'X' || op == 0x8d;
      const int width = (op == 0x8c || op == 'C') ? 1 : (op == 'X' || op == 'B') ? 4 : 8;
      RESHARD_ASSIGN_OR_RETURN(const uint64_t n, TakeUint(width));
      return PushText(str ? PickleKind::kStr : PickleKind::kBytes, n);
    }
    default:
      return InternalError("opcode routed to the wrong group");
  }
}

Status PickleMachine::ContainerOp(uint8_t op) {
  switch (op) {
    case '}':
      return Push(PickleKind::kDict);
    case ']':
      return Push(PickleKind::kList);
    case ')':
      return Push(PickleKind::kTuple);
    case 0x8f:
      return Push(PickleKind::kSet);
    case 0x85:
    case 0x86:
    case 0x87: {
      std::vector<PickleNodeId> items(static_cast<size_t>(op - 0x84));
      for (size_t i = items.size(); i-- > 0;) {
        RESHARD_ASSIGN_OR_RETURN(items[i], Pop());
      }
      RESHARD_ASSIGN_OR_RETURN(const PickleNodeId id, PushNew(PickleKind::kTuple));
      N(id).items = std::move(items);
      return Status::Ok();
    }
    case 't':
    case 'l':
    case 0x91: {
      RESHARD_ASSIGN_OR_RETURN(std::vector<PickleNodeId> items, PopToMark());
      const PickleKind kind = op == 't'   ? PickleKind::kTuple
                              : op == 'l' ? PickleKind::kList
                                          : PickleKind::kSet;
      RESHARD_ASSIGN_OR_RETURN(const PickleNodeId id, PushNew(kind));
      N(id).items = std::move(items);
      N(id).frozen = op == 0x91;
      return Status::Ok();
    }
    case 'd': {
      RESHARD_ASSIGN_OR_RETURN(const std::vector<PickleNodeId> kv, PopToMark());
      RESHARD_ASSIGN_OR_RETURN(const PickleNodeId id, New(PickleKind::kDict));
      stack_.push_back(id);
      return SetItems(id, kv);
    }
    case 's': {
      RESHARD_ASSIGN_OR_RETURN(const PickleNodeId value, Pop());
      RESHARD_ASSIGN_OR_RETURN(const PickleNodeId key, Pop());
      RESHARD_ASSIGN_OR_RETURN(const PickleNodeId dict, Top());
      return SetItems(dict, {key, value});
    }
    case 'u': {
      RESHARD_ASSIGN_OR_RETURN(const std::vector<PickleNodeId> kv, PopToMark());
      RESHARD_ASSIGN_OR_RETURN(const PickleNodeId dict, Top());
      return SetItems(dict, kv);
    }
    case 'a': {
      RESHARD_ASSIGN_OR_RETURN(const PickleNodeId value, Pop());
      RESHARD_ASSIGN_OR_RETURN(const PickleNodeId list, Top());
      if (N(list).kind != PickleKind::kList) return Error("APPEND on a non-list");
      return Extend(list, {value});
    }
    case 'e':
    case 0x90: {
      RESHARD_ASSIGN_OR_RETURN(const std::vector<PickleNodeId> items, PopToMark());
      RESHARD_ASSIGN_OR_RETURN(const PickleNodeId target, Top());
      if (N(target).kind != (op == 'e' ? PickleKind::kList : PickleKind::kSet)) {
        return Error(std::string(op == 'e' ? "APPENDS on a " : "ADDITEMS on a ") +
                     std::string(PickleKindName(N(target).kind)));
      }
      return Extend(target, items);
    }
    default:
      return InternalError("opcode routed to the wrong group");
  }
}

Status PickleMachine::ObjectOp(uint8_t op) {
  switch (op) {
    case 'c': {
      RESHARD_ASSIGN_OR_RETURN(const std::string_view module, TakeLine());
      RESHARD_ASSIGN_OR_RETURN(const std::string_view name, TakeLine());
      return PushGlobal(std::string(module) + "." + std::string(name));
    }
    case 0x93: {  // STACK_GLOBAL
      RESHARD_ASSIGN_OR_RETURN(const PickleNodeId name, Pop());
      RESHARD_ASSIGN_OR_RETURN(const PickleNodeId module, Pop());
      if (N(name).kind != PickleKind::kStr || N(module).kind != PickleKind::kStr) {
        return Error("STACK_GLOBAL of something other than two strings");
      }
      return PushGlobal(N(module).text + "." + N(name).text);
    }
    case 'R':
      return Call(/*newobj=*/false);
    case 0x81:
      return Call(/*newobj=*/true);
    case 'b':
      return Build();
    case 'Q': {  // BINPERSID
      RESHARD_ASSIGN_OR_RETURN(const PickleNodeId pid, Pop());
      RESHARD_ASSIGN_OR_RETURN(const PickleNodeId id, PushNew(PickleKind::kPersistentId));
      N(id).items = {pid};
      return Status::Ok();
    }
    default:
      return InternalError("opcode routed to the wrong group");
  }
}

Status PickleMachine::Step(uint8_t op) {
  switch (op) {
    case 0x80:
    case 0x95:
    case '.':
    case '(':
    case '0':
    case '1':
    case '2':
    case 'q':
    case 'r':
    case 0x94:
    case 'h':
    case 'j':
      return ControlOp(op);
    case 'N':
    case 0x88:
    case 0x89:
    case 'K':
    case 'M':
    case 'J':
    case 0x8a:
    case 0x8b:
    case 'G':
    case 0x8c:
    case 'X':
    case 0x8d:
    case 'C':
    case 'B':
    case 0x8e:
    case 0x96:
      return ScalarOp(op);
    case '}':
    case ']':
    case ')':
    case 0x8f:
    case 0x85:
    case 0x86:
    case 0x87:
    case 't':
    case 'l':
    case 0x91:
    case 'd':
    case 's':
    case 'u':
    case 'a':
    case 'e':
    case 0x90:
      return ContainerOp(op);
    case 'c':
    case 0x93:
    case 'R':
    case 0x81:
    case 'b':
    case 'Q':
      return ObjectOp(op);
    default:
      return UnimplementedError("pickle byte " + std::to_string(op_at_) + ": opcode " + Hex2(op) +
                                " is not read (protocol 2 to 5 opcodes of torch.save only)");
  }
}

// Refuses cycles and nesting deeper than the limit, walking the finished tree once. A shared
// object is walked once, so its height (the longest chain of objects below it, itself included)
// is kept: the nesting is the root's height, whichever path first reached the shared objects.
// Its expanded size (counting shared objects once per path) is kept the same way.
Status PickleMachine::CheckAcyclic() {
  enum : uint8_t { kUnseen, kOnPath, kDone };
  std::vector<uint8_t> color(tree_.nodes_.size(), kUnseen);
  std::vector<size_t> height(tree_.nodes_.size(), 0);
  std::vector<uint64_t>& expanded = tree_.expanded_;
  expanded.assign(tree_.nodes_.size(), 0);
  const auto add = [](uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; };
  struct Frame {
    PickleNodeId id;
    size_t next;
    size_t tallest_child = 0;
    uint64_t expanded = 1;  // itself and, so far, its children expanded
  };
  const auto too_deep = [this](PickleNodeId id) {
    op_at_ = tree_.nodes_[id].offset;
    return Error("objects nested deeper than " + std::to_string(options_.limits.max_depth) +
                 " (PickleLimits::max_depth)");
  };
  const auto child = [&](const PickleNode& n, size_t k) -> PickleNodeId {
    if (k < n.items.size()) return n.items[k];
    k -= n.items.size();
    if (k < 2 * n.entries.size()) return k % 2 ? n.entries[k / 2].second : n.entries[k / 2].first;
    k -= 2 * n.entries.size();
    if (k == 0 && n.args != kNoPickleNode) return n.args;
    if (n.args != kNoPickleNode) --k;
    if (k == 0 && n.state != kNoPickleNode) return n.state;
    return kNoPickleNode;
  };
  std::vector<Frame> path = {{tree_.root_, 0}};
  color[tree_.root_] = kOnPath;
  while (!path.empty()) {
    Frame& f = path.back();
    const PickleNodeId c = child(tree_.nodes_[f.id], f.next++);
    if (c == kNoPickleNode) {
      const PickleNodeId done = f.id;
      color[done] = kDone;
      height[done] = f.tallest_child + 1;
      expanded[done] = f.expanded;
      if (height[done] > options_.limits.max_depth) return too_deep(done);
      path.pop_back();
      if (!path.empty()) {
        path.back().tallest_child = std::max(path.back().tallest_child, height[done]);
        path.back().expanded = add(path.back().expanded, expanded[done]);
      }
      continue;
    }
    if (color[c] == kOnPath) {
      op_at_ = tree_.nodes_[c].offset;
      return Error("cyclic structure: a " + std::string(PickleKindName(tree_.nodes_[c].kind)) +
                   " contains itself");
    }
    if (color[c] == kDone) {
      f.tallest_child = std::max(f.tallest_child, height[c]);
      f.expanded = add(f.expanded, expanded[c]);
      if (f.tallest_child + 1 > options_.limits.max_depth) return too_deep(f.id);
      continue;
    }
    if (path.size() >= options_.limits.max_depth) return too_deep(c);
    color[c] = kOnPath;
    path.push_back({c, 0});
  }
  return Status::Ok();
}

Result<PickleTree> PickleMachine::Run() {
  while (!stopped_) {
    if (pos_ >= in_.size()) {
      op_at_ = pos_;
      return Error("the pickle ends without STOP");
    }
    op_at_ = pos_;
    const auto op = static_cast<uint8_t>(in_[pos_++]);
    RESHARD_RETURN_IF_ERROR(Step(op));
  }
  if (pos_ != in_.size()) {
    op_at_ = pos_;
    return Error(std::to_string(in_.size() - pos_) + " bytes after STOP");
  }
  RESHARD_RETURN_IF_ERROR(CheckAcyclic());
  return std::move(tree_);
}

Result<PickleTree> ParsePickle(std::span<const std::byte> bytes, const PickleOptions& options) {
  PickleMachine machine(bytes, options);
  return machine.Run();
}

std::string PickleKeyName(const PickleTree& tree, PickleNodeId key, size_t index) {
  if (key >= tree.size()) return "#" + std::to_string(index);
  const PickleNode& k = tree.node(key);
  switch (k.kind) {
    case PickleKind::kStr:
      return k.text;
    case PickleKind::kInt:
      return std::to_string(k.int_value);
    case PickleKind::kBool:
      return k.bool_value ? "True" : "False";
    case PickleKind::kNone:
      return "None";
    default:
      return "#" + std::to_string(index);
  }
}

bool IsValidPickleString(std::string_view s) { return DecodeUtf8(s).has_value(); }

bool IsAllowedPickleGlobal(std::string_view name, const std::vector<std::string>& extra) {
  return RoleOf(name, extra).has_value();
}

std::string_view PickleKindName(PickleKind kind) {
  switch (kind) {
    case PickleKind::kNone:
      return "None";
    case PickleKind::kBool:
      return "bool";
    case PickleKind::kInt:
    case PickleKind::kBigInt:
      return "int";
    case PickleKind::kFloat:
      return "float";
    case PickleKind::kStr:
      return "str";
    case PickleKind::kBytes:
      return "bytes";
    case PickleKind::kList:
      return "list";
    case PickleKind::kTuple:
      return "tuple";
    case PickleKind::kSet:
      return "set";
    case PickleKind::kDict:
      return "dict";
    case PickleKind::kGlobal:
      return "global";
    case PickleKind::kRecord:
      return "record";
    case PickleKind::kPersistentId:
      return "persistent id";
  }
  return "?";
}

}  // namespace reshard
