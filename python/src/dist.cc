// reshard._core: the schedule behind reshard.distributed (DESIGN 14).
//
// An Exchange composes every parameter's maps once, with a replica policy that knows which
// process holds which map rank, and turns the plans into a schedule between processes:
//
//   - moves whose source and target shards live in the same process are local copies;
//   - every other move joins the byte stream of its (source process, target process) pair, in
//     parameter order, then plan order. A stream is cut into chunks of at most `chunk_bytes`
//     (a move that straddles a cut is split into the boxes of its row-major index range), and
//     round k of the exchange carries chunk k of every stream;
//   - each element sits in a chunk at an offset aligned to its size, so a chunk is one flat
//     byte buffer that the strided-copy engine packs from the source shards (applying the
//     move's factor) and unpacks into the target shards.
//
// Every pack, unpack and local copy is a small transfer plan precomputed here and run through
// ExecutePlan, so bounds checks, scale powers and the exactness of scales are those of
// reshard.transfer. Processes are named by any int (Python passes global ranks).
//
// A scale that loses values is found in the data, by the process that holds it. So that every
// process learns of it before any byte moves (rather than the senders failing while packing
// and the receivers waiting), CheckSources runs each of a process's moves whose factor is not
// 1 into scratch memory first, during the agreement: the same plans, options and checks as the
// copies themselves, on the few elements that carry a scale.
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core.h"
#include "reshard/base/dtype.h"
#include "reshard/exec/delta.h"
#include "reshard/exec/executor.h"
#include "reshard/exec/fingerprint.h"

namespace reshard::python {
namespace {

// A move (or part of one) placed in a chunk.
struct Segment {
  size_t param = 0;
  size_t move = 0;
  Index lo = 0, hi = 0;   // the range of the move's row-major index space it carries
  Index byte_offset = 0;  // where it starts in the chunk
};

// Calls `emit(start, shape)` for boxes that tile the row-major index range [lo, hi) of `shape`
// in order; each box is contiguous in that order. At most 2 * rank boxes.
template <typename Emit>
void RangeBoxes(const Shape& shape, size_t d, Shape& start, Index lo, Index hi, Emit& emit) {
  if (lo >= hi) return;
  if (shape.empty()) {  // a move of one element (compose gives it no dimensions): one box
    emit(start, shape);
    return;
  }
  Index inner = 1;
  for (size_t k = d + 1; k < shape.size(); ++k) inner *= shape[k];
  auto box = [&](Index first, Index count) {
    Shape s(shape.size(), 1), at = start;
    at[d] = first;
    s[d] = count;
    for (size_t k = d + 1; k < shape.size(); ++k) s[k] = shape[k], at[k] = 0;
    emit(at, s);
  };
  if (lo % inner != 0) {  // the partial row lo lies in
    const Index row = lo / inner;
    const Index end = std::min(hi, (row + 1) * inner);
    start[d] = row;
    RangeBoxes(shape, d + 1, start, lo - row * inner, end - row * inner, emit);
    lo = end;
    if (lo >= hi) return;
  }
  if (hi / inner > lo / inner) box(lo / inner, hi / inner - lo / inner);
  if (hi % inner != 0) {
    const Index row = hi / inner;
    start[d] = row;
    RangeBoxes(shape, d + 1, start, 0, hi - row * inner, emit);
  }
}

Shape RowMajor(const Shape& shape) {
  Shape strides(shape.size(), 1);
  for (size_t k = shape.size(); k-- > 1;)
    strides[k - 1] = strides[k] * std::max<Index>(shape[k], 1);
  return strides;
}

Index Dot(const Shape& index, const Shape& strides) {
  Index at = 0;
  for (size_t k = 0; k < index.size(); ++k) at += index[k] * strides[k];
  return at;
}

// One precomputed step: a plan of one parameter between one source buffer and one target
// buffer (either may be a chunk).
struct Step {
  size_t param = 0;
  ParamPlan plan;
};

// One message of a chunk as it travels when the shards themselves can be sent from and
// received into: `bytes` read from the source shard of `src_param` at `src_byte` when that
// side is one contiguous run there (src_param >= 0), else from the sender's staging at
// `src_byte`; and written likewise into the target shard of `dst_param` or the receiver's
// staging at `dst_byte`.
struct Message {
  long src_param = -1, dst_param = -1;
  Index src_byte = 0, dst_byte = 0, bytes = 0;
};

// Whether a box of `shape` at `strides` is one contiguous run of elements in row-major order.
bool Contiguous(const Shape& shape, const Shape& strides) {
  Index expected = 1;
  for (size_t k = shape.size(); k-- > 0;) {
    if (shape[k] == 1) continue;
    if (strides[k] != expected) return false;
    expected *= shape[k];
  }
  return true;
}

struct Chunk {
  Index bytes = 0;
  std::vector<Segment> segments;
  std::vector<Step> pack, unpack;  // every box, at its place in the chunk
  // The chunk as it travels over a transport that sends from and receives into the shards:
  // one message per box (adjacent ones merged). A side where the box is one contiguous run
  // (and, on the sending side, unscaled) uses the shard as it lies; the other side packs it
  // into (or unpacks it from) its staging: `send_rest` bytes of it, `recv_rest` bytes.
  std::vector<Message> messages;
  std::vector<Step> pack_rest, unpack_rest;
  Index send_rest = 0, recv_rest = 0;
};

// The replica policy between processes: a holder in the target's own process when there is
// one (a local copy); otherwise the holder whose process has been given the fewest bytes to
// send so far over the whole model, ties to one whose read continues a planned move, then to
// the lowest rank.
class ProcessPolicy {
 public:
  ProcessPolicy(const std::vector<int>& src_proc, const std::vector<int>& dst_proc,
                std::map<int, Index>& send_load, std::map<int, Index>& lower_bound)
      : src_proc_(src_proc),
        dst_proc_(dst_proc),
        send_load_(send_load),
        lower_bound_(lower_bound) {}

  void set_itemsize(Index itemsize) { itemsize_ = itemsize; }

  Rank operator()(const ReplicaChoice& c) {
    const int here = dst_proc_[static_cast<size_t>(c.dst_rank)];
    for (Rank h : c.holders) {
      if (src_proc_[static_cast<size_t>(h)] == here) return h;
    }
    const Index bytes = c.elements * itemsize_;
    lower_bound_[here] += bytes;
    auto load = [&](Rank h) { return send_load_[src_proc_[static_cast<size_t>(h)]]; };
    Rank best = c.holders.front();
    for (Rank h : c.holders) {
      const bool continues = std::binary_search(c.continuing.begin(), c.continuing.end(), h);
      const bool best_continues =
          std::binary_search(c.continuing.begin(), c.continuing.end(), best);
      if (load(h) < load(best) || (load(h) == load(best) && continues && !best_continues)) best = h;
    }
    send_load_[src_proc_[static_cast<size_t>(best)]] += bytes;
    return best;
  }

 private:
  const std::vector<int>& src_proc_;
  const std::vector<int>& dst_proc_;
  std::map<int, Index>& send_load_;
  std::map<int, Index>& lower_bound_;
  Index itemsize_ = 1;
};

class Exchange {
 public:
  using Pair = std::pair<int, int>;  // (source process, target process)

  Exchange(std::vector<MapHandle*> targets, std::vector<MapHandle*> sources,
           std::vector<std::string> names, std::vector<std::string> dtypes,
           std::vector<int> src_proc, std::vector<int> dst_proc, Index chunk_bytes)
      : names_(std::move(names)), src_proc_(std::move(src_proc)), dst_proc_(std::move(dst_proc)) {
    if (chunk_bytes < 8) throw py::value_error("chunk_bytes must be at least 8");
    for (const std::string& d : dtypes) dtypes_.push_back(LoadDType(d));
    std::vector<const ParamMap*> t, s;
    for (size_t i = 0; i < names_.size(); ++i) {
      t.push_back(&targets[i]->Valid());
      s.push_back(&sources[i]->Valid());
    }
    Status status;
    {
      py::gil_scoped_release release;
      status = Plan(t, s, chunk_bytes);
    }
    if (!status.ok()) Raise(status, ErrorKind::kMap);
  }

  // The exchange of plans composed elsewhere (a sync schedule's steps, one plan per name): the
  // plans decide which holder sends each replicated piece. A process's lower bound is what it
  // receives from other processes.
  Exchange(const PlanSet& plans, std::vector<std::string> names, std::vector<std::string> dtypes,
           std::vector<int> src_proc, std::vector<int> dst_proc, Index chunk_bytes)
      : names_(std::move(names)), src_proc_(std::move(src_proc)), dst_proc_(std::move(dst_proc)) {
    if (chunk_bytes < 8) throw py::value_error("chunk_bytes must be at least 8");
    if (plans.plans.size() != names_.size() || dtypes.size() != names_.size())
      throw py::value_error("one plan and one dtype per name");
    for (const std::string& d : dtypes) dtypes_.push_back(LoadDType(d));
    for (size_t i = 0; i < names_.size(); ++i) {
      const ParamPlan& p = plans.plans[i];
      if (p.source_world != static_cast<int>(src_proc_.size()) ||
          p.target_world != static_cast<int>(dst_proc_.size())) {
        throw py::value_error("\"" + names_[i] +
                              "\": the plan's worlds are not the processes named");
      }
      for (const Move& m : p.moves) {
        const int to = dst_proc_[static_cast<size_t>(m.dst_rank)];
        if (src_proc_[static_cast<size_t>(m.src_rank)] != to) {
          lower_bound_[to] += m.num_elements() * static_cast<Index>(DTypeSize(dtypes_[i]));
        }
      }
    }
    plans_ = plans.plans;
    Status status;
    {
      py::gil_scoped_release release;
      status = Schedule(plans_, chunk_bytes);
    }
    if (!status.ok()) Raise(status, ErrorKind::kMap);
  }

  size_t num_rounds() const { return rounds_; }

  // [(round, peer, bytes)] this process sends (or receives), in round order, then peer order.
  std::vector<std::tuple<size_t, int, Index>> Transfers(int proc, bool sending) const {
    std::vector<std::tuple<size_t, int, Index>> out;
    for (const auto& [pair, chunks] : streams_) {
      if ((sending ? pair.first : pair.second) != proc) continue;
      for (size_t k = 0; k < chunks.size(); ++k) {
        out.emplace_back(k, sending ? pair.second : pair.first, chunks[k].bytes);
      }
    }
    std::sort(out.begin(), out.end());
    return out;
  }

  // {"sent", "received", "local", "lower_bound", "segments_sent"} for one process, in bytes.
  py::dict Stats(int proc) const {
    Index sent = 0, received = 0, segments = 0;
    for (const auto& [pair, chunks] : streams_) {
      for (const Chunk& c : chunks) {
        if (pair.first == proc) sent += c.bytes, segments += static_cast<Index>(c.segments.size());
        if (pair.second == proc) received += c.bytes;
      }
    }
    py::dict d;
    d["sent"] = sent;
    d["received"] = received;
    d["local"] = Lookup(local_bytes_, proc);
    d["lower_bound"] = Lookup(lower_bound_, proc);
    d["segments_sent"] = segments;
    return d;
  }

  // The chunk of `round` from process `src` to `dst` as it travels when the shards themselves
  // can be sent from and received into: (staging bytes of the sender, of the receiver,
  // [(source parameter or -1 for staging, its byte offset, target parameter or -1, its byte
  // offset, bytes)] per message, in order).
  std::tuple<Index, Index, std::vector<std::tuple<long, Index, long, Index, Index>>> Messages(
      int src, int dst, size_t round) const {
    const Chunk& c = ChunkOf(src, dst, round, std::numeric_limits<Index>::max());
    std::vector<std::tuple<long, Index, long, Index, Index>> out;
    for (const Message& m : c.messages) {
      out.emplace_back(m.src_param, m.src_byte, m.dst_param, m.dst_byte, m.bytes);
    }
    return {c.send_rest, c.recv_rest, std::move(out)};
  }

  // With `rest`, only the boxes that use staging on this side of a message, at their places.
  void Pack(int proc, int peer, size_t round, uintptr_t buffer, Index buffer_bytes,
            const std::vector<std::pair<uintptr_t, Index>>& sources, const ExecOptions& options,
            bool rest) {
    const Chunk& c =
        ChunkOf(proc, peer, round, buffer_bytes, rest ? Staged::kSend : Staged::kWhole);
    Run(rest ? c.pack_rest : c.pack, sources, buffer, buffer_bytes, true, options,
        "packing for process " + std::to_string(peer));
  }

  void Unpack(int proc, int peer, size_t round, uintptr_t buffer, Index buffer_bytes,
              const std::vector<std::pair<uintptr_t, Index>>& targets, const ExecOptions& options,
              bool rest) {
    const Chunk& c =
        ChunkOf(peer, proc, round, buffer_bytes, rest ? Staged::kReceive : Staged::kWhole);
    Run(rest ? c.unpack_rest : c.unpack, targets, buffer, buffer_bytes, false, options,
        "unpacking from process " + std::to_string(peer));
  }

  // Runs this process's scaled moves (factor != 1, remote and local) from its source shards
  // into scratch memory, with the options of the real copies: raises what packing or copying
  // would (a lossy scale, a scaled optimizer state), before anything is sent or written.
  void CheckSources(int proc, const std::vector<std::pair<uintptr_t, Index>>& sources,
                    const ExecOptions& options) {
    auto it = checks_.find(proc);
    if (it == checks_.end()) return;
    Status status;
    {
      py::gil_scoped_release release;
      std::vector<uint64_t> scratch;  // 8-byte aligned for every dtype
      for (const Step& step : it->second) {
        Index elements = 0;
        for (const Move& m : step.plan.moves) elements += m.num_elements();
        const Index bytes = elements * static_cast<Index>(DTypeSize(dtypes_[step.param]));
        scratch.resize(static_cast<size_t>((bytes + 7) / 8));
        const auto& [sa, sn] = sources.at(step.param);
        const ConstBuffer in[] = {{reinterpret_cast<const std::byte*>(sa), sn}};
        const MutableBuffer out[] = {{reinterpret_cast<std::byte*>(scratch.data()), elements}};
        status = ExecutePlan(step.plan, dtypes_[step.param], in, out, options)
                     .Annotate("\"" + names_[step.param] + "\": checking its scales before moving");
        if (!status.ok()) break;
      }
    }
    if (!status.ok()) Raise(status, ErrorKind::kData);
  }

  // Every copy a process makes, as boxes for a copier outside this executor (torch's strided
  // copies on a GPU): (parameter, shape, source offset, source strides, target offset, target
  // strides, factor), offsets and strides in elements. `kind` "local": the moves inside the
  // process; "padding": the blocks of its targets that no move writes (the source fields
  // empty); "pack" / "unpack": the staged rest of the chunk of `round` between it and `peer`
  // (the staging side at its element offset, strides row-major).
  using Box = std::tuple<size_t, Shape, Index, Shape, Index, Shape, double>;
  std::vector<Box> Boxes(int proc, const std::string& kind, int peer, size_t round) const {
    std::vector<Box> out;
    auto add = [&out](const std::vector<Step>& steps) {
      for (const Step& step : steps) {
        for (const Move& m : step.plan.moves) {
          out.emplace_back(step.param, m.shape, m.src.offset, m.src.strides, m.dst.offset,
                           m.dst.strides, m.factor);
        }
      }
    };
    if (kind == "local" || kind == "padding") {
      auto it = local_.find(proc);
      if (it == local_.end()) return out;
      if (kind == "local") {
        add(it->second);
        return out;
      }
      for (const Step& step : it->second) {
        for (const UnwrittenBlock& u : step.plan.unwritten) {
          out.emplace_back(step.param, u.shape, 0, Shape{}, u.dst.offset, u.dst.strides, 1.0);
        }
      }
      return out;
    }
    if (kind == "pack") {
      add(ChunkOf(proc, peer, round, std::numeric_limits<Index>::max()).pack_rest);
    } else if (kind == "unpack") {
      add(ChunkOf(peer, proc, round, std::numeric_limits<Index>::max()).unpack_rest);
    } else {
      throw py::value_error("kind must be local, padding, pack or unpack, not \"" + kind + "\"");
    }
    return out;
  }

  // The moves inside this process, and zeros in its target padding.
  void CopyLocal(int proc, const std::vector<std::pair<uintptr_t, Index>>& sources,
                 const std::vector<std::pair<uintptr_t, Index>>& targets,
                 const ExecOptions& options) {
    auto it = local_.find(proc);
    if (it == local_.end()) return;
    Status status;
    {
      py::gil_scoped_release release;
      for (const Step& step : it->second) {
        const auto& [sa, sn] = sources.at(step.param);
        const auto& [ta, tn] = targets.at(step.param);
        const ConstBuffer in[] = {{reinterpret_cast<const std::byte*>(sa), sn}};
        const MutableBuffer out[] = {{reinterpret_cast<std::byte*>(ta), tn}};
        status = ExecutePlan(step.plan, dtypes_[step.param], in, out, options)
                     .Annotate("\"" + names_[step.param] + "\": copying inside the process");
        if (!status.ok()) break;
      }
    }
    if (!status.ok()) Raise(status, ErrorKind::kData);
  }

  // One fingerprint request: (parameter, target process, lo, hi, buckets): positions [lo, hi)
  // of the target's shard in `buckets` buckets (exec/fingerprint.h).
  using Request = std::tuple<size_t, int, Index, Index, Index>;
  using Sums = std::tuple<size_t, int, std::vector<uint64_t>>;

  // The fingerprints of what process `proc` holds of each (parameter, target process), keyed by
  // the elements' flat indices in the target's shard (or buffer): on the source side
  // (`source`), over every move it sends or copies there, the values of its source `shards`
  // after the move's factor (replicas are counted once: each element comes from the one holder
  // the plan reads); on the target side, over every move into it, the values its target
  // `shards` hold (padding, which no move writes, is left out). Parts that the source
  // processes compute add up to the target's. `requests` empty: every pair this side of `proc`
  // touches, whole, in one bucket.
  std::vector<Sums> Fingerprints(int proc, bool source,
                                 const std::vector<std::pair<uintptr_t, Index>>& shards,
                                 uint64_t key, std::vector<Request> requests,
                                 const ExecOptions& options) const {
    if (shards.size() != plans_.size()) {
      throw py::value_error(std::to_string(shards.size()) + " shards for " +
                            std::to_string(plans_.size()) + " parameters");
    }
    if (requests.empty()) {
      std::set<std::pair<size_t, int>> pairs;
      for (size_t i = 0; i < plans_.size(); ++i) {
        for (const Move& m : plans_[i].moves) {
          if (m.num_elements() > 0 && Holds(proc, source, m)) pairs.insert({i, ProcOf(m, false)});
        }
      }
      for (const auto& [i, target] : pairs) requests.emplace_back(i, target, 0, kMaxIndex, 1);
    }
    for (const auto& [param, target, lo, hi, count] : requests) {
      if (param >= plans_.size()) throw py::index_error("no parameter " + std::to_string(param));
      if (count < 1 || count > (Index{1} << 20)) throw py::value_error("1 to 2^20 buckets");
    }
    std::vector<Sums> out;
    Status status;
    {
      py::gil_scoped_release release;
      for (const auto& [param, target, lo, hi, count] : requests) {
        std::vector<uint64_t> sums(static_cast<size_t>(count), 0);
        status = FingerprintOf(proc, source, shards[param], key, param, target, {lo, hi, count},
                               options, sums)
                     .Annotate("\"" + names_[param] + "\": fingerprinting what process " +
                               std::to_string(target) + " holds");
        if (!status.ok()) break;
        out.emplace_back(param, target, std::move(sums));
      }
    }
    if (!status.ok()) Raise(status, ErrorKind::kData);
    return out;
  }

 private:
  int ProcOf(const Move& m, bool source) const {
    return source ? src_proc_[static_cast<size_t>(m.src_rank)]
                  : dst_proc_[static_cast<size_t>(m.dst_rank)];
  }

  bool Holds(int proc, bool source, const Move& m) const { return ProcOf(m, source) == proc; }

  // One (parameter, target process) pair's fingerprint on one side (see Fingerprints).
  Status FingerprintOf(int proc, bool source, std::pair<uintptr_t, Index> shard, uint64_t key,
                       size_t param, int target, const FingerprintBuckets& buckets,
                       const ExecOptions& options, std::span<uint64_t> sums) const {
    const DType dtype = dtypes_[param];
    const Index item = static_cast<Index>(DTypeSize(dtype));
    const auto* base = reinterpret_cast<const std::byte*>(shard.first);
    std::vector<FingerprintView> views;
    std::vector<std::vector<uint64_t>> scaled;  // a scaled move's values, row-major
    for (const Move& m : plans_[param].moves) {
      if (m.num_elements() == 0 || !Holds(proc, source, m) || ProcOf(m, false) != target) continue;
      const StridedView& read = source ? m.src : m.dst;
      const std::optional<Index> last = LastOffset(read.offset, m.shape, read.strides);
      if (read.offset < 0 || !last || *last >= shard.second ||
          std::any_of(read.strides.begin(), read.strides.end(), [](Index s) { return s < 0; })) {
        return OutOfRangeError("a move reaches past the end of a shard of " +
                               std::to_string(shard.second) + " elements");
      }
      if (!source || m.factor == 1.0) {
        views.push_back(
            {m.shape, base + read.offset * item, read.strides, m.dst.offset, m.dst.strides});
        continue;
      }
      ParamPlan one;  // the target's values: the source's through the move's factor
      one.source_world = one.target_world = 1;
      one.moves.push_back({0, 0, m.shape, m.src, StridedView{0, RowMajor(m.shape)}, m.factor});
      std::vector<uint64_t>& values =
          scaled.emplace_back(static_cast<size_t>((m.num_elements() * item + 7) / 8));
      const ConstBuffer in[] = {{base, shard.second}};
      const MutableBuffer into[] = {
          {reinterpret_cast<std::byte*>(values.data()), m.num_elements()}};
      RESHARD_RETURN_IF_ERROR(ExecutePlan(one, dtype, in, into, options));
      views.push_back({m.shape, reinterpret_cast<const std::byte*>(values.data()),
                       RowMajor(m.shape), m.dst.offset, m.dst.strides});
    }
    return AddFingerprints(dtype, views, key, buckets, sums, options.num_threads);
  }

  static Index Lookup(const std::map<int, Index>& m, int key) {
    auto it = m.find(key);
    return it == m.end() ? 0 : it->second;
  }

  static DType LoadDType(const std::string& name) {
    std::optional<DType> dtype = DTypeFromName(name);
    if (!dtype) throw py::value_error("unknown dtype \"" + name + "\"");
    return *dtype;
  }

  // Which staging a buffer holds: the whole chunk, or a message form's sending or receiving rest.
  enum class Staged { kWhole, kSend, kReceive };

  const Chunk& ChunkOf(int src, int dst, size_t round, Index buffer_bytes,
                       Staged staged = Staged::kWhole) const {
    auto it = streams_.find({src, dst});
    if (it == streams_.end() || round >= it->second.size()) {
      throw py::index_error("no chunk from process " + std::to_string(src) + " to process " +
                            std::to_string(dst) + " in round " + std::to_string(round));
    }
    const Chunk& c = it->second[round];
    const Index needed = staged == Staged::kSend      ? c.send_rest
                         : staged == Staged::kReceive ? c.recv_rest
                                                      : c.bytes;
    if (buffer_bytes < needed) {
      throw py::value_error("chunk buffer has " + std::to_string(buffer_bytes) + " bytes, needs " +
                            std::to_string(needed));
    }
    return c;
  }

  // Runs steps between the shards and one chunk (`to_chunk`: shards -> chunk).
  void Run(const std::vector<Step>& steps, const std::vector<std::pair<uintptr_t, Index>>& shards,
           uintptr_t buffer, Index buffer_bytes, bool to_chunk, const ExecOptions& options,
           const std::string& what) {
    Status status;
    {
      py::gil_scoped_release release;
      for (const Step& step : steps) {
        const Index item = static_cast<Index>(DTypeSize(dtypes_[step.param]));
        const auto& [addr, n] = shards.at(step.param);
        std::byte* chunk = reinterpret_cast<std::byte*>(buffer);
        std::byte* shard = reinterpret_cast<std::byte*>(addr);
        const ConstBuffer in[] = {to_chunk ? ConstBuffer{shard, n}
                                           : ConstBuffer{chunk, buffer_bytes / item}};
        const MutableBuffer out[] = {to_chunk ? MutableBuffer{chunk, buffer_bytes / item}
                                              : MutableBuffer{shard, n}};
        status = ExecutePlan(step.plan, dtypes_[step.param], in, out, options)
                     .Annotate("\"" + names_[step.param] + "\": " + what);
        if (!status.ok()) break;
      }
    }
    if (!status.ok()) Raise(status, ErrorKind::kData);
  }

  Status Plan(const std::vector<const ParamMap*>& targets,
              const std::vector<const ParamMap*>& sources, Index chunk_bytes) {
    std::map<int, Index> send_load;
    ProcessPolicy policy(src_proc_, dst_proc_, send_load, lower_bound_);
    ComposeOptions options;
    options.policy = [&policy](const ReplicaChoice& c) { return policy(c); };
    std::vector<ParamPlan> plans;
    for (size_t i = 0; i < names_.size(); ++i) {
      if (targets[i]->world_size() != static_cast<int>(dst_proc_.size()) ||
          sources[i]->world_size() != static_cast<int>(src_proc_.size())) {
        return FailedPreconditionError(
            "\"" + names_[i] + "\": the maps have " + std::to_string(sources[i]->world_size()) +
            " source and " + std::to_string(targets[i]->world_size()) + " target ranks, but " +
            std::to_string(src_proc_.size()) + " source and " + std::to_string(dst_proc_.size()) +
            " target processes were named");
      }
      policy.set_itemsize(static_cast<Index>(DTypeSize(dtypes_[i])));
      Result<ParamPlan> plan = Compose(*targets[i], *sources[i], options);
      if (!plan.ok()) return plan.status().Annotate("\"" + names_[i] + "\"");
      plans.push_back(*std::move(plan));
    }
    plans_ = std::move(plans);
    return Schedule(plans_, chunk_bytes);
  }

  // The streams, local copies and scale checks of composed plans (one per name).
  Status Schedule(const std::vector<ParamPlan>& plans, Index chunk_bytes) {
    std::map<Pair, std::vector<std::pair<size_t, size_t>>> remote;  // (param, move) per pair
    for (size_t i = 0; i < plans.size(); ++i) {
      PlanLocal(i, plans[i]);
      PlanChecks(i, plans[i]);
      for (size_t j = 0; j < plans[i].moves.size(); ++j) {
        const Move& m = plans[i].moves[j];
        const Pair pair{src_proc_[static_cast<size_t>(m.src_rank)],
                        dst_proc_[static_cast<size_t>(m.dst_rank)]};
        if (pair.first != pair.second && m.num_elements() > 0) remote[pair].push_back({i, j});
      }
    }
    for (const auto& [pair, moves] : remote) {
      std::vector<Chunk>& chunks = streams_[pair];
      Cut(plans, moves, chunk_bytes, chunks);
      for (Chunk& c : chunks) Steps(plans, c);
      rounds_ = std::max(rounds_, chunks.size());
    }
    return Status::Ok();
  }

  // The moves of parameter i that stay inside a process, and its target padding.
  void PlanLocal(size_t i, const ParamPlan& plan) {
    std::map<int, ParamPlan> per_proc;
    auto local = [&](int proc) -> ParamPlan& {
      ParamPlan& p = per_proc[proc];
      p.source_world = p.target_world = 1;
      return p;
    };
    for (const Move& m : plan.moves) {
      const int proc = dst_proc_[static_cast<size_t>(m.dst_rank)];
      if (src_proc_[static_cast<size_t>(m.src_rank)] != proc) continue;
      Move copy = m;
      copy.src_rank = copy.dst_rank = 0;
      local_bytes_[proc] += m.num_elements() * static_cast<Index>(DTypeSize(dtypes_[i]));
      local(proc).moves.push_back(std::move(copy));
    }
    for (const UnwrittenBlock& u : plan.unwritten) {
      UnwrittenBlock copy = u;
      copy.dst_rank = 0;
      local(dst_proc_[static_cast<size_t>(u.dst_rank)]).unwritten.push_back(std::move(copy));
    }
    for (auto& [proc, p] : per_proc) local_[proc].push_back({i, std::move(p)});
  }

  // The moves of parameter i whose factor is not 1, by the process of their source shard, each
  // into its own row-major block of one scratch buffer (see CheckSources).
  void PlanChecks(size_t i, const ParamPlan& plan) {
    std::map<int, ParamPlan> per_proc;
    std::map<int, Index> used;
    for (const Move& m : plan.moves) {
      if (m.factor == 1.0 || m.num_elements() == 0) continue;
      const int proc = src_proc_[static_cast<size_t>(m.src_rank)];
      ParamPlan& p = per_proc[proc];
      p.source_world = p.target_world = 1;
      Index& at = used[proc];
      p.moves.push_back({0, 0, m.shape, m.src, StridedView{at, RowMajor(m.shape)}, m.factor});
      at += m.num_elements();
    }
    for (auto& [proc, p] : per_proc) checks_[proc].push_back({i, std::move(p)});
  }

  // Cuts one pair's stream into chunks of at most chunk_bytes.
  void Cut(const std::vector<ParamPlan>& plans, const std::vector<std::pair<size_t, size_t>>& moves,
           Index chunk_bytes, std::vector<Chunk>& chunks) const {
    chunks.emplace_back();
    for (const auto& [i, j] : moves) {
      const Index item = static_cast<Index>(DTypeSize(dtypes_[i]));
      const Index n = plans[i].moves[j].num_elements();
      for (Index lo = 0; lo < n;) {
        Chunk* c = &chunks.back();
        Index at = (c->bytes + item - 1) / item * item;
        if (at + item > chunk_bytes) {
          c = &chunks.emplace_back();
          at = 0;
        }
        const Index take = std::min(n - lo, (chunk_bytes - at) / item);
        c->segments.push_back({i, j, lo, lo + take, at});
        c->bytes = at + take * item;
        lo += take;
      }
    }
  }

  // The pack and unpack plans of one chunk: one step per parameter, one move per box; and the
  // chunk's messages, with the plans of their staged sides.
  void Steps(const std::vector<ParamPlan>& plans, Chunk& c) const {
    auto step_of = [](std::vector<Step>& steps, size_t param) -> ParamPlan& {
      if (steps.empty() || steps.back().param != param) {
        ParamPlan one;
        one.source_world = one.target_world = 1;
        steps.push_back({param, one});
      }
      return steps.back().plan;
    };
    for (const Segment& seg : c.segments) {
      const Move& m = plans[seg.param].moves[seg.move];
      const Index item = static_cast<Index>(DTypeSize(dtypes_[seg.param]));
      const Shape move_strides = RowMajor(m.shape);
      Shape start(m.shape.size(), 0);
      auto emit = [&](const Shape& at, const Shape& shape) {
        const StridedView in_chunk{seg.byte_offset / item + Dot(at, move_strides) - seg.lo,
                                   RowMajor(shape)};
        const StridedView in_src{m.src.offset + Dot(at, m.src.strides), m.src.strides};
        const StridedView in_dst{m.dst.offset + Dot(at, m.dst.strides), m.dst.strides};
        step_of(c.pack, seg.param).moves.push_back({0, 0, shape, in_src, in_chunk, m.factor});
        step_of(c.unpack, seg.param).moves.push_back({0, 0, shape, in_chunk, in_dst, 1.0});
        Index bytes = item;
        for (Index d : shape) bytes *= d;
        Message msg;
        msg.bytes = bytes;
        if (m.factor == 1.0 && Contiguous(shape, m.src.strides)) {
          msg.src_param = static_cast<long>(seg.param);
          msg.src_byte = in_src.offset * item;
        } else {
          msg.src_byte = (c.send_rest + item - 1) / item * item;
          step_of(c.pack_rest, seg.param)
              .moves.push_back({0, 0, shape, in_src,
                                StridedView{msg.src_byte / item, RowMajor(shape)}, m.factor});
          c.send_rest = msg.src_byte + bytes;
        }
        if (Contiguous(shape, m.dst.strides)) {
          msg.dst_param = static_cast<long>(seg.param);
          msg.dst_byte = in_dst.offset * item;
        } else {
          msg.dst_byte = (c.recv_rest + item - 1) / item * item;
          step_of(c.unpack_rest, seg.param)
              .moves.push_back(
                  {0, 0, shape, StridedView{msg.dst_byte / item, RowMajor(shape)}, in_dst, 1.0});
          c.recv_rest = msg.dst_byte + bytes;
        }
        if (!c.messages.empty()) {  // one message with the last when it continues on both sides
          Message& last = c.messages.back();
          if (last.src_param == msg.src_param && last.dst_param == msg.dst_param &&
              last.src_byte + last.bytes == msg.src_byte &&
              last.dst_byte + last.bytes == msg.dst_byte) {
            last.bytes += msg.bytes;
            return;
          }
        }
        c.messages.push_back(msg);
      };
      RangeBoxes(m.shape, 0, start, seg.lo, seg.hi, emit);
    }
    // Many small messages cost more than staging: such a chunk travels whole, staged both sides.
    const Index n = static_cast<Index>(c.messages.size());
    if (n > kMaxMessages || (n > 1 && c.bytes / n < kMinMessageBytes)) {
      c.messages = {Message{-1, -1, 0, 0, c.bytes}};
      c.pack_rest = c.pack;
      c.unpack_rest = c.unpack;
      c.send_rest = c.recv_rest = c.bytes;
    }
  }

  static constexpr Index kMaxMessages = 256;
  static constexpr Index kMinMessageBytes = 16 << 10;

  std::vector<std::string> names_;
  std::vector<DType> dtypes_;
  std::vector<int> src_proc_, dst_proc_;
  std::map<Pair, std::vector<Chunk>> streams_;
  std::map<int, std::vector<Step>> local_;
  std::map<int, std::vector<Step>> checks_;  // scaled moves by source process (CheckSources)
  std::map<int, Index> local_bytes_, lower_bound_;
  size_t rounds_ = 0;
  std::vector<ParamPlan> plans_;  // the composed plans, one per name (fingerprints)
};

}  // namespace

void BindDist(py::module_& m) {
  // A delta push's chunks (exec/delta.h), addresses of uint16 words.
  m.def(
      "delta_encode",
      [](uintptr_t previous, uintptr_t current, Index words, uintptr_t payload, Index capacity) {
        Result<DeltaChunk> chunk = DeltaChunk{};
        {
          py::gil_scoped_release release;
          chunk = EncodeDelta(reinterpret_cast<const uint16_t*>(previous),
                              reinterpret_cast<const uint16_t*>(current), words,
                              reinterpret_cast<std::byte*>(payload), capacity);
        }
        if (!chunk.ok()) Raise(chunk.status(), ErrorKind::kData);
        return std::make_tuple(static_cast<int>(chunk->encoding), chunk->changed, chunk->bytes);
      },
      py::arg("previous"), py::arg("current"), py::arg("words"), py::arg("payload"),
      py::arg("capacity"));
  m.def(
      "delta_apply",
      [](uintptr_t previous, Index words, int encoding, Index changed, uintptr_t payload,
         Index bytes) {
        if (encoding < 0 || encoding > 2)
          throw py::value_error("no delta encoding " + std::to_string(encoding));
        Status status;
        {
          py::gil_scoped_release release;
          status = ApplyDelta(reinterpret_cast<uint16_t*>(previous), words,
                              static_cast<DeltaEncoding>(encoding), changed,
                              reinterpret_cast<const std::byte*>(payload), bytes);
        }
        if (!status.ok()) Raise(status, ErrorKind::kData);
      },
      py::arg("previous"), py::arg("words"), py::arg("encoding"), py::arg("changed"),
      py::arg("payload"), py::arg("bytes"));
  py::class_<Exchange>(m, "Exchange")
      .def(py::init<std::vector<MapHandle*>, std::vector<MapHandle*>, std::vector<std::string>,
                    std::vector<std::string>, std::vector<int>, std::vector<int>, Index>(),
           py::arg("targets"), py::arg("sources"), py::arg("names"), py::arg("dtypes"),
           py::arg("source_procs"), py::arg("target_procs"), py::arg("chunk_bytes"))
      .def(py::init<const PlanSet&, std::vector<std::string>, std::vector<std::string>,
                    std::vector<int>, std::vector<int>, Index>(),
           py::arg("plans"), py::arg("names"), py::arg("dtypes"), py::arg("source_procs"),
           py::arg("target_procs"), py::arg("chunk_bytes"))
      .def_property_readonly("num_rounds", &Exchange::num_rounds)
      .def("sends", [](const Exchange& e, int proc) { return e.Transfers(proc, true); })
      .def("receives", [](const Exchange& e, int proc) { return e.Transfers(proc, false); })
      .def("stats", &Exchange::Stats, py::arg("proc"))
      .def("boxes", &Exchange::Boxes, py::arg("proc"), py::arg("kind"), py::arg("peer") = 0,
           py::arg("round") = 0)
      .def("messages", &Exchange::Messages, py::arg("source_proc"), py::arg("target_proc"),
           py::arg("round"))
      .def("pack", &Exchange::Pack, py::arg("proc"), py::arg("peer"), py::arg("round"),
           py::arg("buffer"), py::arg("buffer_bytes"), py::arg("sources"), py::arg("options"),
           py::arg("rest") = false)
      .def("unpack", &Exchange::Unpack, py::arg("proc"), py::arg("peer"), py::arg("round"),
           py::arg("buffer"), py::arg("buffer_bytes"), py::arg("targets"), py::arg("options"),
           py::arg("rest") = false)
      .def("check_sources", &Exchange::CheckSources, py::arg("proc"), py::arg("sources"),
           py::arg("options"))
      .def("copy_local", &Exchange::CopyLocal, py::arg("proc"), py::arg("sources"),
           py::arg("targets"), py::arg("options"))
      .def("fingerprints", &Exchange::Fingerprints, py::arg("proc"), py::arg("source"),
           py::arg("shards"), py::arg("key"), py::arg("requests"), py::arg("options"));
}

}  // namespace reshard::python
