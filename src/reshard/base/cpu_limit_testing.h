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

#if defined(__SANITIZE_ADDRESS__)
#define RESHARD_TESTING_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define RESHARD_TESTING_SANITIZED 1
#endif
#endif

#ifdef RESHARD_TESTING_SANITIZED
/// How much slower this build runs the code than an optimised one: a Debug build under
/// AddressSanitizer takes 10-30x the time, so its bounds scale with it.
inline constexpr rlim_t kCpuLimitScale = 30;
/// A sanitized build runs these tests' inputs at 1/16 of their size: it looks for memory errors
/// along the same code (a smaller input walks the same paths), while the growth of the cost
/// is the optimised build's to check, at full size under the tight bound.
inline constexpr int kCostInputDivisor = 16;
#elif !defined(NDEBUG)
inline constexpr rlim_t kCpuLimitScale = 30;
inline constexpr int kCostInputDivisor = 1;
#else
inline constexpr rlim_t kCpuLimitScale = 1;
inline constexpr int kCostInputDivisor = 1;
#endif

/// The size `n` of a cost test's input in this build (see kCostInputDivisor).
constexpr int CostInput(int n) { return n / kCostInputDivisor; }

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
