"""Packing of scoring rows: every continuation's targets, positions and visibility, rows filled first-fit."""
import jax.numpy as jnp
import numpy as np

from mesh_transformer.infer.score import Unit, pack, packed_mask


def test_pack_places_each_continuation_after_its_context_and_cuts_long_units():
    units = [Unit(tuple(range(1, 41)), tuple(tuple(range(100, 100 + n)) for n in (10, 20, 15))),
             Unit((7,), ((8, 9),)), Unit((5, 6), ((),))]
    rows, placed = pack(units, 64)
    assert rows.ids.shape == (3, 64)  # 39 + 45 tokens do not fit one row: three pieces, each with the context
    for unit, places in zip(units, placed):
        for cont, p in zip(unit.continuations, places):
            assert rows.targets[p.row, p.start:p.start + p.length].tolist() == list(cont)
            cols = rows.columns[p.row, p.start:p.start + p.length]
            assert rows.positions[p.row, cols].tolist() == list(range(len(unit.context) - 1,
                                                                      len(unit.context) - 1 + len(cont)))
            inputs = rows.ids[p.row, cols].tolist()
            assert inputs == ([unit.context[-1], *cont[:-1]] if cont else [])
    assert placed[2][0].length == 0


def test_packed_mask_sees_own_context_and_segment_only():
    groups = jnp.array([[0, 0, 0, 0, 1, 1]])
    segments = jnp.array([[0, 1, 1, 2, 0, 1]])
    mask = np.asarray(packed_mask(groups, segments))[0].astype(int)
    assert mask.tolist() == [[1, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [1, 1, 1, 0, 0, 0],
                             [1, 0, 0, 1, 0, 0],
                             [0, 0, 0, 0, 1, 0],
                             [0, 0, 0, 0, 1, 1]]
