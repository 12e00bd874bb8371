// Temporaries: the files and directories an output is built in before it is renamed into
// place, named so that they can be cleaned up when the run that made them cannot.
//
// Name: "<parent>/.<name>.tmp-<boot>-<pid>-<start>-<random>", where <boot> is the first eight
// hex digits of the kernel's boot id, <pid> the process id and <start> its start time in
// clock ticks since boot (field 22 of /proc/<pid>/stat). Together they say which process made
// it; a temporary whose boot id is this boot's and whose process is gone (no such pid, or a
// pid reused by a process that started at another time) is stale, and the next run writing
// the same output removes it. A temporary of another boot (after a reboot, or another machine
// on a shared file system) is left alone: its owner cannot be proven gone.
//
// Interruption: every live temporary is recorded in a process-wide registry. A program that
// handles termination signals calls `RemoveTemporariesAndHold` from a thread that is not
// writing (a dedicated signal thread that received the signal with sigwait): it removes each
// recorded temporary and keeps the registry locked until the process ends, so no new
// temporary appears and no commit renames one into place after the removal began. Commits
// (the rename into place) and new temporaries take the same lock, so an interruption sees
// either the finished output or nothing.
#ifndef RESHARD_IO_TEMPORARIES_H_
#define RESHARD_IO_TEMPORARIES_H_

#include <functional>
#include <string>

#include "reshard/base/result.h"

namespace reshard {

/// The name of a new temporary for output `path`, in the same directory (see above).
std::string TemporaryPathFor(const std::string& path);

/// Runs `create` (which makes the temporary at `temp`) under the registry's lock and, if it
/// succeeds, records `temp` to be removed on interruption. Unavailable once
/// RemoveTemporariesAndHold has begun (the process is ending).
Status CreateTemporary(const std::string& temp, const std::function<Status()>& create);

/// Runs `finish` (a commit: rename `temp` into place, or remove it) under the registry's lock,
/// then forgets `temp`. Unavailable, without running `finish`, once the process is ending.
Status FinishTemporary(const std::string& temp, const std::function<Status()>& finish);

/// Removes every recorded temporary (recursively for directories) and never releases the
/// registry: for a program about to end because of a signal. Not async-signal-safe: call it
/// from an ordinary thread (e.g. one waiting in sigwait), never from a signal handler.
void RemoveTemporariesAndHold();

/// Removes the stale temporaries of output `path` (same directory, same name; owner proven
/// gone as above) and returns how many it removed.
int RemoveStaleTemporaries(const std::string& path);

}  // namespace reshard

#endif  // RESHARD_IO_TEMPORARIES_H_
