// A pickle reader that runs no code: the object trees of torch.save files (`data.pkl`, see
// torch_file.h) and of the DeepSpeed checkpoints built on them.
//
// A pickle is a program for a stack machine: one opcode byte, then its operands. This reader
// runs protocols 2 to 5 with the opcodes torch.save and DeepSpeed emit:
//   80 PROTO n        95 FRAME u64        2E STOP
//   28 MARK  30 POP  31 DUP  32 POP_MARK
//   71 BINPUT u8   72 LONG_BINPUT u32   94 MEMOIZE   68 BINGET u8   6A LONG_BINGET u32
//   4E NONE  88 NEWTRUE  89 NEWFALSE
//   4B BININT1 u8  4D BININT2 u16  4A BININT i32  8A LONG1 n+bytes  8B LONG4 u32+bytes
//   47 BINFLOAT f64 big-endian
//   8C SHORT_BINUNICODE u8  58 BINUNICODE u32  8D BINUNICODE8 u64 (UTF-8, checked)
//   43 SHORT_BINBYTES u8  42 BINBYTES u32  8E BINBYTES8 u64  96 BYTEARRAY8 u64
//   7D EMPTY_DICT  5D EMPTY_LIST  29 EMPTY_TUPLE  8F EMPTY_SET  64 DICT  6C LIST  74 TUPLE
//   85 TUPLE1  86 TUPLE2  87 TUPLE3  91 FROZENSET
//   73 SETITEM  75 SETITEMS  61 APPEND  65 APPENDS  90 ADDITEMS
//   63 GLOBAL "module\nname\n"  93 STACK_GLOBAL  52 REDUCE  81 NEWOBJ  62 BUILD  51 BINPERSID
// Any other opcode (the text opcodes of protocol 0, INST/OBJ, extension registry codes,
// out-of-band buffers) refuses the pickle.
//
// Globals are the only way a pickle runs code, so a global is accepted only from a fixed
// allowlist, checked where GLOBAL or STACK_GLOBAL names it (before anything uses it):
//   - `collections.OrderedDict` called with () makes an (ordered) dict;
//   - `builtins.set`/`frozenset` (also spelled `__builtin__`) of a list make a set;
//   - `torch.Size` of a tuple makes that tuple; `_codecs.encode(str, "latin1")` makes bytes;
//   - every other allowed name (tensor and parameter rebuilders, storage types, dtypes,
//     `torch.device`, DeepSpeed's loss scalers, `ZeroStageEnum` and `fragment_address`,
//     `argparse.Namespace`, and any caller-added class) becomes an inert *record*: REDUCE or
//     NEWOBJ keeps the class name and the arguments, BUILD keeps the state. Nothing runs.
// Any other global refuses the pickle (InvalidArgument) naming `module.name` and its byte.
//
// Sizes are bounded by the input (a string or container cannot be longer than the bytes that
// make it; what set, frozenset, torch.Size and _codecs.encode copy may not pass the input's size
// in all) and by PickleLimits: nodes, memo entries and nesting depth. Cyclic structures (a list
// that contains itself through the memo) are refused. An object recalled from the memo is one
// node referenced from each place (a DAG), so the tree costs what the pickle holds, however
// often its objects are shared; PickleTree::expanded_size says what expanding them would cost.
#ifndef RESHARD_IO_PICKLE_H_
#define RESHARD_IO_PICKLE_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "reshard/base/result.h"

namespace reshard {

using PickleNodeId = uint32_t;
inline constexpr PickleNodeId kNoPickleNode = 0xffffffffu;

enum class PickleKind {
  kNone,
  kBool,
  kInt,     // fits int64: int_value
  kBigInt,  // wider than 64 bits: text holds its two's-complement bytes, little-endian
  kFloat,
  kStr,     // text: UTF-8
  kBytes,   // text: the raw bytes
  kList,    // items
  kTuple,   // items; torch_size = made by torch.Size
  kSet,     // items; frozen = a frozenset
  kDict,    // entries (key, value) in insertion order; ordered = an OrderedDict; state = BUILD
  kGlobal,  // an allowed global used as a value (a dtype, a storage type): text = name
  kRecord,  // an allowed class or function applied: text = "module.name", args, state; newobj =
            // made by NEWOBJ (cls.__new__(cls, *args)) rather than REDUCE (callable(*args))
  kPersistentId,  // BINPERSID: items[0] is the persistent id (for torch a tuple)
};

std::string_view PickleKindName(PickleKind kind);

/// One value of the tree. Fields not used by its kind are left empty.
struct PickleNode {
  PickleKind kind = PickleKind::kNone;
  bool bool_value = false;
  bool ordered = false;     // kDict made by collections.OrderedDict
  bool torch_size = false;  // kTuple made by torch.Size
  bool frozen = false;      // kSet made by frozenset
  bool newobj = false;      // kRecord made by NEWOBJ
  int64_t int_value = 0;
  double float_value = 0;
  std::string text;
  std::vector<PickleNodeId> items;
  std::vector<std::pair<PickleNodeId, PickleNodeId>> entries;
  PickleNodeId args = kNoPickleNode;   // kRecord: the arguments (a kTuple)
  PickleNodeId state = kNoPickleNode;  // kRecord, kDict: what BUILD set, if anything
  uint64_t offset = 0;                 // byte of the opcode that made this node
};

struct PickleLimits {
  size_t max_nodes = size_t{1} << 22;
  size_t max_memo = size_t{1} << 22;
  size_t max_depth = 1000;  // nesting of the finished tree and of MARKs
  /// Objects a reader may visit when it expands the tree into paths, a shared object once per
  /// path to it: TorchFile naming its tensors (io/torch_file.h). Parsing does not expand.
  size_t max_expanded = size_t{1} << 22;
};

struct PickleOptions {
  PickleLimits limits;
  /// More classes to read as inert records, as "module.name" (e.g. a project's own enum).
  std::vector<std::string> extra_record_classes;
};

/// The object tree of a pickle: nodes in an arena, referenced by id. A node reached twice
/// (through the memo) is shared, as in Python; a tree read by ParsePickle is acyclic. Trees
/// to write (SerializePickle, io/torch_writer.h) are built with Add: children are added
/// first or later, any node may be referenced from several places.
class PickleTree {
 public:
  PickleNodeId root() const { return root_; }
  const PickleNode& node(PickleNodeId id) const { return nodes_[id]; }
  size_t size() const { return nodes_.size(); }
  /// Of a tree read by ParsePickle: how many objects the tree under `id` would hold if every
  /// shared object were a copy (each counted once per path to it), saturating at UINT64_MAX.
  /// l = (l, l) nested 60 times is 61 nodes and expands to 2^61 - 1. 0 for a node the root
  /// does not reach or a tree built with Add. Readers that walk paths (dotted names) bound
  /// their work with it; those that print print a shared object once.
  uint64_t expanded_size(PickleNodeId id) const {
    return id < expanded_.size() ? expanded_[id] : 0;
  }

  /// Appends a node and returns its id.
  PickleNodeId Add(PickleNode node) {
    nodes_.push_back(std::move(node));
    return static_cast<PickleNodeId>(nodes_.size() - 1);
  }
  /// The node to change of a tree being built.
  PickleNode& mutable_node(PickleNodeId id) { return nodes_[id]; }
  void set_root(PickleNodeId root) { root_ = root; }

 private:
  friend class PickleMachine;
  std::vector<PickleNode> nodes_;
  std::vector<uint64_t> expanded_;  // by ParsePickle
  PickleNodeId root_ = kNoPickleNode;
};

/// Runs the pickle in `bytes` (inertly, as above) and returns its tree. Errors carry the byte
/// offset of the opcode: DataLoss for a malformed pickle (truncated operands, stack or memo
/// misuse, wrong types for an opcode, invalid UTF-8, trailing bytes after STOP, a cycle, a
/// limit of PickleLimits passed, copies past the input's size); InvalidArgument for a global
/// outside the allowlist; Unimplemented for an opcode outside the set above.
Result<PickleTree> ParsePickle(std::span<const std::byte> bytes, const PickleOptions& options = {});

/// The pickle of the tree under `root`, as Python's pickle writes protocol 2 (torch.save's
/// default), so that `pickle.load` (and torch.load, with weights_only=True when the tree holds
/// only tensors and plain data) rebuilds it: every kind of node as the reader reads it back,
/// records by REDUCE or NEWOBJ of their class with their arguments and then BUILD of their
/// state, dicts made by OrderedDict as `OrderedDict()` (state by BUILD), torch.Size, sets and
/// frozensets as calls of `torch.Size`, `builtins.set` and `builtins.frozenset`, bytes as
/// `_codecs.encode(str, "latin1")`. A node reached from two places is written once and then
/// recalled from the memo, so shared objects stay shared. InvalidArgument (naming the path
/// of dict keys and indices from the root) for a node id out of range, a cycle, nesting
/// deeper than `max_depth`, a string that is not UTF-8, a global name without a module, a
/// record whose arguments are not a tuple or a persistent id with no value.
Result<std::string> SerializePickle(const PickleTree& tree, PickleNodeId root,
                                    size_t max_depth = PickleLimits{}.max_depth);

/// How a dict key is named in a dotted path (`module.layers.0.weight`): a str as it is, an
/// int in decimal, True/False/None as Python prints them, any other key (or an id outside the
/// tree) as `#<index>`, its position in the dict.
std::string PickleKeyName(const PickleTree& tree, PickleNodeId key, size_t index);

/// Whether `s` may be written as a pickle string (well-formed UTF-8, as this reader accepts).
bool IsValidPickleString(std::string_view s);

/// Whether "module.name" is on the built-in allowlist (or is one of `extra`).
bool IsAllowedPickleGlobal(std::string_view name, const std::vector<std::string>& extra = {});

}  // namespace reshard

#endif  // RESHARD_IO_PICKLE_H_
