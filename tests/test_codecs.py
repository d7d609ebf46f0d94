"""Tests of bicodec_shm.codecs: codec token layouts, request checks, and Orpheus's token layout.

All torch-free: a subprocess checks that importing the package does not import torch.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from bicodec_shm.codecs import (
    BICODEC,
    LAYOUTS,
    SNAC_24KHZ,
    SNAC_32KHZ,
    SNAC_44KHZ,
    CodecLayout,
    check_request,
    codes_to_orpheus,
    custom_token_numbers,
    get_layout,
    orpheus_to_codes,
)
from bicodec_shm.codecs.orpheus import AUDIO_TOKEN_BASE, CUSTOM_TOKEN_OFFSET


def snac_codes(n: int, seed: int = 0, rates=(1, 2, 4)) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 4096, n * r) for r in rates]


def test_importing_codecs_does_not_import_torch():
    code = "import sys, bicodec_shm.codecs; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_layouts_describe_the_codecs():
    assert SNAC_24KHZ.level_rates == (1, 2, 4) and SNAC_24KHZ.codes_per_frame == 7
    assert SNAC_24KHZ.samples_per_frame == 2048 and not SNAC_24KHZ.takes_global_ids
    assert SNAC_32KHZ.n_levels == SNAC_44KHZ.n_levels == 4
    assert BICODEC.takes_global_ids and BICODEC.n_global == 32 and BICODEC.samples_per_frame == 320
    assert SNAC_24KHZ.frame_rate == pytest.approx(24000 / 2048)
    assert "1:2:4" in SNAC_24KHZ.describe() and "no global ids" in SNAC_24KHZ.describe()
    for layout in LAYOUTS.values():
        assert CodecLayout.from_dict(layout.to_dict()) == layout
        assert get_layout(layout.name) is layout


def test_unknown_codec_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown codec 'mimi'.*snac-24khz"):
        get_layout("mimi")
    with pytest.raises(ValueError, match="not a codec layout"):
        CodecLayout.from_dict({"name": "x"})


def test_check_request_accepts_and_converts():
    levels, glob, frames = check_request(SNAC_24KHZ, [list(c) for c in snac_codes(3)])
    assert frames == 3 and glob is None
    assert [a.dtype for a in levels] == [np.int32] * 3 and [len(a) for a in levels] == [3, 6, 12]
    semantic = np.arange(10)
    levels, glob, frames = check_request(BICODEC, [semantic], np.zeros(32, np.int64))
    assert frames == 10 and glob.dtype == np.int32 and len(glob) == 32


@pytest.mark.parametrize(
    ("layout", "levels", "glob", "message"),
    [
        (SNAC_24KHZ, snac_codes(3)[:2], None, r"snac-24khz takes 3 code level\(s\) at rates 1:2:4, got 2"),
        (SNAC_32KHZ, snac_codes(3), None, r"snac-32khz takes 4 code level"),
        (SNAC_24KHZ, [np.zeros(3, int), np.zeros(5, int), np.zeros(12, int)], None,
         r"levels\[1\] has 5 codes, but snac-24khz needs 2 per frame: 6 for the 3 frame"),
        (SNAC_24KHZ, [np.zeros(3, int), np.zeros(6, int), np.r_[np.zeros(11, int), 4096]], None,
         r"levels\[2\]\[11\] = 4096 is out of range: ids must be in 0..4095"),
        (SNAC_24KHZ, [np.array([-1, 0]), np.zeros(4, int), np.zeros(8, int)], None,
         r"levels\[0\]\[0\] = -1 is out of range"),
        (SNAC_24KHZ, snac_codes(3), np.zeros(32, int), r"snac-24khz takes no global ids"),
        (BICODEC, [np.zeros(5, int)], None, r"bicodec needs 32 global ids, got none"),
        (BICODEC, [np.zeros(5, int)], np.zeros(31, int), r"global_ids must have exactly 32 ids"),
        (SNAC_24KHZ, np.zeros(7, int), None, r"takes a sequence of 3 code level"),
        (SNAC_24KHZ, [[], [], []], None, r"levels\[0\] is empty"),
    ],
)  # fmt: skip
def test_check_request_rejects_bad_input(layout, levels, glob, message):
    with pytest.raises(ValueError, match=message):
        check_request(layout, levels, glob)


def test_check_request_enforces_max_frames():
    with pytest.raises(ValueError, match=r"levels\[0\] has 5 ids, more than the 4"):
        check_request(SNAC_24KHZ, snac_codes(5), max_frames=4)
    check_request(SNAC_24KHZ, snac_codes(4), max_frames=4)


def test_orpheus_tokens_round_trip_and_follow_orpheus_layout():
    levels = snac_codes(4, seed=1)
    ids = codes_to_orpheus(levels)
    assert len(ids) == 28
    # Orpheus's own decoder: code = N - 10 - 4096·(index % 7), N the custom token's number, and
    # frame j holds a_j, b_2j, c_4j, c_4j+1, b_2j+1, c_4j+2, c_4j+3 (orpheus_tts/decoder.py).
    numbers = ids - 128256
    orpheus_codes = [int(n) - 10 - (i % 7) * 4096 for i, n in enumerate(numbers)]
    a, b, c = levels
    want = []
    for j in range(4):
        want += [a[j], b[2 * j], c[4 * j], c[4 * j + 1], b[2 * j + 1], c[4 * j + 2], c[4 * j + 3]]
    assert orpheus_codes == [int(v) for v in want]
    back = orpheus_to_codes(ids)
    assert all(np.array_equal(x, y) for x, y in zip(back, levels))
    assert all(x.dtype == np.int32 for x in back)


def test_orpheus_custom_token_numbers():
    levels = snac_codes(2, seed=2)
    text = "".join(f"<custom_token_{n}>" for n in codes_to_orpheus(levels, base=CUSTOM_TOKEN_OFFSET))
    numbers = custom_token_numbers("noise " + text)
    assert numbers == list(codes_to_orpheus(levels) - 128256)
    back = orpheus_to_codes(numbers, base=CUSTOM_TOKEN_OFFSET)
    assert all(np.array_equal(x, y) for x, y in zip(back, levels))


def test_orpheus_special_tokens_are_skipped_as_orpheus_skips_them():
    """Orpheus's language model ends its speech with <custom_token_2> (and starts it with other
    special tokens below 10): they are not audio, wherever they are."""
    levels = snac_codes(3, seed=4)
    audio = [f"<custom_token_{n}>" for n in codes_to_orpheus(levels, base=CUSTOM_TOKEN_OFFSET)]
    text = "<custom_token_1>" + "".join(audio[:9]) + "<custom_token_5>" + "".join(audio[9:])
    text += "<custom_token_2>"  # the end of speech
    back = orpheus_to_codes(custom_token_numbers(text), base=CUSTOM_TOKEN_OFFSET)
    assert all(np.array_equal(x, y) for x, y in zip(back, levels))
    ids = codes_to_orpheus(levels)
    back = orpheus_to_codes([AUDIO_TOKEN_BASE - 9, *ids, AUDIO_TOKEN_BASE - 8])  # as language-model ids
    assert all(np.array_equal(x, y) for x, y in zip(back, levels))
    bad = [1, *custom_token_numbers("".join(audio)), 2]
    bad[5] = 10 + 6 * 4096  # audio token 4 carries position 6's offset; it is item 5 of what was passed
    with pytest.raises(ValueError, match=r"^token 5 \(frame 0, position 4, level 1\)"):
        orpheus_to_codes(bad, base=CUSTOM_TOKEN_OFFSET)
    with pytest.raises(ValueError, match=r"no audio token \(after skipping 2 special token\(s\)\)"):
        orpheus_to_codes([1, 2], base=CUSTOM_TOKEN_OFFSET)


def test_orpheus_rejects_a_partial_frame():
    ids = codes_to_orpheus(snac_codes(3))
    with pytest.raises(ValueError, match=r"20 Orpheus audio tokens, not a multiple of 7: 2 whole frame\(s\) "
                                         r"and 6 token\(s\) left over \(tokens 14..19\)"):  # fmt: skip
        orpheus_to_codes(ids[:-1])
    with pytest.raises(ValueError, match="holds no audio token"):
        orpheus_to_codes([])


def test_orpheus_rejects_a_token_with_another_positions_offset():
    ids = codes_to_orpheus(snac_codes(2)).copy()
    ids[9] = AUDIO_TOKEN_BASE + 5 * 4096 + 17  # position 2 of frame 1 with position 5's offset
    with pytest.raises(ValueError, match=r"token 9 \(frame 1, position 2, level 2\) = \d+ carries "
                                         r"position 5's offset \(code 17\), but position 2 takes ids "
                                         r"136458..140553"):  # fmt: skip
        orpheus_to_codes(ids)


@pytest.mark.parametrize("value", [AUDIO_TOKEN_BASE - 11, AUDIO_TOKEN_BASE + 7 * 4096, 5])
def test_orpheus_rejects_an_id_out_of_range(value):
    ids = codes_to_orpheus(snac_codes(2)).copy()
    ids[7] = value
    message = rf"token 7 \(frame 1, position 0, level 0\) = {value} is not an Orpheus audio token: "
    with pytest.raises(ValueError, match=message + r"audio ids are 128266..156937"):
        orpheus_to_codes(ids)


def test_orpheus_rejects_non_integer_input():
    with pytest.raises(ValueError, match=r"token_ids\[1\] = 2.5 is a float"):
        orpheus_to_codes([1, 2.5])
    with pytest.raises(ValueError, match="must be 1-D"):
        orpheus_to_codes(np.zeros((7, 2), np.int64))
