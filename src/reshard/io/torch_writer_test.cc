#include "reshard/io/torch_writer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "reshard/io/torch_file.h"

namespace reshard {
namespace {

namespace fs = std::filesystem;

// A fresh directory per test, removed with everything in it when the test ends.
class TempDir {
 public:
  TempDir() {
    const auto* test = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() /
            ("torch_writer_test_" + std::to_string(::getpid()) + "_" + test->name());
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  fs::path operator/(const std::string& name) const { return path_ / name; }

 private:
  fs::path path_;
};

// A tensor whose bytes are i, i+1, ... (mod 256).
TensorToWrite Counting(std::string name, DType dtype, Shape shape, uint8_t first) {
  return {.name = std::move(name),
          .dtype = dtype,
          .shape = std::move(shape),
          .fill = [first](std::span<std::byte> out) {
            for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<std::byte>(first + i);
            return Status::Ok();
          }};
}

TEST(TorchWriterTest, GlobalsOfEveryDTypeReadBackAsThatDType) {
  for (const DType dtype : kAllDTypes) {
    SCOPED_TRACE(DTypeName(dtype));
    const TorchDTypeGlobals globals = TorchGlobalsOf(dtype);
    const std::optional<TorchDType> object =
        TorchDTypeOf("torch." + std::string(globals.dtype_object));
    ASSERT_TRUE(object.has_value());
    EXPECT_EQ(object->dtype, dtype);
    const bool untyped = dtype == DType::kU16 || dtype == DType::kU32 || dtype == DType::kU64 ||
                         DTypeKindOf(dtype) == DTypeKind::kFloat8;
    EXPECT_EQ(globals.storage_class.empty(), untyped);
    // Both are names in module torch.
    EXPECT_EQ(globals.storage_class.find('.'), std::string_view::npos);
    EXPECT_EQ(globals.dtype_object.find('.'), std::string_view::npos);
    if (untyped) continue;
    const std::optional<TorchDType> storage =
        TorchDTypeOf("torch." + std::string(globals.storage_class));
    ASSERT_TRUE(storage.has_value());
    EXPECT_EQ(storage->dtype, dtype);
  }
}

TEST(TorchWriterTest, WrittenFilesReadBackAsViewsOfTheirStorages) {
  const TempDir tmp;
  const std::string path = (tmp / "a.pt").string();
  std::vector<TensorToWrite> tensors = {
      Counting("w", DType::kBF16, {2, 3}, 1), Counting("f8", DType::kF8E5M2, {4}, 50),
      Counting("u32", DType::kU32, {}, 9), Counting("empty", DType::kF32, {0, 7}, 0)};
  ASSERT_TRUE(WriteTorchStateDict(path, tensors, {.root = "ckpt", .overwrite = false}).ok());
  Result<TorchFile> f = TorchFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->root(), "ckpt");
  ASSERT_EQ(f->tensors().size(), 4u);
  const char* names[] = {"w", "f8", "u32", "empty"};
  const char* dtypes[] = {"BF16", "F8_E5M2", "U32", "F32"};
  for (size_t i = 0; i < 4; ++i) {
    const TorchTensor& t = f->tensors()[i];
    EXPECT_EQ(t.name, names[i]);
    EXPECT_EQ(t.dtype.name, dtypes[i]);
    EXPECT_EQ(t.shape, tensors[i].shape);
    EXPECT_TRUE(t.is_contiguous());
    std::vector<std::byte> got(t.num_bytes()), want(t.num_bytes());
    ASSERT_TRUE(f->CopyTo(t, got).ok());
    ASSERT_TRUE(tensors[i].fill(want).ok());
    EXPECT_EQ(got, want) << t.name;
    // Storages start at a multiple of 64 bytes of the file, as torch aligns them.
    const auto at =
        f->storages()[t.storage].bytes.data() - f->archive().data(f->archive().entries()[0]).data();
    EXPECT_EQ((at + static_cast<ptrdiff_t>(f->archive().entries()[0].data_offset)) % 64, 0)
        << t.name;
  }
}

TEST(TorchWriterTest, ManyEntriesUseZip64Records) {
  const TempDir tmp;
  const std::string path = (tmp / "many.pt").string();
  std::vector<TensorToWrite> tensors;
  for (int i = 0; i < 70000; ++i)
    tensors.push_back(Counting("t" + std::to_string(i), DType::kU8, {1}, static_cast<uint8_t>(i)));
  ASSERT_TRUE(WriteTorchStateDict(path, tensors, {.root = "archive", .overwrite = true}).ok());
  Result<TorchFile> f = TorchFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_TRUE(f->archive().zip64());
  ASSERT_EQ(f->tensors().size(), 70000u);
  std::byte b{};
  ASSERT_TRUE(f->CopyTo(f->tensors()[69999], {&b, 1}).ok());
  EXPECT_EQ(b, static_cast<std::byte>(69999 % 256));
}

TEST(TorchWriterTest, BadInputsAndFailingFillsLeaveNothing) {
  const TempDir tmp;
  const fs::path dir = tmp / "bad";
  fs::create_directories(dir);
  const std::string path = (dir / "x.pt").string();
  std::vector<TensorToWrite> dup = {Counting("a", DType::kF32, {1}, 0),
                                    Counting("a", DType::kF32, {1}, 0)};
  EXPECT_EQ(WriteTorchStateDict(path, dup).code(), StatusCode::kInvalidArgument);
  std::vector<TensorToWrite> bad_name = {Counting("\xff", DType::kF32, {1}, 0)};
  EXPECT_EQ(WriteTorchStateDict(path, bad_name).code(), StatusCode::kInvalidArgument);
  std::vector<TensorToWrite> failing = {Counting("a", DType::kF32, {1}, 0)};
  failing[0].fill = [](std::span<std::byte>) { return UnavailableError("disk gone"); };
  const Status s = WriteTorchStateDict(path, failing);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_NE(s.message().find("tensor \"a\": disk gone"), std::string::npos) << s.ToString();
  EXPECT_TRUE(fs::is_empty(dir));  // no output, no temporary left behind
}

}  // namespace
}  // namespace reshard
