"""A user's program, checked with mypy --strict against the package's annotations and stubs
(tests/python/test_package_docs.py)."""

from typing import Any, Optional

import reshard
import reshard.distributed


def rows_split(rows: int, cols: int, tp: int) -> reshard.ParamMap:
    per = rows // tp
    return reshard.ParamMap.from_dict({
        "logical_shape": [rows, cols],
        "ranks": {str(r): {"shard_shape": [per, cols],
                           "pieces": [{"shape": [per, cols], "source": [r * per * cols, [cols, 1]],
                                       "dest": [0, [cols, 1]], "locations": [r]}]}
                  for r in range(tp)},
    })


def weight_sync(shards: dict[str, Any]) -> dict[str, Any]:
    """TP 4 on processes 0-3 -> TP 2 on processes 4-5 (not run here: it needs a group)."""
    sources, targets = {"w": rows_split(8, 4, 4)}, {"w": rows_split(8, 4, 2)}
    sync = reshard.distributed.Redistributor(sources, targets, source_ranks=[0, 1, 2, 3],
                                             target_ranks=[4, 5], bucket_bytes=1 << 20)
    out = sync.run(shards)
    stats = sync.last_stats
    assert stats is None or stats["received"] >= stats["lower_bound"]
    schedule: dict[str, Any] = reshard.distributed.redistribute(
        sources, targets, shards, source_ranks=[0, 1, 2, 3], target_ranks=[4, 5], dry_run=True)
    assert schedule["rounds"] >= 0
    result: dict[str, Any] = out
    return result


def deepspeed_outputs(save_dir: str) -> None:
    """A DeepSpeed checkpoint through reshard.checkpoint (not run here: it needs one)."""
    reshard.checkpoint.gather(save_dir, "hf", fp32=True)
    reshard.checkpoint.convert(save_dir, "tp1", tp=1, weights_only=True)
    reshard.checkpoint.convert(save_dir, "universal", to="universal", sync=False)
    report: reshard.DiffReport = reshard.diff(save_dir, "hf", rtol=1e-3)
    first: Optional[reshard.TensorDifference] = next(iter(report.differences), None)
    index: Optional[int] = None if first is None else first.index
    print(report.equal, report.elements_compared, index)


def main() -> None:
    source, target = rows_split(8, 4, 4), rows_split(8, 4, 2)
    plan: reshard.Plan = reshard.compose(source=source, target=target)
    pieces: list[reshard.Piece] = source.pieces(0)
    moves: list[reshard.Move] = plan.moves
    report: reshard.DegreeReport = reshard.degree({"model_type": "llama", "num_attention_heads": 8,
                                                   "num_key_value_heads": 8, "hidden_size": 64,
                                                   "intermediate_size": 128, "vocab_size": 256})
    shape: tuple[int, ...] = target.shard_shape(0)
    print(len(pieces), len(moves), report.max_tp_degree, shape, plan.bytes_moved("F32"))
    sync: reshard.SyncPlan = reshard.plan_sync(
        {"hosts": [{"name": "a", "gpus": 4}]},
        config={"model_type": "llama", "num_attention_heads": 8, "num_key_value_heads": 8,
                "hidden_size": 64, "intermediate_size": 128, "vocab_size": 256,
                "num_hidden_layers": 2},
        trainer={"tp": 2}, engine_tp=2)
    links: dict[str, int] = dict(sync.links)
    busiest: Optional[reshard.SyncLink] = sync.busiest_link
    print(sync.one_copy_bytes, sync.predicted_s, len(links), busiest, len(sync.json()))
    try:
        reshard.ParamMap.from_json("{")
    except reshard.MapError as e:
        print(e.code)


if __name__ == "__main__":
    main()
