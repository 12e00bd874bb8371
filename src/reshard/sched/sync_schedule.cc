#include "reshard/sched/sync_schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>
#include <tuple>
#include <unordered_map>
#include <utility>

namespace reshard {

namespace {

// The buffer each rank of `m` keeps the tensor in, or empty when none does (ParamPlan's form).
std::vector<std::string> BuffersOf(const ParamMap& m) {
  std::vector<std::string> out;
  if (!m.has_buffers()) return out;
  for (const RankShard& r : m.ranks()) out.push_back(r.buffer);
  return out;
}

// `m` with each replicated piece kept by one of its holders only (the one with the fewest bytes
// so far in `assigned`): the holders the trainer sends to. Every rank is put in buffered form,
// so that ranks keeping part of their shard stay valid; the views are unchanged.
Result<ParamMap> PrimaryMap(const ParamMap& m, std::vector<Index>* assigned) {
  using Key = std::tuple<Index, Shape, Shape, std::vector<Rank>>;
  std::map<Key, Rank> owner;
  ParamMapBuilder b;
  b.set_logical_shape(m.logical_shape());
  if (m.has_padding()) b.set_valid_shape(m.valid_shape());
  b.set_world_size(m.world_size());
  for (Rank r = 0; r < m.world_size(); ++r) {
    const RankShard& shard = m.rank(r);
    b.set_shard_shape(r, shard.shard_shape);
    b.set_buffer(r, shard.is_buffered() ? shard.buffer : std::string("sync.primary"));
    for (const Piece& p : shard.pieces) {
      Rank keeper = r;
      if (p.is_replicated()) {
        Key key{p.source.offset, p.source.strides, p.shape, p.locations};
        auto it = owner.find(key);
        if (it == owner.end()) {
          Rank best = p.locations[0];
          for (Rank l : p.locations) {
            if ((*assigned)[static_cast<size_t>(l)] < (*assigned)[static_cast<size_t>(best)])
              best = l;
          }
          (*assigned)[static_cast<size_t>(best)] += p.num_elements();
          it = owner.emplace(std::move(key), best).first;
        }
        keeper = it->second;
      } else {
        (*assigned)[static_cast<size_t>(r)] += p.num_elements();
      }
      if (keeper != r) continue;
      Piece kept = p;
      kept.locations = {r};
      b.add_piece(r, std::move(kept));
    }
  }
  return b.Finalize();
}

// Cuts every move of `plan` over `max_bytes` into moves of at most that many bytes: along the
// first dimension whose inner block fits, in runs of whole inner blocks, every index of the
// dimensions outside it enumerated.
void CutMoves(ParamPlan* plan, Index element_bytes, Index max_bytes) {
  if (max_bytes <= 0) return;
  std::vector<Move> out;
  for (Move& m : plan->moves) {
    if (m.num_elements() * element_bytes <= max_bytes || m.shape.empty()) {
      out.push_back(std::move(m));
      continue;
    }
    const size_t nd = m.shape.size();
    size_t d = 0;
    Index inner = m.num_elements() / m.shape[0];  // elements inside dimension d
    while (d + 1 < nd && inner * element_bytes > max_bytes) {
      ++d;
      inner /= m.shape[d];
    }
    const Index run = std::max<Index>(1, max_bytes / std::max<Index>(1, inner * element_bytes));
    Index outer = 1;
    for (size_t k = 0; k < d; ++k) outer *= m.shape[k];
    for (Index o = 0; o < outer; ++o) {
      Index src = m.src.offset;
      Index dst = m.dst.offset;
      Index rest = o;
      for (size_t k = d; k-- > 0;) {
        const Index i = rest % m.shape[k];
        rest /= m.shape[k];
        src += i * m.src.strides[k];
        dst += i * m.dst.strides[k];
      }
      for (Index start = 0; start < m.shape[d]; start += run) {
        Move c = m;
        for (size_t k = 0; k < d; ++k) c.shape[k] = 1;
        c.shape[d] = std::min(run, m.shape[d] - start);
        c.src.offset = src + start * m.src.strides[d];
        c.dst.offset = dst + start * m.dst.strides[d];
        out.push_back(std::move(c));
      }
    }
  }
  plan->moves = std::move(out);
}

}  // namespace

struct SyncPlanner::State {
  const Topology* topo = nullptr;
  SyncOptions options;
  std::vector<double> load;    // seconds of traffic scheduled per link
  std::vector<double> inv_bw;  // seconds per byte per link
  std::vector<double> delta;   // scratch: seconds a candidate adds per link
  std::vector<int> touched;
  std::vector<std::vector<Index>> primary_assigned;  // per engine, per worker
  std::vector<Index> engine_work;  // per engine: bytes taken from the trainer and relayed
  SyncSchedule schedule;

  // The process a move's source / target rank is.
  int SourceProcess(int from_engine, Rank r) const {
    return from_engine == kTrainer ? r : topo->engine_process(from_engine, r);
  }

  // The busiest link's load if `plan` ran from `from_engine` to `to_engine` now.
  // The busiest sending link's load and the busiest receiving link's, after `plan` ran from
  // `from_engine` to `to_engine`.
  std::pair<double, double> Loads(const ParamPlan& plan, int from_engine, int to_engine,
                                  Index element_bytes) {
    double worst[2] = {0, 0};
    for (const Move& m : plan.moves) {
      const int a = SourceProcess(from_engine, m.src_rank);
      const int b = topo->engine_process(to_engine, m.dst_rank);
      if (a == b) continue;
      int links[2];
      topo->Route(a, b, &links[0], &links[1]);
      const auto bytes = static_cast<double>(m.num_elements() * element_bytes);
      for (int side = 0; side < 2; ++side) {
        const auto li = static_cast<size_t>(links[side]);
        if (delta[li] == 0) touched.push_back(links[side]);
        delta[li] += bytes * inv_bw[li];
        worst[side] = std::max(worst[side], load[li] + delta[li]);
      }
    }
    for (int l : touched) delta[static_cast<size_t>(l)] = 0;
    touched.clear();
    return {worst[0], worst[1]};
  }

  // A relay's cost: the busiest link, ties (every parent of one child shares the child's
  // receiving links) broken by the busiest sending link.
  double Cost(const ParamPlan& plan, int from_engine, int to_engine, Index element_bytes) {
    const auto [out, in] = Loads(plan, from_engine, to_engine, element_bytes);
    return std::max(out, in) + 1e-3 * out;
  }

  // What has arrived of the tensor being planned: per process, (step, first and one past the
  // last element of the target region, transfer index, round).
  struct Arrival {
    int step;
    Index begin;
    Index end;
    int transfer;
    int round;
  };
  std::unordered_map<int, std::vector<Arrival>> arrived;

  // Records step `step_index` of `tensor` (index `t`): its transfers, their dependencies and
  // rounds, the loads.
  void Commit(SyncTensor& tensor, int t, int step_index) {
    const SyncStep& step = tensor.steps[static_cast<size_t>(step_index)];
    const ParamPlan& plan = tensor.plans[static_cast<size_t>(step.plan)];
    std::vector<std::pair<int, Arrival>> fresh;
    for (size_t i = 0; i < plan.moves.size(); ++i) {
      const Move& m = plan.moves[i];
      const int a = SourceProcess(step.from_engine, m.src_rank);
      const int b = topo->engine_process(step.to_engine, m.dst_rank);
      if (a == b) continue;
      int round = 1;
      SyncTransfer x{1,
                     a,
                     b,
                     m.num_elements() * tensor.element_bytes,
                     t,
                     step_index,
                     static_cast<int>(i),
                     static_cast<int64_t>(schedule.dependencies.size()),
                     0};
      if (step.from_engine != kTrainer) {
        const auto [begin, end] = Span(m.shape, m.src);
        auto it = arrived.find(a);
        if (it != arrived.end()) {
          for (const Arrival& got : it->second) {
            if (got.end <= begin || end <= got.begin) continue;
            if (std::find(step.after.begin(), step.after.end(), got.step) == step.after.end())
              continue;
            schedule.dependencies.push_back(got.transfer);
            ++x.num_dependencies;
            round = std::max(round, got.round + 1);
          }
        }
      }
      x.round = round;
      const auto [dbegin, dend] = Span(m.shape, m.dst);
      fresh.push_back({b, Arrival{step_index, dbegin, dend,
                                  static_cast<int>(schedule.transfers.size()), round}});
      int out_link = 0;
      int in_link = 0;
      topo->Route(a, b, &out_link, &in_link);
      load[static_cast<size_t>(out_link)] +=
          static_cast<double>(x.bytes) * inv_bw[static_cast<size_t>(out_link)];
      load[static_cast<size_t>(in_link)] +=
          static_cast<double>(x.bytes) * inv_bw[static_cast<size_t>(in_link)];
      if (step.kind == SyncStep::Kind::kRelay) {
        engine_work[static_cast<size_t>(step.from_engine)] += x.bytes;
      }
      schedule.transfers.push_back(x);
      schedule.rounds = std::max(schedule.rounds, round);
    }
    for (auto& [process, arrival] : fresh) arrived[process].push_back(arrival);
  }

  // Every engine but the root, from an engine holding the tensor that reaches it most cheaply.
  Status AddRelays(const SyncTensorInput& in, const std::vector<int>& needed,
                   const std::vector<int>& cls, int root, int t, SyncTensor& tensor) {
    // Every other engine from the engine holding the tensor that reaches it most cheaply.
    std::map<std::pair<int, int>, int> relay_plan;  // (to class, from class) -> plan index
    std::vector<int> holders = {root};
    std::map<int, int> children;  // per engine holding the tensor: engines it relays to
    std::map<int, int> depth = {{root, 0}};
    const auto root_pos = std::find(needed.begin(), needed.end(), root) - needed.begin();
    for (size_t k = 1; k < needed.size(); ++k) {
      const int c = needed[(static_cast<size_t>(root_pos) + k) % needed.size()];
      int parent = holders[0];
      int parent_plan = -1;
      double best = std::numeric_limits<double>::infinity();
      // Among the holders with room (fan-out) that keep the tree within its depth.
      auto eligible = [&](int p) {
        return (options.max_fanout <= 0 || children[p] < options.max_fanout) &&
               (options.max_depth <= 0 || depth[p] + 1 <= options.max_depth);
      };
      const bool any_eligible = std::any_of(holders.begin(), holders.end(), eligible);
      for (int p : holders) {
        if (any_eligible && !eligible(p)) continue;
        const std::pair<int, int> key{cls[static_cast<size_t>(c)], cls[static_cast<size_t>(p)]};
        auto it = relay_plan.find(key);
        if (it == relay_plan.end()) {
          Result<ParamPlan> plan =
              Compose(*in.engines[static_cast<size_t>(c)], *in.engines[static_cast<size_t>(p)]);
          if (!plan.ok())
            return FailedPreconditionError(
                fmt::format("tensor \"{}\": {}", in.name, plan.status().message()));
          CutMoves(&*plan, in.element_bytes, options.max_transfer_bytes);
          it = relay_plan.emplace(key, static_cast<int>(tensor.plans.size())).first;
          tensor.plans.push_back(*std::move(plan));
        }
        const double cost =
            Cost(tensor.plans[static_cast<size_t>(it->second)], p, c, in.element_bytes);
        if (cost < best) {
          best = cost;
          parent = p;
          parent_plan = it->second;
        }
      }
      std::vector<int> after;
      for (size_t i = 0; i < tensor.steps.size(); ++i) {
        if (tensor.steps[i].to_engine == parent) after.push_back(static_cast<int>(i));
      }
      tensor.steps.push_back(
          SyncStep{parent_plan, parent, c, SyncStep::Kind::kRelay, std::move(after)});
      Commit(tensor, t, static_cast<int>(tensor.steps.size()) - 1);
      holders.push_back(c);
      ++children[parent];
      depth[c] = depth[parent] + 1;
    }
    return Status::Ok();
  }

  // The first element a view addresses and one past its last (strides are non-negative).
  static std::pair<Index, Index> Span(const Shape& shape, const StridedView& v) {
    Index end = v.offset + 1;
    for (size_t k = 0; k < shape.size(); ++k) end += (shape[k] - 1) * v.strides[k];
    return {v.offset, end};
  }
};

SyncPlanner::SyncPlanner(const Topology& topology, SyncOptions options)
    : state_(std::make_unique<State>()) {
  state_->topo = &topology;
  state_->options = options;
  const auto n = static_cast<size_t>(topology.num_links());
  state_->load.assign(n, 0.0);
  state_->delta.assign(n, 0.0);
  for (int l = 0; l < topology.num_links(); ++l) {
    state_->inv_bw.push_back(1.0 / topology.LinkBandwidth(l));
  }
  for (int e = 0; e < topology.num_engines(); ++e) {
    state_->primary_assigned.emplace_back(static_cast<size_t>(topology.engine_workers(e)), 0);
    state_->engine_work.push_back(0);
  }
}

SyncPlanner::~SyncPlanner() = default;
SyncPlanner::SyncPlanner(SyncPlanner&&) noexcept = default;
SyncPlanner& SyncPlanner::operator=(SyncPlanner&&) noexcept = default;

Status SyncPlanner::Add(const SyncTensorInput& in) {
  State& s = *state_;
  const Topology& topo = *s.topo;
  const int num_engines = topo.num_engines();
  if (in.source == nullptr || in.source->world_size() != topo.trainer_ranks()) {
    return InvalidArgumentError(
        fmt::format("tensor \"{}\": the trainer's map has {} ranks, the topology places {}",
                    in.name, in.source ? in.source->world_size() : 0, topo.trainer_ranks()));
  }
  if (static_cast<int>(in.engines.size()) != num_engines) {
    return InvalidArgumentError(fmt::format("tensor \"{}\": {} engine maps for {} engines", in.name,
                                            in.engines.size(), num_engines));
  }
  std::vector<int> needed;
  std::vector<int> cls(static_cast<size_t>(num_engines), -1);  // first engine of equal layout
  for (int e = 0; e < num_engines; ++e) {
    const ParamMap* m = in.engines[static_cast<size_t>(e)];
    if (m == nullptr) continue;
    if (m->world_size() != topo.engine_workers(e)) {
      return InvalidArgumentError(
          fmt::format("tensor \"{}\": engine {}'s map has {} ranks, the topology places {} workers",
                      in.name, e, m->world_size(), topo.engine_workers(e)));
    }
    needed.push_back(e);
    cls[static_cast<size_t>(e)] = e;
    for (int f : needed) {
      const ParamMap* o = in.engines[static_cast<size_t>(f)];
      if (f < e && (o == m || *o == *m)) {
        cls[static_cast<size_t>(e)] = cls[static_cast<size_t>(f)];
        break;
      }
    }
  }
  if (needed.empty()) return Status::Ok();
  const int t = static_cast<int>(s.schedule.tensors.size());
  SyncTensor tensor;
  tensor.name = in.name;
  tensor.element_bytes = in.element_bytes;
  tensor.bytes = ProductOf(in.source->valid_shape()) * in.element_bytes;
  auto annotate = [&](const Status& st) {
    return FailedPreconditionError(fmt::format("tensor \"{}\": {}", in.name, st.message()));
  };
  // From the trainer into each layout's primary holders (one compose per distinct layout).
  std::map<int, int> trainer_plan;  // class -> plan index
  std::map<int, ParamMap> primaries;
  const auto seed = static_cast<size_t>(t);
  ComposeOptions from_trainer;
  from_trainer.policy = [seed](const ReplicaChoice& c) {
    Index least = std::numeric_limits<Index>::max();
    for (Rank h : c.holders) least = std::min(least, c.assigned[static_cast<size_t>(h)]);
    std::vector<Rank> tied;
    for (Rank h : c.holders) {
      if (c.assigned[static_cast<size_t>(h)] == least) tied.push_back(h);
    }
    return tied[seed % tied.size()];
  };
  for (int e : needed) {
    const int c = cls[static_cast<size_t>(e)];
    if (trainer_plan.count(c)) continue;
    ParamMap primary = *in.engines[static_cast<size_t>(c)];
    if (s.options.hand_on_within_root) {
      RESHARD_ASSIGN_OR_RETURN(primary, PrimaryMap(*in.engines[static_cast<size_t>(c)],
                                                   &s.primary_assigned[static_cast<size_t>(c)]));
    }
    Result<ParamPlan> plan = Compose(primary, *in.source, from_trainer);
    if (!plan.ok()) return annotate(plan.status());
    plan->target_buffers = BuffersOf(*in.engines[static_cast<size_t>(c)]);
    CutMoves(&*plan, in.element_bytes, s.options.max_transfer_bytes);
    trainer_plan[c] = static_cast<int>(tensor.plans.size());
    tensor.plans.push_back(*std::move(plan));
    primaries.emplace(c, std::move(primary));
  }
  // The root: every engine takes in one copy of what it needs whichever is root, so what
  // tells engines apart is what they send: the root is the engine that has sent the fewest
  // bytes so far (relays and what it took from the trainer, which it relays), ties to the
  // engine after the tensor's index.
  int root = needed[0];
  Index least = std::numeric_limits<Index>::max();
  for (size_t k = 0; k < needed.size(); ++k) {
    const int e = needed[(static_cast<size_t>(t) + k) % needed.size()];
    const Index work = s.engine_work[static_cast<size_t>(e)];
    if (work < least) {
      least = work;
      root = e;
    }
  }
  s.engine_work[static_cast<size_t>(root)] += tensor.bytes;
  s.arrived.clear();
  const int root_cls = cls[static_cast<size_t>(root)];
  tensor.steps.push_back(
      SyncStep{trainer_plan[root_cls], kTrainer, root, SyncStep::Kind::kFromTrainer, {}});
  s.Commit(tensor, t, 0);
  if (s.options.hand_on_within_root) {
    Result<ParamPlan> within =
        Compose(*in.engines[static_cast<size_t>(root)], primaries.at(root_cls));
    if (!within.ok()) return annotate(within.status());
    within->source_buffers = BuffersOf(*in.engines[static_cast<size_t>(root)]);
    CutMoves(&*within, in.element_bytes, s.options.max_transfer_bytes);
    const bool any = std::any_of(within->moves.begin(), within->moves.end(),
                                 [](const Move& m) { return m.src_rank != m.dst_rank; });
    if (any) {
      tensor.plans.push_back(*std::move(within));
      tensor.steps.push_back(SyncStep{
          static_cast<int>(tensor.plans.size()) - 1, root, root, SyncStep::Kind::kWithinRoot, {0}});
      s.Commit(tensor, t, 1);
    }
  }
  RESHARD_RETURN_IF_ERROR(s.AddRelays(in, needed, cls, root, t, tensor));
  s.schedule.one_copy_bytes += tensor.bytes;
  s.schedule.tensors.push_back(std::move(tensor));
  return Status::Ok();
}

SyncSchedule SyncPlanner::Finish() && { return std::move(state_->schedule); }

}  // namespace reshard
