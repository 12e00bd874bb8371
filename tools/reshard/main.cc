// reshard: plan, describe and perform the re-sharding of tensor-parallel checkpoints.
#include <CLI/CLI.hpp>
#include <cstdio>

#include "commands.h"
#include "exit_status.h"
#include "interrupt.h"
#include "processes.h"

int main(int argc, char** argv) {
  using namespace reshard::cli;
  HandleInterruptions();
  CLI::App app{
      "reshard: describe, validate and move tensor-parallel shards as affine maps.\n"
      "Exit status: 0 success, 1 a check failed, 2 usage or malformed input, 3 internal or "
      "environment failure."};
  app.require_subcommand(1);
  app.set_version_flag("--version", "reshard 0.1.0");
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
  }
  EndProcesses();
  return exit_status;
}
