#include "reshard/sched/sync_schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>
#include <set>
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
  // Lists of ints by a small index, kept from tensor to tensor (emptied, not freed).
  struct Lists {
    std::vector<std::vector<int>> lists;
    std::vector<int> used;
    explicit Lists(size_t n = 0) : lists(n) {}
    std::vector<int>& at(int k) {
      auto& list = lists[static_cast<size_t>(k)];
      if (list.empty()) used.push_back(k);
      return list;
    }
    void Clear() {
      for (int k : used) lists[static_cast<size_t>(k)].clear();
      used.clear();
    }
  };
  Lists on_host;
  Lists on_nic_out;
  Lists steps_into;
  int64_t parents_costed = 0;       // candidate parents whose cost the relays computed
  std::vector<int> nic_out_loaded;  // NIC out links Commit loaded (since the caller cleared it)

  // The holders that could send a tensor's relay to a child of one class from hosts the child
  // is not on, by their busiest NIC out link after the relay's plan (then holder position).
  struct RemoteParents {
    int plan = -1;
    std::set<std::pair<double, int>> by_load;
    std::unordered_map<int, double> key;  // holder position -> its entry's load
  };

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
    return CostOf(out, in);
  }

  static double CostOf(double out, double in) { return std::max(out, in) + 1e-3 * out; }

  // What has arrived of the tensor being planned: per process, (step, first and one past the
  // last element of the target region, transfer index, round).
  struct Arrival {
    int step;
    Index begin;
    Index end;
    int transfer;
    int round;
  };
  // Kept from tensor to tensor (emptied, not freed): one list per process of the sync.
  std::vector<std::vector<Arrival>> arrived;
  std::vector<int> arrived_at;  // the processes whose list is not empty

  void ClearArrivals() {
    for (int p : arrived_at) arrived[static_cast<size_t>(p)].clear();
    arrived_at.clear();
  }

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
        for (const Arrival& got : arrived[static_cast<size_t>(a)]) {
          if (got.end <= begin || end <= got.begin) continue;
          if (std::find(step.after.begin(), step.after.end(), got.step) == step.after.end())
            continue;
          schedule.dependencies.push_back(got.transfer);
          ++x.num_dependencies;
          round = std::max(round, got.round + 1);
        }
      }
      x.round = round;
      const auto [dbegin, dend] = Span(m.shape, m.dst);
      fresh.push_back({b, Arrival{step_index, dbegin, dend,
                                  static_cast<int>(schedule.transfers.size()), round}});
      int out_link = 0;
      int in_link = 0;
      topo->Route(a, b, &out_link, &in_link);
      if (topo->slot(a).host != topo->slot(b).host) nic_out_loaded.push_back(out_link);
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
    for (auto& [process, arrival] : fresh) {
      auto& list = arrived[static_cast<size_t>(process)];
      if (list.empty()) arrived_at.push_back(process);
      list.push_back(arrival);
    }
  }

  // The relays of the tensor being planned: the holders so far and what the parent search
  // keeps of them.
  struct Relays {
    const SyncTensorInput* in = nullptr;
    const std::vector<int>* cls = nullptr;
    SyncTensor* tensor = nullptr;
    std::map<std::pair<int, int>, int> plan;   // (to class, from class) -> plan index
    std::vector<int> holders;                  // engines holding the tensor, in that order
    std::vector<int> classes;                  // the holders' classes, in order of first holder
    std::map<int, std::vector<int>> of_class;  // class -> its holders' positions
    Lists* on_host = nullptr;                  // used host -> holders with a worker there
    Lists* on_nic_out = nullptr;               // NIC out link -> holders sending on it
    Lists* steps_into = nullptr;               // engine -> steps into it
    std::map<std::pair<int, int>, RemoteParents> remote;          // (to class, from class)
    std::map<int, std::vector<std::pair<int, int>>> remote_from;  // from class -> keys of remote
    std::vector<char> local;                                      // scratch: holders costed in full
  };

  // The plan from class `from` to class `to` of the tensor, composed the first time it is asked.
  Result<int> PlanFor(Relays& r, int to, int from) {
    auto it = r.plan.find({to, from});
    if (it != r.plan.end()) return it->second;
    Result<ParamPlan> plan =
        Compose(*r.in->engines[static_cast<size_t>(to)], *r.in->engines[static_cast<size_t>(from)]);
    if (!plan.ok()) {
      return FailedPreconditionError(
          fmt::format("tensor \"{}\": {}", r.in->name, plan.status().message()));
    }
    CutMoves(&*plan, r.in->element_bytes, options.max_transfer_bytes);
    r.tensor->plans.push_back(*std::move(plan));
    const int index = static_cast<int>(r.tensor->plans.size()) - 1;
    r.plan.emplace(std::make_pair(to, from), index);
    return index;
  }

  // The busiest NIC out link after `plan` ran from `from_engine` to an engine on other hosts
  // (Loads' sending side, which then depends on the sender only), and the busiest NIC in link
  // of `to_engine` after `plan` ran into it from other hosts (the same for every such sender).
  double RemoteLoad(const ParamPlan& plan, int engine, bool sending, Index element_bytes) {
    double worst = 0;
    for (const Move& m : plan.moves) {
      const auto l =
          static_cast<size_t>(sending ? topo->NicOutLink(SourceProcess(engine, m.src_rank))
                                      : topo->NicInLink(topo->engine_process(engine, m.dst_rank)));
      if (delta[l] == 0) touched.push_back(static_cast<int>(l));
      delta[l] += static_cast<double>(m.num_elements() * element_bytes) * inv_bw[l];
      worst = std::max(worst, load[l] + delta[l]);
    }
    for (int l : touched) delta[static_cast<size_t>(l)] = 0;
    touched.clear();
    return worst;
  }

  void InsertRemote(Relays& r, RemoteParents& set, int pos) {
    const double key = RemoteLoad(r.tensor->plans[static_cast<size_t>(set.plan)],
                                  r.holders[static_cast<size_t>(pos)], true, r.in->element_bytes);
    set.key[pos] = key;
    set.by_load.emplace(key, pos);
  }

  // The remote candidates from class `from` for a child of class `to`, made the first time.
  Result<RemoteParents*> RemoteFor(Relays& r, int to, int from) {
    auto it = r.remote.find({to, from});
    if (it != r.remote.end()) return &it->second;
    RESHARD_ASSIGN_OR_RETURN(const int plan, PlanFor(r, to, from));
    RemoteParents& set = r.remote[{to, from}];
    set.plan = plan;
    for (int pos : r.of_class[from]) InsertRemote(r, set, pos);
    r.remote_from[from].emplace_back(to, from);
    return &set;
  }

  // Makes engine `e` a holder of the tensor.
  void AddHolder(Relays& r, int e) {
    const int pos = static_cast<int>(r.holders.size());
    const int c = (*r.cls)[static_cast<size_t>(e)];
    r.holders.push_back(e);
    r.local.push_back(0);
    if (!r.of_class.count(c)) r.classes.push_back(c);
    r.of_class[c].push_back(pos);
    for (int w = 0; w < topo->engine_workers(e); ++w) {
      const int process = topo->engine_process(e, w);
      for (auto* list : {&r.on_host->at(topo->UsedHost(process)),
                         &r.on_nic_out->at(topo->NicOutLink(process))}) {
        if (list->empty() || list->back() != pos) list->push_back(pos);
      }
    }
    for (const auto& key : r.remote_from[c]) InsertRemote(r, r.remote.at(key), pos);
  }

  // After a step: the holders whose NIC out links it loaded get their remote keys again.
  void Rekey(Relays& r, std::vector<int>& nic_out_links) {
    std::sort(nic_out_links.begin(), nic_out_links.end());
    nic_out_links.erase(std::unique(nic_out_links.begin(), nic_out_links.end()),
                        nic_out_links.end());
    for (int l : nic_out_links) {
      for (int pos : r.on_nic_out->at(l)) {
        const int c = (*r.cls)[static_cast<size_t>(r.holders[static_cast<size_t>(pos)])];
        for (const auto& key : r.remote_from[c]) {
          RemoteParents& set = r.remote.at(key);
          set.by_load.erase({set.key.at(pos), pos});
          InsertRemote(r, set, pos);
        }
      }
    }
  }

  struct Choice {
    double cost = std::numeric_limits<double>::infinity();
    int pos = 0;
    int plan = -1;
    void Offer(double c, int p, int pl) {
      if (c < cost || (c == cost && p < pos)) {
        cost = c;
        pos = p;
        plan = pl;
      }
    }
  };

  // The parent of engine `child` by cost over every holder (in holder order, the first of the
  // cheapest), among those within the fan-out and depth caps when any is.
  Result<Choice> ChooseEveryHolder(Relays& r, int child, const std::vector<int>& children,
                                   const std::vector<int>& depth) {
    auto eligible = [&](int p) {
      const auto e = static_cast<size_t>(p);
      return (options.max_fanout <= 0 || children[e] < options.max_fanout) &&
             (options.max_depth <= 0 || depth[e] + 1 <= options.max_depth);
    };
    const bool any_eligible = std::any_of(r.holders.begin(), r.holders.end(), eligible);
    Choice best;
    for (size_t pos = 0; pos < r.holders.size(); ++pos) {
      const int p = r.holders[pos];
      if (any_eligible && !eligible(p)) continue;
      RESHARD_ASSIGN_OR_RETURN(const int plan, PlanFor(r, (*r.cls)[static_cast<size_t>(child)],
                                                       (*r.cls)[static_cast<size_t>(p)]));
      ++parents_costed;
      best.Offer(Cost(r.tensor->plans[static_cast<size_t>(plan)], p, child, r.in->element_bytes),
                 static_cast<int>(pos), plan);
    }
    return best;
  }

  // The same choice without costing every holder: the holders with a worker on one of the
  // child's hosts are costed in full; every other holder sends over its NICs into the child's
  // NICs, so its cost is a non-decreasing function of its own busiest NIC out link after the
  // plan (the receiving side is the child's, the same for all of them), and the holders of each
  // class are kept ordered by it: the scan stops at the first whose cost exceeds the best.
  Result<Choice> ChoosePruned(Relays& r, int child) {
    const int to = (*r.cls)[static_cast<size_t>(child)];
    for (int from : r.classes) RESHARD_RETURN_IF_ERROR(PlanFor(r, to, from).status());
    Choice best;
    std::vector<int> marked;
    for (int w = 0; w < topo->engine_workers(child); ++w) {
      for (int pos : r.on_host->at(topo->UsedHost(topo->engine_process(child, w)))) {
        if (r.local[static_cast<size_t>(pos)]) continue;
        r.local[static_cast<size_t>(pos)] = 1;
        marked.push_back(pos);
        const int p = r.holders[static_cast<size_t>(pos)];
        const int plan = r.plan.at({to, (*r.cls)[static_cast<size_t>(p)]});
        ++parents_costed;
        best.Offer(Cost(r.tensor->plans[static_cast<size_t>(plan)], p, child, r.in->element_bytes),
                   pos, plan);
      }
    }
    for (int from : r.classes) {
      RESHARD_ASSIGN_OR_RETURN(RemoteParents * set, RemoteFor(r, to, from));
      const ParamPlan& plan = r.tensor->plans[static_cast<size_t>(set->plan)];
      const double in = RemoteLoad(plan, child, false, r.in->element_bytes);
      auto it = set->by_load.begin();
      while (it != set->by_load.end()) {
        if (r.local[static_cast<size_t>(it->second)]) {
          ++it;
          continue;
        }
        const double out = it->first;
        const double cost = CostOf(out, in);
        ++parents_costed;
        if (cost > best.cost) break;
        best.Offer(cost, it->second, set->plan);
        // The rest of this load costs the same and comes later among the holders.
        it = set->by_load.upper_bound({out, std::numeric_limits<int>::max()});
      }
    }
    for (int pos : marked) r.local[static_cast<size_t>(pos)] = 0;
    return best;
  }

  // Every engine but the root, from an engine holding the tensor that reaches it most cheaply.
  Status AddRelays(const SyncTensorInput& in, const std::vector<int>& needed,
                   const std::vector<int>& cls, int root, int t, SyncTensor& tensor) {
    Relays r;
    on_host.Clear();
    on_nic_out.Clear();
    steps_into.Clear();
    r.on_host = &on_host;
    r.on_nic_out = &on_nic_out;
    r.steps_into = &steps_into;
    r.in = &in;
    r.cls = &cls;
    r.tensor = &tensor;
    for (size_t i = 0; i < tensor.steps.size(); ++i) {
      r.steps_into->at(tensor.steps[i].to_engine).push_back(static_cast<int>(i));
    }
    AddHolder(r, root);
    // Per engine holding the tensor: the engines it relays to, and its depth in the tree.
    std::vector<int> children(static_cast<size_t>(topo->num_engines()), 0);
    std::vector<int> depth(static_cast<size_t>(topo->num_engines()), 0);
    const bool exhaustive =
        !options.prune_parents || options.max_fanout > 0 || options.max_depth > 0;
    const auto root_pos = std::find(needed.begin(), needed.end(), root) - needed.begin();
    for (size_t k = 1; k < needed.size(); ++k) {
      const int c = needed[(static_cast<size_t>(root_pos) + k) % needed.size()];
      Result<Choice> choice =
          exhaustive ? ChooseEveryHolder(r, c, children, depth) : ChoosePruned(r, c);
      if (!choice.ok()) return choice.status();
      const int parent = r.holders[static_cast<size_t>(choice->pos)];
      std::vector<int> after = r.steps_into->at(parent);
      const int step = static_cast<int>(tensor.steps.size());
      tensor.steps.push_back(
          SyncStep{choice->plan, parent, c, SyncStep::Kind::kRelay, std::move(after)});
      r.steps_into->at(c).push_back(step);
      nic_out_loaded.clear();
      Commit(tensor, t, step);
      if (!exhaustive) Rekey(r, nic_out_loaded);
      AddHolder(r, c);
      ++children[static_cast<size_t>(parent)];
      depth[static_cast<size_t>(c)] = depth[static_cast<size_t>(parent)] + 1;
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
  state_->arrived.resize(static_cast<size_t>(topology.num_processes()));
  state_->on_host = State::Lists(static_cast<size_t>(topology.num_used_hosts()));
  state_->on_nic_out = State::Lists(n);
  state_->steps_into = State::Lists(static_cast<size_t>(topology.num_engines()));
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
  std::vector<int> firsts;                                     // the first engine of each layout
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
    for (int f : firsts) {
      const ParamMap* o = in.engines[static_cast<size_t>(f)];
      if (o == m || *o == *m) {
        cls[static_cast<size_t>(e)] = f;
        break;
      }
    }
    if (cls[static_cast<size_t>(e)] == e) firsts.push_back(e);
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
  s.ClearArrivals();
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

int64_t SyncPlanner::parents_costed() const { return state_->parents_costed; }

}  // namespace reshard
