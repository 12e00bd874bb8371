#include "reshard/dist/mpi_communicator.h"

#include <fmt/format.h>
#include <mpi.h>

#include <climits>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "reshard/io/temporaries.h"

namespace reshard {

namespace {

constexpr int kProgressTag = 7301;
constexpr auto kProgressInterval = std::chrono::milliseconds(100);
constexpr auto kPollInterval = std::chrono::microseconds(200);

std::string MpiErrorText(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return fmt::format("error {}", code);
  return std::string(text, static_cast<size_t>(length));
}

}  // namespace

struct MpiCommunicator::State {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0;
  int size = 1;
  std::chrono::duration<double> timeout{0};
  mutable std::mutex mu;  // serializes every MPI call (threads: MPI_THREAD_SERIALIZED)
  bool broken = false;
  // Progress sent (processes other than 0): the latest count published and sent, messages sent.
  uint64_t published = 0;
  uint64_t sent_value = 0;
  uint64_t sent = 0;
  std::chrono::steady_clock::time_point last_send;
  std::deque<std::pair<std::unique_ptr<uint64_t>, MPI_Request>> sends;
  // Progress received (process 0): each process's latest count and messages received.
  std::vector<uint64_t> latest;
  std::vector<uint64_t> received;
  std::function<void(uint64_t)> listener;

  Status Check(int rc, std::string_view what) {
    if (rc == MPI_SUCCESS) return Status::Ok();
    broken = true;
    return UnavailableError(
        fmt::format("process {}: MPI {} failed: {}", rank, what, MpiErrorText(rc)));
  }

  void Send() {
    while (!sends.empty()) {
      int done = 0;
      if (MPI_Test(&sends.front().second, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || !done) break;
      sends.pop_front();
    }
    if (published == sent_value) return;
    auto value = std::make_unique<uint64_t>(published);
    MPI_Request request;
    if (MPI_Isend(value.get(), 1, MPI_UINT64_T, 0, kProgressTag, comm, &request) != MPI_SUCCESS) {
      return;  // progress is advisory; a dead peer shows at the next collective
    }
    sends.emplace_back(std::move(value), request);
    ++sent;
    sent_value = published;
    last_send = std::chrono::steady_clock::now();
  }

  void Record(int source, uint64_t value) {
    auto s = static_cast<size_t>(source);
    latest[s] = std::max(latest[s], value);
    ++received[s];
  }

  // Process 0: receives the progress messages that have arrived and tells the listener.
  void Drain() {
    while (true) {
      int flag = 0;
      MPI_Status status;
      if (MPI_Iprobe(MPI_ANY_SOURCE, kProgressTag, comm, &flag, &status) != MPI_SUCCESS || !flag)
        break;
      uint64_t value = 0;
      if (MPI_Recv(&value, 1, MPI_UINT64_T, status.MPI_SOURCE, kProgressTag, comm,
                   MPI_STATUS_IGNORE) != MPI_SUCCESS)
        break;
      Record(status.MPI_SOURCE, value);
    }
    Notify();
  }

  void Notify() {
    uint64_t job = 0;
    for (uint64_t v : latest) job += v;
    if (listener) listener(job);
  }

  // Waits for `request` until the deadline, draining progress meanwhile on process 0.
  Status Wait(MPI_Request& request, std::chrono::steady_clock::time_point deadline,
              std::string_view what) {
    while (true) {
      int done = 0;
      RESHARD_RETURN_IF_ERROR(Check(MPI_Test(&request, &done, MPI_STATUS_IGNORE), what));
      if (done) return Status::Ok();
      if (rank == 0) Drain();
      if (std::chrono::steady_clock::now() > deadline) {
        broken = true;
        return UnavailableError(fmt::format(
            "process {}: the other processes did not answer within {:.0f} s (one has died or "
            "hangs); giving up",
            rank, timeout.count()));
      }
      std::this_thread::sleep_for(kPollInterval);
    }
  }

  // Process 0: receives the progress messages each process says it sent.
  Status ReceiveRest(const std::vector<uint64_t>& sent_by,
                     std::chrono::steady_clock::time_point deadline) {
    for (int q = 1; q < size; ++q) {
      while (received[static_cast<size_t>(q)] < sent_by[static_cast<size_t>(q)]) {
        uint64_t value = 0;
        MPI_Request request;
        RESHARD_RETURN_IF_ERROR(
            Check(MPI_Irecv(&value, 1, MPI_UINT64_T, q, kProgressTag, comm, &request), "receive"));
        RESHARD_RETURN_IF_ERROR(Wait(request, deadline, "receive"));
        Record(q, value);
      }
    }
    Notify();
    return Status::Ok();
  }
};

Result<std::unique_ptr<MpiCommunicator>> MpiCommunicator::Start(
    std::chrono::duration<double> timeout) {
  auto state = std::make_unique<State>();
  state->timeout = timeout;
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS) {
      return UnavailableError("cannot initialise MPI");
    }
    if (provided < MPI_THREAD_SERIALIZED) {
      return UnavailableError(
          fmt::format("this MPI offers thread level {}, below MPI_THREAD_SERIALIZED ({})", provided,
                      static_cast<int>(MPI_THREAD_SERIALIZED)));
    }
  }
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  RESHARD_RETURN_IF_ERROR(state->Check(MPI_Comm_dup(MPI_COMM_WORLD, &state->comm), "setup"));
  MPI_Comm_set_errhandler(state->comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(state->comm, &state->rank);
  MPI_Comm_size(state->comm, &state->size);
  state->latest.assign(static_cast<size_t>(state->size), 0);
  state->received.assign(static_cast<size_t>(state->size), 0);
  return std::unique_ptr<MpiCommunicator>(new MpiCommunicator(std::move(state)));
}

MpiCommunicator::MpiCommunicator(std::unique_ptr<State> state) : state_(std::move(state)) {}

MpiCommunicator::~MpiCommunicator() {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (state_->broken) {
    // The peers cannot be trusted to finalize: end the job, leaving no temporary behind.
    RemoveTemporariesAndHold();
    MPI_Abort(MPI_COMM_WORLD, 3);
  }
  if (state_->rank == 0) state_->Drain();
  for (auto& [value, request] : state_->sends) {
    int done = 0;
    if (MPI_Test(&request, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && !done) {
      MPI_Request_free(&request);
    }
  }
  state_->sends.clear();
  MPI_Comm_free(&state_->comm);
  MPI_Finalize();
}

int MpiCommunicator::rank() const { return state_->rank; }
int MpiCommunicator::size() const { return state_->size; }

bool MpiCommunicator::broken() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->broken;
}

Result<std::vector<std::string>> MpiCommunicator::AllGather(const std::string& mine) {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.broken) return UnavailableError("an earlier exchange between the processes failed");
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(s.timeout);
  if (s.rank != 0) s.Send();  // the latest count, so that process 0 ends with every count
  // Each payload starts with its sender's count of progress messages.
  std::string payload(sizeof(uint64_t), '\0');
  std::memcpy(payload.data(), &s.sent, sizeof(uint64_t));
  payload += mine;
  uint64_t length = payload.size();
  std::vector<uint64_t> lengths(static_cast<size_t>(s.size));
  MPI_Request request;
  RESHARD_RETURN_IF_ERROR(s.Check(
      MPI_Iallgather(&length, 1, MPI_UINT64_T, lengths.data(), 1, MPI_UINT64_T, s.comm, &request),
      "allgather"));
  RESHARD_RETURN_IF_ERROR(s.Wait(request, deadline, "allgather"));
  std::vector<int> counts, offsets;
  uint64_t total = 0;
  for (uint64_t n : lengths) {
    if (n < sizeof(uint64_t) || total + n > INT_MAX) {
      s.broken = true;
      return InternalError(fmt::format("a process sent {} bytes to exchange", n));
    }
    counts.push_back(static_cast<int>(n));
    offsets.push_back(static_cast<int>(total));
    total += n;
  }
  std::string all(total, '\0');
  RESHARD_RETURN_IF_ERROR(
      s.Check(MPI_Iallgatherv(payload.data(), static_cast<int>(length), MPI_CHAR, all.data(),
                              counts.data(), offsets.data(), MPI_CHAR, s.comm, &request),
              "allgatherv"));
  RESHARD_RETURN_IF_ERROR(s.Wait(request, deadline, "allgatherv"));
  std::vector<std::string> out;
  std::vector<uint64_t> sent_by;
  for (size_t q = 0; q < counts.size(); ++q) {
    uint64_t sent = 0;
    std::memcpy(&sent, all.data() + offsets[q], sizeof(uint64_t));
    sent_by.push_back(sent);
    out.push_back(all.substr(static_cast<size_t>(offsets[q]) + sizeof(uint64_t),
                             static_cast<size_t>(counts[q]) - sizeof(uint64_t)));
  }
  if (s.rank == 0) RESHARD_RETURN_IF_ERROR(s.ReceiveRest(sent_by, deadline));
  return out;
}

void MpiCommunicator::PublishProgress(uint64_t bytes_done) {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.broken) return;
  s.published = bytes_done;
  if (s.rank == 0) {
    s.latest[0] = bytes_done;
    s.Drain();
  } else if (std::chrono::steady_clock::now() - s.last_send >= kProgressInterval) {
    s.Send();
  }
}

void MpiCommunicator::SetProgressListener(std::function<void(uint64_t)> listener) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->listener = std::move(listener);
}

}  // namespace reshard
