#include "interrupt.h"

#include <pthread.h>
#include <unistd.h>

#include <csignal>
#include <thread>

#include "reshard/io/temporaries.h"

namespace reshard::cli {

namespace {

constexpr int kSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGXFSZ};

[[noreturn]] void EndBySignal(int sig) {
  RemoveTemporariesAndHold();
  std::signal(sig, SIG_DFL);
  sigset_t one;
  sigemptyset(&one);
  sigaddset(&one, sig);
  pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
  std::raise(sig);
  ::_exit(128 + sig);  // not reached: the default action of every handled signal ends the process
}

}  // namespace

void HandleInterruptions() {
  sigset_t set;
  sigemptyset(&set);
  for (int sig : kSignals) {
    struct sigaction current {};
    if (sigaction(sig, nullptr, &current) == 0 && current.sa_handler == SIG_IGN) continue;
    sigaddset(&set, sig);
  }
  if (pthread_sigmask(SIG_BLOCK, &set, nullptr) != 0) return;
  std::thread([set] {
    int sig = 0;
    while (sigwait(&set, &sig) != 0) {
    }
    EndBySignal(sig);
  }).detach();
}

}  // namespace reshard::cli
