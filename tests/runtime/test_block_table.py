"""Block table: dirty-row sync, resize, slot mapping and the length limit."""

import numpy as np
import pytest
import torch

from blocktune.runtime.block_table import BlockTable, SequenceTooLong


def test_sync_uploads_only_dirty_rows_and_matches_the_host_mirror():
    table = BlockTable(4, 3, block_size=8)
    table.set_row(0, [5, 2])
    table.set_row(2, [7, 1, 4])
    assert table.sync() == 2
    assert table.sync() == 0
    assert np.array_equal(table.device_table.numpy(), table.host)
    # Clobber a clean row on the device: only dirty rows move, so it stays clobbered.
    table.device_table[3, 0] = 99
    table.set_row(0, [6])
    assert table.sync() == 1
    assert table.device_table[0].tolist() == [6, 0, 0]
    assert table.device_table[3, 0].item() == 99


def test_resize_keeps_contents():
    table = BlockTable(2, 2, block_size=4)
    table.set_row(0, [3, 1])
    table.set_row(1, [2])
    table.sync()
    table.resize(max_seqs=3, max_blocks_per_seq=5)
    assert table.host.shape == (3, 5)
    assert table.row(0) == [3, 1]
    assert table.row(1) == [2]
    assert table.device_table.tolist() == [[3, 1, 0, 0, 0], [2, 0, 0, 0, 0], [0] * 5]
    table.set_row(2, [1, 2, 3, 4, 5])
    table.sync()
    assert np.array_equal(table.device_table.numpy(), table.host)
    with pytest.raises(ValueError, match="only grows"):
        table.resize(max_seqs=1)


def test_over_long_sequence_raises_and_writes_nothing():
    table = BlockTable(2, 3, block_size=16)
    table.set_row(1, [0, 1])
    with pytest.raises(SequenceTooLong, match=r"4 blocks \(64 tokens.*3 blocks \(48 tokens\)"):
        table.set_row(1, [0, 1, 2, 3])
    assert table.row(1) == [0, 1]


def test_slot_mapping_translates_positions_through_the_row():
    table = BlockTable(1, 4, block_size=4)
    table.set_row(0, [2, 0, 5])
    slots = table.slot_mapping(0, range(10))
    assert slots.tolist() == [8, 9, 10, 11, 0, 1, 2, 3, 20, 21]
    with pytest.raises(SequenceTooLong, match="position 12"):
        table.slot_mapping(0, [12])


def test_device_table_is_int32_on_the_requested_device():
    table = BlockTable(2, 2, block_size=4, device="cpu")
    assert table.device_table.dtype == torch.int32
    assert table.device_table.device.type == "cpu"
