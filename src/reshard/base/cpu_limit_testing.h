// For unit tests of cost: a bound on the CPU time of a block run in a child process, so that a
// cost that grows with the square of its input fails the test instead of merely slowing it.
//
//   EXPECT_EXIT(RunUnderCpuLimit(10, [] { ...; return ok; }), ::testing::ExitedWithCode(0), "");
//
// Past `seconds` of CPU the kernel ends the child with SIGXCPU; the limit is set far above
// what the linear cost takes (10x or more), so only a change of growth trips it, never a slow
// machine.
#ifndef RESHARD_BASE_CPU_LIMIT_TESTING_H_
#define RESHARD_BASE_CPU_LIMIT_TESTING_H_

#include <sys/resource.h>

#include <cstdlib>

namespace reshard::test_support {

/// How much slower this build runs the code than an optimised one: a Debug build under
/// AddressSanitizer takes 10-30x the time, so its bounds scale with it (they still catch a
/// runaway cost, and the optimised build keeps the tight bound).
#if defined(__SANITIZE_ADDRESS__) || !defined(NDEBUG)
inline constexpr rlim_t kCpuLimitScale = 30;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr rlim_t kCpuLimitScale = 30;
#else
inline constexpr rlim_t kCpuLimitScale = 1;
#endif
#else
inline constexpr rlim_t kCpuLimitScale = 1;
#endif

/// Sets this process's CPU-time limit to `seconds`, runs `f` (returning whether it succeeded)
/// and exits 0 when it did, 1 otherwise. For the statement of EXPECT_EXIT.
template <typename F>
[[noreturn]] void RunUnderCpuLimit(rlim_t seconds, F f) {
  const rlimit limit{seconds * kCpuLimitScale, seconds * kCpuLimitScale};
  setrlimit(RLIMIT_CPU, &limit);
  std::exit(f() ? 0 : 1);
}

}  // namespace reshard::test_support

#endif  // RESHARD_BASE_CPU_LIMIT_TESTING_H_
