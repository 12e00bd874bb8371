// reshard: plan, describe and perform the re-sharding of tensor-parallel checkpoints.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <new>
#include <string>

#include "commands.h"
#include "exit_status.h"
#include "interrupt.h"
#include "processes.h"
#include "reshard/io/temporaries.h"

namespace {

// The last resort for an exception that nothing caught (the library returns Status, so this is
// a bug): remove every temporary output, say so, and end with exit status 3 at once (under
// mpirun, ending makes the launcher end the others). `what` describes the exception.
[[noreturn]] void EndByInternalError(const std::string& what) {
  ::alarm(30);  // should the removal wait on a lock this thread holds, end anyway
  reshard::RemoveTemporariesAndHold();
  std::fprintf(stderr,
               "reshard: internal error: %s; the unfinished outputs were removed. Please report "
               "this with the command line that caused it.\n",
               what.c_str());
  std::fflush(stderr);
  std::fflush(stdout);
  std::_Exit(reshard::cli::kExitInternal);
}

// An allocation that failed: a size an input claims (a chunk, a tensor, a count) that this
// process cannot hold. Malformed or oversized input, not a bug: exit status 2, outputs removed.
[[noreturn]] void EndByOutOfMemory() {
  ::alarm(30);
  reshard::RemoveTemporariesAndHold();
  std::fprintf(stderr,
               "reshard: out of memory (std::bad_alloc): an input claims more memory than this "
               "process can have (a size in its metadata, or a limit such as ulimit -v); the "
               "unfinished outputs were removed.\n");
  std::fflush(stderr);
  std::fflush(stdout);
  std::_Exit(reshard::cli::kExitUsage);
}

// What an exception in flight is, for the message.
std::string DescribeCurrentException() {
  try {
    throw;
  } catch (const std::exception& e) {
    return std::string("uncaught exception: ") + e.what();
  } catch (...) {
    return "uncaught exception of an unknown type";
  }
}

// Ends for the exception in flight: out of memory, or an internal error.
[[noreturn]] void EndByCurrentException() {
  try {
    throw;
  } catch (const std::bad_alloc&) {
    EndByOutOfMemory();
  } catch (...) {
    EndByInternalError(DescribeCurrentException());
  }
}

// std::terminate's handler: an exception escaping a thread (or a noexcept function) ends here
// instead of in abort().
[[noreturn]] void OnTerminate() {
  if (std::current_exception()) EndByCurrentException();
  EndByInternalError("std::terminate called");
}

int RunCli(int argc, char** argv) {
  using namespace reshard::cli;
  HandleInterruptions();
  CLI::App app{
      "reshard: describe, validate and move tensor-parallel shards as affine maps.\n"
      "Exit status: 0 success, 1 a check failed, 2 usage or malformed input, 3 internal or "
      "environment failure."};
  app.require_subcommand(1);
  app.set_version_flag("--version", "reshard " RESHARD_VERSION);
  int exit_status = kExitOk;
  AddCommands(app, exit_status);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "reshard: %s\nRun 'reshard --help' or 'reshard <command> --help'.\n",
                 e.what());
    return kExitUsage;
  } catch (...) {
    // The stack is unwound by now, so every output's temporary has been removed by its owner;
    // anything left is removed here.
    EndByCurrentException();
  }
  EndProcesses();
  return exit_status;
}

}  // namespace

int main(int argc, char** argv) {
  std::set_terminate(OnTerminate);
  try {
    return RunCli(argc, argv);
  } catch (...) {  // from building the command table or printing help
    EndByCurrentException();
  }
}
