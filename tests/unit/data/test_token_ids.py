"""Token ids are read from the .bin itself (not its .meta.json) when data is opened."""

import numpy as np


def test_token_ids_past_the_vocabulary_are_refused_from_the_bin_itself(tmp_path):
    from megatron_bridge.data.indexed import largest_token_id

    prefix = str(tmp_path / "d")
    ids = np.array([3, 9, 700, 4], dtype=np.uint16)
    ids.tofile(prefix + ".bin")
    head = b"MMIDIDX\x00\x00" + (1).to_bytes(8, "little") + bytes([8]) + (1).to_bytes(8, "little") * 2
    open(prefix + ".idx", "wb").write(head)
    assert largest_token_id(prefix) == 700
