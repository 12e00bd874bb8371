#include "reshard/checkpoint/megatron/run_config.h"

#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <optional>
#include <vector>

#include "reshard/base/json_reader.h"

namespace reshard {
namespace {

struct Line {
  size_t number = 0;  // 1-based
  size_t indent = 0;
  std::string_view text;  // without the indent and trailing blanks
};

std::vector<Line> SplitLines(std::string_view s) {
  std::vector<Line> out;
  size_t number = 0;
  while (!s.empty()) {
    const size_t end = s.find('\n');
    std::string_view line = s.substr(0, end);
    s.remove_prefix(end == std::string_view::npos ? s.size() : end + 1);
    ++number;
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ' || line.back() == '\t')) {
      line.remove_suffix(1);
    }
    size_t indent = 0;
    while (indent < line.size() && line[indent] == ' ') ++indent;
    line.remove_prefix(indent);
    if (line.empty() || line.front() == '#') continue;
    out.push_back({number, indent, line});
  }
  return out;
}

// A plain or quoted YAML scalar; nullopt for null.
std::optional<std::string> Scalar(std::string_view v) {
  if (v.empty() || v == "null" || v == "~") return std::nullopt;
  if (v.size() >= 2 && v.front() == '\'' && v.back() == '\'') {
    std::string out;
    v = v.substr(1, v.size() - 2);
    for (size_t i = 0; i < v.size(); ++i) {
      out.push_back(v[i]);
      if (v[i] == '\'' && i + 1 < v.size() && v[i + 1] == '\'') ++i;
    }
    return out;
  }
  if (v.size() >= 2 && v.front() == '"' && v.back() == '"') {
    return std::string(v.substr(1, v.size() - 2));
  }
  return std::string(v);
}

Result<double> PositiveNumber(const std::optional<std::string>& v, std::string_view field,
                              std::string_view what) {
  double x = 0;
  bool ok = v.has_value();
  if (ok) {
    const auto [end, err] = std::from_chars(v->data(), v->data() + v->size(), x);
    ok = err == std::errc() && end == v->data() + v->size() && std::isfinite(x) && x > 0;
  }
  if (ok) return x;
  return InvalidArgumentError(
      fmt::format("{}: peft.{} is {}, which is not a positive number", what, field,
                  v ? json::QuoteShort(*v) : std::string("missing or null")));
}

}  // namespace

Result<MegatronPeftConfig> ParseMegatronPeftConfig(std::string_view yaml, std::string_view what) {
  const std::vector<Line> lines = SplitLines(yaml);
  size_t at = 0;
  while (at < lines.size() && !(lines[at].indent == 0 && lines[at].text.starts_with("peft:"))) {
    ++at;
  }
  if (at == lines.size()) {
    return InvalidArgumentError(fmt::format(
        "{} has no peft: section (Megatron-Bridge writes one for a run that trains adapters)",
        what));
  }
  std::string_view head = lines[at].text.substr(5);
  while (!head.empty() && head.front() == ' ') head.remove_prefix(1);
  if (!head.empty()) {
    if (!Scalar(head)) {
      return InvalidArgumentError(fmt::format(
          "{}: peft is null: the run that wrote this checkpoint trained no adapter", what));
    }
    return InvalidArgumentError(fmt::format(
        "{} line {}: peft is {}, not a block of `key: value` lines (the form Megatron-Bridge "
        "writes)",
        what, lines[at].number, json::QuoteShort(head)));
  }
  MegatronPeftConfig out;
  std::optional<std::string> dim;
  std::optional<std::string> alpha;
  size_t child = 0;  // the section's keys' indent
  for (++at; at < lines.size() && lines[at].indent > 0; ++at) {
    const Line& line = lines[at];
    if (child == 0) child = line.indent;
    if (line.indent != child || line.text.starts_with("- ")) continue;  // a nested value
    const size_t colon = line.text.find(':');
    if (colon == std::string_view::npos ||
        (colon + 1 < line.text.size() && line.text[colon + 1] != ' ')) {
      return InvalidArgumentError(
          fmt::format("{} line {}: {} in the peft: section is not `key: value`", what, line.number,
                      json::QuoteShort(line.text)));
    }
    const std::string_view key = line.text.substr(0, colon);
    std::string_view value = line.text.substr(colon + 1);
    while (!value.empty() && value.front() == ' ') value.remove_prefix(1);
    if (key == "_target_") {
      out.target = Scalar(value).value_or("");
    } else if (key == "dim") {
      dim = Scalar(value);
    } else if (key == "alpha") {
      alpha = Scalar(value);
    } else if (key == "dropout") {
      if (std::optional<std::string> d = Scalar(value); d) {
        const auto [end, err] = std::from_chars(d->data(), d->data() + d->size(), out.dropout);
        if (err != std::errc() || end != d->data() + d->size()) out.dropout = 0;
      }
    }
  }
  RESHARD_ASSIGN_OR_RETURN(const double r, PositiveNumber(dim, "dim", what));
  if (r != std::floor(r) || r > 1e12) {
    return InvalidArgumentError(
        fmt::format("{}: peft.dim is {}, which is not a whole number", what, *dim));
  }
  out.dim = static_cast<Index>(r);
  RESHARD_ASSIGN_OR_RETURN(out.alpha, PositiveNumber(alpha, "alpha", what));
  return out;
}

}  // namespace reshard
