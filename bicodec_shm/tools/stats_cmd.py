"""``bicodec-shm stats``: a server's (or a group's) live counters, once or ``--watch``ed."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

from ..codecs.layout import get_layout
from ..errors import BiCodecShmError, SegmentError
from ..protocol.group import GroupInfo, group_stats, read_group
from ..protocol.header import read_header, read_slot_owners, stats_from_header
from ..protocol.layout import MAGIC, Phase
from ..protocol.names import ServerState, probe
from ..protocol.served import describe_served
from .decode_cmd import TOKENS_PER_SECOND

_sleep = time.sleep  # `stats --watch` between samples; tests replace it to drive the intervals


def marked_stopping(name: str) -> bool:
    """True if the server of ``name`` has marked its header as stopping (it will let go)."""
    header = read_header(name)
    return (header is not None and int(header["magic"]) == MAGIC
            and int(header["phase"]) in (Phase.STOPPING, Phase.STOPPED))  # fmt: skip


def pid_clause(name: str) -> str:
    """" (server pid N)" or " (a server group, supervisor pid N)", as far as it can be read."""
    try:
        info = read_group(name)
        if info is not None:
            return f" (a server group, supervisor pid {info.supervisor_pid})"
        header = read_header(name)
    except (BiCodecShmError, ValueError, OSError):
        return ""
    if header is None or int(header["magic"]) != MAGIC:
        return ""
    return f" (server pid {int(header['server_pid'])})"


def _cmd_stats(args: argparse.Namespace) -> int:
    """Exit status 0 only while a live server (or group) serves the name: a health probe."""
    if args.watch is not None and args.watch <= 0:
        raise ValueError(f"--watch must be > 0 seconds, got {args.watch}")
    info = read_group(args.name)
    if info is not None:
        return _group_stats(args, info)
    header = read_header(args.name)
    if header is None:
        raise BiCodecShmError(f"nothing serves {args.name!r}: no bicodec-shm segment of that name in "
                              f"/dev/shm; start a server with `bicodec-shm serve --name {args.name}`. "
                              f"{describe_served(exclude=args.name)}")  # fmt: skip
    stats = _stats(args.name, header)
    if args.watch is not None:
        return _watch(args, stats)
    print(json.dumps(stats, indent=2) if args.json else format_stats(args.name, stats))
    return _probe_status(args.name, stats["state"], f"its server (pid {stats['server_pid']})")


def _probe_status(name: str, state: str, who: str) -> int:
    """0 if ``state`` is serving; else 1, with one line on standard error saying what to do."""
    if state == ServerState.SERVING.value:
        return 0
    if state == ServerState.BUSY.value:
        why = f"{who} is starting or stopping; try again in a moment"
    else:
        why = (f"{who} died; start a new server under the name (it takes the leftovers over), or "
               f"remove them with `bicodec-shm cleanup {name}`")  # fmt: skip
    print(f"bicodec-shm: {name!r} is not served: {why}", file=sys.stderr)
    return 1


def _stats(name: str, header) -> dict:
    stats = stats_from_header(header)
    state = probe(name)
    stats["state"] = state.value  # serving | busy (starting or stopping) | dead
    stats["server_alive"] = state is ServerState.SERVING
    try:
        stats.update(read_slot_owners(name) or {})
    except SegmentError:
        if state is ServerState.SERVING:
            raise  # a header clients refuse: so does the health probe
        # a dead or half-made server's leftovers: the counters above are all there is
    return stats


def _watch(args: argparse.Namespace, stats: dict) -> int:
    """One line per interval: a timestamp and the rates within that interval (like vmstat)."""
    if not args.json:
        print(format_stats(args.name, stats))
        print(WATCH_COLUMNS, flush=True)
    before, t_before = stats, time.monotonic()
    while True:
        _sleep(args.watch)
        header, now = read_header(args.name), time.monotonic()
        stamp = datetime.datetime.now().isoformat(sep=" ", timespec="seconds")
        if header is None:
            line = {"time": stamp, "segment": None}
            print(json.dumps(line) if args.json else f"{stamp}  no segment named {args.name!r} (stopped?)",
                  flush=True)  # fmt: skip
            continue
        stats = _stats(args.name, header)
        if stats["server_epoch"] != before["server_epoch"]:  # a new server: counters restart at 0
            before = _ZERO
            if not args.json:
                print(f"{stamp}  new server (pid {stats['server_pid']}); rates from its start", flush=True)
        rates = interval_rates(before, stats, now - t_before)
        if args.json:
            print(json.dumps({"time": stamp, "interval": rates, "totals": stats}), flush=True)
        else:
            print(format_watch_line(stamp, rates, stats), flush=True)
        before, t_before = stats, now


_ZERO = {k: 0 for k in ("requests", "batches", "tokens", "failed", "completed")} | {
    "batch_size_histogram": {}, "avg_queue_wait_ms": 0.0}  # fmt: skip


def _group_stats(args: argparse.Namespace, info: GroupInfo) -> int:
    """``stats N`` of a server group: the members side by side, or with ``--watch`` one line
    per member and interval."""
    stats = group_stats(info)
    # The group object stays "alive" while its supervisor runs, even with every member down.
    stats["members_serving"] = sum(bool(st.get("server_alive")) for st in stats["members"].values())
    stats["serving"] = bool(stats["supervisor_alive"] and stats["members_serving"])
    if args.watch is None:
        print(json.dumps(stats, indent=2) if args.json else format_group_stats(stats))
        if stats["serving"]:
            return 0
        if stats["supervisor_alive"]:  # its members are (re)starting
            return _probe_status(args.name, ServerState.BUSY.value, "every member of the group")
        return _probe_status(args.name, ServerState.DEAD.value,
                             f"the group's supervisor (pid {stats['supervisor_pid']})")  # fmt: skip
    if not args.json:
        print(format_group_stats(stats))
        print(f"{WATCH_COLUMNS}  member", flush=True)
    before, t_before = stats["members"], time.monotonic()
    while True:
        _sleep(args.watch)
        info, now = read_group(args.name), time.monotonic()
        stamp = datetime.datetime.now().isoformat(sep=" ", timespec="seconds")
        if info is None:
            print(json.dumps({"time": stamp, "group": None}) if args.json
                  else f"{stamp}  no group named {args.name!r} (stopped?)", flush=True)  # fmt: skip
            continue
        members = group_stats(info)["members"]
        for member, st in members.items():
            if "requests" not in st:
                print(json.dumps({"time": stamp, "member": member, "segment": None}) if args.json
                      else f"{stamp}  {member} is down", flush=True)  # fmt: skip
                continue
            prev = before.get(member, {})
            prev = prev if prev.get("server_epoch") == st["server_epoch"] else _ZERO
            rates = interval_rates(prev, st, now - t_before)
            line = {"time": stamp, "member": member, "interval": rates, "totals": st}
            print(json.dumps(line) if args.json else f"{format_watch_line(stamp, rates, st)}  {member}",
                  flush=True)  # fmt: skip
        before, t_before = members, now


WATCH_COLUMNS = (f"{'time':<19}  {'req/s':>7}  {'batch/s':>7}  {'audio s/s':>9}  {'avg batch':>9}  "
                 f"{'queue ms':>8}  {'failed':>6}  {'requests':>8}  server")  # fmt: skip


def interval_rates(before: dict, after: dict, seconds: float) -> dict:
    """Rates between two ``stats_from_header`` snapshots taken ``seconds`` apart.

    Audio seconds come from the real (unpadded) frames decoded (BiCodec: 50 tokens a second).
    """
    seconds = max(seconds, 1e-9)
    requests = after["requests"] - before["requests"]
    batches = after["batches"] - before["batches"]
    rows = _rows(after) - _rows(before)
    queued_ms = _queued_ms(after) - _queued_ms(before)
    completed = after["completed"] - before["completed"]
    return {
        "seconds": seconds,
        "requests": requests,
        "failed": after["failed"] - before["failed"],
        "requests_per_s": requests / seconds,
        "batches_per_s": batches / seconds,
        "audio_s_per_s": (after["tokens"] - before["tokens"]) / _frames_per_second(after) / seconds,
        "avg_batch_size": rows / batches if batches else 0.0,
        "avg_queue_wait_ms": queued_ms / completed if completed else 0.0,
    }


def _rows(stats: dict) -> int:
    """Requests decoded in all batches so far, from the batch-size histogram."""
    return sum(b * n for b, n in stats["batch_size_histogram"].items())


def _queued_ms(stats: dict) -> float:
    return stats["avg_queue_wait_ms"] * stats["completed"]  # the average is over completed ones


def format_watch_line(stamp: str, rates: dict, stats: dict) -> str:
    r, state = rates, "alive" if stats.get("server_alive") else "dead"
    return (f"{stamp:<19}  {r['requests_per_s']:>7.1f}  {r['batches_per_s']:>7.1f}  "
            f"{r['audio_s_per_s']:>9.2f}  {r['avg_batch_size']:>9.2f}  "
            f"{r['avg_queue_wait_ms']:>8.1f}  {r['failed']:>6}  {stats['requests']:>8}  {state}")  # fmt: skip


def format_stats(name: str, stats: dict) -> str:
    """A two-column table of ``stats_from_header`` output."""
    rows = [("segment", name), *stats_rows(stats)]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def format_group_stats(stats: dict) -> str:
    """A server group's ``group_stats``: one column per member (a member that is down: "-")."""
    members = stats["members"]
    columns = {m: dict([("device", st["device"]), ("restarts", st["restarts"])]
                       + (stats_rows(st) if "requests" in st else [("server pid", "down")]))
               for m, st in members.items()}  # fmt: skip
    keys = list(max(columns.values(), key=len))
    alive = "alive" if stats["supervisor_alive"] else "not serving"
    up = sum(bool(st.get("server_alive")) for st in members.values())
    state = f"{up} of {len(members)} serving" if up else "DOWN: no member serves"
    rows = [("member", list(members))] + [(k, [columns[m].get(k, "-") for m in members]) for k in keys]
    width = max(len(k) for k, _ in rows)
    widths = [max(len(str(row[1][i])) for row in rows) for i in range(len(members))]
    lines = [f"group {stats['group']}: {len(members)} members, {state}; supervisor pid "
             f"{stats['supervisor_pid']} ({alive}), {stats['requests']} requests in all"]  # fmt: skip
    for key, values in rows:
        cells = "  ".join(f"{str(v):<{w}}" for v, w in zip(values, widths))
        lines.append(f"{key:<{width}}  {cells}".rstrip())
    return "\n".join(lines)


def _frames_per_second(stats: dict) -> float:
    """Frames (BiCodec: tokens) per second of audio of the codec ``stats`` names."""
    try:
        return get_layout(stats.get("codec", "bicodec")).frame_rate
    except ValueError:
        return TOKENS_PER_SECOND


_STATE_WORDS = {"serving": "alive", "busy": "starting or stopping", "dead": "dead"}


def stats_rows(stats: dict) -> list[tuple[str, object]]:
    """The rows of ``format_stats`` after the segment's name."""
    state = stats.get("state", "serving" if stats.get("server_alive") else "dead")
    rows = [
        ("server pid", f"{stats['server_pid']} ({_STATE_WORDS.get(state, state)})"),
        ("codec", stats.get("codec", "-")),
        ("slots / max tokens", f"{stats['slots']} / {stats['max_tokens']}"),
        ("encodes", f"yes (audio of {stats['encode_min_samples']} samples or more)"
         if stats.get("encode_min_samples") else "no (started without --encode)"),
    ]
    if "attached_clients" in stats:
        rows.append(("slots held (ready, busy)", f"{stats['owned']} ({stats['ready']}, {stats['busy']})"))
        rows.append(("attached clients", stats["attached_clients"]))
    rows += [
        ("lanes (busy)", f"{stats['lanes']} ({stats['busy_lanes']})"),
        ("requests", stats["requests"]),
        ("failed", stats["failed"]),
        ("batches", stats["batches"]),
        ("avg batch size", f"{stats['avg_batch_size']:.2f}"),
        ("avg batch time", f"{stats['avg_batch_time_ms']:.2f} ms"),
        ("avg queue wait", f"{stats['avg_queue_wait_ms']:.2f} ms"),
        ("avg latency", f"{stats['avg_latency_ms']:.2f} ms (submit to answer)"),
        ("tokens (padded)", f"{stats['tokens']} ({stats['padded_tokens']})"),
        ("host gap", f"{stats['host_gap_ms']:.1f} ms (lanes idle while decodable work waited for the host)"),
        ("waited on purpose", f"{stats['waited_ms']:.1f} ms (lanes holding ready work back, not host gap)"),
        ("reclaimed slots", f"{stats['reclaimed']} (of clients that died or gave up)"),
        ("idle slots expired", f"{stats['idle_slots_expired']} (idle handles' warm slots: routine)"),
        ("dropped answers", f"{stats['dropped_answers']} (slots their client freed while decoded)"),
        ("batch sizes", " ".join(f"{b}:{n}" for b, n in stats["batch_size_histogram"].items()) or "-"),
    ]
    return rows
