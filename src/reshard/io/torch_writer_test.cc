#include "reshard/io/torch_writer.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "reshard/base/temp_dir_testing.h"
#include "reshard/io/file.h"
#include "reshard/io/pickle.h"
#include "reshard/io/torch_file.h"

namespace reshard {
namespace {

using test_support::TempDir;

namespace fs = std::filesystem;

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

// The value of `key` in dict node `dict` of `tree`, or kNoPickleNode.
PickleNodeId Get(const PickleTree& tree, PickleNodeId dict, std::string_view key) {
  for (const auto& [k, v] : tree.node(dict).entries) {
    if (tree.node(k).kind == PickleKind::kStr && tree.node(k).text == key) return v;
  }
  return kNoPickleNode;
}

// A storage larger than memory can hold is a Status (ResourceExhausted), found before the
// output is made: no exception escapes and nothing is left.
TEST(TorchWriterTest, AStorageMemoryCannotHoldIsRefusedLeavingNothing) {
  const TempDir tmp;
  TorchTreeBuilder b;
  const PickleNodeId t =
      b.Tensor(DType::kU8, {Index{1} << 61}, [](std::span<std::byte>) { return Status::Ok(); });
  const Status s = b.Write((tmp / "huge.pt").string(), t);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
  EXPECT_NE(s.message().find("cannot allocate"), std::string::npos) << s.ToString();
  EXPECT_TRUE(fs::is_empty(fs::path((tmp / "huge.pt").string()).parent_path()));
}

TEST(TorchTreeBuilderTest, EveryKindOfNodeReadsBackWithItsClassAndSharing) {
  const TempDir tmp;
  const std::string path = (tmp / "tree.pt").string();
  TorchTreeBuilder b;
  const PickleNodeId shared = b.Dict({{b.Str("x"), b.Int(1)}});
  const PickleNodeId frozen = b.Set({b.Int(3)});
  b.mutable_node(frozen).frozen = true;
  const PickleNodeId w = b.Tensor(DType::kF32, {2, 3}, Counting("", DType::kF32, {}, 0).fill);
  Result<PickleNodeId> col = b.View(w, 1, {2}, {3});
  ASSERT_TRUE(col.ok()) << col.status().ToString();
  const PickleNodeId root = b.Dict({}, /*ordered=*/true);
  const auto put = [&](const char* key, PickleNodeId value) { b.Insert(root, b.Str(key), value); };
  put("none", b.None());
  put("flag", b.Bool(true));
  put("big", b.Int(int64_t{1} << 40));
  put("negative", b.Int(-70000));
  put("float", b.Float(0.25));
  put("text", b.Str("名前"));
  put("raw", b.Bytes(std::string("\x00\xff", 2)));
  put("list", b.List({b.Int(1), shared}));
  put("tuple", b.Tuple({b.Int(1), b.Int(2), b.Int(3), b.Int(4), b.Int(5)}));
  put("set", b.Set({b.Int(1), b.Int(2)}));
  put("frozen", frozen);
  put("shared", shared);
  put("size", b.Size({4, 5}));
  put("dtype", b.DTypeObject(DType::kBF16));
  put("device", b.Device("cpu"));
  put("args", b.Object("argparse.Namespace", b.Dict({{b.Str("lr"), b.Float(0.5)}})));
  put("stage", b.Enum("deepspeed.runtime.zero.config.ZeroStageEnum", b.Int(1)));
  put("w", w);
  put("w_again", w);
  put("col", *col);
  put("f8", b.Tensor(DType::kF8E4M3, {3}, Counting("", DType::kF8E4M3, {}, 7).fill));
  ASSERT_TRUE(b.Write(path, root).ok());

  Result<TorchFile> f = TorchFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  const PickleTree& t = f->tree();
  const PickleNodeId r = t.root();
  EXPECT_TRUE(t.node(r).ordered);
  EXPECT_EQ(t.node(Get(t, r, "none")).kind, PickleKind::kNone);
  EXPECT_TRUE(t.node(Get(t, r, "flag")).bool_value);
  EXPECT_EQ(t.node(Get(t, r, "big")).int_value, int64_t{1} << 40);
  EXPECT_EQ(t.node(Get(t, r, "negative")).int_value, -70000);
  EXPECT_EQ(t.node(Get(t, r, "float")).float_value, 0.25);
  EXPECT_EQ(t.node(Get(t, r, "text")).text, "名前");
  EXPECT_EQ(t.node(Get(t, r, "raw")).text, std::string("\x00\xff", 2));
  EXPECT_EQ(t.node(Get(t, r, "tuple")).items.size(), 5u);
  EXPECT_FALSE(t.node(Get(t, r, "set")).frozen);
  EXPECT_TRUE(t.node(Get(t, r, "frozen")).frozen);
  EXPECT_TRUE(t.node(Get(t, r, "size")).torch_size);
  EXPECT_FALSE(t.node(Get(t, r, "tuple")).torch_size);
  EXPECT_EQ(t.node(Get(t, r, "dtype")).text, "torch.bfloat16");
  EXPECT_EQ(t.node(Get(t, r, "device")).text, "torch.device");
  EXPECT_FALSE(t.node(Get(t, r, "device")).newobj);
  EXPECT_TRUE(t.node(Get(t, r, "args")).newobj);
  EXPECT_EQ(t.node(t.node(Get(t, r, "args")).state).kind, PickleKind::kDict);
  EXPECT_FALSE(t.node(Get(t, r, "stage")).newobj);
  // Shared objects are one node again; a view shares its tensor's storage.
  EXPECT_EQ(Get(t, r, "shared"), t.node(Get(t, r, "list")).items[1]);
  EXPECT_EQ(Get(t, r, "w"), Get(t, r, "w_again"));
  const TorchTensor* tw = f->TensorAt(Get(t, r, "w"));
  const TorchTensor* tc = f->TensorAt(Get(t, r, "col"));
  ASSERT_TRUE(tw != nullptr && tc != nullptr);
  EXPECT_EQ(tw->storage, tc->storage);
  std::vector<std::byte> got(tc->num_bytes());
  ASSERT_TRUE(f->CopyTo(*tc, got).ok());
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(got[i], static_cast<std::byte>(4 + i));  // element 1
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(got[4 + i], static_cast<std::byte>(16 + i));  // 4
  EXPECT_EQ(f->TensorAt(Get(t, r, "f8"))->dtype.name, "F8_E4M3");
}

TEST(TorchTreeBuilderTest, RewrittenFilesKeepTreeAndStoragesAndAreDeterministic) {
  const TempDir tmp;
  TorchTreeBuilder b;
  const PickleNodeId w = b.Tensor(DType::kBF16, {4, 4}, Counting("", DType::kBF16, {}, 3).fill);
  Result<PickleNodeId> row = b.View(w, 8, {4}, {1});
  ASSERT_TRUE(row.ok());
  // More shared objects than the one-byte memo indices reach.
  const PickleNodeId many = b.List();
  for (int i = 0; i < 300; ++i) b.Append(many, b.List({b.Int(i)}));
  const PickleNodeId root = b.Dict(
      {{b.Str("w"), w}, {b.Str("row"), *row}, {b.Str("many"), many}, {b.Str("again"), many}});
  const std::string first = (tmp / "first.pt").string();
  ASSERT_TRUE(b.Write(first, root, {.root = "ckpt", .overwrite = false}).ok());
  Result<TorchFile> f = TorchFile::Open(first);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  const std::string second = (tmp / "second.pt").string();
  const std::string third = (tmp / "third.pt").string();
  ASSERT_TRUE(RewriteTorchFile(*f, second, {.root = f->root(), .overwrite = false}).ok());
  Result<TorchFile> g = TorchFile::Open(second);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  ASSERT_TRUE(RewriteTorchFile(*g, third, {.root = g->root(), .overwrite = false}).ok());
  EXPECT_EQ(*ReadFileToString(second), *ReadFileToString(third));
  ASSERT_EQ(g->tensors().size(), 2u);
  EXPECT_EQ(g->tensors()[0].storage, g->tensors()[1].storage);
  EXPECT_EQ(g->tensors()[1].storage_offset, 8);
  for (size_t i = 0; i < 2; ++i) {
    std::vector<std::byte> a(f->tensors()[i].num_bytes()), c(g->tensors()[i].num_bytes());
    ASSERT_TRUE(f->CopyTo(f->tensors()[i], a).ok());
    ASSERT_TRUE(g->CopyTo(g->tensors()[i], c).ok());
    EXPECT_EQ(a, c);
  }
  const PickleTree& t = g->tree();
  const PickleNodeId m = Get(t, t.root(), "many");
  EXPECT_EQ(m, Get(t, t.root(), "again"));
  ASSERT_EQ(t.node(m).items.size(), 300u);
  EXPECT_EQ(t.node(t.node(t.node(m).items[299]).items[0]).int_value, 299);
}

TEST(TorchTreeBuilderTest, AppendedArchivesAreTheBytesOfFilesOfTheirOwn) {
  // Two archives one after the other in one file (DCP's items): each is, byte for byte, the
  // file written alone, so its zip offsets and alignment count from its own start.
  const TempDir tmp;
  const auto tensor = [](DType dtype, Shape shape, uint8_t first) {
    TorchTreeBuilder b;
    const TensorToWrite t = Counting("t", dtype, std::move(shape), first);
    const PickleNodeId root = b.Tensor(t.dtype, t.shape, t.fill);
    return std::pair{std::move(b), root};
  };
  auto [a, a_root] = tensor(DType::kBF16, {3, 5}, 7);
  auto [b, b_root] = tensor(DType::kF32, {}, 1);
  ASSERT_TRUE(a.Write((tmp / "a.pt").string(), a_root).ok());
  ASSERT_TRUE(b.Write((tmp / "b.pt").string(), b_root).ok());
  const std::string both = (tmp / "both").string();
  Result<AtomicFileWriter> out = AtomicFileWriter::Create(both, {});
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  ASSERT_TRUE(out->Append(std::string_view("x")).ok());  // the first archive starts unaligned
  Result<uint64_t> a_len = a.AppendTo(*out, a_root);
  Result<uint64_t> b_len = b.AppendTo(*out, b_root);
  ASSERT_TRUE(a_len.ok() && b_len.ok()) << a_len.status().ToString() << b_len.status().ToString();
  ASSERT_TRUE(out->Commit().ok());
  Result<std::string> a_file = ReadFileToString((tmp / "a.pt").string());
  Result<std::string> b_file = ReadFileToString((tmp / "b.pt").string());
  Result<std::string> joined = ReadFileToString(both);
  ASSERT_TRUE(a_file.ok() && b_file.ok() && joined.ok());
  EXPECT_EQ(*a_len, a_file->size());
  EXPECT_EQ(*b_len, b_file->size());
  EXPECT_EQ(*joined, "x" + *a_file + *b_file);
  // In memory, the same bytes (a DCP bytes item built before its file is written).
  Result<std::string> a_bytes = a.Archive(a_root);
  ASSERT_TRUE(a_bytes.ok()) << a_bytes.status().ToString();
  EXPECT_EQ(*a_bytes, *a_file);
  // A tree the writer refuses appends nothing.
  TorchTreeBuilder bad;
  const PickleNodeId bad_root = bad.Global("no_module");
  Result<AtomicFileWriter> out2 = AtomicFileWriter::Create((tmp / "bad").string(), {});
  ASSERT_TRUE(out2.ok());
  EXPECT_FALSE(bad.AppendTo(*out2, bad_root).ok());
  EXPECT_FALSE(bad.Archive(bad_root).ok());
  ASSERT_TRUE(out2->Commit().ok());
  Result<std::string> bad_file = ReadFileToString((tmp / "bad").string());
  ASSERT_TRUE(bad_file.ok());
  EXPECT_TRUE(bad_file->empty());
}

TEST(TorchTreeBuilderTest, TreesThatCannotBeWrittenAreRefusedNamingThePath) {
  const TempDir tmp;
  const fs::path dir = tmp / "refused";
  fs::create_directories(dir);
  const std::string path = (dir / "x.pt").string();
  const auto refused = [&](const TorchTreeBuilder& b, PickleNodeId root, StatusCode code,
                           const std::string& message) {
    const Status s = b.Write(path, root);
    EXPECT_EQ(s.code(), code) << s.ToString();
    EXPECT_NE(s.message().find(message), std::string::npos) << s.ToString();
  };
  {
    TorchTreeBuilder b;
    const PickleNodeId list = b.List();
    b.Append(list, list);
    refused(b, b.Dict({{b.Str("a"), list}}), StatusCode::kInvalidArgument,
            "\"a.0\": cyclic structure: a list contains itself");
  }
  {
    TorchTreeBuilder b;
    const PickleNodeId inner = b.Dict({{b.Int(3), b.Str("\xff")}});
    refused(b, b.Dict({{b.Str("outer"), b.List({inner})}}), StatusCode::kInvalidArgument,
            "\"outer.0.3\": a string that is not valid UTF-8");
  }
  {
    TorchTreeBuilder b;
    refused(b, b.List({b.Global("nodot")}), StatusCode::kInvalidArgument,
            "\"0\": global \"nodot\" is not \"module.name\"");
  }
  {
    TorchTreeBuilder b;
    const PickleNodeId w = b.Tensor(DType::kF32, {2}, Counting("", DType::kF32, {}, 0).fill);
    // The persistent id's key renamed to one no storage has.
    const PickleNodeId pid_tuple =
        b.tree().node(b.tree().node(b.tree().node(w).args).items[0]).items[0];
    b.mutable_node(b.tree().node(pid_tuple).items[2]).text = "missing";
    refused(b, b.Dict({{b.Str("m"), b.Dict({{b.Str("w"), w}})}}), StatusCode::kInvalidArgument,
            "object \"m.w\": storage \"missing\" is not among the storages");
    EXPECT_EQ(b.View(w, 1, {2}, {1}).status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(b.View(b.Int(0), 0, {1}, {1}).status().code(), StatusCode::kInvalidArgument);
  }
  EXPECT_TRUE(fs::is_empty(dir));  // nothing written, nothing left behind
}

TEST(PickleWriterTest, SerializedTreesParseBackToTheSameShape) {
  PickleTree tree;
  const auto add = [&](PickleKind kind, int64_t v = 0) {
    PickleNode n;
    n.kind = kind;
    n.int_value = v;
    return tree.Add(std::move(n));
  };
  const PickleNodeId big = add(PickleKind::kBigInt);
  tree.mutable_node(big).text = std::string("\x00\x00\x00\x00\x00\x00\x00\x00\x80", 9);
  const PickleNodeId list = add(PickleKind::kList);
  tree.mutable_node(list).items = {add(PickleKind::kInt, -1), big, add(PickleKind::kInt, 1 << 20)};
  Result<std::string> bytes = SerializePickle(tree, list);
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  Result<PickleTree> back = ParsePickle(std::as_bytes(std::span(bytes->data(), bytes->size())));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  const PickleNode& l = back->node(back->root());
  ASSERT_EQ(l.items.size(), 3u);
  EXPECT_EQ(back->node(l.items[0]).int_value, -1);
  EXPECT_EQ(back->node(l.items[1]).kind, PickleKind::kBigInt);
  EXPECT_EQ(back->node(l.items[1]).text, tree.node(big).text);
  EXPECT_EQ(back->node(l.items[2]).int_value, 1 << 20);
  EXPECT_EQ(SerializePickle(tree, 99).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace reshard
