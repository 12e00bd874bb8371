// Interruption: SIGINT, SIGTERM, SIGHUP and SIGXFSZ end the process without leaving a
// temporary output behind.
//
// Design: before any thread starts, main blocks these signals (every thread inherits the
// mask), and one thread waits for them with sigwait. Nothing runs in a signal handler, so
// nothing needs to be async-signal-safe: on a signal that thread removes every registered
// temporary (io/temporaries.h; it then holds the registry, so no new temporary appears and no
// output is committed after the removal began), restores the signal's default action and
// raises it again, so the exit status still says "killed by signal N". A signal that was
// ignored when the program started (nohup's SIGHUP) stays ignored. A SIGXFSZ that a write
// raises itself (a file size limit, `ulimit -f`) is directed at the writing thread, where it
// stays blocked: the write fails with EFBIG instead, the command cleans up as for any failed
// write and exits 3.
#ifndef RESHARD_TOOLS_INTERRUPT_H_
#define RESHARD_TOOLS_INTERRUPT_H_

namespace reshard::cli {

/// Call first thing in main, before any other thread exists.
void HandleInterruptions();

}  // namespace reshard::cli

#endif  // RESHARD_TOOLS_INTERRUPT_H_
