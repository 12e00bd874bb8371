#include "reshard/io/file.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <thread>

#include "reshard/base/temp_dir_testing.h"
#include "reshard/io/temporaries.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

class FileTest : public ::testing::Test {
 protected:
  std::string Path(const std::string& name) const { return (tmp_ / name).string(); }
  size_t FileCount() const { return tmp_.Listing().size(); }
  test_support::TempDir tmp_;
  const fs::path& dir_ = tmp_.path();
};

TEST_F(FileTest, WriteThenReadRoundTrips) {
  ASSERT_TRUE(WriteFileAtomically(Path("a.json"), "{\"x\": 1}\n").ok());
  Result<std::string> back = ReadFileToString(Path("a.json"));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, "{\"x\": 1}\n");
  EXPECT_EQ(FileCount(), 1u);
}

TEST_F(FileTest, ExistingOutputIsKeptWithoutOverwrite) {
  ASSERT_TRUE(WriteFileAtomically(Path("a.json"), "old").ok());
  Status s = WriteFileAtomically(Path("a.json"), "new");
  EXPECT_EQ(s.code(), StatusCode::kAlreadyExists);
  EXPECT_NE(s.message().find("already exists"), std::string::npos);
  EXPECT_EQ(s.message().find("--force"), std::string::npos);  // the CLI adds its flags
  EXPECT_EQ(*ReadFileToString(Path("a.json")), "old");
  ASSERT_TRUE(WriteFileAtomically(Path("a.json"), "new", {.overwrite = true}).ok());
  EXPECT_EQ(*ReadFileToString(Path("a.json")), "new");
  EXPECT_EQ(FileCount(), 1u);
}

TEST_F(FileTest, MissingFileAndDirectoryAreNamed) {
  Result<std::string> missing = ReadFileToString(Path("nope.json"));
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("nope.json"), std::string::npos);
  EXPECT_EQ(ReadFileToString(dir_.string()).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(WriteFileAtomically(Path("no/such/dir/a.json"), "x").code(), StatusCode::kNotFound);
}

TEST_F(FileTest, FailedWriteLeavesNothingBehind) {
  // A file size limit makes write() fail part-way (SIGXFSZ ignored so it returns EFBIG).
  struct rlimit old {};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  auto previous = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old;
  small.rlim_cur = 1024;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  Status s = WriteFileAtomically(Path("big.bin"), std::string(4096, 'x'));
  setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, previous);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
  EXPECT_EQ(FileCount(), 0u);
}

TEST_F(FileTest, FifoIsRefusedWithoutBlocking) {
  // A FIFO with no writer: a blocking open would wait forever.
  ASSERT_EQ(::mkfifo(Path("model.safetensors").c_str(), 0644), 0);
  Result<std::string> read = ReadFileToString(Path("model.safetensors"));
  EXPECT_EQ(read.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(read.status().message().find("a FIFO with no writer"), std::string::npos)
      << read.status().message();
  EXPECT_EQ(FileHandle::OpenForReading(Path("model.safetensors")).status().code(),
            StatusCode::kInvalidArgument);
}

TEST_F(FileTest, PipeWithAWriterIsReadToItsEnd) {
  // What `reshard infer <(make_maps)` passes: a pipe whose writer is already there.
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const std::string text = std::string(100000, 'x') + "end";
  std::thread writer([&] {
    size_t done = 0;
    while (done < text.size()) {
      const ssize_t n = ::write(fds[1], text.data() + done, text.size() - done);
      if (n <= 0) break;
      done += static_cast<size_t>(n);
    }
    ::close(fds[1]);
  });
  Result<std::string> read = ReadFileToString("/dev/fd/" + std::to_string(fds[0]));
  writer.join();
  ::close(fds[0]);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(*read, text);
}

// The bytes of `path`, read back.
std::string Slurp(const std::string& path) { return *ReadFileToString(path); }

TEST_F(FileTest, CopyFileRangeCopiesAtThePositionAndAdvancesIt) {
  std::string text(300000, '\0');
  for (size_t i = 0; i < text.size(); ++i) text[i] = static_cast<char>(i * 131 + 7);
  ASSERT_TRUE(WriteFileAtomically(Path("in"), text).ok());
  Result<FileHandle> in = FileHandle::OpenForReading(Path("in"));
  ASSERT_TRUE(in.ok());
  FileHandle out(::open(Path("out").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  ASSERT_TRUE(out.valid());
  ASSERT_EQ(::write(out.get(), "head", 4), 4);
  Result<bool> copied = CopyFileRange(in->get(), 1000, out.get(), 200000, Path("out"));
  ASSERT_TRUE(copied.ok()) << copied.status().ToString();
  ASSERT_TRUE(*copied);  // ext4, tmpfs, xfs, btrfs: all copy within one file system
  EXPECT_EQ(::lseek(out.get(), 0, SEEK_CUR), 200004);
  ASSERT_EQ(::write(out.get(), "tail", 4), 4);
  EXPECT_EQ(Slurp(Path("out")), "head" + text.substr(1000, 200000) + "tail");
  // The input's own position is untouched: it is read at the offsets given.
  EXPECT_EQ(::lseek(in->get(), 0, SEEK_CUR), 0);
}

TEST_F(FileTest, CopyFileRangeDeclinesWhatTheKernelCannotCopyAndLeavesThePosition) {
  ASSERT_TRUE(WriteFileAtomically(Path("in"), std::string(5000, 'a')).ok());
  Result<FileHandle> in = FileHandle::OpenForReading(Path("in"));
  ASSERT_TRUE(in.ok());
  FileHandle out(::open(Path("out").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  ASSERT_EQ(::write(out.get(), "xy", 2), 2);
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  FileHandle pipe_read(fds[0]), pipe_write(fds[1]);
  struct Case {
    const char* what;
    int in;
    uint64_t offset, length;
    int out;
  } cases[] = {
      {"to a pipe", in->get(), 0, 100, pipe_write.get()},
      {"from a pipe", pipe_read.get(), 0, 100, out.get()},
      {"past the input's end", in->get(), 4000, 2000, out.get()},  // a short copy
      {"from a descriptor opened for writing only", out.get(), 0, 1, out.get()},
  };
  for (const Case& c : cases) {
    Result<bool> copied = CopyFileRange(c.in, c.offset, c.out, c.length, Path("out"));
    ASSERT_TRUE(copied.ok()) << c.what << ": " << copied.status().ToString();
    EXPECT_FALSE(*copied) << c.what;
    EXPECT_EQ(::lseek(out.get(), 0, SEEK_CUR), 2) << c.what;
  }
}

TEST_F(FileTest, AppendCopyOfGivesTheSameFileAsAppendAndCanBeTurnedOff) {
  const std::string text = std::string(70000, 'q') + "end";
  ASSERT_TRUE(WriteFileAtomically(Path("in"), text).ok());
  Result<FileHandle> in = FileHandle::OpenForReading(Path("in"));
  ASSERT_TRUE(in.ok());
  for (const bool fast : {true, false}) {
    const std::string out = Path(fast ? "fast" : "slow");
    Result<AtomicFileWriter> w = AtomicFileWriter::Create(out, {.copy_file_ranges = fast});
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE(w->Append("<").ok());
    Result<bool> copied = w->AppendCopyOf(in->get(), 3, text.size() - 3);
    ASSERT_TRUE(copied.ok());
    EXPECT_EQ(*copied, fast);
    if (!*copied) {
      ASSERT_TRUE(w->Append(std::string_view(text).substr(3)).ok());
    }
    ASSERT_TRUE(w->Append(">").ok());
    ASSERT_TRUE(w->Commit().ok());
    EXPECT_EQ(Slurp(out), "<" + text.substr(3) + ">");
  }
}

TEST_F(FileTest, UnreadableInputIsTheInputsFaultButIoErrorsAreTheEnvironments) {
  for (int err : {EACCES, EPERM, EISDIR, ENOTDIR, ELOOP, ENAMETOOLONG}) {
    EXPECT_EQ(ErrnoStatus(err, "cannot open", "x").code(), StatusCode::kInvalidArgument) << err;
  }
  EXPECT_EQ(ErrnoStatus(ENOENT, "cannot open", "x").code(), StatusCode::kNotFound);
  for (int err : {ENOSPC, EDQUOT, EFBIG}) {
    EXPECT_EQ(ErrnoStatus(err, "cannot write", "x").code(), StatusCode::kResourceExhausted) << err;
  }
  EXPECT_EQ(ErrnoStatus(EIO, "cannot read", "x").code(), StatusCode::kUnavailable);
}

TEST_F(FileTest, HandlesCloseOnceAndMove) {
  ASSERT_TRUE(WriteFileAtomically(Path("a"), "abc").ok());
  Result<FileHandle> a = FileHandle::OpenForReading(Path("a"));
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->size(), 3u);
  FileHandle b = *std::move(a);
  EXPECT_TRUE(b.valid());
  std::byte out[3];
  EXPECT_TRUE(ReadAt(b, out, 3, 0, Path("a")).ok());
  EXPECT_EQ(ReadAt(b, out, 3, 1, Path("a")).code(), StatusCode::kDataLoss);
}

TEST_F(FileTest, StaleTemporariesOfDeadProcessesAreRemovedOthersKept) {
  // A temporary's name says which process made it: boot id, pid, start time.
  const std::string mine = fs::path(TemporaryPathFor(Path("out"))).filename().string();
  const std::string boot = mine.substr(std::string(".out.tmp-").size(), 8);
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  ::waitpid(child, nullptr, 0);  // now a pid with no process
  fs::create_directory(Path(".out.tmp-" + boot + "-" + std::to_string(child) + "-1-0000abcd"));
  fs::create_directory(Path(mine));                              // ours: running
  fs::create_directory(Path(".out.tmp-ffffffff-1-1-00000000"));  // another boot
  fs::create_directory(Path(".other.tmp-" + boot + "-" + std::to_string(child) + "-1-0"));
  EXPECT_EQ(RemoveStaleTemporaries(Path("out")), 1);
  EXPECT_TRUE(fs::exists(Path(mine)));
  EXPECT_TRUE(fs::exists(Path(".out.tmp-ffffffff-1-1-00000000")));
  EXPECT_EQ(FileCount(), 3u);
}

}  // namespace
}  // namespace reshard
