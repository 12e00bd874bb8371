"""A user's program, checked with mypy --strict against the package's annotations and stubs
(tests/python/test_package_docs.py)."""

import reshard


def rows_split(rows: int, cols: int, tp: int) -> reshard.ParamMap:
    per = rows // tp
    return reshard.ParamMap.from_dict({
        "logical_shape": [rows, cols],
        "ranks": {str(r): {"shard_shape": [per, cols],
                           "pieces": [{"shape": [per, cols], "source": [r * per * cols, [cols, 1]],
                                       "dest": [0, [cols, 1]], "locations": [r]}]}
                  for r in range(tp)},
    })


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
    try:
        reshard.ParamMap.from_json("{")
    except reshard.MapError as e:
        print(e.code)


if __name__ == "__main__":
    main()
