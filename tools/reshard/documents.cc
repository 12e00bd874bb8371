#include "documents.h"

#include <fmt/format.h>

#include "reshard/io/file.h"

namespace reshard::cli {

namespace {

std::string ReadingContext(const std::string& path) {
  return fmt::format("error reading \"{}\"", path);
}

}  // namespace

Result<ValidatedMapDocument> ReadValidatedMapDocument(const std::string& path) {
  RESHARD_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  Result<ValidatedMapDocument> doc = ValidateMapDocumentJson(text);
  if (!doc.ok()) return doc.status().Annotate(ReadingContext(path));
  return doc;
}

Result<MapDocument> ReadMapDocument(const std::string& path) {
  RESHARD_ASSIGN_OR_RETURN(ValidatedMapDocument doc, ReadValidatedMapDocument(path));
  Result<MapDocument> maps = std::move(doc).ToDocument();
  if (!maps.ok()) return maps.status().Annotate(fmt::format("\"{}\"", path));
  return maps;
}

Result<LayoutsDocument> ReadLayoutsDocument(const std::string& path) {
  RESHARD_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  Result<LayoutsDocument> doc = ParseLayoutsDocumentJson(text);
  if (!doc.ok()) return doc.status().Annotate(ReadingContext(path));
  return doc;
}

}  // namespace reshard::cli
