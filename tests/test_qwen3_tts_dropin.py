"""bicodec_shm.integrations.qwen3_tts: ``Qwen3TTSModel``'s ``speech_tokenizer.decode`` call,
answered by a ``serve --codec qwen3-tts-12hz --preset tiny`` server process (real shared memory).

Ground truth: qwen-tts's own ``Qwen3TTSTokenizer.decode`` (``qwen_tts/inference/
qwen3_tts_tokenizer.py``, loaded as it is) over qwen-tts's ``Qwen3TTSTokenizerV2Model`` holding the
server's weights (the tiny preset, seed 0), for every input form it takes.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from test_qwen3_tts_model import upstream_twin
from upstream_qwen3_tts import upstream

from bicodec_shm import DecoderClient, NoEncoderError
from bicodec_shm.integrations import qwen3_tts
from bicodec_shm.integrations.qwen3_tts import SharedSpeechTokenizer, install, uninstall
from bicodec_shm.model.qwen3_tts import Qwen3TTSDecoder

TOL = 1e-5
SPF = 1920


def qwen_tts_tokenizer(twin):
    """qwen-tts's ``Qwen3TTSTokenizer`` (its file as it is) around ``twin``. Its module imports
    librosa and soundfile for ``encode``'s audio loading, which decoding never runs: empty
    stand-ins take their place while it loads where they are not installed."""
    up = upstream()
    core = sys.modules["qwen_tts.core"]
    core.Qwen3TTSTokenizerV2Config = up.configuration.Qwen3TTSTokenizerV2Config
    core.Qwen3TTSTokenizerV2Model = up.modeling.Qwen3TTSTokenizerV2Model
    core.Qwen3TTSTokenizerV1Config = core.Qwen3TTSTokenizerV1Model = object  # the 25 Hz one: unused
    name = "qwen_tts.inference.qwen3_tts_tokenizer"
    if name not in sys.modules:
        root = Path(sys.modules["qwen_tts"].__path__[0])
        package = types.ModuleType("qwen_tts.inference")
        package.__path__ = [str(root / "inference")]
        sys.modules["qwen_tts.inference"] = package
        stubs = [m for m in ("librosa", "soundfile") if importlib.util.find_spec(m) is None]
        for m in stubs:
            sys.modules[m] = types.ModuleType(m)
        try:
            spec = importlib.util.spec_from_file_location(name, root / "inference" / "qwen3_tts_tokenizer.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        finally:
            for m in stubs:
                del sys.modules[m]
    tokenizer = sys.modules[name].Qwen3TTSTokenizer()
    tokenizer.model, tokenizer.config, tokenizer.device = twin, twin.config, torch.device("cpu")
    return tokenizer


@pytest.fixture(scope="module")
def reference():
    """qwen-tts's tokenizer with the weights of the server's tiny model."""
    return qwen_tts_tokenizer(upstream_twin(Qwen3TTSDecoder.from_config("tiny", seed=0)))


@pytest.fixture
def server(start_server, shm_name):
    start_server("--codec", "qwen3-tts-12hz", "--slots", "8", "--max-wait-ms", "50", "--min-fill", "0",
                 "--max-batch-tokens", "none")  # fmt: skip
    client = DecoderClient(shm_name)
    yield client
    client.close()


def codes(frames: int, seed: int) -> torch.Tensor:
    """(T, 16) int64 codes, as the talker writes one utterance."""
    return torch.randint(0, 2048, (frames, 16), generator=torch.Generator().manual_seed(seed))


def padded(rows: list[torch.Tensor]) -> torch.Tensor:
    """(B, T, 16), -1 past each row's end (qwen-tts's pad_sequence)."""
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=-1)


def same(ours, theirs) -> None:
    (wavs, rate), (want, want_rate) = ours, theirs
    assert rate == want_rate == 24000
    assert len(wavs) == len(want)
    for got, exp in zip(wavs, want):
        assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.ndim == 1
        assert got.shape == exp.shape
        if exp.size:
            assert np.abs(got - exp).max() <= TOL


ROWS = [codes(40, 1), codes(7, 2), codes(23, 3)]
FORMS = {
    "list of dicts of tensors (Qwen3TTSModel's call)": [{"audio_codes": c} for c in ROWS],
    "list of dicts of numpy arrays": [{"audio_codes": c.numpy()} for c in ROWS],
    "list of dicts of nested lists": [{"audio_codes": c.tolist()} for c in ROWS],
    "one dict of one (T, 16) tensor": {"audio_codes": ROWS[0]},
    "one dict of a padded (B, T, 16) tensor": {"audio_codes": padded(ROWS)},
    "one dict of a padded (B, T, 16) numpy array": {"audio_codes": padded(ROWS).numpy()},
    "one dict of a list of tensors": {"audio_codes": list(ROWS)},
    "list of dicts with padded rows": [{"audio_codes": r} for r in padded(ROWS)],
}


def test_every_input_form_gives_qwen_tts_decode(server, reference):
    """Each form qwen-tts's decode takes gives its arrays (float32 within 1e-5, same lengths) and
    its sample rate; one tokenizer serves them all."""
    tokenizer = SharedSpeechTokenizer(client=server)
    for form, encoded in FORMS.items():
        try:
            same(tokenizer.decode(encoded), reference.decode(encoded))
        except AssertionError as exc:
            raise AssertionError(f"{form}: {exc}") from None
    encoded = upstream().modeling.Qwen3TTSTokenizerV2EncoderOutput(audio_codes=list(ROWS))
    same(tokenizer.decode(encoded), reference.decode(encoded))  # encode()'s output, as it is
    wavs, _ = tokenizer.decode([{"audio_codes": c} for c in ROWS])
    assert [len(w) for w in wavs] == [40 * SPF, 7 * SPF, 23 * SPF]


def test_an_empty_row_beside_others_is_empty_as_upstream(server, reference):
    encoded = [{"audio_codes": ROWS[1]}, {"audio_codes": torch.zeros((0, 16), dtype=torch.long)}]
    ours = SharedSpeechTokenizer(client=server).decode(encoded)
    same(ours, reference.decode(encoded))
    assert ours[0][1].shape == (0,)


def test_the_rows_of_one_call_are_decoded_in_one_batch(server):
    """Four rows of mixed lengths from one call: the server's histogram shows a batch of more
    than one row (sent one after another, each would be a batch of its own)."""
    before = server.get_stats()["batch_size_histogram"]
    wavs, _ = SharedSpeechTokenizer(client=server).decode(
        [{"audio_codes": codes(n, n)} for n in (31, 5, 18, 9)]
    )
    assert [len(w) for w in wavs] == [31 * SPF, 5 * SPF, 18 * SPF, 9 * SPF]
    after = server.get_stats()["batch_size_histogram"]
    grown = {int(k): v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    assert sum(k * v for k, v in grown.items()) == 4, grown
    assert max(grown) > 1, grown


BAD = [
    ([], "nothing to decode"),
    ([{"audio_codes": codes(5, 0)[:, :8]}], "16 codes per frame"),
    ([{"audio_codes": codes(5, 0).T}], "transpose a"),
    (
        [{"audio_codes": torch.full((3, 16), 2048)}],
        "row 0: frame 0, codebook 0 holds code 2048, outside 0..2047",
    ),
    (
        [{"audio_codes": codes(3, 0)}, {"audio_codes": torch.tensor([[5] * 15 + [-3]] * 2)}],
        "row 1: frame 0, codebook 15 holds code -3",
    ),
    ([{"audio_codes": torch.tensor([[1] * 16, [-1] * 16, [2] * 16])}], "codes after the padding"),
    ([{"audio_codes": codes(3, 0).float()}], "integer codes"),
    ([{"codes": codes(3, 0)}], "item 0 to decode must be a dict with 'audio_codes'"),
    ({"audio_codes": torch.zeros((1, 1, 3, 16), dtype=torch.long)}, r"\(T, 16\) or \(B, T, 16\)"),
    ("codes", "decode takes encode"),
    (
        [{"audio_codes": codes(400, 0)}],
        "more than the server .* takes \\(375\\): restart it with a larger --max-tokens",
    ),
]


def test_bad_input_is_a_value_error_naming_it_and_the_tokenizer_still_works(server, reference):
    tokenizer = SharedSpeechTokenizer(client=server)
    requests = server.get_stats()["requests"]
    for encoded, message in BAD:
        with pytest.raises(ValueError, match=message):
            tokenizer.decode(encoded)
    assert server.get_stats()["requests"] == requests  # nothing was sent: every check comes first
    encoded = [{"audio_codes": c} for c in ROWS]
    same(tokenizer.decode(encoded), reference.decode(encoded))


class Talker:
    """What ``Qwen3TTSForConditionalGeneration`` holds that the generate functions read."""

    def __init__(self, speech_tokenizer) -> None:
        self.speech_tokenizer = speech_tokenizer


class Qwen3TTSModelStandIn:
    """``Qwen3TTSModel``'s generate functions once the talker has written its codes: the tail
    of ``generate_voice_design`` and ``generate_custom_voice``, and of ``generate_voice_clone``
    (reference codes from ``encode``, put before each row and cut off the audio)."""

    def __init__(self, speech_tokenizer) -> None:
        self.model = Talker(speech_tokenizer)

    def generate_voice_design(self, talker_codes_list):
        wavs, fs = self.model.speech_tokenizer.decode([{"audio_codes": c} for c in talker_codes_list])
        return wavs, fs

    def generate_voice_clone(self, talker_codes_list, ref_audio):
        ref_code = self.model.speech_tokenizer.encode(ref_audio, sr=24000).audio_codes[0]
        codes_for_decode = [torch.cat([ref_code, c], dim=0) for c in talker_codes_list]
        wavs_all, fs = self.model.speech_tokenizer.decode([{"audio_codes": c} for c in codes_for_decode])
        cuts = [int(len(ref_code) / len(c) * len(w)) for c, w in zip(codes_for_decode, wavs_all)]
        return [w[cut:] for w, cut in zip(wavs_all, cuts)], fs


class EncoderStandIn:
    """qwen-tts's tokenizer as voice cloning uses it: ``encode`` (codes from audio) and the
    decode it would otherwise run."""

    def __init__(self, reference) -> None:
        self.reference = reference
        self.encoded = 0

    def encode(self, audios, sr=None):
        self.encoded += 1
        return types.SimpleNamespace(audio_codes=[codes(len(audios) // SPF, 9)])

    def get_model_type(self):
        return "qwen3_tts_tokenizer_12hz"

    def decode(self, encoded):
        return self.reference.decode(encoded)


def test_install_routes_generates_decode_through_the_server(server, shm_name, reference):
    """``install(model, name=...)``: voice design's and voice cloning's decode go to the server
    (its request count grows by the rows), cloning's encode to the kept tokenizer; the audio is
    what the original gives; uninstall gives it back."""
    original = EncoderStandIn(reference)
    model = Qwen3TTSModelStandIn(original)
    talker = [codes(12, 4), codes(30, 5)]
    want_design, want_clone = (
        model.generate_voice_design(talker),
        model.generate_voice_clone(talker, [0.0] * SPF * 6),
    )
    shared = install(model, name=shm_name)
    assert model.model.speech_tokenizer is shared and shared.tokenizer is original
    requests = server.get_stats()["requests"]
    same(model.generate_voice_design(talker), want_design)
    assert server.get_stats()["requests"] == requests + 2
    same(model.generate_voice_clone(talker, [0.0] * SPF * 6), want_clone)
    assert server.get_stats()["requests"] == requests + 4 and original.encoded == 2
    assert install(model, name=shm_name).tokenizer is original  # installing again wraps the original
    uninstall(model)
    assert model.model.speech_tokenizer is original


def test_without_the_tokenizer_encode_goes_to_the_server_and_other_attributes_say_what_to_load(
        server, shm_name, reference):  # fmt: skip
    """``keep_tokenizer=False``: cloning's encode goes to the server (this one was started
    without ``--encode``: NoEncoderError); an attribute only the tokenizer has names the fix."""
    original = EncoderStandIn(reference)
    model = Qwen3TTSModelStandIn(original)
    shared = install(model, name=shm_name, keep_tokenizer=False)
    assert shared.tokenizer is None and shared.get_output_sample_rate() == 24000
    same(model.generate_voice_design([codes(6, 6)]), reference.decode([{"audio_codes": codes(6, 6)}]))
    with pytest.raises(NoEncoderError, match="--encode"):
        model.generate_voice_clone([codes(6, 6)], np.zeros(SPF, np.float32))
    assert original.encoded == 0
    with pytest.raises(AttributeError, match=re.escape("keep qwen-tts's tokenizer loaded")):
        shared.feature_extractor  # noqa: B018
    with pytest.raises(ValueError, match="kept no tokenizer"):
        uninstall(model)


def test_install_refuses_what_it_cannot_serve():
    with pytest.raises(ValueError, match="has no speech tokenizer"):
        install(object())
    other = types.SimpleNamespace(get_model_type=lambda: "qwen3_tts_tokenizer_25hz")
    with pytest.raises(ValueError, match="'qwen3_tts_tokenizer_25hz'; the server decodes"):
        install(Qwen3TTSModelStandIn(other))


def test_the_shared_client_is_one_per_name(server, shm_name):
    first = qwen3_tts.shared_client(shm_name)
    try:
        assert qwen3_tts.shared_client(shm_name) is first
        assert SharedSpeechTokenizer(shm_name).client is first
        from bicodec_shm.integrations import inputs, orpheus_tts

        assert orpheus_tts.shared_client(shm_name) is first  # one per name for every drop-in
    finally:
        inputs._clients.pop(shm_name).close()
