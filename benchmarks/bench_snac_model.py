"""Speed of the full-size SNAC decoders (random weights): cost per frame, batching gain, FLOPs.

The SNAC counterpart of ``bench_model.py``. Measures ``SNACDecoder.detokenize`` for batch sizes
1, 2, 4, 8 and lengths of 6 and 12 frames by default (a frame is one coarse code: 85 ms of audio
at 24 kHz, 96 ms at 32 kHz, 70 ms at 44.1 kHz), on CPU in float32, against these baselines:

- the same decode at batch size 1 (``gain`` = per-item time at B / per-item time at B=1; below
  1 means batching saves time per item);
- the same padded batch with ``mask=False`` (what per-layer masking costs; lengths are spread
  evenly from T/2 to T, as in bench_model);
- the same batch with ``noise=False`` (what drawing the per-row noise on the host costs).

FLOPs are counted once with ``torch.utils.flop_counter.FlopCounterMode`` per frame. Quality: the
largest |Δ| of a batched row against its lone decode, and of the decoder against ``snac.SNAC``
with the same weights and noise (when ``snac`` is installed).

    python benchmarks/bench_snac_model.py [--variant snac-24khz] [--quick] [--repeats N]
        [--lengths 6,12] [--batch-sizes 1,2,4,8] [--threads N] [--device cpu] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_model import _cpu_name, _num, _timer, spread_lengths  # noqa: E402

from bicodec_shm.model.devices import resolve_device  # noqa: E402
from bicodec_shm.model.snac import SNACConfig, SNACDecoder  # noqa: E402
from bicodec_shm.model.snac.noise import batch_noise  # noqa: E402

BATCH_SIZES = (1, 2, 4, 8)
LENGTHS = (6, 12)
VARIANTS = ("snac-24khz", "snac-32khz", "snac-44khz", "tiny-24khz", "tiny-32khz", "tiny-44khz")


def random_codes(cfg: SNACConfig, batch: int, frames: int, gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randint(0, cfg.codebook_size, (batch, frames * r), generator=gen) for r in cfg.level_rates]


def gflop_per_frame(model: SNACDecoder, frames: int = 4) -> float:
    """FLOPs of one decode of ``frames`` frames, counted by torch, per frame (GFLOP)."""
    codes = random_codes(model.config, 1, frames, torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model.detokenize(codes)
    return counter.get_total_flops() / frames / 1e9


def bench_snac(
    model: SNACDecoder,
    *,
    batch_sizes: tuple[int, ...] = BATCH_SIZES,
    lengths: tuple[int, ...] = LENGTHS,
    repeats: int = 2,
    device: torch.device,
) -> list[dict[str, Any]]:
    """Time every (length, batch) with masking and noise on, off and noise off; one dict each."""
    cfg, timed = model.config, _timer(device)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for frames in lengths:
        for batch in batch_sizes:
            codes = random_codes(cfg, batch, frames, gen)
            lens = torch.tensor(spread_lengths(batch, frames))
            runs = {
                "on": partial(model.detokenize, codes, lens),
                "nomask": partial(model.detokenize, codes, lens, mask=False),
                "nonoise": partial(model.detokenize, codes, lens, noise=False),
            }
            for run in runs.values():
                run()  # warm-up: oneDNN picks its kernels for each new shape
            times: dict[str, list[float]] = {k: [] for k in runs}
            for _ in range(repeats):
                for key, run in runs.items():
                    times[key].append(timed(run))
            ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
            rows.append({"frames": frames, "batch": batch, "lengths": lens.tolist(),
                         "ms_batch": ms["on"], "ms_batch_nomask": ms["nomask"],
                         "ms_batch_nonoise": ms["nonoise"], "times_s": times})  # fmt: skip
            print(f"  T={frames} B={batch}: {ms['on']:.1f} ms", file=sys.stderr, flush=True)
    single = {r["frames"]: r["ms_batch"] for r in rows if r["batch"] == 1}
    for r in rows:
        r["ms_item"] = r["ms_batch"] / r["batch"]
        r["ms_per_frame"] = r["ms_batch"] / sum(r["lengths"])  # per valid frame decoded
        r["gain"] = r["ms_item"] / single[r["frames"]] if r["frames"] in single else float("nan")
        r["mask_overhead_pct"] = 100 * (r["ms_batch"] / r["ms_batch_nomask"] - 1)
        r["noise_pct"] = 100 * (r["ms_batch"] / r["ms_batch_nonoise"] - 1)
    return rows


def bench_quality(model: SNACDecoder, frames: int = 8) -> dict[str, float | None]:
    """Batched rows (T, 3T/4, T/2, 1 frames) against their lone decodes, and the decoder against
    snac.SNAC with the same weights and noise (None without the snac package)."""
    cfg = model.config
    gen = torch.Generator().manual_seed(1)
    lens = [frames, frames * 3 // 4, frames // 2, 1]
    codes = random_codes(cfg, len(lens), frames, gen)
    audio = model.detokenize(codes, lens, noise_seeds=[0, 1, 2, 3])
    worst = 0.0
    for i, n in enumerate(lens):
        alone = model.detokenize([c[i : i + 1, : n * r] for c, r in zip(codes, cfg.level_rates)],
                                 noise_seeds=i)[0]  # fmt: skip
        worst = max(worst, (audio[i, : len(alone)] - alone).abs().max().item())
    return {"batched_vs_lone_max_abs": worst, "vs_snac_max_abs": _vs_snac(model, codes)}


def _vs_snac(model: SNACDecoder, codes: list[torch.Tensor]) -> float | None:
    try:
        with warnings.catch_warnings():
            # snac 1.2.1 wraps its Snake in torch.jit.script, deprecated since torch 2.10.
            warnings.filterwarnings("ignore", "`torch.jit.script` is deprecated")
            import snac
    except ImportError:
        return None
    from unittest import mock

    from bicodec_shm.model import weights as shared

    twin = snac.SNAC(**model.config.to_dict()).eval().to(model.device)
    state = shared.convert_state_dict(model.state_dict(), shared.weight_norm_prefixes(model),
                                      "parametrizations")  # fmt: skip
    twin.load_state_dict(state, strict=False)
    batch, latent = codes[0].shape[0], codes[0].shape[1] * model.config.latents_per_frame
    noise = iter(batch_noise([0] * batch, [latent] * batch, [0] * batch, latent, model.noise_factors))
    randn = lambda shape, device=None, dtype=None: next(noise).to(device=device, dtype=dtype)  # noqa: E731
    with torch.inference_mode(), mock.patch.object(snac.layers.torch, "randn", randn):
        want = twin.decode([c.to(model.device) for c in codes])[:, 0]
    return (model.detokenize(codes) - want).abs().max().item()


def format_table(rows: list[dict[str, Any]], cfg: SNACConfig, gflop: float) -> str:
    head = (f"{'frames':>6} {'B':>3} {'ms/batch':>9} {'ms/item':>8} {'ms/frame':>9} {'x realtime':>10} "
            f"{'gain':>6} {'mask ovh %':>10} {'noise %':>8} {'GFLOPS':>7}")  # fmt: skip
    lines = [head, "-" * len(head)]
    frame_s = cfg.samples_per_frame / cfg.sampling_rate
    for r in rows:
        realtime = frame_s / (r["ms_per_frame"] / 1e3)
        gflops = gflop * r["batch"] * r["frames"] / (r["ms_batch"] / 1e3)
        lines.append(
            f"{r['frames']:>6} {r['batch']:>3} {r['ms_batch']:>9.1f} {r['ms_item']:>8.1f} "
            f"{r['ms_per_frame']:>9.2f} {realtime:>10.1f} {_num(r['gain'], '.2f', 6)} "
            f"{_num(r['mask_overhead_pct'], '+.1f', 10)} {_num(r['noise_pct'], '+.1f', 8)} {gflops:>7.1f}"
        )
    lines.append(f"{cfg.codec_name}: a frame is {cfg.samples_per_frame} samples ({1e3 * frame_s:.1f} ms); "
                 f"{gflop:.3f} GFLOP per frame (counted)")  # fmt: skip
    lines.append("ms/frame = ms/batch over the batch's valid frames (lengths T..T/2); "
                 "x realtime = audio s / s")  # fmt: skip
    lines.append("gain = (ms per item at B) / (ms per item at B=1); mask ovh = vs mask=False; "
                 "noise % = vs noise=False")  # fmt: skip
    return "\n".join(lines)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="snac-24khz", choices=VARIANTS)
    parser.add_argument("--quick", action="store_true", help="4 frames, B in {1, 2}, 1 repeat")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--lengths", type=_ints, default=LENGTHS, help="frames, e.g. 6,12")
    parser.add_argument("--batch-sizes", type=_ints, default=BATCH_SIZES)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-quality", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="default benchmarks/out/bench_<variant>.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    if device.type == "cuda":  # as the server does: TF32 rounds differently per batch shape
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    batch_sizes, lengths, repeats = args.batch_sizes, args.lengths, args.repeats
    if args.quick:
        batch_sizes, lengths, repeats = (1, 2), (4,), 1
    model = SNACDecoder.from_config(args.variant, seed=0).to(device)
    gflop = gflop_per_frame(model)
    print(f"{args.variant}: {gflop:.3f} GFLOP per frame", file=sys.stderr)
    rows = bench_snac(model, batch_sizes=batch_sizes, lengths=lengths, repeats=repeats, device=device)
    print(format_table(rows, model.config, gflop))
    quality = None if args.no_quality else bench_quality(model)
    if quality:
        print(f"batched vs lone max |Δ| {quality['batched_vs_lone_max_abs']:.2e}; vs snac.SNAC "
              f"{'-' if quality['vs_snac_max_abs'] is None else format(quality['vs_snac_max_abs'], '.2e')}")
    meta = {"torch": torch.__version__, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
            "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "machine": platform.machine(),
            "variant": args.variant, "repeats": repeats, "gflop_per_frame": gflop,
            "load_average": os.getloadavg()}  # fmt: skip
    out = args.json or ROOT / f"benchmarks/out/bench_{args.variant}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": rows, "quality": quality}, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
