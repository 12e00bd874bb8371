"""reshard's canonical maps never use more pieces than DeepSpeed's own descriptions, and reach
the known minima (DESIGN 3)."""

from piece_counts import rows


def test_never_more_pieces_than_deepspeed_and_the_known_minima():
    table = rows()
    assert table
    for layout, shape, tp, ours, theirs in table:
        if theirs is not None:
            assert ours <= theirs, (layout, shape, tp, ours, theirs)
        expected = {"GPT-BigCode fused QKV (multi-query)": 2, "CodeGen fused QKV": 1,
                    "Yuan shared-QK value": 1, "Yuan shared-QK o_proj": 1,
                    "column split (dim 0)": 1, "row split (dim 1)": 1}.get(layout)
        if expected is not None:
            assert ours == expected, (layout, shape, tp, ours)
