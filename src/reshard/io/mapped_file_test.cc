#include "reshard/io/mapped_file.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace reshard {
namespace {

namespace fs = std::filesystem;

fs::path TempDir() {
  const fs::path dir =
      fs::temp_directory_path() / ("mapped_file_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return dir;
}

TEST(MappedFileTest, MapsTheWholeFileAndSurvivesMoves) {
  const fs::path path = TempDir() / "data.bin";
  std::ofstream(path, std::ios::binary) << "hello, mapping";
  Result<MappedFile> file = MappedFile::Open(path.string());
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  const std::byte* data = file->bytes().data();
  MappedFile moved = std::move(file).value();
  EXPECT_EQ(moved.bytes().data(), data);  // a move keeps the mapping where it is
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(data), moved.bytes().size()),
            "hello, mapping");
  EXPECT_EQ(moved.path(), path.string());
}

TEST(MappedFileTest, EmptyFileIsAnEmptySpan) {
  const fs::path path = TempDir() / "empty.bin";
  std::ofstream(path, std::ios::binary).flush();
  Result<MappedFile> file = MappedFile::Open(path.string());
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_TRUE(file->bytes().empty());
}

TEST(MappedFileTest, MissingFilesAndDirectoriesAreRefusedByName) {
  const fs::path dir = TempDir();
  Result<MappedFile> missing = MappedFile::Open((dir / "nope").string());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("nope"), std::string::npos);
  Result<MappedFile> directory = MappedFile::Open(dir.string());
  EXPECT_EQ(directory.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(directory.status().message().find("is a directory"), std::string::npos);
}

}  // namespace
}  // namespace reshard
