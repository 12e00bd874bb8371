// What reaches the disk when: every checkpoint operation syncs its output before it appears
// (DESIGN 7), and with sync off (--no-sync) writes the same bytes without one fsync. The test
// binary counts the calls by defining fsync and sync_file_range itself, ahead of libc's.
#include <dlfcn.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>

#include "reshard/checkpoint/checkpoint_ops.h"
#include "reshard/io/file.h"
#include "reshard/io/safetensors.h"

namespace {
std::atomic<int> g_fsyncs{0};
std::atomic<int> g_writebacks{0};
}  // namespace

extern "C" int fsync(int fd) {
  ++g_fsyncs;
  static const auto real = reinterpret_cast<int (*)(int)>(dlsym(RTLD_NEXT, "fsync"));
  return real(fd);
}

extern "C" int sync_file_range(int fd, off64_t offset, off64_t nbytes, unsigned int flags) {
  ++g_writebacks;
  static const auto real = reinterpret_cast<int (*)(int, off64_t, off64_t, unsigned int)>(
      dlsym(RTLD_NEXT, "sync_file_range"));
  return real(fd, offset, nbytes, flags);
}

namespace reshard {
namespace {

namespace fs = std::filesystem;

LayoutDescriptor Layout(std::string_view json) {
  Result<LayoutDescriptor> d = ParseLayoutJson(json);
  EXPECT_TRUE(d.ok()) << d.status().ToString();
  return *d;
}

// Every file under `dir` by relative path, with its bytes.
std::map<std::string, std::string> Files(const fs::path& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    Result<std::string> bytes = ReadFileToString(e.path().string());
    EXPECT_TRUE(bytes.ok());
    files[fs::relative(e.path(), dir).string()] = *bytes;
  }
  return files;
}

class SyncTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("checkpoint_sync_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "full");
    std::vector<TensorToWrite> tensors;
    for (const char* name : {"a", "b", "c"}) {
      tensors.push_back({name, DType::kF32, {8, 6}, [](std::span<std::byte> out) {
                           for (size_t i = 0; i < out.size(); ++i)
                             out[i] = static_cast<std::byte>(i * 7);
                           return Status::Ok();
                         }});
    }
    ASSERT_TRUE(
        WriteSafetensors((dir_ / "full" / "model.safetensors").string(), std::move(tensors)).ok());
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Runs scatter (TP 2, rows), convert (TP 3) and gather into "<prefix>-*" with `sync`; the
  // fsync calls they made.
  int RunAll(const std::string& prefix, bool sync) {
    CheckpointOptions o;
    o.sync = sync;
    o.max_shard_bytes = 200;  // a few files a rank, and an index for the full output
    const int before = g_fsyncs;
    const int writebacks_before = g_writebacks;
    const MapProvider rows =
        MapsFromLayouts({{"*", Layout(R"({"family": "split", "dim": 0})")}}, 2);
    EXPECT_TRUE(Scatter(Path("full"), 2, rows, Path(prefix + "-tp2"), o).ok());
    EXPECT_TRUE(Convert(Path(prefix + "-tp2"), 3, std::nullopt, Path(prefix + "-tp3"), o).ok());
    EXPECT_TRUE(Gather(Path(prefix + "-tp3"), Path(prefix + "-full"), o).ok());
    writebacks_ = g_writebacks - writebacks_before;
    return g_fsyncs - before;
  }
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  fs::path dir_;
  int writebacks_ = 0;  // the sync_file_range calls of the last RunAll
};

TEST_F(SyncTest, EveryOperationSyncsItsFilesByDefault) {
  const int fsyncs = RunAll("synced", true);
  size_t files = 0;
  for (const char* out : {"synced-tp2", "synced-tp3", "synced-full"})
    files += Files(dir_ / out).size();
  EXPECT_GE(files, 10u);
  // Each file, its directory's entry, and each output's parent directory.
  EXPECT_GE(fsyncs, static_cast<int>(files) + 3);
}

// The universal writer's scheme, in every operation: no writer thread waits for the disk
// between two files; each safetensors file's writeback starts as it closes, and the files are
// synced together before the commit.
TEST_F(SyncTest, EveryOperationStartsEachFilesWritebackAsItCloses) {
  RunAll("synced", true);
  size_t tensor_files = 0;
  for (const char* out : {"synced-tp2", "synced-tp3", "synced-full"}) {
    for (const auto& [name, bytes] : Files(dir_ / out))
      tensor_files += name.ends_with(".safetensors");
  }
  EXPECT_GE(tensor_files, 10u);
  EXPECT_GE(writebacks_, static_cast<int>(tensor_files));
  RunAll("unsynced", false);
  EXPECT_EQ(writebacks_, 0);
}

TEST_F(SyncTest, NoSyncWritesTheSameBytesWithoutOneFsync) {
  RunAll("synced", true);
  EXPECT_EQ(RunAll("unsynced", false), 0);
  for (const char* out : {"-tp2", "-tp3", "-full"}) {
    const auto synced = Files(dir_ / ("synced" + std::string(out)));
    EXPECT_FALSE(synced.empty());
    EXPECT_EQ(Files(dir_ / ("unsynced" + std::string(out))), synced) << out;
  }
}

TEST_F(SyncTest, StartWritebackStartsItWithoutWaiting) {
  const int fsyncs = g_fsyncs, writebacks = g_writebacks;
  Result<AtomicFileWriter> w =
      AtomicFileWriter::Create(Path("x"), {.sync = false, .start_writeback = true});
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  ASSERT_TRUE(w->Append(std::string_view("bytes")).ok());
  ASSERT_TRUE(w->Commit().ok());
  EXPECT_EQ(g_writebacks - writebacks, 1);
  EXPECT_EQ(g_fsyncs - fsyncs, 0);
  StartWriteback(Path("x"));
  EXPECT_EQ(g_writebacks - writebacks, 2);
  // A synced writer has nothing to start: its commit waits for the disk.
  Result<AtomicFileWriter> synced =
      AtomicFileWriter::Create(Path("y"), {.sync = true, .start_writeback = true});
  ASSERT_TRUE(synced.ok());
  ASSERT_TRUE(synced->Commit().ok());
  EXPECT_EQ(g_writebacks - writebacks, 2);
  EXPECT_GE(g_fsyncs - fsyncs, 1);
  EXPECT_EQ(Files(dir_).at("x"), "bytes");
}

}  // namespace
}  // namespace reshard
