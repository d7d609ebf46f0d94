"""The CPU lanes' traced graphs (model/traced.py), Qwen3-TTS's and SNAC's: bit for bit the eager
forward, across batch sizes, lengths, stream starts, noise and all three dtypes; built once when lanes call
at once; run without the module's Python; and an eager fallback, with one warning, where tracing
fails."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
import torch
from torch import nn

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.model.bicodec.decoder import BiCodecDecoder
from bicodec_shm.model.qwen3_tts import Qwen3TTSDecoder
from bicodec_shm.model.snac import SNACDecoder
from bicodec_shm.model.snac.serving import UnpaddedForward
from bicodec_shm.model.traced import TracedForward, take_warmup_ns
from bicodec_shm.server.adapters import BiCodecAdapter
from bicodec_shm.server.batch_costs import BatchCosts
from bicodec_shm.server.lane_tuner import LaneTuner


def codes(batch: int, frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2048, (batch, 16, frames), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_qwen3_windows_through_the_graph_equal_the_eager_decode_bit_for_bit(dtype):
    """One graph, traced at the first shape, then batches of other sizes and lengths, padded
    rows, stream windows with left context, and rows across the 300-frame chunk."""
    decoder = Qwen3TTSDecoder.from_config("tiny", seed=0, dtype=dtype)
    adapter = decoder.codec_adapter()
    graph = adapter.window_decoder
    assert isinstance(graph, TracedForward) and not graph.graphs  # traced at the first batch
    cases = [  # (codes, lengths, start_frames)
        (codes(1, 2, 0), None, None),
        (codes(3, 27, 1), [27, 9, 1], None),
        (codes(2, 8, 2), [8, 4], [40, 296]),  # stream windows: context before, one across 300
        (codes(4, 50, 3), [50, 50, 31, 2], [0, 8, 16, 325]),
        (codes(2, 310, 4), [310, 305], None),  # two chunk passes per row
    ]
    for ids, lengths, starts in cases:
        lens = None if lengths is None else torch.tensor(lengths)
        eager = decoder.detokenize(ids, lens, start_frames=starts)
        traced = decoder.detokenize(ids, lens, start_frames=starts, window_decoder=graph)
        assert traced.dtype == eager.dtype and torch.equal(traced, eager), (ids.shape, lengths, starts)
    assert list(graph.graphs) == [None] and not graph.failed  # one graph for every shape


def snac_levels(decoder: SNACDecoder, batch: int, frames: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    size = decoder.config.codebook_size
    return [torch.randint(0, size, (batch, frames * r), generator=g) for r in decoder.config.level_rates]


@pytest.mark.parametrize("preset", ["tiny-24khz", "tiny-32khz"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_snac_batches_without_padding_through_graphs_equal_the_eager_decode(preset, dtype):
    """A graph per branch (noise or none; at 32 kHz, a length that fills the attention's
    windows or not), each serving several shapes; stream starts; a padded batch (a mask)
    decodes eagerly and adds no graph."""
    decoder = SNACDecoder.from_config(preset, seed=0, dtype=dtype)
    graphs = decoder.codec_adapter().unpadded_forward
    assert isinstance(graphs, TracedForward) and not graphs.graphs
    cases = [  # (batch, frames, lengths, noise, start_frames)
        (1, 4, None, True, [0]),
        (1, 4, None, True, [12]),
        (3, 8, None, True, [0, 4, 100]),
        (1, 7, None, False, None),
        (2, 3, None, False, None),
        (1, 8, None, False, None),
        (2, 9, None, True, [3, 0]),
        (2, 5, None, True, [1, 2]),
        (2, 9, [9, 5], True, [0, 0]),  # padded: eager
    ]
    for i, (batch, frames, lengths, noise, starts) in enumerate(cases):
        levels = snac_levels(decoder, batch, frames, seed=i)
        lens = None if lengths is None else torch.tensor(lengths)
        kwargs = dict(noise=noise, noise_seeds=[7 + j for j in range(batch)], start_frames=starts)
        eager = decoder.detokenize(levels, lens, **kwargs)
        graphed = decoder.detokenize(levels, lens, **kwargs, unpadded_forward=graphs)
        assert torch.equal(graphed, eager), (batch, frames, lengths, noise, starts)
    windowed = decoder.config.attn_window_size is not None
    assert len(graphs.graphs) == (4 if windowed else 2) and not graphs.failed


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_bicodec_batches_without_padding_through_the_graph_equal_the_eager_decode(dtype):
    """One graph for every unpadded shape (whole utterances of one length arrive together); a
    padded batch (a mask) decodes eagerly and leaves the graph unused; the server's adapter
    hands the graph to the decoder."""
    decoder = BiCodecDecoder.from_config("tiny", seed=0, dtype=dtype)
    adapter = BiCodecAdapter(decoder)
    graphs = adapter.unpadded_forward
    assert isinstance(graphs, TracedForward) and not graphs.graphs
    g = torch.Generator().manual_seed(0)
    for batch, frames, lengths in [(1, 150, None), (3, 41, None), (2, 1, None), (2, 30, [30, 17])]:
        semantic = torch.randint(0, decoder.config.semantic_vocab, (batch, frames), generator=g)
        global_ids = torch.randint(0, decoder.config.global_vocab, (batch, 32), generator=g)
        lens = None if lengths is None else torch.tensor(lengths)
        eager = decoder.detokenize(semantic, global_ids, lens)
        graphed = decoder.detokenize(semantic, global_ids, lens, unpadded_forward=graphs)
        assert torch.equal(graphed, eager), (batch, frames, lengths)
    assert len(graphs.graphs) == 1 and not graphs.failed


def test_a_bicodec_servers_cpu_lanes_decode_through_the_graph(thread_server):
    """Through a real server: a lone request (no padding) is decoded by the graph, and gives
    the lone eager decode."""
    decoder = BiCodecDecoder.from_config("tiny", seed=0)
    server = thread_server(decoder)
    rng = np.random.default_rng(0)
    semantic, global_ids = rng.integers(0, 8192, 40), rng.integers(0, 4096, 32)
    with DecoderClient(server.name) as client:
        audio = client.decode(semantic, global_ids, dtype="float32")
    graphs = BiCodecAdapter(decoder).unpadded_forward
    assert len(graphs.graphs) == 1 and not graphs.failed  # the server's lane traced it
    lone = decoder.detokenize(torch.from_numpy(semantic)[None], torch.from_numpy(global_ids)[None])
    np.testing.assert_array_equal(audio, lone[0].numpy())


def test_a_branch_on_a_size_needs_its_own_graph():
    """Why SNAC's graphs are keyed: one traced where the length fills the attention's windows
    (no mask) gives other audio for a length that does not; keyed by branch, both are exact."""
    decoder = SNACDecoder.from_config("tiny-32khz", seed=0)
    forward = UnpaddedForward(decoder)
    one_graph, keyed = TracedForward(forward), forward.traced()
    filled = snac_levels(decoder, 1, 4, seed=0)  # 32 latent frames: one whole window
    one_graph(*filled)
    keyed(*filled)
    short = snac_levels(decoder, 2, 3, seed=1)  # 24 latent frames: a shorter last window
    assert not torch.equal(one_graph(*short), forward(*short))
    assert torch.equal(keyed(*short), forward(*short)) and len(keyed.graphs) == 2


def test_the_lanes_of_a_decoder_share_its_graphs():
    decoder = SNACDecoder.from_config("tiny-24khz", seed=0)
    assert decoder.codec_adapter().unpadded_forward is decoder.codec_adapter().unpadded_forward
    qwen3 = Qwen3TTSDecoder.from_config("tiny", seed=0)
    assert qwen3.codec_adapter().window_decoder is qwen3.codec_adapter().window_decoder
    bicodec = BiCodecDecoder.from_config("tiny", seed=0)
    assert BiCodecAdapter(bicodec).unpadded_forward is BiCodecAdapter(bicodec).unpadded_forward
    other = SNACDecoder.from_config("tiny-24khz", seed=0)
    assert other.codec_adapter().unpadded_forward is not decoder.codec_adapter().unpadded_forward


def test_the_graph_runs_without_the_modules_python():
    """The point of the graph: after the trace, no call goes back through the eager forward."""
    decoder = Qwen3TTSDecoder.from_config("tiny", seed=0)
    graph = TracedForward(decoder.decoder)
    expected = decoder.decoder(codes(2, 6, 5))
    graph(codes(1, 4, 6))  # traced here

    def refuse(*args: object) -> None:
        raise AssertionError("the eager forward ran")

    calls = []
    hook = decoder.decoder.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        assert torch.equal(graph(codes(2, 6, 5)), expected)
    finally:
        hook.remove()
    assert calls == []  # a traced graph does not call the module (nor its hooks)
    graph.module.forward = refuse  # and not its forward either
    assert torch.equal(graph(codes(2, 6, 5)), expected)


def test_lanes_calling_at_once_trace_once_and_all_get_the_eager_result(monkeypatch):
    decoder = Qwen3TTSDecoder.from_config("tiny", seed=0)
    graph = TracedForward(decoder.decoder)
    traces = []
    real_trace = torch.jit.trace
    monkeypatch.setattr(torch.jit, "trace", lambda *a, **k: traces.append(1) or real_trace(*a, **k))
    inputs = [codes(1 + i % 2, 3 + i, 10 + i) for i in range(6)]
    expected = [decoder.decoder(x) for x in inputs]
    results: dict[int, torch.Tensor] = {}
    start = threading.Barrier(len(inputs))

    def lane(i: int) -> None:
        torch.set_num_threads(1)
        start.wait()
        results[i] = graph(inputs[i])

    threads = [threading.Thread(target=lane, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert traces == [1]
    assert all(torch.equal(results[i], expected[i]) for i in range(len(inputs)))


class Gated(nn.Module):
    """A forward that, the first time it runs (inside the trace), waits for ``go``."""

    def __init__(self) -> None:
        super().__init__()
        self.inside, self.go = threading.Event(), threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.inside.is_set():
            self.inside.set()
            self.go.wait(30)
        return x * 2


def test_a_thread_counts_its_trace_and_its_wait_for_another_threads_trace_as_warm_up():
    graph = TracedForward(Gated())
    counted: dict[str, list[int]] = {"tracer": [], "waiter": []}

    def call(name: str, times: int) -> None:
        take_warmup_ns()  # this thread's count starts at zero
        for _ in range(times):
            graph(torch.ones(3))
            counted[name].append(take_warmup_ns())

    tracer = threading.Thread(target=call, args=("tracer", 2))
    tracer.start()
    assert graph.module.inside.wait(30)  # the tracer is inside its trace, holding the lock
    waiter = threading.Thread(target=call, args=("waiter", 2))
    waiter.start()
    threading.Event().wait(0.2)  # the waiter is blocked behind the trace meanwhile
    graph.module.go.set()
    tracer.join(30)
    waiter.join(30)
    (traced, then), (waited, after) = counted["tracer"], counted["waiter"]
    assert traced >= 0.2e9 and waited >= 0.15e9  # both batches paid for the trace
    assert then == after == 0  # the graph exists: no more warm-up on either thread


def test_a_server_measures_no_cost_on_a_batch_that_traced_a_graph(thread_server, monkeypatch):
    """A trace takes 20-50 times a tiny decoder's batch: read as a batch's cost it would skew
    the cost fit and read as a long batch to the lane tuner (lanes sharing the cores)."""
    added: list[tuple] = []
    observed: list[int] = []
    real_add, real_observe = BatchCosts.add, LaneTuner.observe
    monkeypatch.setattr(BatchCosts, "add", lambda self, *a: added.append(a) or real_add(self, *a))
    monkeypatch.setattr(LaneTuner, "observe",
                        lambda self, s: observed.append(s.tokens) or real_observe(self, s))  # fmt: skip
    decoder = SNACDecoder.from_config("tiny-24khz", seed=0)
    torch.set_num_threads(2)  # a server of 2+ threads tunes its lanes (the fixture restores it)
    server = thread_server(decoder)
    assert server._lanes.tuner is not None

    def levels(frames: int) -> list:
        rng = np.random.default_rng(frames)
        return [rng.integers(0, 4096, frames * r) for r in decoder.codec_adapter().layout.level_rates]

    with DecoderClient(server.name) as client:
        client.decode_codes(levels(5))  # its batch traces the graph of an unpadded batch
        client.decode_codes(levels(6))  # the same graph: an ordinary batch
    deadline = time.monotonic() + 30
    while (not added or not observed) and time.monotonic() < deadline:
        threading.Event().wait(0.01)
    threading.Event().wait(0.2)  # a late count of the first batch would show by now
    assert [a[2] for a in added] == [6]  # (key, rows, longest, ...): the second batch alone
    assert observed == [6]


class Untraceable(nn.Module):
    """Returns a list of Python numbers: ``torch.jit.trace`` refuses it."""

    def forward(self, x: torch.Tensor) -> list[float]:
        return [float(v) for v in x.flatten()]


def test_a_module_that_cannot_be_traced_runs_eagerly_with_one_warning(caplog):
    graph = TracedForward(Untraceable())
    with caplog.at_level(logging.WARNING, logger="bicodec_shm.model.traced"):
        assert graph(torch.tensor([1.0, 2.0])) == [1.0, 2.0]
        assert graph(torch.tensor([3.0])) == [3.0]
    assert graph.failed and not graph.graphs
    warned = [r for r in caplog.records if "decoding eagerly" in r.getMessage()]
    assert len(warned) == 1 and "Untraceable" in warned[0].getMessage()


def test_a_graph_that_fails_at_run_time_gives_way_to_the_eager_forward(caplog):
    """A graph must never fail a request that the eager forward would answer."""
    decoder = Qwen3TTSDecoder.from_config("tiny", seed=0)
    graph = TracedForward(decoder.decoder)
    graph(codes(1, 4, 0))

    class Broken:
        def __call__(self, *args: object) -> None:
            raise RuntimeError("planted")

    graph.graphs[None] = Broken()
    x = codes(2, 6, 1)
    with caplog.at_level(logging.WARNING, logger="bicodec_shm.model.traced"):
        assert torch.equal(graph(x), decoder.decoder(x))
        assert torch.equal(graph(x), decoder.decoder(x))
    warned = [r for r in caplog.records if "decoding eagerly" in r.getMessage()]
    assert graph.failed and len(warned) == 1 and "planted" in warned[0].getMessage()


def test_a_decoder_on_another_device_decodes_eagerly():
    """CUDA has its own graphs; the adapters trace for CPU lanes only."""
    qwen3 = Qwen3TTSDecoder.from_config("tiny", seed=0)
    qwen3.decoder.to("meta")  # any device that is not the CPU
    assert qwen3.codec_adapter().window_decoder is None
    snac = SNACDecoder.from_config("tiny-24khz", seed=0).to("meta")
    assert snac.codec_adapter().unpadded_forward is None
