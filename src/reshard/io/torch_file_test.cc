#include "reshard/io/torch_file.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "reshard/base/temp_dir_testing.h"
#include "reshard/io/pickle.h"
#include "reshard/io/safetensors.h"
#include "reshard/io/torch_writer.h"

namespace reshard {
namespace {

using test_support::TempDir;

namespace fs = std::filesystem;

TorchTreeBuilder::Fill Ones() {
  return [](std::span<std::byte> out) {
    for (std::byte& b : out) b = std::byte{1};
    return Status::Ok();
  };
}

// l = (l, l), `depth` times over, from `leaf`: one tuple per level, 2^depth paths to the leaf.
PickleNodeId Dag(TorchTreeBuilder& b, PickleNodeId leaf, int depth) {
  PickleNodeId l = leaf;
  for (int i = 0; i < depth; ++i) l = b.Tuple({l, l});
  return l;
}

Result<TorchFile> WriteAndOpen(const TorchTreeBuilder& b, PickleNodeId root,
                               const std::string& path, const PickleOptions& options = {}) {
  RESHARD_RETURN_IF_ERROR(b.Write(path, root));
  return TorchFile::Open(path, options);
}

// A DAG of shared tuples 60 levels deep beside a tensor: naming the tensors walks only what
// can hold one, so the work is a few objects, not 2^60.
TEST(TorchFileTest, SharedObjectsWithoutTensorsAreNotExpanded) {
  const TempDir tmp;
  TorchTreeBuilder b;
  const PickleNodeId root = b.Dict(
      {{b.Str("w"), b.Tensor(DType::kF32, {2}, Ones())}, {b.Str("dag"), Dag(b, b.Int(1), 60)}});
  Result<TorchFile> f = WriteAndOpen(b, root, (tmp / "dag.pt").string());
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_EQ(f->tensors().size(), 1u);
  EXPECT_EQ(f->tensors()[0].name, "w");
  EXPECT_LE(f->objects_walked(), f->tree().size());
}

// Tensors under shared objects are listed under each of their names, as long as the walk
// that names them stays within max_expanded; past it the file is refused, saying why.
TEST(TorchFileTest, TensorsUnderSharedObjectsAreNamedWithinTheBound) {
  const TempDir tmp;
  TorchTreeBuilder b;
  const PickleNodeId root = Dag(b, b.Tensor(DType::kF32, {2}, Ones()), 3);
  Result<TorchFile> f = WriteAndOpen(b, root, (tmp / "dag3.pt").string());
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_EQ(f->tensors().size(), 8u);
  EXPECT_EQ(f->tensors()[0].name, "0.0.0");
  EXPECT_EQ(f->tensors()[7].name, "1.1.1");
  for (const TorchTensor& t : f->tensors()) EXPECT_EQ(t.storage, 0u);

  TorchTreeBuilder deep;
  const PickleNodeId deep_root = Dag(deep, deep.Tensor(DType::kF32, {2}, Ones()), 60);
  const std::string path = (tmp / "dag60.pt").string();
  const Result<TorchFile> refused = WriteAndOpen(deep, deep_root, path);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(refused.status().message().find("more than 4194304 objects"), std::string::npos)
      << refused.status().ToString();

  // The bound is the limit given: the 2^10 names of a 10-level DAG walk its 2^10 - 1 tuple
  // paths and the tensor 2^10 times, 2047 objects.
  TorchTreeBuilder ten;
  const PickleNodeId ten_root = Dag(ten, ten.Tensor(DType::kF32, {2}, Ones()), 10);
  PickleOptions small;
  small.limits.max_expanded = 2000;
  EXPECT_EQ(WriteAndOpen(ten, ten_root, (tmp / "dag10.pt").string(), small).status().code(),
            StatusCode::kDataLoss);
  const Result<TorchFile> ok = TorchFile::Open((tmp / "dag10.pt").string());
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->tensors().size(), 1024u);
}

// A view that repeats its storage's elements (stride 0, as torch's expand makes) is written
// to safetensors dense, as tensor.contiguous() would be, while the repeats add no more than
// the storages' own size or 1 GiB: a 4-byte storage expanded to 2^40 elements is refused
// before anything is allocated or written. Written back to a .pt it stays the storage and
// its strides, as torch.save keeps it.
TEST(TorchFileTest, ExpandedViewsAreWrittenDenseWithinTheBound) {
  const TempDir tmp;
  for (const Index n : {Index{4}, Index{1} << 40}) {
    SCOPED_TRACE(n);
    TorchTreeBuilder b;
    const PickleNodeId one = b.Tensor(DType::kF32, {1}, Ones());
    Result<PickleNodeId> view = b.View(one, 0, Shape{n}, Shape{0});
    ASSERT_TRUE(view.ok()) << view.status().ToString();
    const std::string in = (tmp / "expanded.pt").string();
    fs::remove(in);
    Result<TorchFile> f = WriteAndOpen(b, b.Dict({{b.Str("e"), *view}}), in);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    ASSERT_EQ(f->tensors().size(), 1u);
    EXPECT_EQ(f->tensors()[0].num_bytes(), static_cast<uint64_t>(n) * 4);

    const std::string out = (tmp / "out.safetensors").string();
    const Status s = ExportToSafetensors(*f, out, false);
    if (n == 4) {
      ASSERT_TRUE(s.ok()) << s.ToString();
      const Result<SafetensorsFile> st = SafetensorsFile::Open(out);
      ASSERT_TRUE(st.ok()) << st.status().ToString();
      EXPECT_EQ(st->header().tensors[0].shape, Shape{4});
      EXPECT_EQ(st->data(st->header().tensors[0]).size(), 16u);
      fs::remove(out);
    } else {
      ASSERT_FALSE(s.ok());
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
      EXPECT_NE(s.message().find("tensor \"e\""), std::string::npos) << s.ToString();
      EXPECT_NE(s.message().find("written dense"), std::string::npos) << s.ToString();
      EXPECT_EQ(tmp.Listing(), std::vector<std::string>{"expanded.pt"});
    }

    const std::string back = (tmp / "back.pt").string();
    ASSERT_TRUE(RewriteTorchFile(*f, back, {.root = f->root()}).ok());
    const Result<TorchFile> g = TorchFile::Open(back);
    ASSERT_TRUE(g.ok()) << g.status().ToString();
    EXPECT_EQ(g->tensors()[0].shape, Shape{n});
    EXPECT_EQ(g->tensors()[0].strides, Shape{0});
    EXPECT_EQ(g->storages()[0].bytes.size(), 4u);
    fs::remove(back);
  }
}

// The same bound holds for a tensor under many names: 2^12 names of a 1 MiB tensor would be
// 4 GiB of output from a 1 MiB file.
TEST(TorchFileTest, ManyNamesOfOneTensorAreBoundedToo) {
  const TempDir tmp;
  TorchTreeBuilder b;
  const PickleNodeId root = Dag(b, b.Tensor(DType::kU8, {1 << 20}, Ones()), 12);
  Result<TorchFile> f = WriteAndOpen(b, root, (tmp / "names.pt").string());
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_EQ(f->tensors().size(), 4096u);
  const Status s = ExportToSafetensors(*f, (tmp / "out.safetensors").string(), false);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_EQ(tmp.Listing(), std::vector<std::string>{"names.pt"});
}

// A view's byte count must fit in 2^62 (as element counts do): 2^61 F32 elements over one
// element of storage are 2^63 bytes, refused when read rather than reported wrapped.
TEST(TorchFileTest, ViewsOfMoreThan2To62BytesAreRefused) {
  const TempDir tmp;
  TorchTreeBuilder b;
  const PickleNodeId one = b.Tensor(DType::kF32, {1}, Ones());
  Result<PickleNodeId> view = b.View(one, 0, Shape{Index{1} << 61}, Shape{0});
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  const Result<TorchFile> f = WriteAndOpen(b, *view, (tmp / "huge.pt").string());
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(f.status().message().find("more than 2^62 bytes"), std::string::npos)
      << f.status().ToString();
}

}  // namespace
}  // namespace reshard
