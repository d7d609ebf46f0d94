"""bicodec_shm.integrations.orpheus_tts against Orpheus's own decoder (orpheus-speech 0.1.0).

Orpheus's ``orpheus_tts/decoder.py`` is loaded from the installed distribution's files and run as
it is, except for what it loads: ``SNAC.from_pretrained`` (a download) returns ``snac.SNAC`` with
the tiny test model's random weights, kept on the CPU (it would move to "cuda"), and each of its
window decodes draws the noise that the server draws for that window (window k starts at frame
k). The same streams then go to Orpheus and to the drop-in on a ``snac-24khz`` server (a thread
of this process, real shared memory).

Ground truth: Orpheus's bytes for the ``orpheus`` preset (within 1 LSB: the two SNACs differ by
float rounding); the whole utterance decoded at once (same seed) for ``default`` and ``exact``.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import itertools
import subprocess
import sys
from contextlib import contextmanager
from unittest import mock

import numpy as np
import pytest
import torch
from test_snac_model import injected_randn, snac, upstream_twin

from bicodec_shm import DecoderClient
from bicodec_shm.codecs import codes_to_orpheus
from bicodec_shm.errors import DecodeTimeoutError
from bicodec_shm.integrations import orpheus_tts as dropin
from bicodec_shm.model.snac import SNACDecoder
from bicodec_shm.model.snac.noise import batch_noise

NEEDS_ORPHEUS = (
    "orpheus-speech is not installed: `pip install --no-deps orpheus-speech==0.1.0` (its own "
    "dependencies pull vLLM and a CUDA build of torch; the test needs only its decoder.py)"
)
SEED = 0  # the drop-in's default noise seed, which Orpheus's windows are given too


def load_orpheus_decoder(twin: torch.nn.Module):
    """``orpheus_tts/decoder.py`` of the installed orpheus-speech, as a fresh module whose SNAC is
    ``twin`` on the CPU. Its package's ``__init__`` is not run: it imports vLLM."""
    try:
        dist = importlib.metadata.distribution("orpheus-speech")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(NEEDS_ORPHEUS)
    assert dist.version == "0.1.0", dist.version
    (path,) = [f for f in dist.files if f.as_posix() == "orpheus_tts/decoder.py"]

    class Pretrained:  # what SNAC.from_pretrained(...).eval().to("cuda") returns: the twin
        def eval(self):
            return self

        def to(self, device):
            assert device == "cuda"  # what it would have moved the model to
            return twin

    spec = importlib.util.spec_from_file_location("orpheus_decoder_under_test", dist.locate_file(path))
    module = importlib.util.module_from_spec(spec)
    with mock.patch.object(snac.SNAC, "from_pretrained", lambda *a, **k: Pretrained()):
        spec.loader.exec_module(module)
    assert module.model is twin and module.snac_device == "cuda"
    module.snac_device = "cpu"  # read by convert_to_audio at each call
    return module


@pytest.fixture(scope="module")
def model() -> SNACDecoder:
    torch.set_num_threads(1)
    return SNACDecoder.from_config("tiny-24khz", seed=0)


@pytest.fixture(scope="module")
def orpheus(model):
    twin = upstream_twin(model)
    return load_orpheus_decoder(twin), twin


@contextmanager
def server_noise(model: SNACDecoder, twin: torch.nn.Module):
    """Orpheus's window k draws the noise the server draws for a window starting at frame k."""
    decode, windows, per_frame = twin.decode, itertools.count(), model.config.latents_per_frame

    def seeded(codes):
        latent = codes[0].shape[1] * per_frame
        noise = batch_noise([SEED], [latent], [next(windows) * per_frame], latent, model.noise_factors)
        with injected_randn(noise):
            return decode(codes)

    twin.decode = seeded
    try:
        yield
    finally:
        del twin.decode  # back to the class's method


@pytest.fixture
def server(thread_server, model):
    return thread_server(model, slots=16, max_tokens=64, max_wait_ms=20, min_fill=0.0)


def random_levels(frames: int, seed: int, low: int = 1) -> list[np.ndarray]:
    """Codes of ``frames`` frames; ``low=1`` keeps code 0 out (Orpheus drops it)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(low, 4096, frames * r) for r in (1, 2, 4)]


def per_token_items(numbers) -> list[str]:
    return [f"<custom_token_{n}>" for n in numbers]


def cumulative_items(numbers) -> list[str]:
    """vLLM's streamed ``outputs[0].text``: the whole text so far, one token longer each time."""
    text, out = "", []
    for n in numbers:
        text += f"<custom_token_{n}>"
        out.append(text)
    return out


def full_decode16(model: SNACDecoder, levels) -> np.ndarray:
    audio = model.detokenize([torch.from_numpy(v)[None] for v in levels], noise_seeds=[SEED])[0].numpy()
    return (np.clip(audio, -1.0, 1.0) * 32767).astype(np.int16)


def snr_db(got: np.ndarray, want: np.ndarray) -> float:
    want, got = want.astype(np.float64), got.astype(np.float64)
    return float(10 * np.log10(np.sum(want**2) / max(np.sum((got - want) ** 2), 1e-30)))


def pcm(chunks) -> np.ndarray:
    return np.frombuffer(b"".join(chunks), "<i2")


def assert_chunks_within_1_lsb(ours: list[bytes], theirs: list[bytes]) -> None:
    assert len(ours) == len(theirs) > 0
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert len(a) == len(b) == 2 * 2048, i
        a, b = np.frombuffer(a, "<i2").astype(np.int32), np.frombuffer(b, "<i2").astype(np.int32)
        assert np.abs(a - b).max() <= 1, (i, np.abs(a - b).max())
        assert np.sqrt(np.mean(b.astype(np.float64) ** 2)) > 300, "near-silent audio: a weak check"


async def agen(items):
    for item in items:
        yield item


async def collect(gen) -> list[bytes]:
    return [chunk async for chunk in gen]


# -- the orpheus preset: Orpheus's bytes ----------------------------------------------------------


@pytest.mark.parametrize("form", ["per_token", "cumulative"])
def test_orpheus_preset_yields_orpheus_chunks_within_1_lsb(orpheus, model, server, form):
    """Same stream (with Orpheus's control tokens and a text item around the audio) to Orpheus's
    tokens_decoder_sync and to the drop-in's: chunk for chunk, 1 LSB apart at most."""
    upstream, twin = orpheus
    numbers = codes_to_orpheus(random_levels(13, seed=1), base=10)
    items = (per_token_items if form == "per_token" else cumulative_items)(numbers)
    items = ["<custom_token_1>", *items, "<custom_token_2>"] if form == "per_token" else items
    with server_noise(model, twin):
        theirs = list(upstream.tokens_decoder_sync(iter(items)))
    ours = list(dropin.tokens_decoder_sync(iter(items), name=server.name, preset="orpheus"))
    assert len(theirs) == 13 - 3  # frames 1..10 of 13: never frame 0 nor the last 2
    assert_chunks_within_1_lsb(ours, theirs)


def test_async_orpheus_preset_matches_orpheus_async_decoder(orpheus, model, server):
    upstream, twin = orpheus
    items = per_token_items(codes_to_orpheus(random_levels(9, seed=2), base=10))
    with server_noise(model, twin):
        theirs = asyncio.run(collect(upstream.tokens_decoder(agen(items))))
    with DecoderClient(server.name) as client:
        ours = asyncio.run(collect(dropin.tokens_decoder(agen(items), client=client, preset="orpheus")))
    assert_chunks_within_1_lsb(ours, theirs)


# -- default and exact: every frame, against the whole decode -------------------------------------


def test_default_plays_every_frame_within_its_snr_and_orpheus_loses_4_frames_at_16_db(orpheus, model, server):
    """23 frames: default returns all 23 (frame 0 and the tail too) at >= 50 dB against the whole
    decode, chunk by chunk >= 40 dB; exact is the whole decode up to int16 rounding; Orpheus plays
    frames 1..20 only, at ~16 dB (its windows have 1 frame of context on the left)."""
    upstream, twin = orpheus
    frames = 23
    levels = random_levels(frames, seed=3)
    want = full_decode16(model, levels)
    items = per_token_items(codes_to_orpheus(levels, base=10))
    with DecoderClient(server.name) as client:
        default = list(dropin.tokens_decoder_sync(items, client=client))
        exact = list(dropin.tokens_decoder_sync(items, client=client, preset="exact"))
    with server_noise(model, twin):
        theirs = pcm(upstream.tokens_decoder_sync(iter(items)))

    got = pcm(default)
    assert len(got) == len(want) == frames * 2048
    assert snr_db(got, want) >= 50  # measured 55 dB (tiny) and 54 dB (full size)
    start = 0
    for chunk in default:
        n = len(chunk) // 2
        assert snr_db(np.frombuffer(chunk, "<i2"), want[start : start + n]) >= 40, start
        start += n
    # The first chunk comes after 4 frames, as Orpheus's, and holds frames 0 and 1.
    assert len(default[0]) == 2 * 2 * 2048
    assert np.abs(pcm(exact).astype(np.int32) - want).max() <= 1
    assert len(theirs) == (frames - 3) * 2048
    orpheus_snr = snr_db(theirs, want[2048 : 2048 + len(theirs)])
    assert 5 < orpheus_snr < 25, orpheus_snr  # measured 15.6 dB (tiny), 15.4 dB (full size)


def test_under_4_frames_orpheus_plays_nothing_and_default_plays_all(orpheus, model, server):
    upstream, twin = orpheus
    levels = random_levels(3, seed=4)
    items = per_token_items(codes_to_orpheus(levels, base=10))
    with server_noise(model, twin):
        assert list(upstream.tokens_decoder_sync(iter(items))) == []
    assert list(dropin.tokens_decoder_sync(items, name=server.name, preset="orpheus")) == []
    got = pcm(dropin.tokens_decoder_sync(items, name=server.name))
    assert len(got) == 3 * 2048
    assert snr_db(got, full_decode16(model, levels)) >= 50


# -- Orpheus's bugs, not copied ------------------------------------------------------------------


def test_code_0_is_kept_where_orpheus_drops_it_and_garbles_the_rest(orpheus, model, server):
    """One code 0 (frame 5, position 3): Orpheus drops the token, so every later token is read at
    the wrong position. Ground truth: Orpheus's windows of the true codes, decoded by its own
    SNAC directly (same noise), sliced as Orpheus slices them."""
    upstream, twin = orpheus
    frames = 12
    levels = random_levels(frames, seed=5)
    levels[2][5 * 4 + 1] = 0  # frame 5's second level-2 code: token 7·5 + 3
    numbers = codes_to_orpheus(levels, base=10)
    assert numbers[7 * 5 + 3] == 10 + 3 * 4096  # <custom_token_N> of code 0 at position 3
    items = per_token_items(numbers)
    truth = []
    with server_noise(model, twin), torch.inference_mode():
        for m in range(3, frames):  # Orpheus's window once frame m is complete
            window = [torch.as_tensor(v[(m - 3) * r : (m + 1) * r][None]) for v, r in zip(levels, (1, 2, 4))]
            audio = twin.decode(window)[0, 0, 2048:4096].numpy()
            truth.append((audio * 32767).astype(np.int16).tobytes())
    with server_noise(model, twin):
        theirs = list(upstream.tokens_decoder_sync(iter(items)))
    ours = list(dropin.tokens_decoder_sync(items, name=server.name, preset="orpheus"))
    assert_chunks_within_1_lsb(ours, truth)
    # Orpheus: the windows from frame 5 on hold misread tokens; it skips those with a code over
    # 4096 and garbles the others.
    assert len(theirs) < len(truth)
    assert theirs[:2] == truth[:2]  # windows 0 and 1 end before frame 5
    full = full_decode16(model, levels)
    assert snr_db(pcm(dropin.tokens_decoder_sync(items, name=server.name)), full) >= 50


def test_code_4096_is_refused_with_its_position_where_orpheus_passes_it_to_snac(orpheus, model, server):
    upstream, twin = orpheus
    numbers = codes_to_orpheus(random_levels(5, seed=6), base=10)
    numbers[7 * 4 + 2] = 10 + 2 * 4096 + 4096  # code 4096 at frame 4, position 2
    items = per_token_items(numbers)
    with server_noise(model, twin), pytest.raises(IndexError):  # SNAC's codebook has 4096 rows
        asyncio.run(collect(upstream.tokens_decoder(agen(items))))
    for preset in dropin.PRESETS:
        got = []
        with pytest.raises(ValueError, match=r"audio token 30 of the stream \(frame 4, position 2\) is "
                           r"<custom_token_12298>, code 4096: position 2 takes "
                           r"<custom_token_8202>..<custom_token_12297>"):  # fmt: skip
            for chunk in dropin.tokens_decoder_sync(items, name=server.name, preset=preset):
                got.append(chunk)
        # What the 4 frames before it made final was returned first (frames, 2048 samples each).
        assert len(b"".join(got)) == {"default": 2, "exact": 0, "orpheus": 1}[preset] * 2048 * 2


def test_bad_settings_and_items_raise_clear_errors(server):
    with DecoderClient(server.name) as client:
        with pytest.raises(ValueError, match=r"unknown preset 'peers'; expected one of \['default', "
                           r"'exact', 'orpheus'\]"):  # fmt: skip
            dropin.OrpheusStream(client, preset="peers")
        for preset in dropin.PRESETS:
            with pytest.raises(ValueError, match="noise_seed"):
                dropin.OrpheusStream(client, preset=preset, noise_seed=-1)
        stream = dropin.OrpheusStream(client)
        with pytest.raises(ValueError, match="must be a str holding <custom_token_N>, got bytes"):
            stream.push(b"<custom_token_10>")
        assert stream.push("tara: <custom_token_10> hello") == b""  # the text around it adds nothing
        assert stream.audio_tokens == 1
    with pytest.raises(ValueError, match="client must be a DecoderClient"):
        dropin.OrpheusStream(object())


def test_a_bicodec_server_is_refused_naming_the_codec(thread_server):
    bicodec = thread_server()
    with DecoderClient(bicodec.name) as client:
        with pytest.raises(ValueError, match=r"decodes bicodec: start the server with `bicodec-shm serve "
                           r"--codec snac-24khz`"):  # fmt: skip
            list(dropin.tokens_decoder_sync([], client=client))


class FailsOnce:
    """A client whose ``n``-th decode raises DecodeTimeoutError (before sending it); it counts."""

    def __init__(self, client: DecoderClient, n: int | None) -> None:
        self.client, self.codec, self.name, self.calls, self.n = client, client.codec, client.name, 0, n

    def _maybe_fail(self) -> None:
        self.calls += 1
        if self.calls == self.n:
            raise DecodeTimeoutError("the decode took too long (planted)")

    def decode_codes(self, *args, **kwargs):
        self._maybe_fail()
        return self.client.decode_codes(*args, **kwargs)

    async def decode_codes_async(self, *args, **kwargs):
        self._maybe_fail()
        return await self.client.decode_codes_async(*args, **kwargs)


@pytest.mark.parametrize("preset", dropin.PRESETS)
@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_failed_decode_raises_and_the_next_call_decodes_it_again(server, preset, asynchronous):
    """The 2nd decode fails: the very next item decodes it again. The last one fails (in the last
    push, or in finish): finish does. Either way the audio is all there."""
    items = per_token_items(codes_to_orpheus(random_levels(8, seed=9), base=10))

    def run(client) -> tuple[list[bytes], int | None]:
        stream = dropin.OrpheusStream(client, preset=preset)
        push = (lambda i: asyncio.run(stream.push_async(i))) if asynchronous else stream.push
        finish = (lambda: asyncio.run(stream.finish_async())) if asynchronous else stream.finish
        out, failed_at = [], None
        for k, item in enumerate(items):
            try:
                out.append(push(item))
            except DecodeTimeoutError:
                out.append(b"")
                failed_at = k
        try:
            out.append(finish())
        except DecodeTimeoutError:  # the failed decode was finish's own: finish again
            failed_at = len(items)
            out.append(finish())
        return out, failed_at

    with DecoderClient(server.name) as client:
        counting = FailsOnce(client, None)
        want, _ = run(counting)
        for n in (2, counting.calls):
            got, failed_at = run(FailsOnce(client, n))
            assert failed_at is not None
            if failed_at + 1 < len(items):
                assert got[failed_at + 1], "the next item did not decode the failed window again"
            got, want16 = pcm(got).astype(np.int32), pcm(want)
            assert len(got) == len(want16) and np.abs(got - want16).max() <= 1  # 1: batched together


# -- many streams, one server --------------------------------------------------------------------


def test_concurrent_streams_batch_at_the_server_and_each_equals_its_lone_stream(model, server):
    streams = [per_token_items(codes_to_orpheus(random_levels(9 + i, seed=10 + i), base=10))
               for i in range(4)]  # fmt: skip
    with DecoderClient(server.name) as client:
        alone = [list(dropin.tokens_decoder_sync(s, client=client)) for s in streams]
        before = client.get_stats()

        async def run():
            decoders = [dropin.tokens_decoder(agen(s), client=client) for s in streams]
            return await asyncio.gather(*(collect(d) for d in decoders))

        together = asyncio.run(run())
        after = client.get_stats()
    for a, b in zip(alone, together):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert np.abs(np.frombuffer(x, "<i2").astype(np.int32) - np.frombuffer(y, "<i2")).max() <= 1
    requests, batches = after["requests"] - before["requests"], after["batches"] - before["batches"]
    assert batches < requests, (batches, requests)  # windows of different streams shared batches


def test_an_in_process_decoder_gives_the_servers_audio(model, server):
    """``client=`` a SNACDecoder: each process its own decoder (the examples' baseline)."""
    items = per_token_items(codes_to_orpheus(random_levels(8, seed=7), base=10))
    for preset in dropin.PRESETS:
        own = list(dropin.tokens_decoder_sync(items, client=model, preset=preset))
        shared = list(dropin.tokens_decoder_sync(items, name=server.name, preset=preset))
        assert len(own) == len(shared) > 0
        assert np.abs(pcm(own).astype(np.int32) - pcm(shared)).max() <= 1


# -- install: Orpheus's own OrpheusModel decodes through the server ------------------------------


def test_install_makes_orpheus_model_decode_through_the_server_without_loading_snac(
    model, server, monkeypatch
):
    """The real orpheus_tts package, imported after install(); vLLM and transformers (which its
    engine module imports) are stand-ins, and SNAC.from_pretrained must not be called."""
    for name, attrs in {"vllm": ("AsyncLLMEngine", "AsyncEngineArgs", "SamplingParams"),
                        "transformers": ("AutoTokenizer",)}.items():  # fmt: skip
        stand_in = type(sys)(name)
        for attr in attrs:
            setattr(stand_in, attr, object())
        monkeypatch.setitem(sys.modules, name, stand_in)
    monkeypatch.setattr(snac.SNAC, "from_pretrained", mock.Mock(side_effect=AssertionError("SNAC loaded")))
    items = per_token_items(codes_to_orpheus(random_levels(6, seed=8), base=10))
    try:
        dropin.install(name=server.name, preset="orpheus")
        import orpheus_tts
        import orpheus_tts.decoder as decoder
        from orpheus_tts import engine_class

        assert isinstance(decoder.__loader__, dropin._OrpheusDecoderFinder)
        ours = decoder.tokens_decoder_sync
        assert orpheus_tts.tokens_decoder_sync is engine_class.tokens_decoder_sync is ours
        tts = object.__new__(engine_class.OrpheusModel)  # no engine: its token stream is a stand-in
        tts.generate_tokens_sync = lambda **kwargs: iter(items)
        chunks = list(tts.generate_speech(prompt="hello", voice="tara"))
    finally:
        dropin.uninstall()
        for name in [m for m in sys.modules if m.split(".")[0] == "orpheus_tts"]:
            del sys.modules[name]
    assert not snac.SNAC.from_pretrained.called
    assert chunks == list(dropin.tokens_decoder_sync(items, name=server.name, preset="orpheus"))
    assert len(chunks) == 6 - 3


def test_install_after_orpheus_was_imported_rebinds_its_functions(orpheus, server, monkeypatch):
    upstream, _ = orpheus
    monkeypatch.setitem(sys.modules, "orpheus_tts.decoder", upstream)
    monkeypatch.setattr(upstream, "tokens_decoder_sync", upstream.tokens_decoder_sync)  # restored after
    monkeypatch.setattr(upstream, "tokens_decoder", upstream.tokens_decoder)
    items = per_token_items(codes_to_orpheus(random_levels(5, seed=12), base=10))
    try:
        dropin.install(name=server.name)
    finally:
        dropin.uninstall()
    assert upstream.tokens_decoder_sync.__module__ == dropin.__name__
    chunks = list(upstream.tokens_decoder_sync(iter(items)))
    assert pcm(chunks).size == 5 * 2048  # the default preset: every frame
    assert asyncio.run(collect(upstream.tokens_decoder(agen(items)))) == chunks


def test_the_dropins_import_only_the_public_client_api_and_no_torch():
    """The rule of bicodec_shm/integrations/__init__.py for these two: the package's exported names
    only (DecoderClient, DecodeStream, codecs' exports, errors) and the client's decode_any_length,
    and no torch, even lazily."""
    import ast
    import pathlib

    allowed = {"bicodec_shm.client.decoder_client", "bicodec_shm.client.streaming", "bicodec_shm.codecs",
               "bicodec_shm.errors", "bicodec_shm.client.long_requests",
               "bicodec_shm.integrations.inputs"}  # fmt: skip
    folder = pathlib.Path(dropin.__file__).parent
    for path in (folder / "orpheus_tts.py", folder / "spark_tts.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.startswith("bicodec_shm"):
                assert node.module in allowed, (path.name, node.module)
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0, (path.name, "relative import")
            names = [a.name for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
            assert not any(n.split(".")[0] == "torch" for n in names), path.name
    code = ("import sys; import bicodec_shm.integrations.orpheus_tts, bicodec_shm.integrations.spark_tts; "
            "assert 'torch' not in sys.modules, 'torch imported'")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- what docs/integrations.md says of each preset ------------------------------------------------


def integrations_preset_rows() -> dict[str, list[str]]:
    """docs/integrations.md's table of the Orpheus presets: preset -> its cells after the name."""
    import pathlib

    page = pathlib.Path(__file__).resolve().parents[1] / "docs" / "integrations.md"
    rows = {}
    for line in page.read_text().splitlines():
        if line.startswith('| `"'):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0].strip('`"')] = cells[1:]
    return rows


def test_each_preset_gives_what_the_integrations_page_says(orpheus, model, server):
    """Row by row, against Orpheus's own decoder: the chunk (and the last one's, n = 20..23),
    the frames played, the first audio, and the audio against Orpheus's on the frames both play:
    only preset="orpheus" is Orpheus's chunks."""
    import re

    upstream, twin = orpheus
    rows = integrations_preset_rows()
    assert sorted(rows) == sorted(dropin.PRESETS)
    for preset, (chunk, played, first, against) in rows.items():
        size, last = re.fullmatch(r"(\d+) frames?(?:, one per window \(as Orpheus\)| \(the last (.+)\))",
                                  chunk).groups()  # fmt: skip
        lasts = set()
        for n in (20, 21, 22, 23):
            items = per_token_items(codes_to_orpheus(random_levels(n, seed=30 + n), base=10))
            stream = dropin.OrpheusStream(model, preset=preset)
            chunks = [c for item in items for c in stream.push_chunks(item)] + stream.finish_chunks()
            assert {len(c) // 4096 for c in chunks[:-1]} == {int(size)}, (preset, n)
            lasts.add(len(chunks[-1]) // 4096)
        if last is not None:
            lo, hi = map(int, re.fullmatch(r"(\d+) (?:or|to) (\d+)", last).groups())
            assert lasts == set(range(lo, hi + 1)), (preset, lasts)
        else:
            assert lasts == {int(size)}

        n = 23
        levels = random_levels(n, seed=31)
        items = per_token_items(codes_to_orpheus(levels, base=10))
        with server_noise(model, twin):
            theirs = list(upstream.tokens_decoder_sync(iter(items)))
        ours, first_at = [], None
        with DecoderClient(server.name) as client:
            stream = dropin.OrpheusStream(client, preset=preset)
            for pushed, item in enumerate(items, 1):
                ours += stream.push_chunks(item)
                first_at = first_at or (pushed if ours else None)
            ours += stream.finish_chunks()
        assert played == ("1 .. n-3 (none under 4 frames)" if len(ours) == n - 3 else "all n")
        assert len(pcm(ours)) == 2048 * (n - 3 if played.startswith("1 ..") else n)
        frames_first = first_at // 7
        assert first == f"after {frames_first} frames, {7 * frames_first} tokens" and first_at % 7 == 0
        if against == "Orpheus's chunks, within 1 int16 step":
            assert_chunks_within_1_lsb(ours, theirs)
            continue
        assert against.startswith("other chunks and 3 more frames") and len(ours) != len(theirs)
        assert len(pcm(ours)) - len(pcm(theirs)) == 3 * 2048
        both = pcm(ours)[2048 : 2048 + len(pcm(theirs))]  # frames 1 .. n-3
        (said,) = map(float, re.findall(r"(\d+) dB SNR on the frames both play", against))
        measured = snr_db(both, pcm(theirs))
        assert abs(measured - said) <= 3, (preset, measured, said)  # tiny here, full size there


def test_importing_orpheus_tts_still_needs_vllm_after_install():
    """install() answers orpheus_tts.decoder, but the package's __init__ imports its engine
    module, which imports vLLM."""
    code = ("from bicodec_shm.integrations import orpheus_tts as d; d.install()\n"
            "try:\n    import orpheus_tts.decoder\nexcept ModuleNotFoundError as e:\n"
            "    assert e.name == 'vllm', e.name\n"
            "else:\n    raise SystemExit('imported without vLLM')\n")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
