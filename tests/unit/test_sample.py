"""A prepared sample is two compact arrays (int32 ids, uint8 mask) that still read as lists:
what every rank holds for 0.3-0.8 M samples, and what rank 0 broadcasts pickled."""
import pickle

import numpy as np
import pytest

from dflash.data.sample import Sample


def test_reads_as_lists_and_holds_five_bytes_a_token():
    s = Sample([151_935, 7, 0], [0, 1, 1])
    assert s.input_ids == [151_935, 7, 0] and s.loss_mask == [0, 1, 1]
    assert len(s) == 3 and s.loss_tokens == 2
    assert s.ids.dtype == np.int32 and s.mask.dtype == np.uint8
    assert s.ids.nbytes + s.mask.nbytes == 5 * len(s)
    assert s == Sample(np.array([151_935, 7, 0]), [0, 1, 1]) and s != Sample([151_935, 7, 1], [0, 1, 1])


def test_a_cut_is_a_copy_and_a_pickle_holds_only_the_sample():
    shard = np.arange(100_000, dtype=np.int32)  # a capture shard's ids: samples are views of it
    s = Sample(shard[10:20], np.ones(10, np.uint8))
    assert s.ids.base is not None and len(pickle.dumps(s)) < 1_000
    back = pickle.loads(pickle.dumps(s))
    assert back == s and back.input_ids == list(range(10, 20))
    cut = s.cut(4)
    assert cut.input_ids == [10, 11, 12, 13] and cut.ids.base is None
    assert s.cut(10) is s


def test_ids_that_do_not_fit_and_mismatched_masks_are_refused():
    with pytest.raises(OverflowError):
        Sample([2**31], [1])
    with pytest.raises(ValueError, match="one loss-mask entry per token id"):
        Sample([1, 2, 3], [1, 1])
