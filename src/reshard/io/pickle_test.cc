#include "reshard/io/pickle.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

namespace reshard {
namespace {

std::span<const std::byte> Bytes(const std::string& s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

// A little pickle assembler: each call appends one opcode with its operands.
struct P {
  std::string b = "\x80\x02";
  P& op(char c) {
    b.push_back(c);
    return *this;
  }
  P& u(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) b.push_back(static_cast<char>(v >> (8 * i)));
    return *this;
  }
  P& str(const std::string& s) { return op('X').u(s.size(), 4).raw(s); }
  P& raw(const std::string& s) {
    b += s;
    return *this;
  }
  P& global(const std::string& module, const std::string& name) {
    return op('c').raw(module + "\n" + name + "\n");
  }
  P& i1(uint8_t v) { return op('K').u(v, 1); }
  P& put(uint8_t i) { return op('q').u(i, 1); }
  P& get(uint8_t i) { return op('h').u(i, 1); }
  std::string stop() { return b + "."; }
};

Result<PickleTree> Parse(const std::string& s, const PickleOptions& options = {}) {
  return ParsePickle(Bytes(s), options);
}

TEST(PickleTest, ScalarsAndContainers) {
  // {"a": [1, -5, 300, 2**40, None, True, 1.5], "b": (b"xy", "é"), 7: {}}
  P p;
  p.op('}').op('(').str("a").op(']').op('(').i1(1).op('J').u(static_cast<uint32_t>(-5), 4);
  p.op('M').u(300, 2).op('\x8a').u(6, 1).u(uint64_t{1} << 40, 6).op('N').op('\x88');
  p.op('G').raw(std::string("\x3f\xf8\0\0\0\0\0\0", 8)).op('e');
  p.str("b").op('C').u(2, 1).raw("xy").op('\x8c').u(2, 1).raw("\xc3\xa9").op('\x86');
  p.i1(7).op('}').op('u');
  Result<PickleTree> t = Parse(p.stop());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  const PickleNode& root = t->node(t->root());
  ASSERT_EQ(root.kind, PickleKind::kDict);
  ASSERT_EQ(root.entries.size(), 3u);
  const PickleNode& list = t->node(root.entries[0].second);
  ASSERT_EQ(list.kind, PickleKind::kList);
  ASSERT_EQ(list.items.size(), 7u);
  EXPECT_EQ(t->node(list.items[0]).int_value, 1);
  EXPECT_EQ(t->node(list.items[1]).int_value, -5);
  EXPECT_EQ(t->node(list.items[2]).int_value, 300);
  EXPECT_EQ(t->node(list.items[3]).int_value, int64_t{1} << 40);
  EXPECT_EQ(t->node(list.items[4]).kind, PickleKind::kNone);
  EXPECT_TRUE(t->node(list.items[5]).bool_value);
  EXPECT_EQ(t->node(list.items[6]).float_value, 1.5);
  const PickleNode& tuple = t->node(root.entries[1].second);
  ASSERT_EQ(tuple.kind, PickleKind::kTuple);
  EXPECT_EQ(t->node(tuple.items[0]).text, "xy");
  EXPECT_EQ(t->node(tuple.items[0]).kind, PickleKind::kBytes);
  EXPECT_EQ(t->node(tuple.items[1]).text, "\xc3\xa9");
  EXPECT_EQ(t->node(root.entries[2].first).int_value, 7);
}

TEST(PickleTest, NegativeAndWideLongs) {
  P p;
  p.op(']').op('(');
  p.op('\x8a').u(1, 1).u(0xff, 1);               // -1
  p.op('\x8a').u(2, 1).u(0x7fff, 2);             // 32767
  p.op('\x8a').u(8, 1).u(uint64_t{1} << 63, 8);  // INT64_MIN
  p.op('\x8a').u(9, 1).u(0, 8).u(1, 1);          // 2**64
  p.op('\x8a').u(0, 1).op('e');                  // 0
  Result<PickleTree> t = Parse(p.stop());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  const auto& items = t->node(t->root()).items;
  EXPECT_EQ(t->node(items[0]).int_value, -1);
  EXPECT_EQ(t->node(items[1]).int_value, 32767);
  EXPECT_EQ(t->node(items[2]).int_value, INT64_MIN);
  EXPECT_EQ(t->node(items[3]).kind, PickleKind::kBigInt);
  EXPECT_EQ(t->node(items[3]).text.size(), 9u);
  EXPECT_EQ(t->node(items[4]).int_value, 0);
}

TEST(PickleTest, MemoSharesObjectsAndRepeatedKeysReplace) {
  // l = []; d = {"x": l, "y": l, "x": 3}; l.append(1)   (through the memo)
  P p;
  p.op('}').put(0).str("x").op(']').put(1).op('s').str("y").get(1).op('s');
  p.str("x").i1(3).op('s').get(1).i1(1).op('a').op('0');
  Result<PickleTree> t = Parse(p.stop());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  const PickleNode& d = t->node(t->root());
  ASSERT_EQ(d.entries.size(), 2u);
  EXPECT_EQ(t->node(d.entries[0].first).text, "x");
  EXPECT_EQ(t->node(d.entries[0].second).int_value, 3);
  const PickleNode& l = t->node(d.entries[1].second);
  ASSERT_EQ(l.kind, PickleKind::kList);
  EXPECT_EQ(l.items.size(), 1u);  // the append through the memo reached the shared list
}

TEST(PickleTest, AllowedGlobalsBecomeValuesOrInertRecords) {
  P p;
  p.op('(');
  p.global("collections", "OrderedDict").op(')').op('R');
  p.global("torch", "Size").i1(2).i1(3).op('\x86').op('\x85').op('R');
  p.global("__builtin__", "set").op(']').i1(4).op('a').op('\x85').op('R');
  p.global("_codecs", "encode").str("a\xc3\xbf").str("latin1").op('\x86').op('R');
  p.global("torch", "float16");
  p.global("argparse", "Namespace").op(')').op('\x81').op('}').str("lr").i1(1).op('s').op('b');
  p.op('\x8c').u(5, 1).raw("torch").op('\x8c').u(6, 1).raw("device").op('\x93');
  p.str("cpu").op('\x85').op('R');
  p.op('l');
  Result<PickleTree> t = Parse(p.stop());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  const auto& v = t->node(t->root()).items;
  ASSERT_EQ(v.size(), 7u);
  EXPECT_EQ(t->node(v[0]).kind, PickleKind::kDict);
  EXPECT_TRUE(t->node(v[0]).ordered);
  EXPECT_EQ(t->node(v[1]).kind, PickleKind::kTuple);
  EXPECT_EQ(t->node(v[1]).items.size(), 2u);
  EXPECT_EQ(t->node(v[2]).kind, PickleKind::kSet);
  EXPECT_EQ(t->node(v[3]).kind, PickleKind::kBytes);
  EXPECT_EQ(t->node(v[3]).text, "a\xff");
  EXPECT_EQ(t->node(v[4]).kind, PickleKind::kGlobal);
  EXPECT_EQ(t->node(v[4]).text, "torch.float16");
  const PickleNode& ns = t->node(v[5]);
  ASSERT_EQ(ns.kind, PickleKind::kRecord);
  EXPECT_EQ(ns.text, "argparse.Namespace");
  ASSERT_NE(ns.state, kNoPickleNode);
  EXPECT_EQ(t->node(ns.state).entries.size(), 1u);
  EXPECT_EQ(t->node(v[6]).text, "torch.device");
  EXPECT_EQ(t->node(t->node(t->node(v[6]).args).items[0]).text, "cpu");
}

TEST(PickleTest, ExtraRecordClassesAreAccepted) {
  const std::string s = P().global("my.pkg", "Mode").i1(1).op('\x85').op('R').stop();
  EXPECT_EQ(Parse(s).status().code(), StatusCode::kInvalidArgument);
  PickleOptions options;
  options.extra_record_classes = {"my.pkg.Mode"};
  Result<PickleTree> t = Parse(s, options);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->node(t->root()).text, "my.pkg.Mode");
}

// The globals a hostile pickle would call, directly and behind STACK_GLOBAL: refused where
// they are named, before any REDUCE.
TEST(PickleTest, CodeGlobalsRefusedNamingGlobalAndByte) {
  struct Case {
    std::string pickle;
    std::string message;
  };
  const std::vector<Case> cases = {
      {P().global("os", "system").str("touch /tmp/x").op('\x85').op('R').stop(),
       "pickle byte 2: global os.system is not allowed"},
      {P().global("builtins", "exec").str("1").op('\x85').op('R').stop(),
       "pickle byte 2: global builtins.exec is not allowed"},
      {P().global("subprocess", "Popen").str("ls").op('\x85').op('R').stop(),
       "global subprocess.Popen is not allowed"},
      {P().str("posix").str("system").op('\x93').stop(),
       "pickle byte 23: global posix.system is not allowed"},
      {P().global("torch", "load").stop(), "global torch.load is not allowed"},
      {P().global("collections", "defaultdict").stop(), "collections.defaultdict is not allowed"},
  };
  for (const Case& c : cases) {
    Result<PickleTree> t = Parse(c.pickle);
    ASSERT_FALSE(t.ok()) << c.message;
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find(c.message), std::string::npos) << t.status().ToString();
  }
}

TEST(PickleTest, EveryCorruptionRefusedWithItsOwnMessage) {
  struct Case {
    std::string pickle;
    std::string message;
    StatusCode code = StatusCode::kDataLoss;
  };
  std::string deep = "\x80\x02";
  for (int i = 0; i < 1100; ++i) deep += "]";
  for (int i = 0; i < 1099; ++i) deep += "a";
  deep += ".";
  const std::vector<Case> cases = {
      {P().op('\xff').stop(), "pickle byte 2: opcode 0xFF is not read", StatusCode::kUnimplemented},
      {P().op('I').raw("1\n").stop(), "opcode 0x49 is not read", StatusCode::kUnimplemented},
      {P().get(9).stop(), "memo entry 9 was never set"},
      {P().op('X').u(100, 4).raw("abc").stop(), "operand of 100 bytes runs past the end"},
      {P().op('\x8d').u(uint64_t{1} << 63, 8).stop(), "operand of 9223372036854775808 bytes"},
      {P().op('a').stop(), "pickle byte 2: stack underflow"},
      {P().op(']').put(0).get(0).op('a').stop(), "cyclic structure: a list contains itself"},
      {P().op('N').b, "ends without STOP"},
      {P().op('N').stop() + "N", "1 bytes after STOP"},
      {P().op('\x8c').u(2, 1).raw("\xc3\x28").stop(), "string is not valid UTF-8"},
      {P().op(')').op('(').i1(1).op('e').stop(), "APPENDS on a tuple"},
      {P().i1(1).op(')').op('R').stop(), "REDUCE of a int, not a global"},
      {P().op('}').op('(').i1(1).op('u').stop(), "odd number"},
      {std::string("\x80\x09N."), "protocol 9"},
      {P().op('e').stop(), "no MARK on the stack"},
      {P().op('N').op('N').op('b').stop(), "BUILD on a None"},
      {P().global("collections", "OrderedDict").i1(1).op('\x85').op('R').stop(),
       "collections.OrderedDict called with arguments other than ()"},
      {P().op('c').raw("os").stop(), "no newline"},
      {deep, "nested deeper than 1000"},
  };
  for (const Case& c : cases) {
    Result<PickleTree> t = Parse(c.pickle);
    ASSERT_FALSE(t.ok()) << c.message;
    EXPECT_EQ(t.status().code(), c.code) << t.status().ToString();
    EXPECT_NE(t.status().message().find(c.message), std::string::npos) << t.status().ToString();
  }
}

// A pickle past a limit is malformed input (DataLoss), as no torch.save file comes near them.
TEST(PickleTest, LimitsOnNodesMemoAndMarks) {
  PickleOptions options;
  options.limits = {.max_nodes = 3, .max_memo = 1, .max_depth = 2};
  EXPECT_EQ(Parse(P().op('N').op('N').op('N').op('N').op('l').stop(), options).status().code(),
            StatusCode::kDataLoss);
  EXPECT_EQ(Parse(P().op('N').put(0).put(1).stop(), options).status().code(),
            StatusCode::kDataLoss);
  EXPECT_EQ(Parse(P().op('(').op('(').op('(').stop(), options).status().code(),
            StatusCode::kDataLoss);
}

// Nesting 10^5 deep, by tuples or by MARKs, is refused as malformed at the default limit.
TEST(PickleTest, HundredThousandDeepIsMalformed) {
  P tuples;
  tuples.i1(1);
  for (int i = 0; i < 100000; ++i) tuples.op('\x85');
  P marks;
  for (int i = 0; i < 100000; ++i) marks.op('(');
  marks.op('N');
  const struct {
    std::string pickle;
    std::string message;
  } cases[] = {{tuples.stop(), "objects nested deeper than 1000"},
               {marks.stop(), "more than 1000 nested MARKs"}};
  for (const auto& c : cases) {
    const Result<PickleTree> t = Parse(c.pickle);
    ASSERT_FALSE(t.ok()) << c.message;
    EXPECT_EQ(t.status().code(), StatusCode::kDataLoss) << t.status().ToString();
    EXPECT_NE(t.status().message().find(c.message), std::string::npos) << t.status().ToString();
  }
}

// l = (l, l) sixty times over, as torch.save writes it: each level recalls the one below
// from the memo twice. The tree holds one node per level (cost in proportion to the pickle),
// and says how large it is when every shared object is counted once per path to it.
TEST(PickleTest, SharedMemoDagIsOneNodePerObjectWithItsExpandedSize) {
  P p;
  p.i1(7).put(0);
  for (uint8_t i = 0; i < 60; ++i) p.get(i).get(i).op('\x86').put(static_cast<uint8_t>(i + 1));
  const Result<PickleTree> t = Parse(p.stop());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->size(), 61u);
  // e(0) = 1, e(d) = 1 + 2 e(d - 1): 2^(d+1) - 1.
  EXPECT_EQ(t->expanded_size(t->root()), (uint64_t{1} << 61) - 1);
  const PickleNodeId level1 = t->node(t->root()).items[0];
  EXPECT_EQ(t->expanded_size(level1), (uint64_t{1} << 60) - 1);
  // Past 2^64 the count saturates rather than wraps.
  P q;
  q.i1(7).put(0);
  for (uint8_t i = 0; i < 70; ++i) q.get(i).get(i).op('\x86').put(static_cast<uint8_t>(i + 1));
  const Result<PickleTree> big = Parse(q.stop());
  ASSERT_TRUE(big.ok()) << big.status().ToString();
  EXPECT_EQ(big->expanded_size(big->root()), UINT64_MAX);
}

// set(l) and torch.Size(t) copy the items of l or t into a new node: recalled from the memo a
// hundred times, a list of a hundred items would make 10^4 references from a kilobyte. What
// they copy may not pass the pickle's size in all (each item of a list Python pickles has an
// opcode of its own).
TEST(PickleTest, CopiesMayNotPassThePicklesSize) {
  const auto pickle = [](int copies) {
    P p;
    p.op(']').put(0).op('(');
    for (int i = 0; i < 100; ++i) p.i1(1);
    p.op('e').global("builtins", "set").put(1).op('0');
    for (int i = 0; i < copies; ++i) p.get(1).get(0).op('\x85').op('R').op('0');
    return p.get(0).stop();
  };
  EXPECT_TRUE(Parse(pickle(1)).ok()) << Parse(pickle(1)).status().ToString();
  const Result<PickleTree> t = Parse(pickle(100));
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(t.status().message().find("builtins.set would copy more than the pickle's"),
            std::string::npos)
      << t.status().ToString();
}

// A shared object walked first through a short path still counts at its deepest use: root =
// [A, [[A]]] with A = [[[]]] nests six objects, though a walk that skips what it has seen
// meets at most four on one path.
TEST(PickleTest, DepthCountsASharedObjectAtItsDeepestUse) {
  const std::string pickle = P().op(']')
                                 .op(']')
                                 .op(']')
                                 .op(']')
                                 .op('a')
                                 .op('a')
                                 .put(0)
                                 .op('a')
                                 .op(']')
                                 .op(']')
                                 .get(0)
                                 .op('a')
                                 .op('a')
                                 .op('a')
                                 .stop();
  PickleOptions options;
  options.limits.max_depth = 6;
  ASSERT_TRUE(Parse(pickle, options).ok()) << Parse(pickle, options).status().ToString();
  options.limits.max_depth = 5;
  const Result<PickleTree> refused = Parse(pickle, options);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(refused.status().message().find("nested deeper than 5"), std::string::npos)
      << refused.status().ToString();
}

TEST(PickleTest, EveryTruncationRefused) {
  P p;
  p.op('}').op('(').str("weight").global("torch._utils", "_rebuild_tensor_v2").op('(');
  p.op('(').str("storage").global("torch", "FloatStorage").str("0").str("cpu").i1(6).op('t');
  p.op('Q').i1(0).i1(2).i1(3).op('\x86').i1(3).i1(1).op('\x86').op('\x89');
  p.global("collections", "OrderedDict").op(')').op('R').op('t').op('R').op('u');
  const std::string full = p.stop();
  ASSERT_TRUE(Parse(full).ok()) << Parse(full).status().ToString();
  for (size_t n = 0; n < full.size(); ++n) {
    EXPECT_FALSE(Parse(full.substr(0, n)).ok()) << n;
  }
}

}  // namespace
}  // namespace reshard
