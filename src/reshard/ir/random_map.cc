#include "reshard/ir/random_map.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <utility>

namespace reshard {
namespace {

// A source view of F with its holders and scale, before it is placed in shards.
struct SourcePiece {
  Shape shape;
  StridedView source;
  std::vector<Rank> locations;
  double scale = 1.0;
};

// A box of F: [lo[k], lo[k] + extent[k]) along each dimension.
struct Box {
  Shape lo;
  Shape extent;
};

class Generator {
 public:
  Generator(std::mt19937_64& rng, const RandomMapOptions& options) : rng_(rng), options_(options) {}

  ParamMapBuilder Build() {
    world_ = static_cast<int>(Uniform(1, std::max(1, options_.max_world)));
    const auto dims = static_cast<size_t>(Uniform(1, std::max(1, options_.max_dims)));
    logical_.resize(dims);
    for (Index& e : logical_) e = Uniform(1, std::max<Index>(1, options_.max_extent));
    while (ProductOf(logical_) > std::max<Index>(1, options_.max_elements)) {
      Index& largest = *std::max_element(logical_.begin(), logical_.end());
      largest = (largest + 1) / 2;
    }
    if (Chance(0.03)) logical_[Pick(dims)] = 0;  // F with no elements at all
    if (options_.logical_shape) logical_ = *options_.logical_shape;
    strides_ = RowMajorStrides(logical_);
    valid_ = logical_;
    if (options_.valid_shape) {
      valid_ = *options_.valid_shape;
    } else if (options_.padding && ProductOf(logical_) > 0 && Chance(0.2)) {
      for (size_t k = 0; k < logical_.size(); ++k) {
        if (Chance(0.5)) valid_[k] = logical_[k] - Uniform(0, std::min<Index>(3, logical_[k]));
      }
    }
    if (ProductOf(logical_) > 0) Layout(Box{Shape(logical_.size(), 0), logical_}, 0);
    DropSomeUnheldPadding();

    ParamMapBuilder builder;
    builder.set_logical_shape(logical_);
    if (valid_ != logical_) builder.set_valid_shape(valid_);
    builder.set_world_size(world_);
    for (Rank r = 0; r < world_; ++r) PlaceShard(builder, r);
    return builder;
  }

 private:
  // ---- randomness
  Index Uniform(Index lo, Index hi) {  // inclusive
    return std::uniform_int_distribution<Index>(lo, hi)(rng_);
  }
  size_t Pick(size_t n) { return static_cast<size_t>(Uniform(0, static_cast<Index>(n) - 1)); }
  bool Chance(double p) { return std::bernoulli_distribution(p)(rng_); }
  template <typename T>
  void Shuffle(std::vector<T>& v) {
    std::shuffle(v.begin(), v.end(), rng_);
  }

  std::vector<Rank> AllRanks() const {
    std::vector<Rank> all(static_cast<size_t>(world_));
    std::iota(all.begin(), all.end(), 0);
    return all;
  }

  double RandomScale(size_t holders) {
    if (!options_.scales || Chance(0.75)) return 1.0;
    switch (Uniform(0, 7)) {
      case 0:
        return 0.5;
      case 1:
        return 0.25;
      case 2:
        return 2.0;
      case 3:
        return 1.0 / 3.0;
      case 4:
        return 1.0 / static_cast<double>(std::max<size_t>(holders, 1));  // pre-divided
      case 5:
        return -0.125;
      case 6:
        return 1.0 / 7.0;
      default:
        // Any double must survive the JSON round trip bit for bit.
        return std::uniform_real_distribution<double>(1e-3, 1e3)(rng_);
    }
  }

  // `count` holder sets: distinct single ranks (extra sets reuse ranks), or, with
  // replication, disjoint groups of ranks.
  std::vector<std::vector<Rank>> HolderSets(size_t count) {
    std::vector<Rank> ranks = AllRanks();
    Shuffle(ranks);
    std::vector<std::vector<Rank>> sets;
    if (options_.replication && world_ > 1 && Chance(0.3)) {
      const size_t groups = std::min(count, ranks.size());
      sets.resize(groups);
      for (size_t i = 0; i < ranks.size(); ++i) {
        // Every group gets one rank first; the rest go anywhere, or nowhere.
        if (i < groups) {
          sets[i].push_back(ranks[i]);
        } else if (Chance(0.8)) {
          sets[Pick(groups)].push_back(ranks[i]);
        }
      }
      while (sets.size() < count) sets.push_back(sets[Pick(groups)]);
    } else {
      for (size_t i = 0; i < count; ++i) sets.push_back({ranks[i % ranks.size()]});
      // A rank that holds two chunks of one split (more chunks than ranks).
      for (size_t i = ranks.size(); i < count; ++i) sets[i] = {ranks[Pick(ranks.size())]};
    }
    return sets;
  }

  // ---- partition of F into source pieces
  void Emit(Shape shape, Index offset, Shape strides, std::vector<Rank> locations, double scale) {
    sources_.push_back(
        {std::move(shape), {offset, std::move(strides)}, std::move(locations), scale});
  }

  Index OffsetOf(const Shape& lo) const {
    Index offset = 0;
    for (size_t k = 0; k < lo.size(); ++k) offset += lo[k] * strides_[k];
    return offset;
  }

  void EmitBox(const Box& box, std::vector<Rank> locations, double scale) {
    Emit(box.extent, OffsetOf(box.lo), strides_, std::move(locations), scale);
  }

  std::vector<size_t> DimsWithExtentAtLeast(const Box& box, Index n) const {
    std::vector<size_t> dims;
    for (size_t k = 0; k < box.extent.size(); ++k) {
      if (box.extent[k] >= n) dims.push_back(k);
    }
    return dims;
  }

  void Layout(const Box& box, int depth) {
    switch (Uniform(0, 4)) {
      case 0:
        if (depth < 2 && Segment(box, depth)) return;
        break;
      case 1:
        if (options_.replication && world_ > 1) {
          Replicate(box);
          return;
        }
        break;
      case 2:
        if (Interleave(box)) return;
        break;
      default:
        break;
    }
    Split(box);
  }

  // Cuts one dimension into 2-4 segments, each laid out its own way (e.g. a fused QKV
  // weight: query rows split, key/value rows replicated).
  bool Segment(const Box& box, int depth) {
    const std::vector<size_t> dims = DimsWithExtentAtLeast(box, 2);
    if (dims.empty()) return false;
    const size_t d = dims[Pick(dims.size())];
    std::vector<Index> cuts = {0, box.extent[d]};
    const Index n = Uniform(1, std::min<Index>(3, box.extent[d] - 1));
    for (Index i = 0; i < n; ++i) cuts.push_back(Uniform(1, box.extent[d] - 1));
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      Box sub = box;
      sub.lo[d] += cuts[i];
      sub.extent[d] = cuts[i + 1] - cuts[i];
      Layout(sub, depth + 1);
    }
    return true;
  }

  // One dimension cut into uneven (possibly empty) chunks, one per holder set.
  void Split(const Box& box) {
    const size_t d = Pick(box.extent.size());
    const auto chunks = static_cast<size_t>(Uniform(1, world_ + 1));
    const std::vector<std::vector<Rank>> sets = HolderSets(chunks);
    std::vector<Index> cuts = {0, box.extent[d]};
    for (size_t i = 0; i + 1 < chunks; ++i) cuts.push_back(Uniform(0, box.extent[d]));
    std::sort(cuts.begin(), cuts.end());
    const double scale = RandomScale(sets[0].size());
    for (size_t i = 0; i < chunks; ++i) {
      Box sub = box;
      sub.lo[d] += cuts[i];
      sub.extent[d] = cuts[i + 1] - cuts[i];
      // Empty chunks are dropped, except now and then, as zero-element pieces.
      if (sub.extent[d] == 0 && !Chance(0.05)) continue;
      EmitBox(sub, sets[i], scale);
    }
  }

  // The whole box on several ranks (a bias, a multi-query key/value block).
  void Replicate(const Box& box) {
    std::vector<Rank> holders = AllRanks();
    Shuffle(holders);
    if (Chance(0.5)) holders.resize(static_cast<size_t>(Uniform(1, world_)));
    const double scale = RandomScale(holders.size());
    EmitBox(box, std::move(holders), scale);
  }

  // A dimension of extent B*R*b viewed as (B, R, b): slot j of R takes every R-th block of
  // b (CodeGen's fused QKV at b = head block, R = TP degree).
  bool Interleave(const Box& box) {
    std::vector<std::pair<size_t, Index>> options;  // (dim, R)
    for (size_t k = 0; k < box.extent.size(); ++k) {
      for (Index r = 2; r <= std::min<Index>(world_, box.extent[k]); ++r) {
        if (box.extent[k] % r == 0) options.push_back({k, r});
      }
    }
    if (options.empty()) return false;
    const auto [d, slots] = options[Pick(options.size())];
    const Index rest = box.extent[d] / slots;
    std::vector<Index> divisors;
    for (Index b = 1; b <= rest; ++b) {
      if (rest % b == 0) divisors.push_back(b);
    }
    const Index block = divisors[Pick(divisors.size())];
    const Index blocks = rest / block;
    const std::vector<std::vector<Rank>> sets = HolderSets(static_cast<size_t>(slots));
    const double scale = RandomScale(sets[0].size());
    for (Index j = 0; j < slots; ++j) {
      Shape shape;
      Shape strides;
      for (size_t k = 0; k < box.extent.size(); ++k) {
        if (k == d) {
          shape.insert(shape.end(), {blocks, block});
          strides.insert(strides.end(), {slots * block * strides_[k], strides_[k]});
        } else {
          shape.push_back(box.extent[k]);
          strides.push_back(strides_[k]);
        }
      }
      Emit(std::move(shape), OffsetOf(box.lo) + j * block * strides_[d], std::move(strides),
           sets[static_cast<size_t>(j)], scale);
    }
    return true;
  }

  bool IsPadding(Index offset) const {
    const Shape index = UnravelIndex(offset, logical_);
    for (size_t k = 0; k < index.size(); ++k) {
      if (index[k] >= valid_[k]) return true;
    }
    return false;
  }

  // Padding is not data: a piece that holds only padding may be left out of the map.
  void DropSomeUnheldPadding() {
    if (valid_ == logical_) return;
    std::vector<SourcePiece> kept;
    for (SourcePiece& p : sources_) {
      bool all_padding = ProductOf(p.shape) > 0;
      Piece probe{p.shape, p.source, p.source, {}, 1.0};
      ForEachPieceElement(probe, [&](Index, Index src) { all_padding &= IsPadding(src); });
      if (all_padding && Chance(0.6)) continue;
      kept.push_back(std::move(p));
    }
    sources_ = std::move(kept);
  }

  // ---- shards
  // Representation changes that keep the element set: split in two, permute dimensions,
  // reshape a dimension into two, add a unit dimension with an arbitrary stride.
  void Vary(Piece piece, std::vector<Piece>& out) {
    const size_t nd = piece.shape.size();
    std::vector<size_t> splittable;
    for (size_t k = 0; k < nd; ++k) {
      if (piece.shape[k] >= 2) splittable.push_back(k);
    }
    if (!splittable.empty() && Chance(0.1)) {
      const size_t k = splittable[Pick(splittable.size())];
      const Index cut = Uniform(1, piece.shape[k] - 1);
      Piece second = piece;
      piece.shape[k] = cut;
      second.shape[k] -= cut;
      second.source.offset += cut * piece.source.strides[k];
      Vary(std::move(piece), out);
      Vary(std::move(second), out);
      return;
    }
    if (nd >= 2 && Chance(0.2)) {
      std::vector<size_t> perm(nd);
      std::iota(perm.begin(), perm.end(), 0);
      Shuffle(perm);
      Piece permuted = piece;
      for (size_t k = 0; k < nd; ++k) {
        permuted.shape[k] = piece.shape[perm[k]];
        permuted.source.strides[k] = piece.source.strides[perm[k]];
      }
      piece = std::move(permuted);
    }
    if (Chance(0.1)) {
      for (size_t k = 0; k < nd; ++k) {
        const Index n = piece.shape[k];
        Index a = 0;
        for (Index f = 2; f < n; ++f) {
          if (n % f == 0) a = f;
        }
        if (a == 0) continue;
        const Index s = piece.source.strides[k];
        piece.shape[k] = n / a;
        piece.shape.insert(piece.shape.begin() + static_cast<std::ptrdiff_t>(k) + 1, a);
        piece.source.strides[k] = a * s;
        piece.source.strides.insert(
            piece.source.strides.begin() + static_cast<std::ptrdiff_t>(k) + 1, s);
        break;
      }
    }
    if (Chance(0.05)) {
      const size_t at = Pick(piece.shape.size() + 1);
      const Index stride = std::vector<Index>{0, 1, 7, 1000}[Pick(4)];
      piece.shape.insert(piece.shape.begin() + static_cast<std::ptrdiff_t>(at), 1);
      piece.source.strides.insert(piece.source.strides.begin() + static_cast<std::ptrdiff_t>(at),
                                  stride);
    }
    out.push_back(std::move(piece));
  }

  // Dense dest strides for `shape` with its dimensions laid out in `order` (outermost first),
  // each multiplied by `spread` (element interleave of `spread` pieces).
  static Shape DestStrides(const Shape& shape, const std::vector<size_t>& order, Index spread) {
    Shape strides(shape.size(), 0);
    Index s = spread;
    for (size_t i = order.size(); i > 0; --i) {
      strides[order[i - 1]] = s;
      s *= std::max<Index>(shape[order[i - 1]], 1);
    }
    return strides;
  }

  std::vector<size_t> DestOrder(size_t nd) {
    std::vector<size_t> order(nd);
    std::iota(order.begin(), order.end(), 0);
    if (nd >= 2 && Chance(0.3)) Shuffle(order);  // a transposed copy
    return order;
  }

  Shape RandomShardShape(Index total) {
    if (total == 0) {
      switch (Uniform(0, 2)) {
        case 0:
          return {0};
        case 1:
          return {0, Uniform(1, 4)};
        default:
          return {Uniform(1, 4), 0};
      }
    }
    Shape shape;
    Index rest = total;
    const Index dims = Uniform(1, 3);
    for (Index i = 1; i < dims; ++i) {
      std::vector<Index> divisors;
      for (Index f = 1; f <= rest; ++f) {
        if (rest % f == 0) divisors.push_back(f);
      }
      const Index f = divisors[Pick(divisors.size())];
      shape.push_back(f);
      rest /= f;
    }
    shape.push_back(rest);
    return shape;
  }

  void PlaceShard(ParamMapBuilder& builder, Rank r) {
    std::vector<Piece> pieces;
    for (const SourcePiece& s : sources_) {
      if (std::find(s.locations.begin(), s.locations.end(), r) == s.locations.end()) continue;
      std::vector<Rank> locations = s.locations;
      Shuffle(locations);  // Finalize sorts them
      Vary(Piece{s.shape, s.source, {}, std::move(locations), s.scale}, pieces);
    }
    Shuffle(pieces);  // placement order in the shard
    Index base = 0;
    bool plain = pieces.size() == 1;
    for (size_t i = 0; i < pieces.size(); ++i) {
      Piece& p = pieces[i];
      const Index n = p.num_elements();
      if (i + 1 < pieces.size() && pieces[i + 1].shape == p.shape && n > 0 && Chance(0.3)) {
        // Two pieces of one shape interleaved element by element in 2n elements.
        const std::vector<size_t> order = DestOrder(p.shape.size());
        p.dest = {base, DestStrides(p.shape, order, 2)};
        pieces[i + 1].dest = {base + 1, DestStrides(p.shape, order, 2)};
        base += 2 * n;
        ++i;
        continue;
      }
      const std::vector<size_t> order = DestOrder(p.shape.size());
      plain = plain && std::is_sorted(order.begin(), order.end());
      p.dest = {base, DestStrides(p.shape, order, 1)};
      base += n;
    }
    Shape shard_shape = plain && Chance(0.7) ? pieces[0].shape : RandomShardShape(base);
    Shuffle(pieces);  // listing order
    builder.set_shard_shape(r, std::move(shard_shape));
    for (Piece& p : pieces) builder.add_piece(r, std::move(p));
  }

  std::mt19937_64& rng_;
  const RandomMapOptions& options_;
  int world_ = 1;
  Shape logical_;
  Shape strides_;
  Shape valid_;
  std::vector<SourcePiece> sources_;
};

template <typename T, typename Value>
std::vector<std::vector<T>> Expand(const ParamMap& map, T unwritten, Value value) {
  std::vector<std::vector<T>> out;
  for (Rank r = 0; r < map.world_size(); ++r) {
    std::vector<T> shard(static_cast<size_t>(map.shard_num_elements(r)), unwritten);
    for (const Piece& p : map.rank(r).pieces) {
      ForEachPieceElement(p, [&](Index dst, Index src) {
        if (dst >= 0 && static_cast<size_t>(dst) < shard.size()) {
          shard[static_cast<size_t>(dst)] = value(p, src);
        }
      });
    }
    out.push_back(std::move(shard));
  }
  return out;
}

}  // namespace

ParamMapBuilder RandomParamMapBuilder(std::mt19937_64& rng, const RandomMapOptions& options) {
  return Generator(rng, options).Build();
}

ParamMap RandomParamMap(std::mt19937_64& rng, const RandomMapOptions& options) {
  Result<ParamMap> map = RandomParamMapBuilder(rng, options).Finalize();
  if (!map.ok()) {
    // A generator bug, not a property of the seed: stop loudly with the reason.
    std::fprintf(stderr, "RandomParamMap built an invalid map: %s\n",
                 map.status().ToString().c_str());
    std::abort();
  }
  return std::move(map).value();
}

std::vector<uint64_t> PropertyTestSeeds(size_t count) {
  const char* env = std::getenv("RESHARD_SEED");
  const std::string mode = env == nullptr ? "" : env;
  uint64_t base = kPropertyTestBaseSeed;
  if (mode == "random") {
    std::random_device device;
    base = (uint64_t{device()} << 32) ^ device();
    if (const char* scale = std::getenv("RESHARD_PROPERTY_SCALE"); scale != nullptr) {
      count *= std::max<size_t>(1, std::strtoull(scale, nullptr, 10));
    }
  } else if (!mode.empty()) {
    return {std::strtoull(mode.c_str(), nullptr, 10)};
  }
  std::vector<uint64_t> seeds(count);
  for (size_t i = 0; i < count; ++i) seeds[i] = base + i;
  return seeds;
}

std::vector<std::vector<Index>> ExpandSourceOffsets(const ParamMap& map) {
  return Expand<Index>(map, -1, [](const Piece&, Index src) { return src; });
}

std::vector<std::vector<double>> ExpandScales(const ParamMap& map) {
  return Expand<double>(map, 0.0, [](const Piece& p, Index) { return p.scale; });
}

}  // namespace reshard
