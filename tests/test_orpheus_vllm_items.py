"""The Orpheus drop-in on the item streams vLLM yields (``result.outputs[0].text`` of each output).

vLLM emits one output per step. The step that samples the stop token (or a special token that
skip_special_tokens hides) adds no text: its cumulative text repeats the one before, its delta is
"". A consumer that lags gets several steps as one output: the latest text (cumulative, the
default ``RequestOutputKind``), or all their text (``DELTA``). ``vllm_items`` builds those shapes;
every preset, sync and async, must play every frame of the text it was given. Orpheus's own
``OrpheusModel.generate_speech`` then runs on them through ``install()``, with vLLM and
transformers stubbed (the engine yields those items) and everything else Orpheus's own code.

Ground truth: the whole decode (same seed) for ``default`` and ``exact``; Orpheus's own decoder
fed the same tokens one per item (its correct reading) for ``orpheus``.
"""

from __future__ import annotations

import asyncio
import sys
import types
from unittest import mock

import numpy as np
import pytest
import torch
from test_orpheus_tts import (
    agen,
    assert_chunks_within_1_lsb,
    collect,
    full_decode16,
    pcm,
    per_token_items,
    random_levels,
    server_noise,
    snr_db,
)
from test_snac_model import snac

from bicodec_shm.codecs import codes_to_orpheus
from bicodec_shm.integrations import orpheus_tts as dropin

# The fixtures of test_orpheus_tts: the tiny model, Orpheus's decoder on its twin, a server.
from test_orpheus_tts import model, orpheus, server  # noqa: F401,E402  isort: skip

END_OF_SPEECH = 2  # <custom_token_2>: Orpheus's language model ends its audio with it


def vllm_items(numbers, *, delta: bool, silent=(), merged=None) -> list[str]:
    """``outputs[0].text`` of each output vLLM yields for a request sampling ``<custom_token_N>``
    of ``numbers`` in order, then the stop token (no text: the last, finished output). Before
    each index in ``silent`` a special token is sampled that adds no text; ``merged`` maps a
    step to how many steps from it a lagging consumer gets as one output."""
    steps: list[str] = []
    for i, n in enumerate(numbers):
        if i in silent:
            steps.append("")
        steps.append(f"<custom_token_{n}>")
    steps.append("")  # the stop token's step
    merged = merged or {}
    items, text, i = [], "", 0
    while i < len(steps):
        group = steps[i : i + merged.get(i, 1)]
        text += "".join(group)
        items.append("".join(group) if delta else text)
        i += len(group)
    return items


FRAMES = 9
# A special token at tokens 5 and 30; tokens 10-11 in one item, 20-28 in one (across a frame's
# end), 40-54 in one (two frames' ends: the default preset's two chunks in one push).
SHAPES = {"silent": (5, 30), "merged": {11: 2, 22: 9, 33: 15}}


def test_the_shapes_are_what_vllm_streams():
    cumulative = vllm_items([10, 4106, 8202], delta=False, silent=(1,), merged={2: 2})
    whole = "<custom_token_10><custom_token_4106><custom_token_8202>"
    assert cumulative == ["<custom_token_10>", "<custom_token_10>", whole, whole]
    assert vllm_items([10, 4106, 8202], delta=True, silent=(1,), merged={2: 2}) == [
        "<custom_token_10>", "", "<custom_token_4106><custom_token_8202>", ""]  # fmt: skip


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("preset", dropin.PRESETS)
@pytest.mark.parametrize("delta", [False, True], ids=["cumulative", "delta"])
def test_vllm_item_streams_play_every_frame_of_their_text(
    orpheus, model, server, delta, preset, asynchronous  # noqa: F811
):
    """Repeated and empty items, merged steps and Orpheus's end-of-speech token: default and
    exact play all 9 frames (against the whole decode: >= 50 dB, and 1 LSB), orpheus plays
    Orpheus's chunks of the same tokens."""
    upstream, twin = orpheus
    levels = random_levels(FRAMES, seed=21)
    numbers = [*codes_to_orpheus(levels, base=10), END_OF_SPEECH]
    items = vllm_items(numbers, delta=delta, **SHAPES)
    assert (items[-1] == items[-2]) if not delta else (items[-1] == "")
    if asynchronous:
        ours = asyncio.run(collect(dropin.tokens_decoder(agen(items), name=server.name, preset=preset)))
    else:
        ours = list(dropin.tokens_decoder_sync(iter(items), name=server.name, preset=preset))
    if preset == "orpheus":
        with server_noise(model, twin):
            theirs = list(upstream.tokens_decoder_sync(iter(per_token_items(numbers[:-1]))))
        assert len(theirs) == FRAMES - 3
        assert_chunks_within_1_lsb(ours, theirs)
        return
    got, want = pcm(ours), full_decode16(model, levels)
    assert len(got) == FRAMES * 2048
    if preset == "exact":
        assert np.abs(got.astype(np.int32) - want).max() <= 1
    else:
        assert snr_db(got, want) >= 50


@pytest.mark.parametrize("delta", [False, True], ids=["cumulative", "delta"])
def test_the_repeated_last_item_adds_no_token_so_the_held_back_frames_play(model, delta):  # noqa: F811
    """8 frames: the default preset holds the last frames back for its lookahead; finish plays
    them (16,384 samples), after the stop step's repeated (or empty) item."""
    items = vllm_items(codes_to_orpheus(random_levels(8, seed=22), base=10), delta=delta)
    stream = dropin.OrpheusStream(model)
    out = [stream.push(item) for item in items]
    assert stream.audio_tokens == 56 and stream.frames == 8
    out.append(stream.finish())
    assert len(pcm(out)) == 8 * 2048


@pytest.mark.parametrize("delta", [False, True], ids=["cumulative", "delta"])
def test_a_merged_item_adds_every_token_it_holds(model, delta):  # noqa: F811
    """All 8 frames' tokens in two items (a consumer that lagged): both are read whole."""
    numbers = codes_to_orpheus(random_levels(8, seed=23), base=10)
    items = vllm_items(numbers, delta=delta, merged={0: 3, 3: 53})
    assert len(items) == 3  # 3 tokens, 53 tokens, the stop step
    stream = dropin.OrpheusStream(model)
    out = [stream.push(item) for item in items]
    assert stream.audio_tokens == 56
    out.append(stream.finish())
    assert len(pcm(out)) == 8 * 2048


@pytest.mark.parametrize(
    "items, tokens",
    [
        (["<custom_tok", "en_1", "2>"], (12,)),  # a delta split inside a token
        (["<custom_token_1", "<custom_token_12>"], (12,)),  # the same, cumulative: not token 1
        (["<custom_token_1>", "<custom_token_1><custom_token_12>"], (12,)),  # control, then audio
        (["<custom_token_1>", "<custom_token_12>"], (12,)),  # deltas: 12 does not start with 1>
        ([" <custom_token_12>\n", " <custom_token_12>\n<custom_token_4106> "], (12, 4106)),
        (["<custom_token_12> ", " <custom_token_4106>"], (12, 4106)),  # deltas with whitespace
        (["", "<custom_token_12>", "", "<custom_token_12><custom_token_4106>"], (12, 4106)),
        (["", "<custom_token_12>", "", "<custom_token_4106>", ""], (12, 4106)),
        (["tara: <custom_token_12> hi", "tara: <custom_token_12> hi<custom_token_4106>"], (12, 4106)),
        (["<custom_token_12>", "<custom_token_12>", "<custom_token_12>"], (12,)),  # repeats
        (["<custom_token_12><custom_token_4106><custom_token_3>", "<custom_token_8202"], (12, 4106)),
        (["<custom_token_12>", "<custom_token_ 4106>", "<custom_token_>", "<<custom_token_4106>"],
         (12, 4106)),  # not tokens, then one after a stray "<"
    ],
)
def test_items_are_read_as_text_wherever_they_split(model, items, tokens):  # noqa: F811
    """What each item adds: its new text's complete <custom_token_N> (N >= 10), in order."""
    stream = dropin.OrpheusStream(model)
    for item in items:
        assert stream.push(item) == b""
    assert stream._reading.partial == tokens
    assert stream.audio_tokens == len(tokens)


@pytest.mark.parametrize("delta", [False, True], ids=["cumulative", "delta"])
def test_a_bad_token_in_a_merged_item_raises_naming_it_and_keeps_nothing_of_the_item(model, delta):  # noqa: F811
    """Tokens 1-3 in one item, token 3 with code 4096: ValueError naming token 3, and the stream
    is as before the item; the good items then play all 8 frames."""
    levels = random_levels(8, seed=24)
    numbers = list(codes_to_orpheus(levels, base=10))
    bad = list(numbers)
    bad[3] = 10 + 3 * 4096 + 4096
    good_items = vllm_items(numbers, delta=delta, merged={1: 3})
    bad_item = vllm_items(bad, delta=delta, merged={1: 3})[1]
    stream = dropin.OrpheusStream(model)
    assert stream.push(good_items[0]) == b""
    before = stream._reading
    with pytest.raises(ValueError, match=r"audio token 3 of the stream \(frame 0, position 3\) is "
                       r"<custom_token_16394>, code 4096: position 3 takes <custom_token_12298>\.\."
                       r"<custom_token_16393> \(codes 0\.\.4095\); nothing of its item is kept"):  # fmt: skip
        stream.push(bad_item)
    assert stream._reading is before and stream.audio_tokens == 1
    out = [stream.push(item) for item in good_items[1:]]
    out.append(stream.finish())
    assert snr_db(pcm(out), full_decode16(model, levels)) >= 50


# -- OrpheusModel.generate_speech, Orpheus's own code, on vLLM's items ----------------------------


class StubEngine:
    """vLLM's AsyncLLMEngine as Orpheus uses it: ``generate`` yields outputs whose
    ``outputs[0].text`` are ``items`` (vLLM's default, cumulative text)."""

    def __init__(self, items):
        self.items, self.calls = items, []

    async def generate(self, prompt, sampling_params, request_id):
        self.calls.append((prompt, sampling_params, request_id))
        for i, text in enumerate(self.items):
            await asyncio.sleep(0)
            yield types.SimpleNamespace(outputs=[types.SimpleNamespace(text=text)],
                                        finished=i == len(self.items) - 1)  # fmt: skip


class StubTokenizer:
    def __call__(self, text, return_tensors):
        assert return_tensors == "pt"
        return types.SimpleNamespace(input_ids=torch.tensor([[ord(c) for c in text]]))

    def decode(self, ids):
        return "".join(chr(int(i)) if int(i) < 128000 else f"<{int(i)}>" for i in ids)


@pytest.mark.parametrize("preset", dropin.PRESETS)
def test_install_plays_every_frame_of_vllm_items_through_orpheus_model_generate_speech(
    orpheus, model, server, monkeypatch, preset  # noqa: F811
):
    """OrpheusModel(...) and generate_speech as Orpheus wrote them (its engine thread and queue,
    its tokens_decoder_sync import), on an engine yielding vLLM's shapes."""
    upstream, twin = orpheus
    levels = random_levels(FRAMES, seed=25)
    numbers = [*codes_to_orpheus(levels, base=10), END_OF_SPEECH]
    engine = StubEngine(vllm_items(numbers, delta=False, **SHAPES))
    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = lambda **kwargs: kwargs
    vllm.AsyncEngineArgs = lambda **kwargs: kwargs
    vllm.AsyncLLMEngine = types.SimpleNamespace(from_engine_args=lambda args: engine)
    transformers = types.ModuleType("transformers")
    transformers.AutoTokenizer = types.SimpleNamespace(from_pretrained=lambda name: StubTokenizer())
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "transformers", transformers)
    monkeypatch.setattr(snac.SNAC, "from_pretrained", mock.Mock(side_effect=AssertionError("SNAC loaded")))
    try:
        dropin.install(name=server.name, preset=preset)
        from orpheus_tts import OrpheusModel

        tts = OrpheusModel("canopylabs/orpheus-tts-0.1-finetune-prod")
        chunks = list(tts.generate_speech(prompt="hello", voice="tara"))
    finally:
        dropin.uninstall()
        for name in [m for m in sys.modules if m.split(".")[0] == "orpheus_tts"]:
            del sys.modules[name]
    assert len(engine.calls) == 1 and engine.calls[0][0].startswith("<128259>tara: hello")
    if preset == "orpheus":
        with server_noise(model, twin):
            theirs = list(upstream.tokens_decoder_sync(iter(per_token_items(numbers[:-1]))))
        assert_chunks_within_1_lsb(chunks, theirs)
    else:
        assert len(pcm(chunks)) == FRAMES * 2048
        assert snr_db(pcm(chunks), full_decode16(model, levels)) >= 50


def test_a_delta_that_repeats_the_frame_before_it_is_still_a_delta(model):  # noqa: F811
    """Frames 0 and 1 as two deltas, then frame 1 again (silence repeats its codes) and frame 3:
    the third delta starts with the one before it but not with the whole text, so it is new."""
    levels = random_levels(4, seed=26)
    numbers = codes_to_orpheus(levels, base=10)
    frame = [per_token_items(numbers[7 * f : 7 * f + 7]) for f in range(4)]
    repeated = [np.concatenate([v[r : 2 * r], v[r : 2 * r], v[3 * r :]]) for v, r in zip(levels, (1, 2, 4))]
    deltas = ["".join(frame[0]), "".join(frame[1]), "".join(frame[1] + frame[3])]
    stream = dropin.OrpheusStream(model, preset="exact")
    out = [stream.push(item) for item in deltas] + [stream.finish()]
    assert stream.audio_tokens == 28
    want = full_decode16(model, [np.concatenate([v[:r], w]) for v, w, r in zip(levels, repeated, (1, 2, 4))])
    assert np.abs(pcm(out).astype(np.int32) - want).max() <= 1
