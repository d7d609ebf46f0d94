"""The CLI, called in-process: serve, stats (--json, --watch), decode, demo, cleanup."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import wave

import numpy as np
import pytest
from conftest import wait_until_serving
from support import seed_int16, single_decode

from bicodec_shm.client.decoder_client import DecoderClient
from bicodec_shm.protocol.names import leftover_objects
from bicodec_shm.protocol.segment import Segment
from bicodec_shm.tools import cli, stats_cmd
from bicodec_shm.tools.cli import main


def test_serve_then_stats_json_then_sigterm(shm_name, capsys):
    seen = {}

    def drive():
        try:
            wait_until_serving(shm_name, timeout=60)
            sem, glb = list(range(40)), list(range(32))
            with DecoderClient(shm_name) as client:
                seen["pcm"] = client.decode(sem, glb)
            seen["stats_rc"] = main(["stats", shm_name, "--json"])
            seen["table_rc"] = main(["stats", shm_name])
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # serve's handler stops it cleanly

    t = threading.Thread(target=drive)
    t.start()
    rc = main(["serve", "--preset", "tiny", "--seed", "0", "--name", shm_name, "--slots", "8",
               "--max-batch", "4", "--max-tokens", "200", "--threads", "1"])  # fmt: skip
    t.join(30)
    assert rc == 0
    assert seen["stats_rc"] == 0 and seen["table_rc"] == 0
    out = capsys.readouterr()
    assert "RANDOM weights" in out.err
    stats = json.loads(out.out[: out.out.index("}\n") + 1])
    assert stats["requests"] == 1 and stats["slots"] == 8 and stats["max_tokens"] == 200
    assert stats["server_alive"] is True
    assert "avg batch size" in out.out
    # The handle's warm slot is freed by its close or, if the reaper came first, expired: an
    # idle handle is never a reclaim.
    assert stats["reclaimed"] == 0 and stats["idle_slots_expired"] in (0, 1)
    assert "reclaimed slots" in out.out and "idle slots expired" in out.out
    expected = seed_int16(single_decode(list(range(40)), list(range(32))))
    assert np.abs(seen["pcm"].astype(np.int32) - expected).max() <= 1
    assert leftover_objects(shm_name) == []


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if ``serve`` gets as far as loading a model."""

    def refuse(*args, **kwargs):
        raise AssertionError("serve loaded a model before refusing")

    monkeypatch.setattr(cli, "load_decoder", refuse)


def test_serve_refuses_a_name_with_a_live_server_before_loading(start_server, shm_name, capsys,
                                                                no_model_load, monkeypatch):  # fmt: skip
    proc = start_server()
    monkeypatch.setattr(cli, "NAME_GRACE", 0.3)
    started = time.monotonic()
    rc = main(["serve", "--preset", "tiny", "--name", shm_name])
    err = capsys.readouterr().err
    assert rc == 1 and time.monotonic() - started < 5
    assert f"{shm_name!r} is already being served (server pid {proc.pid}): stop that server" in err
    assert "waiting up to 0.3 s for it to stop" in err


@pytest.mark.parametrize("argv, message", [
    (["--slots", "0"], "--slots must be in 1..4096, got 0"),
    (["--slots", "5000"], "--slots must be in 1..4096, got 5000"),
    (["--max-tokens", "0"], "--max-tokens must be in 1..100000, got 0"),
    (["--max-tokens", "100001"], "--max-tokens must be in 1..100000, got 100001"),
    (["--min-fill", "1.5"], "--min-fill must be in [0, 1], got 1.5"),
    (["--lanes", "0"], "--lanes must be in 1..64, got 0"),
    (["--name", "a b"], "invalid segment name 'a b'"),
    (["--device", "cpu,cpu", "--name", "grp.0"], "cannot end in a member suffix"),
])  # fmt: skip
def test_serve_checks_its_options_before_loading(argv, message, shm_name, capsys, no_model_load):
    assert main(["serve", "--preset", "tiny", "--name", shm_name, *argv]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_a_rolling_restart_waits_for_the_stopping_server_to_let_go(start_server, shm_name):
    """SIGTERM and a new `serve` at once: the old server still serves while it finishes its
    batches, and the new one's name check waits for it instead of refusing."""
    proc = start_server()
    threading.Timer(0.3, proc.send_signal, (signal.SIGTERM,)).start()
    started = time.monotonic()
    cli.wait_for_name(shm_name, grace=20)
    assert time.monotonic() - started < 20
    assert proc.wait(20) == 0


def test_stats_and_decode_of_a_wrong_name_list_the_served_names(thread_server, shm_name, tmp_path, capsys):
    thread_server()
    wrong = shm_name + "-typo"
    (tmp_path / "ids.txt").write_text(" ".join(map(str, range(32))))
    ids = str(tmp_path / "ids.txt")
    assert main(["stats", wrong]) == 1
    assert re.search(r"served now: .*" + re.escape(repr(shm_name)), capsys.readouterr().err)
    out = str(tmp_path / "x.wav")
    assert main(["decode", "--name", wrong, "--semantic", ids, "--global", ids, "-o", out]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"no bicodec-shm server is running under the name {wrong!r}" in err
    assert re.search(r"served now: .*" + re.escape(repr(shm_name)), err)


def test_stats_of_a_missing_name_fails_clearly(shm_name, capsys):
    assert main(["stats", shm_name]) == 1
    err = capsys.readouterr().err
    assert "no bicodec-shm segment" in err and f"bicodec-shm serve --name {shm_name}" in err


def test_stats_is_a_health_probe_that_exits_0_only_while_a_server_serves(start_server, shm_name):
    """As a Docker HEALTHCHECK or a Kubernetes exec probe runs it: a process, its exit status."""
    probe = [sys.executable, "-m", "bicodec_shm", "stats", shm_name]
    assert subprocess.run(probe, capture_output=True, timeout=60).returncode == 1  # nothing yet
    server = start_server()
    done = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "(alive)" in done.stdout and done.stderr == ""
    assert re.search(r"^attached clients\s+0$", done.stdout, re.M)
    server.kill()  # SIGKILL: its objects stay behind, its locks do not
    server.wait(30)
    dead = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    assert dead.returncode == 1 and "(dead)" in dead.stdout
    assert dead.stderr.count("\n") == 1 and f"`bicodec-shm cleanup {shm_name}`" in dead.stderr


def test_stats_of_a_server_that_died_exits_1_and_says_what_to_do(shm_name, capsys):
    Segment.create(shm_name, n_slots=2, max_tokens=10).close()  # a server that died: no locks
    assert main(["stats", shm_name, "--json"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["state"] == "dead"
    assert "died" in err and "start a new server" in err and f"bicodec-shm cleanup {shm_name}" in err


def test_version_names_the_package_version(capsys):
    from bicodec_shm import __version__

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out.strip() == f"bicodec-shm {__version__}"


def test_every_option_of_every_command_has_help_that_shows_its_default():
    import argparse

    parser = cli._parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    missing = []
    for command, sub in commands.choices.items():
        lines = sub.format_help().splitlines()
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            where = f"{command} {'/'.join(action.option_strings) or action.dest}"
            if not action.help:
                missing.append(f"{where}: no help")
            elif action.default not in (None, False, argparse.SUPPRESS, []) and action.option_strings:
                # This option's lines of --help: from its own line to the next option's.
                start = next(i for i, line in enumerate(lines)
                             if line.startswith(f"  {action.option_strings[0]}"))  # fmt: skip
                end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("  -")),
                           len(lines))  # fmt: skip
                if "default" not in " ".join(lines[start:end]):
                    missing.append(f"{where}: its default {action.default!r} is not shown")
    assert missing == []


def test_cleanup_removes_a_dead_servers_leftovers(shm_name, capsys):
    seg = Segment.create(shm_name, n_slots=2, max_tokens=10)
    seg.header["server_pid"] = 2**31  # no such process
    seg.close()
    assert leftover_objects(shm_name)
    assert main(["cleanup", shm_name]) == 0
    assert leftover_objects(shm_name) == []


def test_cleanup_refuses_while_the_server_lives(start_server, shm_name, capsys):
    start_server()
    assert main(["cleanup", shm_name]) == 1
    assert "alive" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["serve", "--mode", "0o1777"], ["serve", "--mode", "abc"]])
def test_bad_mode_is_rejected(argv):
    with pytest.raises(SystemExit):
        main(argv)


def test_demo_runs_checks_results_and_leaves_nothing(tmp_path, capsys):
    out = tmp_path / "demo.json"
    rc = main(["demo", "--preset", "tiny", "--clients", "3", "--requests", "4", "--check", "3",
               "--min-len", "5", "--max-len", "40", "--threads", "1", "--json", str(out)])  # fmt: skip
    assert rc == 0
    summary = json.loads(out.read_text())
    assert summary["requests"] == 12 and summary["failed"] == 0
    assert summary["checked"] == 3 and summary["max_lsb_error"] <= 1
    assert summary["shm_left_behind"] == []
    captured = capsys.readouterr()
    for words in ("throughput", "avg batch size", "latency p50 / p99", "wall time"):
        assert words in captured.out
    # The server's command line as it ran, interpreter included: copy-paste runnable.
    assert f"starting server: {shlex.quote(sys.executable)} -m bicodec_shm serve --name " in captured.err


# -- decode -------------------------------------------------------------------------------------


def _read_wav(path) -> np.ndarray:
    with wave.open(str(path)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 16000)
        return np.frombuffer(w.readframes(w.getnframes()), "<i2")


def test_decode_writes_the_lone_decode_as_a_wav(thread_server, shm_name, tmp_path, capsys):
    thread_server()
    rng = np.random.default_rng(3)
    sem, glb = rng.integers(0, 8192, 77), rng.integers(0, 4096, 32)
    # Text as people paste it (commas, newlines, brackets), and a (1, 1, 32) int32 array as
    # Spark-TTS's tensors save.
    (tmp_path / "sem.txt").write_text(
        "[" + ",\n".join(" ".join(map(str, row)) for row in np.split(sem, 7)) + "]"
    )
    np.save(tmp_path / "glb.npy", glb.astype(np.int32)[None, None])  # Spark-TTS's (1, 1, 32)
    out = tmp_path / "out.wav"
    rc = main(["decode", "--name", shm_name, "--semantic", str(tmp_path / "sem.txt"),
               "--global", str(tmp_path / "glb.npy"), "-o", str(out)])  # fmt: skip
    assert rc == 0
    pcm = _read_wav(out)
    expected = seed_int16(single_decode(sem, glb))
    assert pcm.shape == expected.shape and np.abs(pcm.astype(np.int32) - expected).max() <= 1
    assert f"wrote {out}: 77 tokens, 1.54 s" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("semantic", "global_", "message"),
    [
        ("missing.txt", "glb.npy", "cannot read"),
        ("words.txt", "glb.npy", "item 2 is 'x', not an integer"),
        ("floats.npy", "glb.npy", "ids must be integers"),
        ("square.npy", "glb.npy", "shape (2, 2): a batch of 2 rows; run `bicodec-shm decode` once per row"),
        ("pickle.npy", "glb.npy", "not a numpy array file"),
        ("sem.txt", "sem.txt", "global_ids must have exactly 32 ids, got 3"),
        ("big.txt", "glb.npy", "is out of range: ids must be in 0..8191"),
        ("empty.txt", "glb.npy", "semantic_ids is empty"),
    ],
)
def test_decode_errors_are_one_line(thread_server, shm_name, tmp_path, capsys, semantic, global_, message):
    thread_server()
    (tmp_path / "sem.txt").write_text("1 2 3")
    (tmp_path / "words.txt").write_text("1, 2, x")
    (tmp_path / "big.txt").write_text("1 8192")
    (tmp_path / "empty.txt").write_text("\n")
    np.save(tmp_path / "glb.npy", np.arange(32))
    np.save(tmp_path / "floats.npy", np.ones(5))
    np.save(tmp_path / "square.npy", np.ones((2, 2), np.int64))
    (tmp_path / "pickle.npy").write_bytes(b"not an npy header")
    rc = main(["decode", "--name", shm_name, "--semantic", str(tmp_path / semantic),
               "--global", str(tmp_path / global_), "-o", str(tmp_path / "out.wav")])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and err.startswith("bicodec-shm: error: ")
    assert message in err
    assert not (tmp_path / "out.wav").exists()


def test_decode_checks_the_output_before_asking_the_server(shm_name, tmp_path, capsys):
    (tmp_path / "ids.txt").write_text(" ".join(map(str, range(32))))
    ids = str(tmp_path / "ids.txt")
    for out, words in [(tmp_path / "missing" / "out.wav", "does not exist"), (tmp_path, "is a folder")]:
        # No server serves shm_name: the output's error comes first, and nothing is written.
        assert main(["decode", "--name", shm_name, "--semantic", ids, "--global", ids, "-o", str(out)]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"-o {out}" in err and words in err
    assert not (tmp_path / "missing").exists()


def test_decode_without_a_server_is_one_line(shm_name, tmp_path, capsys):
    (tmp_path / "ids.txt").write_text(" ".join(map(str, range(32))))
    ids = str(tmp_path / "ids.txt")
    assert main(["decode", "--name", shm_name, "--semantic", ids, "--global", ids, "-o", "x.wav"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no bicodec-shm server is running" in err


# -- stats --watch ------------------------------------------------------------------------------


def test_stats_watch_prints_per_interval_rates(thread_server, shm_name, monkeypatch, capsys):
    """Interval 1 sees 4 decodes of 50 tokens (4 s of audio), interval 2 none; then Ctrl-C."""
    thread_server()
    intervals = iter([4, 0])

    def between_samples(seconds):
        n = next(intervals, None)
        if n is None:
            raise KeyboardInterrupt
        with DecoderClient(shm_name) as client:
            for _ in range(n):
                client.decode(list(range(50)), list(range(32)))

    monkeypatch.setattr(stats_cmd, "_sleep", between_samples)
    with DecoderClient(shm_name) as client:  # a request before the watch: not in any interval
        client.decode(list(range(10)), list(range(32)))
    assert main(["stats", shm_name, "--watch", "0.5", "--json"]) == 130
    first, second = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert first["interval"]["requests"] == 4 and first["totals"]["requests"] == 5
    seconds = first["interval"]["seconds"]
    assert first["interval"]["audio_s_per_s"] * seconds == pytest.approx(4.0)
    assert first["interval"]["requests_per_s"] * seconds == pytest.approx(4.0)
    assert first["interval"]["avg_batch_size"] >= 1.0
    assert second["interval"]["requests"] == 0 and second["interval"]["audio_s_per_s"] == 0.0
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", first["time"])

    intervals = iter([2])
    assert main(["stats", shm_name, "--watch", "0.5"]) == 130
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("time"))
    assert lines[0].startswith("segment") and any(line.startswith("requests") for line in lines[:header])
    assert lines[header].split()[:4] == ["time", "req/s", "batch/s", "audio"]
    (row,) = lines[header + 1 :]
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ", row)
    assert row.split()[-2:] == ["7", "alive"]  # totals since start: 1 + 4 + 2 requests


def test_stats_watch_piped_into_head_ends_quietly(thread_server, shm_name):
    thread_server()
    proc = subprocess.Popen([sys.executable, "-m", "bicodec_shm", "stats", shm_name, "--watch", "0.02"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    lines = [proc.stdout.readline() for _ in range(25)]  # what `head -n 25` reads, then it exits
    proc.stdout.close()
    _, err = proc.communicate(timeout=30)
    assert lines[0].startswith("segment") and lines[-1].strip().endswith("alive")
    assert proc.returncode == 1
    assert err == ""


# -- serve --mode -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["777", "0o666", "0o604"])
def test_world_access_is_refused_without_the_flag(shm_name, capsys, mode):
    assert main(["serve", "--preset", "tiny", "--name", shm_name, "--mode", mode]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lets every user of this host attach" in err
    assert "--allow-world-access" in err
    assert leftover_objects(shm_name) == []


def test_world_access_with_the_flag_warns_and_applies_the_mode(shm_name, capsys):
    seen = {}

    def drive():
        try:
            wait_until_serving(shm_name, timeout=60)
            seen["mode"] = os.stat(f"/dev/shm/{shm_name}.sock").st_mode & 0o777  # attached over it
            seen["name's mode"] = os.stat(f"/dev/shm/{shm_name}").st_mode & 0o777
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    t = threading.Thread(target=drive)
    t.start()
    rc = main(["serve", "--preset", "tiny", "--name", shm_name, "--slots", "2", "--threads", "1",
               "--mode", "0o604", "--allow-world-access"])  # fmt: skip
    t.join(30)
    assert rc == 0 and seen["mode"] == 0o604 and seen["name's mode"] == 0o600
    assert "warning: --mode 0o604 lets every user of this host attach" in capsys.readouterr().err


def test_stats_watch_survives_a_server_restart(thread_server, shm_name, monkeypatch, capsys):
    first = thread_server()
    with DecoderClient(shm_name) as client:
        for _ in range(3):
            client.decode(list(range(20)), list(range(32)))
    steps = iter(["stop", "restart"])

    def between_samples(seconds):
        step = next(steps, None)
        if step == "stop":
            first.stop()
            deadline = time.monotonic() + 20
            while leftover_objects(shm_name) and time.monotonic() < deadline:
                time.sleep(0.01)
        elif step == "restart":
            thread_server()
            with DecoderClient(shm_name) as client:
                client.decode(list(range(20)), list(range(32)))
        else:
            raise KeyboardInterrupt

    monkeypatch.setattr(stats_cmd, "_sleep", between_samples)
    assert main(["stats", shm_name, "--watch", "1"]) == 130
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("time"))
    gone, note, row = lines[header + 1 :]
    assert gone.endswith(f"no segment named {shm_name!r} (stopped?)")
    assert "new server" in note and "rates from its start" in note
    assert row.split()[-2:] == ["1", "alive"]  # the new server's total, not 3 + 1, nor -2
    assert float(row.split()[2]) > 0  # req/s of the interval: the new server's one request


# -- smaller: a group with every member down, bench's output folder ----------------------------


def test_group_stats_say_down_when_no_member_serves():
    member = {"device": "cpu", "restarts": 3, "server_alive": False}
    stats = {"group": "tts", "supervisor_pid": 42, "supervisor_alive": True, "requests": 0,
             "members": {"tts.0": dict(member), "tts.1": dict(member)}}  # fmt: skip
    head = stats_cmd.format_group_stats(stats).splitlines()[0]
    assert head.startswith("group tts: 2 members, DOWN: no member serves; supervisor pid 42 (alive)")
    stats["members"]["tts.1"] = {"device": "cpu", "restarts": 0, "server_alive": True, **_member_counters()}
    assert "1 of 2 serving" in stats_cmd.format_group_stats(stats).splitlines()[0]


def _member_counters() -> dict:
    from bicodec_shm.protocol.header import stats_from_header
    from bicodec_shm.protocol.layout import HEADER_DT

    return stats_from_header(np.zeros(1, HEADER_DT)[0])


def test_bench_names_where_it_writes(tmp_path):
    import argparse

    from bicodec_shm.tools.bench import add_arguments
    from bicodec_shm.tools.bench.cli import Plan

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--quick", "--out-dir", str(tmp_path / "results")])
    Plan(args)
    assert args.json == str(tmp_path / "results" / "bench_throughput.json")
    assert args.plot == str(tmp_path / "results" / "bench_throughput.png")
    default = p.parse_args(["--quick"])
    Plan(default)
    assert default.json == os.path.join("benchmarks", "out", "bench_throughput.json")


def test_max_batch_tokens_is_chosen_by_device_unless_given() -> None:
    from bicodec_shm.tools.cli import _parser

    assert _parser().parse_args(["serve"]).max_batch_tokens == "auto"
    assert _parser().parse_args(["serve", "--max-batch-tokens", "none"]).max_batch_tokens is None
    assert _parser().parse_args(["serve", "--max-batch-tokens", "None"]).max_batch_tokens is None
    assert _parser().parse_args(["serve", "--max-batch-tokens", "800"]).max_batch_tokens == 800
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--max-batch-tokens", "0"])


@pytest.fixture(scope="module")
def every_codecs_folder(tmp_path_factory) -> dict[str, str]:
    """A saved tiny model of every codec serve knows: codec -> its folder."""
    from bicodec_shm.model.registry import decoder_class
    from bicodec_shm.tools.model_args import CODECS, resolve_preset

    root = tmp_path_factory.mktemp("model-dirs")
    folders = {}
    for codec in CODECS:
        model = decoder_class(codec).from_config(resolve_preset(codec, "tiny"), seed=0)
        model.save_pretrained(root / codec)
        folders[codec] = str(root / codec)
    return folders


def test_serve_model_dir_of_another_codec_names_the_codec_to_pass(every_codecs_folder):
    """A SNAC folder without --codec, a BiCodec folder with --codec snac-24khz, a DAC 24 kHz file
    with --codec dac-44khz, ...: the message names the folder's codec, not what this codec's
    loader misses in it."""
    from bicodec_shm.model.registry import codec_in
    from bicodec_shm.tools.cli import _parser
    from bicodec_shm.tools.model_args import CODECS, load_decoder

    for i, (codec, folder) in enumerate(every_codecs_folder.items()):
        assert codec_in(folder) == codec
        for asked in {CODECS[(i + 1) % len(CODECS)], "bicodec", "snac-24khz"} - {codec}:
            args = _parser().parse_args(["serve", "--codec", asked, "--model-dir", folder])
            fix = "leave --codec out" if codec == "bicodec" else f"pass --codec {codec}"
            with pytest.raises(ValueError, match=f"holds a {codec} model, not a {asked} one: {fix}"):
                load_decoder(args, announce=False)
    weights = os.path.join(every_codecs_folder["dac-24khz"], "weights.pth")
    assert codec_in(weights) == "dac-24khz" and codec_in(os.path.dirname(weights) + "-none") is None
    args = _parser().parse_args(["serve", "--model-dir", every_codecs_folder["snac-32khz"]])
    with pytest.raises(ValueError, match="pass --codec snac-32khz"):
        load_decoder(args, announce=False)
