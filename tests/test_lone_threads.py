"""A lone CPU lane's thread count, measured (server/lone_threads.py): planted costs in, the
count that decodes faster out."""

import logging

import pytest

from bicodec_shm.server.lone_threads import LoneThreads


def _measure(lone: LoneThreads, cost_ms, lengths) -> list[int]:
    """Feed ``lone`` batches of ``lengths`` (repeated) costing ``cost_ms(threads, tokens)``
    until it chooses; returns the counts it handed out."""
    handed = []
    i = 0
    while lone.measuring:
        threads = lone.next_threads()
        handed.append(threads)
        tokens = lengths[i % len(lengths)]
        lone.add(threads, tokens, int(cost_ms(threads, tokens) * 1e6))
        i += 1
        assert i < 100
    return handed


@pytest.mark.parametrize("one_ms, two_ms, chosen", [
    (lambda t: 5 + 0.2 * t, lambda t: 6 + 0.6 * t, 1),     # a tiny model: two threads hand off more
    (lambda t: 80 + 40 * t, lambda t: 50 + 22 * t, 2),     # a full-size one: two threads share the work
])  # fmt: skip
def test_the_count_that_decodes_faster_is_chosen(one_ms, two_ms, chosen, caplog):
    lone = LoneThreads(cores=2, samples=8)
    with caplog.at_level(logging.INFO, logger="bicodec_shm.server.lanes"):
        handed = _measure(lone, lambda n, t: one_ms(t) if n == 1 else two_ms(t), [2, 4, 8, 16, 32, 50])
    assert handed == [2, 1, 1, 2] * 4  # 8 batches each, A B B A
    assert lone.chosen == chosen and lone.threads == chosen and lone.next_threads() == chosen
    assert "a lone lane runs %d thread(s)" % chosen in caplog.text


def test_a_period_two_pattern_of_lengths_does_not_fool_it():
    """Windows alternating short and long (2, 50, 2, 50 ...): A B B A gives each count both
    lengths, so the faster count wins even though a strict A B A B would hand one count only
    the short ones (and make it look faster)."""
    lone = LoneThreads(cores=2, samples=8)
    handed = _measure(lone, lambda n, t: (10 + 2 * t) * (1.0 if n == 1 else 1.5), [2, 50])
    assert sorted(set(zip(handed, [2, 50] * 8, strict=True))) == [(1, 2), (1, 50), (2, 2), (2, 50)]
    assert lone.chosen == 1  # A B A B: two threads would see only the 2s, and win


def test_batches_of_other_counts_and_empty_batches_are_not_counted():
    lone = LoneThreads(cores=4, samples=2)
    assert lone.threads == 4 and lone.next_threads() == 4
    assert lone.add(2, 10, 1_000_000) is None  # two threads: a lane of two lanes' arrangement
    assert lone.add(None, 10, 1_000_000) is None and lone.add(1, 0, 5) is None
    for threads, ns in ((4, 3e6), (1, 1e6), (4, 3e6)):
        assert lone.add(threads, 10, int(ns)) is None
    assert lone.add(1, 10, 1_000_000) == 1 and lone.add(1, 10, 1) is None and lone.chosen == 1


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="2\\+ cores"):
        LoneThreads(cores=1)
    with pytest.raises(ValueError, match="2\\+ cores"):
        LoneThreads(cores=2, samples=1)
