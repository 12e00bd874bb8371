// Buffers: rank tensors that hold pieces of several checkpoint tensors (DESIGN.md 16).
//
// Frameworks fuse. transformers holds an MoE layer's experts as one `gate_up_proj`
// [E, 2I, H] built from 2E checkpoint tensors; vLLM holds q, k and v in one `qkv_proj`; ZeRO
// keeps one flat partition per rank for many parameters. In the IR each checkpoint tensor
// stays the F of its own map, and a rank of that map may put its pieces in a named *buffer*
// (RankShard::buffer): the pieces' dest views then index the buffer, and the map's shard shape
// on that rank is the buffer's shape there.
//
// A buffer set declares the buffers - name, dtype, and per rank a shape and the blocks that
// are padding (elements no checkpoint tensor has: a padded vocabulary's tail, alignment) - and
// is valid together with the maps over it when every element of every buffer is written by
// exactly one piece of one map, or is declared padding, and by nothing else. Finalize checks
// that once for all maps, at a cost set by pieces (the box sweep of ir/box_cover.h), never
// by elements.
//
// A map with no buffered rank is the section-2 form, unchanged (one shard per tensor per rank)
// and interchangeable with DeepSpeed's affine maps. Composition stays per checkpoint tensor
// (ir/compose.h): a plan's source and target buffers are its maps' (ParamPlan).
#ifndef RESHARD_IR_BUFFER_SET_H_
#define RESHARD_IR_BUFFER_SET_H_

#include <cstddef>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "reshard/base/dtype.h"
#include "reshard/base/index.h"
#include "reshard/base/result.h"
#include "reshard/ir/param_map.h"

namespace reshard {

/// A strided block of elements of a buffer (offsets and strides in elements of its flat
/// row-major storage), e.g. declared padding.
struct BufferBlock {
  Shape shape;
  StridedView view;
  friend bool operator==(const BufferBlock&, const BufferBlock&) = default;
};

/// What a buffer is on one rank.
struct BufferRank {
  Shape shape;
  /// Elements no map writes (left zero when the buffer is produced).
  std::vector<BufferBlock> padding;
  friend bool operator==(const BufferRank&, const BufferRank&) = default;
};

/// One named rank tensor, on every rank of the world (a rank that holds none of it has a
/// zero-element shape).
struct BufferDecl {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<BufferRank> ranks;  // world_size entries
  /// The value of its padding elements: 0, or a constant that no checkpoint has (vLLM's
  /// attention scales `_k_scale` = 1, stored by its sharded-state files), exactly representable
  /// in `dtype` (checked by Finalize).
  double fill = 0.0;
  Index num_elements(Rank r) const { return ProductOf(ranks[static_cast<size_t>(r)].shape); }
  friend bool operator==(const BufferDecl&, const BufferDecl&) = default;
};

/// A map over buffers, by the name of its checkpoint tensor (for error messages).
struct NamedMapRef {
  std::string_view name;
  const ParamMap* map = nullptr;
};

/// A validated set of buffer declarations. Copyable value type; buffers sorted by name.
class BufferSet {
 public:
  BufferSet() = default;
  int world_size() const { return world_size_; }
  const std::vector<BufferDecl>& buffers() const { return buffers_; }
  bool empty() const { return buffers_.empty(); }
  /// The buffer named `name`, or null.
  const BufferDecl* Find(std::string_view name) const;
  friend bool operator==(const BufferSet&, const BufferSet&) = default;

 private:
  friend class BufferSetBuilder;
  int world_size_ = 0;
  std::vector<BufferDecl> buffers_;
};

/// Collects buffer declarations (from untrusted input, as ParamMapBuilder does), then checks the
/// whole set against the maps that write into it in `Finalize`.
class BufferSetBuilder {
 public:
  BufferSetBuilder() = default;
  explicit BufferSetBuilder(const BufferSet& set);
  BufferSetBuilder& add(BufferDecl decl);
  const std::vector<BufferDecl>& buffers() const { return buffers_; }

  /// Validates the declarations and the maps over them:
  /// - names non-empty and unique; every buffer has the same number of ranks, equal to the
  ///   world size of every map (of those given) that is buffered;
  /// - every buffered rank of every map names a declared buffer, and its shard shape is that
  ///   buffer's shape on the rank (`dtypes`, when given, are the maps' dtypes: each must be its
  ///   buffers');
  /// - padding blocks lie inside their buffer;
  /// - exactness: every element of every buffer on every rank is written by exactly one piece of
  ///   one map, or is padding, and never by both.
  /// InvalidArgument naming the buffer, the rank, the element (multi-index) and the two writers
  /// (`params["x"].ranks["1"].pieces[0]`, or padding[k]) or that none writes it.
  /// `maps` may include maps with no buffered rank (skipped).
  Result<BufferSet> Finalize(std::span<const NamedMapRef> maps,
                             std::span<const DType> dtypes = {}) const;

 private:
  std::vector<BufferDecl> buffers_;
};

/// `value` as one element of `dtype` (little-endian bytes), or InvalidArgument when the dtype
/// cannot hold it exactly (a fraction in an integer, 0.1 in BF16, anything but 0 in FP8).
Result<std::vector<std::byte>> ElementBytes(DType dtype, double value);

/// The path of a buffer's rank in error messages: `buffers["name"].ranks["3"]`.
std::string BufferRankPath(std::string_view buffer, Rank rank);

}  // namespace reshard

#endif  // RESHARD_IR_BUFFER_SET_H_
