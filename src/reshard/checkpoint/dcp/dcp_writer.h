// Writing PyTorch Distributed Checkpoints (torch.distributed.checkpoint, "DCP") from any shard
// source, as FSDP2 would have saved them at a world size of our choosing.
//
// The output directory holds `.metadata` and one data file `__{r}_0.distcp` per rank r < N,
// as DCP's FileSystemWriter writes them (one file per rank, one thread):
//   - every tensor is split along dim 0 as FSDP2's Shard(0) splits it (torch.chunk: chunks of
//     ceil(d0 / N) rows, so trailing ranks may hold a short chunk or nothing); a 0-d tensor and
//     a tensor with no elements are one chunk, on rank 0. Empty chunks are not stored;
//   - rank r's file is its chunks, tensor after tensor in the source's order, each item a whole
//     torch.save archive of the chunk (a dense tensor of its own storage, root "archive"),
//     its zip offsets counted from the item's first byte;
//   - `.metadata` is the pickle of DCP's Metadata: per key a TensorStorageMetadata (properties,
//     global size, chunks), planner_data (each key's nested path), storage_data (per chunk, a
//     MetadataIndex to its _StorageInfo: file, offset, length), StorageMeta (checkpoint_id the
//     output path as a str, save_id kDcpSaveId) and version "1.0.0". Only DCP's dataclasses,
//     torch.Size, dtypes, torch.strided and DCP's memory-format enum appear in it, so
//     torch.distributed.checkpoint.load reads it at any world size and
//     format_utils.dcp_to_torch_save reads it whole.
// Keys: a tensor "<param>.<state>" where "<param>" is another tensor of the source and
// "<state>" one of reshard's names of optimizer state (exp_avg, exp_avg_sq, DeepSpeed's fp32
// master weights) is stored as "optim.state.<param>.<state>", nested as get_state_dict's
// optimizer state dict (planner_data ("optim", "state", "<param>", "<state>")); every other
// tensor ("a.b" beside "a" included) under its own name at the top level, as
// dcp.save(model.state_dict()) stores it. A source that records its state dict's structure (a
// DCP checkpoint: StateDictStructure) keeps it instead: each tensor its key and nested path
// (planner_data, list indices as ints), and every non-tensor value (the optimizer's
// param_groups and step, a scheduler's or data loader's state: DCP's bytes items) is written
// as stored, a BytesStorageMetadata item at the start of rank 0's file, so that
// dcp.load of the trainer's whole state dict finds every key. A universal checkpoint gives
// the structure get_state_dict has for an FSDP2 model and torch's AdamW (universal.h,
// OpenUniversal): "model.<param>" its fp32 masters, "optim.state.<param>.{step,exp_avg,
// exp_avg_sq}" and "optim.param_groups.<g>.<key>" from its zero/optimizer_state.pt. Other
// sources hold tensors only: neither the optimizer's step nor its param_groups are written.
//
// Each chunk is produced straight from the source shards by a transfer plan (never the full
// tensor): memory is bounded by the largest chunk. Files are written in parallel, each by one
// thread (across processes, each its share); the output appears atomically (output_dir.h).
#ifndef RESHARD_CHECKPOINT_DCP_DCP_WRITER_H_
#define RESHARD_CHECKPOINT_DCP_DCP_WRITER_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/base/result.h"
#include "reshard/checkpoint/checkpoint_ops.h"
#include "reshard/checkpoint/source.h"

namespace reshard {

/// The box [offsets, offsets + sizes) of a global tensor, stored by `rank`.
struct DcpWriteChunk {
  Rank rank = 0;
  Shape offsets;
  Shape sizes;
  friend bool operator==(const DcpWriteChunk&, const DcpWriteChunk&) = default;
};

/// The chunks of a tensor of `shape` at `world_size` ranks (FSDP2's Shard(0), above): one per
/// rank holding rows, in rank order.
std::vector<DcpWriteChunk> DcpShard0Chunks(const Shape& shape, int world_size);

/// One tensor of a DCP checkpoint to write.
struct DcpTensorToWrite {
  size_t param = 0;               // its index in the source manifest
  std::string key;                // the state dict's flattened key
  std::vector<std::string> path;  // the nested keys it unflattens to (planner_data)
  DType dtype = DType::kF32;
  Shape shape;  // global (the source's valid shape)
  std::vector<DcpWriteChunk> chunks;
  std::vector<bool> path_is_index;  // parallel to path: list indices (ints); empty: none
};

/// The tensors of `manifest` as DCP stores them at `world_size` (keys and chunks above): a
/// tensor `structure` gives a path takes that path, dotted, as its key (a DCP source's own
/// key), with that path.
/// FailedPrecondition when two tensors would take one key, or a key is both a tensor and a
/// prefix of others.
Result<std::vector<DcpTensorToWrite>> PlanDcpTensors(const Manifest& manifest, int world_size,
                                                     const StateDictStructure* structure = nullptr);

/// Where an item lies.
struct DcpWrittenItem {
  std::string file;  // relative to the checkpoint
  uint64_t offset = 0;
  uint64_t length = 0;
};

/// A non-tensor value to write (a BytesStorageMetadata item): its key, path, stored bytes'
/// transforms and where its bytes lie.
struct DcpObjectToWrite {
  std::string key;
  std::vector<std::string> path;
  std::vector<bool> path_is_index;  // parallel to path
  std::vector<std::string> transforms;
  DcpWrittenItem item;
};

/// The bytes of `.metadata`: `items[t][c]` is where chunk c of tensors[t] lies; `objects` are
/// the non-tensor values. InvalidArgument when items do not match the chunks.
Result<std::string> DcpMetadataPickle(const std::vector<DcpTensorToWrite>& tensors,
                                      const std::vector<std::vector<DcpWrittenItem>>& items,
                                      const std::string& checkpoint_id,
                                      const std::vector<DcpObjectToWrite>& objects = {});

/// "__{rank}_0.distcp".
std::string DcpFileName(Rank rank);
inline constexpr char kDcpMetadataName[] = ".metadata";
/// How every `.metadata` reshard writes begins (a protocol-2 pickle of DCP's Metadata; torch
/// writes protocol 4).
inline constexpr std::string_view kDcpMetadataPrefix =
    "\x80\x02"
    "ctorch.distributed.checkpoint.metadata\nMetadata\n";
/// The StorageMeta.save_id of every `.metadata` reshard writes (torch's FileSystemWriter records
/// a uuid4 there, which never takes this form): with the files the metadata names and nothing
/// else beside it, what lets an output replace a DCP checkpoint of reshard's (output_dir.h).
inline constexpr char kDcpSaveId[] = "reshard/dcp-writer";

/// Writes `source` as a DCP checkpoint for `world_size` ranks into `out_dir` (above), with
/// the options of ConvertFrom (replicas verified unless told not to; max_shard_bytes must be
/// 0: one file per rank), keeping `structure` (the source's state dict's, or null) when given.
/// FailedPrecondition when a non-tensor value would take a tensor's key. With several
/// processes, every process passes a source of the same input.
Status WriteDcp(ShardSource& source, int world_size, const std::string& out_dir,
                const CheckpointOptions& options = {},
                const StateDictStructure* structure = nullptr);

}  // namespace reshard

#endif  // RESHARD_CHECKPOINT_DCP_DCP_WRITER_H_
