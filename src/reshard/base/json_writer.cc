#include "reshard/base/json_writer.h"

#include <fmt/format.h>

#include <algorithm>

#include "reshard/base/json_reader.h"

namespace reshard::json {

namespace {

// Levels of containers in `value`: 0 for a scalar, 1 for [1, 2], 2 for [[1]] or {"a": [1]}.
int Depth(const OrderedJson& value) {
  if (!value.is_structured()) return 0;
  int inner = 0;
  for (const OrderedJson& v : value) inner = std::max(inner, Depth(v));
  return inner + 1;
}

void WriteScalar(std::string& out, const OrderedJson& value) {
  switch (value.type()) {
    case OrderedJson::value_t::string:
      out += Quote(value.get_ref<const std::string&>());
      return;
    case OrderedJson::value_t::number_float: {
      std::string s = fmt::format("{}", value.get<double>());
      if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
      out += s;
      return;
    }
    default:  // integers, booleans, null
      out += value.dump();
  }
}

// The outermost container (a document) is always one member per line.
void Write(std::string& out, const OrderedJson& value, int inline_depth, size_t indent) {
  if (!value.is_structured()) return WriteScalar(out, value);
  const bool object = value.is_object();
  const bool one_line = value.empty() || (indent > 0 && Depth(value) <= inline_depth);
  const std::string inner(one_line ? 0 : indent + 2, ' ');
  out += object ? '{' : '[';
  bool first = true;
  for (auto it = value.begin(); it != value.end(); ++it) {
    out += first ? (one_line ? "" : "\n") : (one_line ? ", " : ",\n");
    first = false;
    out += inner;
    if (object) out += Quote(it.key()) + ": ";
    Write(out, it.value(), inline_depth, indent + 2);
  }
  if (!one_line) {
    out += '\n';
    out.append(indent, ' ');
  }
  out += object ? '}' : ']';
}

}  // namespace

void AppendMember(OrderedJson& object, std::string key, OrderedJson value) {
  if (object.is_null()) object = OrderedJson::object();
  // The members are a vector of (key, value) pairs: append to it without the search.
  auto& members =
      static_cast<OrderedJson::object_t::Container&>(*object.get_ptr<OrderedJson::object_t*>());
  members.emplace_back(std::move(key), std::move(value));
}

std::string WriteJson(const OrderedJson& value, int inline_depth) {
  std::string out;
  Write(out, value, inline_depth, 0);
  return out;
}

}  // namespace reshard::json
