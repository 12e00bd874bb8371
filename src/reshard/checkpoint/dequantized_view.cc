// A source with its block-quantized tensors read as numbers: what scatter and convert read
// when asked to dequantize (DequantizedView).
#include <fmt/format.h>

#include <algorithm>
#include <mutex>

#include "reshard/checkpoint/checkpoint_ops.h"
#include "reshard/checkpoint/gather.h"
#include "reshard/layouts/basic.h"

namespace reshard {

using internal::Counters;
using internal::ElementBytes;
using internal::FillDequantized;
using internal::GatherOutput;
using internal::GatherOutputs;
using internal::Rebuilt;

namespace {

// A map of `shape` at `world` ranks that rank 0 holds whole and the others not at all.
Result<ParamMap> HeldByRankZero(const Shape& shape, int world) {
  RESHARD_ASSIGN_OR_RETURN(ParamMap one, ReplicatedMap(shape, 1));
  if (world == 1) return one;
  ParamMapBuilder b;
  b.set_logical_shape(shape).set_world_size(world).set_shard_shape(0, shape);
  for (Rank r = 1; r < world; ++r) b.set_shard_shape(r, Shape{0});
  for (const Piece& piece : one.rank(0).pieces) b.add_piece(0, piece);
  return b.Finalize();
}

// A source with its block-quantized tensors read as numbers (DequantizedView). A dequantized
// tensor is made whole (on rank 0) at its first acquire and freed at its last release: memory
// is set by the tensors being written, never the checkpoint.
class DequantizedSource : public ShardSource {
 public:
  DequantizedSource(ShardSource& inner, CheckpointOptions options,
                    std::vector<GatherOutput> outputs, Manifest manifest)
      : inner_(inner),
        options_(std::move(options)),
        outputs_(std::move(outputs)),
        manifest_(std::move(manifest)),
        made_(outputs_.size()) {
    for (auto& m : made_) m = std::make_unique<Made>();
  }
  const Manifest& manifest() const override { return manifest_; }
  Result<std::vector<ConstBuffer>> AcquireShards(size_t i) override {
    const GatherOutput& o = outputs_[i];
    if (!o.scales) return inner_.AcquireShards(o.param);
    Made& made = *made_[i];
    std::lock_guard lock(made.mu);
    if (made.refs == 0) {
      made.tensor.size = static_cast<size_t>(ElementBytes(ProductOf(o.shape), o.dtype));
      made.tensor.bytes.reset(new (std::nothrow) std::byte[std::max<size_t>(made.tensor.size, 1)]);
      if (!made.tensor.bytes) {
        return ResourceExhaustedError(
            fmt::format("cannot allocate {} bytes for \"{}\"", made.tensor.size, o.name));
      }
      RESHARD_RETURN_IF_ERROR(FillDequantized(inner_, o, options_, made.tensor.span(), counters_));
    }
    ++made.refs;
    std::vector<ConstBuffer> shards(static_cast<size_t>(manifest_.world_size));
    shards[0] = {made.tensor.bytes.get(), ProductOf(o.shape)};
    return shards;
  }
  void ReleaseShards(size_t i) override {
    const GatherOutput& o = outputs_[i];
    if (!o.scales) return inner_.ReleaseShards(o.param);
    Made& made = *made_[i];
    std::lock_guard lock(made.mu);
    if (--made.refs == 0) made.tensor = Rebuilt();
  }
  std::vector<std::string> inputs() const override { return inner_.inputs(); }

 private:
  struct Made {
    std::mutex mu;
    int refs = 0;
    Rebuilt tensor;
  };
  ShardSource& inner_;
  const CheckpointOptions options_;
  const std::vector<GatherOutput> outputs_;
  const Manifest manifest_;
  std::vector<std::unique_ptr<Made>> made_;
  Counters counters_;
};

}  // namespace

Result<std::unique_ptr<ShardSource>> DequantizedView(ShardSource& inner,
                                                     const CheckpointOptions& options,
                                                     const DequantizedManifest& recorded) {
  if (!options.dequantize)
    return InvalidArgumentError("a dequantized view needs DequantizeOptions");
  const Manifest& in = inner.manifest();
  RESHARD_ASSIGN_OR_RETURN(std::vector<GatherOutput> outputs, GatherOutputs(in, options));
  Manifest m;
  m.world_size = in.world_size;
  m.model_config = recorded.model_config ? *recorded.model_config : in.model_config;
  m.constraints = recorded.constraints ? *recorded.constraints : in.constraints;
  for (const GatherOutput& o : outputs) {
    const ShardedParam& p = in.params[o.param];
    if (!o.scales) {
      m.params.push_back(p);
      continue;
    }
    RESHARD_ASSIGN_OR_RETURN(ParamMap map, HeldByRankZero(o.shape, in.world_size));
    // A layout descriptor is in terms of the data's dimensions: it holds while they do.
    std::optional<LayoutDescriptor> layout;
    if (o.shape == p.map.valid_shape()) layout = p.layout;
    m.params.push_back({o.name, o.dtype, std::move(map), std::move(layout), 1});
  }
  CheckpointOptions own = options;
  own.progress = nullptr;  // the scatter or convert reads through the view reports
  own.warn = nullptr;
  return std::unique_ptr<ShardSource>(
      std::make_unique<DequantizedSource>(inner, own, std::move(outputs), std::move(m)));
}

}  // namespace reshard
