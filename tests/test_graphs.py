"""Tests of the CUDA-graph path: the bucket grid, padding up to a bucket, the static mask and
the eager fallback; on a GPU (marker ``gpu``) the graphs themselves.

Everything a graph replays is checked on CPU too: ``GraphedDecoder(mode="padded")`` runs the
very decode that would be captured (padded to the bucket, masked with ``StaticTimeMask``),
eagerly. The ground truth is the lone unpadded decode.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import torch
from support import reference_model, single_decode
from torch._subclasses.fake_tensor import FakeTensorMode

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.model import BiCodecDecoder
from bicodec_shm.model.bicodec.buckets import DEFAULT_LENGTHS, Bucket, BucketGrid, PaddingCost, padding_cost
from bicodec_shm.model.bicodec.graphs import GraphedDecoder, StaticBucket, StaticTimeMask
from bicodec_shm.model.devices import exact_cuda_math
from bicodec_shm.model.modules import TimeMask
from bicodec_shm.tools.cli import _parser
from bicodec_shm.tools.model_args import load_decoder

HOP = 320
SMALL = BucketGrid((1, 2, 4, 8), (8, 16, 32))


def random_batch(batch: int, frames: int, seed: int, *, full_first: bool = True):
    gen = torch.Generator().manual_seed(seed)
    semantic = torch.randint(0, 8192, (batch, frames), generator=gen)
    glob = torch.randint(0, 4096, (batch, 32), generator=gen)
    lengths = torch.randint(1, frames + 1, (batch,), generator=gen)
    if full_first:
        lengths[0] = frames
    return semantic, glob, lengths


def assert_rows_equal_lone(model, audio, semantic, glob, lengths, *, atol: float = 1e-5) -> None:
    assert audio.shape == (semantic.shape[0], HOP * semantic.shape[1])
    assert audio.dtype == torch.float32
    for i, n in enumerate(lengths.tolist()):
        alone = model.detokenize(semantic[i : i + 1, :n], glob[i : i + 1])[0]
        assert (audio[i, : HOP * n] - alone).abs().max().item() <= atol, f"row {i} (n={n})"
        assert torch.all(audio[i, HOP * n :] == 0), f"row {i} has a non-zero tail"


# --- the bucket grid (pure Python) ------------------------------------------------------------


def test_grid_sorts_and_deduplicates() -> None:
    grid = BucketGrid((4, 1, 2, 2), (50, 25))
    assert grid.batch_sizes == (1, 2, 4) and grid.lengths == (25, 50)
    assert len(grid) == 6 and str(grid) == "1,2,4x25,50"


@pytest.mark.parametrize("bad", [(), (0, 1), (-2,), (1.5,), (True,)])
def test_grid_rejects_bad_values(bad) -> None:
    with pytest.raises(ValueError, match="integers >= 1"):
        BucketGrid(bad, (25,))
    with pytest.raises(ValueError, match="integers >= 1"):
        BucketGrid((1,), bad)


@pytest.mark.parametrize(
    ("batch", "frames", "expected"),
    [
        (1, 1, Bucket(1, 8)),
        (1, 8, Bucket(1, 8)),  # exact fit: no padding
        (1, 9, Bucket(1, 16)),
        (3, 16, Bucket(4, 16)),
        (8, 32, Bucket(8, 32)),
        (5, 17, Bucket(8, 32)),
        (9, 8, None),  # more rows than the largest batch size
        (1, 33, None),  # longer than the longest bucket
    ],
)
def test_choose_takes_the_smallest_bucket_that_holds_the_batch(batch, frames, expected) -> None:
    assert SMALL.choose(batch, frames) == expected


def test_choose_is_the_fewest_padded_tokens_of_any_bucket_that_fits() -> None:
    grid = BucketGrid.geometric()
    for batch in range(1, 33):
        for frames in range(1, 301, 7):
            fits = [k for k in grid.buckets() if k.batch >= batch and k.frames >= frames]
            assert grid.choose(batch, frames).tokens == min(k.tokens for k in fits)


def test_choose_rejects_empty_shapes() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        SMALL.choose(0, 5)


def test_buckets_come_largest_first_once_each() -> None:
    buckets = SMALL.buckets()
    assert len(buckets) == len(set(buckets)) == 12
    assert buckets[0] == Bucket(8, 32) and buckets[-1] == Bucket(1, 8)
    tokens = [k.tokens for k in buckets]
    assert tokens == sorted(tokens, reverse=True)


def test_geometric_grid() -> None:
    grid = BucketGrid.geometric()
    assert grid.batch_sizes == (1, 2, 4, 8, 16, 32)
    assert grid.lengths == DEFAULT_LENGTHS == BucketGrid().lengths
    odd = BucketGrid.geometric(max_batch=12, max_frames=130, min_frames=10, ratio=2, multiple=10)
    assert odd.batch_sizes == (1, 2, 4, 8, 12)  # the maximum is always a bucket
    assert odd.lengths == (10, 20, 40, 80, 130)
    # Each length is at most ratio x the one before (after rounding up to the multiple).
    assert all(b <= 2 * a for a, b in zip(odd.lengths, odd.lengths[1:]))
    with pytest.raises(ValueError, match="ratio"):
        BucketGrid.geometric(ratio=1.0)
    with pytest.raises(ValueError, match="max_frames"):
        BucketGrid.geometric(min_frames=50, max_frames=25)


def test_parse_grid() -> None:
    assert BucketGrid.parse("1,2,4x25,50") == BucketGrid((1, 2, 4), (25, 50))
    for bad in ("1,2,4", "1,2x", "ax25", "1x2x3"):
        with pytest.raises(ValueError, match="BATCHES x LENGTHS"):
            BucketGrid.parse(bad)


def test_padding_cost_counts_bucket_and_row_padding() -> None:
    # [8]: bucket 1x8, no padding. [9, 4]: bucket 2x16 = 32 tokens for 13. [40]: too long.
    cost = padding_cost(SMALL, [[8], [9, 4], [40]])
    assert cost == PaddingCost(real_tokens=21, bucket_tokens=40, eager_batches=1, batches=3)
    assert cost.waste == pytest.approx(1 - 21 / 40)
    assert cost.eager_share == pytest.approx(1 / 3)
    assert padding_cost(SMALL, []).waste == 0.0
    # A finer grid wastes less on the same batches.
    batches = [[n] for n in range(1, 33)]
    assert padding_cost(BucketGrid((1,), tuple(range(1, 33))), batches).waste == 0.0
    finer = BucketGrid((1,), (8, 12, 16, 24, 32))
    assert padding_cost(SMALL, batches).waste > padding_cost(finer, batches).waste


# --- the static mask --------------------------------------------------------------------------


def test_static_mask_equals_the_eager_mask_bit_for_bit() -> None:
    lengths, frames, factors = torch.tensor([7, 3, 5, 1]), 7, (1, 8, 40)
    eager = TimeMask(lengths, frames, factors, dtype=torch.float32)
    static = StaticTimeMask(lengths, {f: torch.arange(frames * f) for f in factors}, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    for f in factors:
        x = torch.randn(4, 3, frames * f, generator=gen)
        got, want = static(x.clone()), eager(x.clone())
        assert torch.equal(got, want)
        assert torch.equal(torch.signbit(got), torch.signbit(want))  # even the signs of zeros
        assert torch.all(got[1, :, 3 * f :] == 0) and torch.equal(got[0], x[0])


def test_graph_body_reads_no_tensor_on_the_host() -> None:
    """Fake tensors have no data, so any host read (``int(t)``, ``.item()``, ``.any()`` in an
    ``if``) raises: the CPU stand-in for "no syncs inside the captured region"."""
    model = reference_model()
    with torch.inference_mode():
        static = StaticBucket(model, Bucket(2, 8))
        with FakeTensorMode(allow_non_fake_inputs=True):
            assert static.forward().shape == (2, HOP * 8)
            with pytest.raises(Exception, match="local_scalar_dense|data-dependent"):
                TimeMask(static.lengths, 8, (1, 8), dtype=torch.float32)  # the eager mask does


# --- padding up to a bucket, run eagerly on CPU ----------------------------------------------


@pytest.fixture(scope="module")
def padded() -> GraphedDecoder:
    return GraphedDecoder(reference_model(), grid=SMALL, mode="padded")


@pytest.mark.parametrize(
    ("batch", "frames", "seed"),
    [(3, 13, 0), (4, 16, 1), (1, 5, 2), (8, 32, 3), (5, 30, 4), (2, 1, 5)],
)
def test_padded_rows_equal_their_lone_decode(padded, batch, frames, seed) -> None:
    semantic, glob, lengths = random_batch(batch, frames, seed)
    audio = padded.detokenize(semantic, glob, lengths)
    assert_rows_equal_lone(reference_model(), audio, semantic, glob, lengths)


def test_padded_without_lengths_and_with_numpy(padded) -> None:
    semantic, glob, _ = random_batch(3, 11, seed=6)
    audio = padded.detokenize(semantic.numpy().astype(np.int32), glob.numpy(), None)
    assert_rows_equal_lone(reference_model(), audio, semantic, glob, torch.full((3,), 11))


def test_padded_result_does_not_depend_on_the_batch_before(padded) -> None:
    semantic, glob, lengths = random_batch(2, 10, seed=7)
    fresh = GraphedDecoder(reference_model(), grid=SMALL, mode="padded")
    want = fresh.detokenize(semantic, glob, lengths)
    padded.detokenize(*random_batch(4, 16, seed=8))  # fills more rows and frames of 4x16
    assert torch.equal(padded.detokenize(semantic, glob, lengths), want)


@pytest.mark.parametrize(("batch", "frames"), [(9, 10), (2, 40), (9, 40)])
def test_shapes_outside_the_grid_run_eagerly(padded, monkeypatch, batch, frames) -> None:
    semantic, glob, lengths = random_batch(batch, frames, seed=9)  # > 8 rows or > 32 tokens
    want = reference_model().detokenize(semantic, glob, lengths)
    for bucket in padded.buckets.values():
        monkeypatch.setattr(bucket, "run", _forbidden)
    assert torch.equal(padded.detokenize(semantic, glob, lengths), want)


def _forbidden() -> None:
    raise AssertionError("a bucket ran for a shape outside the grid")


def test_padded_checks_inputs_like_the_decoder(padded) -> None:
    semantic, glob, lengths = random_batch(2, 6, seed=10)
    semantic[1, 2] = 8192
    with pytest.raises(ValueError, match=r"semantic_ids\[1, 2\] = 8192"):
        padded.detokenize(semantic, glob, lengths)


def test_mask_false_runs_the_decoders_unmasked_path(padded) -> None:
    semantic, glob, lengths = random_batch(3, 12, seed=11)
    want = reference_model().detokenize(semantic, glob, lengths, mask=False)
    assert torch.equal(padded.detokenize(semantic, glob, lengths, mask=False), want)


def test_server_serves_through_the_padded_wrapper(thread_server, shm_name) -> None:
    thread_server(GraphedDecoder(reference_model(), grid=BucketGrid((1, 2, 4), (16, 64)), mode="padded"))
    rng = np.random.default_rng(12)
    with DecoderClient(shm_name) as client:
        for n in (5, 16, 40, 70):  # 70 tokens is past the grid: eager
            sem, glb = rng.integers(0, 8192, n), rng.integers(0, 4096, 32)
            pcm = client.decode(sem, glb, dtype="float32")
            np.testing.assert_allclose(pcm, single_decode(sem, glb), atol=1e-5, rtol=0)


# --- the eager fallback -----------------------------------------------------------------------


def test_two_threads_sharing_the_static_buckets_each_get_their_own_audio() -> None:
    """Two server lanes on one GraphedDecoder (--cuda-graphs --lanes 2) share every bucket's
    static inputs and output: load + run + clone must be one step, or a lane decodes (or
    clones) the other's batch. Padded mode runs the same steps eagerly on CPU."""

    model = reference_model()
    padded = GraphedDecoder(model, grid=BucketGrid((2,), (16,)), mode="padded")
    batches = [random_batch(2, 16, seed) for seed in (1, 2)]
    expected = [model.detokenize(*b) for b in batches]
    assert _threads_disagree(padded, batches, expected, rounds=15) == []


def test_without_cuda_auto_mode_is_the_plain_decoder() -> None:
    model = reference_model()
    wrapped = GraphedDecoder(model, grid=SMALL)
    assert wrapped.mode == ("graphs" if model.device.type == "cuda" else "eager")
    assert wrapped.buckets == {} and wrapped.graph_bytes == 0
    assert (wrapped.device, wrapped.dtype, wrapped.config) == (model.device, model.dtype, model.config)
    for seed, (batch, frames) in enumerate([(3, 13), (1, 8), (9, 40)]):
        semantic, glob, lengths = random_batch(batch, frames, seed)
        want = model.detokenize(semantic, glob, lengths)
        assert torch.equal(wrapped.detokenize(semantic, glob, lengths), want)
    assert "mode=eager" in repr(wrapped)


def test_bad_options_are_value_errors() -> None:
    model = reference_model()
    with pytest.raises(ValueError, match="auto, graphs, eager, padded"):
        GraphedDecoder(model, mode="fast")
    with pytest.raises(ValueError, match="memory_gib"):
        GraphedDecoder(model, memory_gib=-1)
    if model.device.type != "cuda":
        with pytest.raises(ValueError, match="CUDA device"):
            GraphedDecoder(model, mode="graphs")


def test_cli_graph_options() -> None:
    args = _parser().parse_args(["serve"])
    assert args.cuda_graphs is False and args.graph_memory_gib == 8.0
    args = _parser().parse_args(["serve", "--cuda-graphs", "--graph-memory-gib", "2.5"])
    assert args.cuda_graphs is True and args.graph_memory_gib == 2.5
    assert _parser().parse_args(["serve", "--no-cuda-graphs"]).cuda_graphs is False
    with pytest.raises(ValueError, match="--cuda-graphs needs a CUDA --device"):
        load_decoder(_parser().parse_args(["serve", "--preset", "tiny", "--cuda-graphs"]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize(
    ("device", "needle"),
    [
        ("cuda:0", "needs a CUDA build of torch" if torch.version.cuda is None else "sees no GPU"),
        ("gpu", "unknown device 'gpu': use one of cpu, cuda, mps"),
        ("meta", "not supported: use one of cpu, cuda, mps"),
    ],
)
def test_cli_device_errors_are_one_line(device, needle, shm_name, capsys) -> None:
    from bicodec_shm.tools.cli import main

    assert main(["serve", "--preset", "tiny", "--device", device, "--name", shm_name]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


# --- on a GPU (benchmarks/device_check.sh) -----------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def full_cuda() -> BiCodecDecoder:
    exact_cuda_math()  # the server's flags: bit-for-bit comparisons need deterministic cuDNN
    return BiCodecDecoder.from_config("spark-tts-0.5b", seed=0).to("cuda")


GPU_GRID = BucketGrid((1, 4), (25, 50))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_equal_eager_byte_for_byte_where_shapes_match(dtype, record_property) -> None:
    exact_cuda_math()
    model = BiCodecDecoder.from_config("spark-tts-0.5b", seed=0, dtype=dtype).to("cuda")
    graphed = GraphedDecoder(model, grid=GPU_GRID, mode="graphs")
    padded = GraphedDecoder(model, grid=GPU_GRID, mode="padded")
    assert set(graphed.buckets) == set(GPU_GRID.buckets()), graphed.skipped
    record_property(f"graph_mib_{dtype}", round(graphed.graph_bytes / 2**20, 1))
    for seed, (batch, frames) in enumerate([(4, 50), (1, 25), (4, 25)]):
        semantic, glob, lengths = (t.cuda() for t in random_batch(batch, frames, seed))
        got = graphed.detokenize(semantic, glob, lengths)
        # The same padded decode without the graph: the graph changes no byte.
        assert torch.equal(got, padded.detokenize(semantic, glob, lengths))
        # At a bucket's exact shape the plain decoder computes the same thing too.
        same = (got == model.detokenize(semantic, glob, lengths)).float().mean().item()
        record_property(f"equal_share_vs_plain_{dtype}_{batch}x{frames}", same)
        assert same == 1.0, f"{batch}x{frames}: {same:.4f} of samples equal"
        full = graphed.detokenize(semantic, glob)  # every row full: no padding at all
        assert torch.equal(full, model.detokenize(semantic, glob))


@pytest.mark.gpu
@cuda
def test_cuda_graph_rows_equal_their_lone_decode(full_cuda, record_property) -> None:
    graphed = GraphedDecoder(full_cuda, grid=GPU_GRID, mode="graphs")
    worst = 0.0
    for seed, (batch, frames) in enumerate([(3, 37), (2, 50), (1, 7)]):
        semantic, glob, lengths = random_batch(batch, frames, seed)  # on the host, as the server sends
        audio = graphed.detokenize(semantic, glob, lengths)
        assert audio.device.type == "cuda"
        for i, n in enumerate(lengths.tolist()):
            alone = full_cuda.detokenize(semantic[i : i + 1, :n], glob[i : i + 1])[0]
            worst = max(worst, (audio[i, : HOP * n] - alone).abs().max().item())
            assert torch.all(audio[i, HOP * n :] == 0)
    record_property("cuda_graphs_batched_vs_lone_max_abs", worst)
    assert worst <= 1e-5


@pytest.mark.gpu
@cuda
def test_cuda_graph_body_does_not_sync(full_cuda) -> None:
    with torch.inference_mode():
        static = StaticBucket(full_cuda, Bucket(2, 25))
        static.forward()  # lazy initialisation may sync once
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            static.forward()
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@cuda
def test_cuda_graph_memory_budget(full_cuda, caplog, record_property) -> None:
    caplog.set_level(logging.INFO, logger="bicodec_shm.model.graphs")
    nothing = GraphedDecoder(full_cuda, grid=GPU_GRID, memory_gib=0.0, mode="graphs")
    assert nothing.buckets == {} and len(nothing.skipped) == len(GPU_GRID)
    assert "skipped" in caplog.text
    semantic, glob, lengths = random_batch(3, 20, seed=13)
    want = full_cuda.detokenize(semantic, glob, lengths)
    assert torch.equal(nothing.detokenize(semantic, glob, lengths), want)  # all eager
    every = GraphedDecoder(full_cuda, grid=GPU_GRID, memory_gib=64, mode="graphs")
    assert len(every.buckets) == len(GPU_GRID) and every.graph_bytes > 0
    assert "captured" in caplog.text
    record_property("graph_mib_4_buckets_float32", round(every.graph_bytes / 2**20, 1))
    # Half of what the largest bucket's activations take: that one is skipped, smaller ones may
    # fit; every bucket is either captured or skipped.
    need = every.activation_bytes[Bucket(4, 50)]
    some = GraphedDecoder(full_cuda, grid=GPU_GRID, memory_gib=0.5 * need / 2**30, mode="graphs")
    assert Bucket(4, 50) in some.skipped and Bucket(4, 50) not in some.buckets
    assert sorted(some.skipped + list(some.buckets)) == sorted(GPU_GRID.buckets())
    record_property("activation_mib_4x50_float32", round(need / 2**20, 1))


@pytest.mark.gpu
@cuda
def test_cuda_two_lanes_share_the_graphs_and_each_row_gets_its_own_audio(full_cuda) -> None:
    """--cuda-graphs --lanes 2: two threads replay the same buckets; the lock keeps each
    thread's load + replay + clone together."""

    graphed = GraphedDecoder(full_cuda, grid=GPU_GRID, mode="graphs")
    batches = [random_batch(4, 50, seed) for seed in (21, 22)]
    expected = [graphed.detokenize(*b) for b in batches]
    assert _threads_disagree(graphed, batches, expected, rounds=30,
                             setup=lambda: torch.cuda.set_device(full_cuda.device)) == []


@pytest.mark.gpu
@cuda
def test_cuda_eager_decode_of_host_inputs_queues_without_waiting(full_cuda) -> None:
    """detokenize stages host inputs in pinned memory and copies them without blocking: a
    pageable copy would wait for the stream, and the lane could not launch batch k while k-1
    runs."""
    semantic, glob, lengths = random_batch(3, 30, seed=4)
    full_cuda.detokenize(semantic, glob, lengths)  # lazy initialisation may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        audio = full_cuda.detokenize(semantic, glob, lengths)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(audio, full_cuda.detokenize(semantic, glob, lengths))


@pytest.mark.gpu
@cuda
def test_cuda_pipelined_lane_publishes_the_decodes_its_event_guards(full_cuda) -> None:
    """The real Runner on the GPU: a batch's host copy, read after its event, is the decode
    (the event is recorded on the model's stream, after the copy)."""
    from bicodec_shm.protocol.slot_io import Batch, Requests
    from bicodec_shm.server.lanes import Runner

    runner = Runner(full_cuda, full_cuda.device)
    launched = []
    for seed in (31, 32, 33):
        semantic, glob, lengths = random_batch(4, 50, seed)
        order = torch.argsort(lengths, descending=True)
        semantic, glob, lengths = semantic[order], glob[order], lengths[order]
        n = len(lengths)
        requests = Requests(np.arange(n, dtype=np.int64), lengths.numpy().astype(np.int64),
                            np.zeros(n, np.uint64), np.zeros(n, np.uint32), np.zeros(n, np.uint32),
                            np.zeros(n, np.uint64))  # fmt: skip
        batch = Batch(requests, semantic.numpy(), glob.numpy(), 0)
        launched.append((runner.launch(batch, retry=len(launched) == 2), semantic, glob, lengths))
    for inflight, semantic, glob, lengths in launched:
        decoded = inflight.wait()
        want = full_cuda.detokenize(semantic, glob, lengths)
        want16 = (torch.clamp(want, -1, 1) * 32767).to(torch.int16).cpu().numpy()
        for row, pcm in zip(decoded.rows16, decoded.pcm16):
            np.testing.assert_array_equal(pcm, want16[row, : pcm.shape[0]])


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


@pytest.mark.gpu
@two_gpus
def test_cuda_a_runner_on_the_second_gpu_guards_its_copy_with_that_gpus_event() -> None:
    """With GPU 0 current (a thread that never set its device), the event must still be on
    cuda:1's stream: the host copy read after it equals the decode."""
    from bicodec_shm.protocol.slot_io import Batch, Requests
    from bicodec_shm.server.lanes import Runner

    exact_cuda_math()
    model = BiCodecDecoder.from_config("spark-tts-0.5b", seed=0).to("cuda:1")
    runner = Runner(model, model.device)
    semantic, glob, _ = random_batch(8, 100, seed=3)
    n = len(semantic)
    requests = Requests(np.arange(n, dtype=np.int64), np.full(n, 100, np.int64), np.zeros(n, np.uint64),
                        np.zeros(n, np.uint32), np.zeros(n, np.uint32), np.zeros(n, np.uint64))  # fmt: skip
    torch.cuda.set_device(0)
    inflight = runner.launch(Batch(requests, semantic.numpy(), glob.numpy(), 0))
    got = inflight.wait().pcm16.copy()
    want = (torch.clamp(model.detokenize(semantic, glob), -1, 1) * 32767).to(torch.int16).cpu().numpy()
    np.testing.assert_array_equal(got, want)


def _threads_disagree(decoder, batches, expected, *, rounds: int, setup=None) -> list[int]:
    """Two threads decode ``batches[0]`` and ``batches[1]`` through ``decoder`` at once,
    ``rounds`` times each; the indices of every result that differed from ``expected``."""
    wrong: list[int] = []

    def hammer(k: int) -> None:
        if setup is not None:
            setup()
        for _ in range(rounds):
            if not torch.equal(decoder.detokenize(*batches[k]), expected[k]):
                wrong.append(k)

    threads = [threading.Thread(target=hammer, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return wrong
