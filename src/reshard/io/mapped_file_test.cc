#include "reshard/io/mapped_file.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "reshard/base/temp_dir_testing.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

TEST(MappedFileTest, MapsTheWholeFileAndSurvivesMoves) {
  const test_support::TempDir tmp;
  const fs::path path = tmp / "data.bin";
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
  const test_support::TempDir tmp;
  const fs::path path = tmp / "empty.bin";
  std::ofstream(path, std::ios::binary).flush();
  Result<MappedFile> file = MappedFile::Open(path.string());
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_TRUE(file->bytes().empty());
}

TEST(MappedFileTest, MissingFilesAndDirectoriesAreRefusedByName) {
  const test_support::TempDir tmp;
  const fs::path& dir = tmp.path();
  Result<MappedFile> missing = MappedFile::Open((dir / "nope").string());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("nope"), std::string::npos);
  Result<MappedFile> directory = MappedFile::Open(dir.string());
  EXPECT_EQ(directory.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(directory.status().message().find("is a directory"), std::string::npos);
}

}  // namespace
}  // namespace reshard
