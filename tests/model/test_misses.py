"""The miss split (`misses.split`) with fixed rates, and the rates' parsing."""

import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.model.misses import MissRates, split

MB = 1 << 20


def _split(mode, counts, misses, rates: MissRates | None = None, nbytes=100 * MB):
    arr = None if rates is None else jnp.asarray(rates.array())
    got = split(mode, jnp.asarray(counts, jnp.int32), jnp.asarray(misses), arr, nbytes)
    return np.asarray(got)


COUNTS = [1, 3, 0, 1, 2, 5, 1, 0]
MISSES = [True, True, False, True, False, True, True, False]


def test_fetch_hosts_nothing_and_host_hosts_every_miss():
    assert not _split("fetch", COUNTS, MISSES).any()
    np.testing.assert_array_equal(_split("host", COUNTS, MISSES), MISSES)


def test_auto_balances_equal_rates_and_prefers_the_link_on_a_tie():
    # 5 misses of one row at equal rates: 2 on the host, 3 over the link (or 3 / 2: the tie
    # goes to fewer on the host, the exact path)
    counts, misses = [1] * 5 + [0] * 3, [True] * 5 + [False] * 3
    got = _split("auto", counts, misses, MissRates(link_gbps=50, host_gbps=50))
    assert got.sum() == 2 and not got[~np.array(misses)].any()
    # 4 misses: 2 / 2
    got = _split("auto", [1] * 4, [True] * 4, MissRates(link_gbps=50, host_gbps=50))
    assert got.sum() == 2


def test_auto_follows_the_rates():
    slow_host = MissRates(link_gbps=50, host_gbps=1)
    assert not _split("auto", COUNTS, MISSES, slow_host).any()
    fast_host = MissRates(link_gbps=1, host_gbps=500)
    np.testing.assert_array_equal(_split("auto", COUNTS, MISSES, fast_host), MISSES)
    # the host at 3x the link takes 3 of 4 one-row misses
    got = _split("auto", [1] * 4, [True] * 4, MissRates(link_gbps=10, host_gbps=30))
    assert got.sum() == 3


def test_auto_sends_the_experts_with_fewest_rows_to_the_host():
    # each further row costs the host as much as the first: many-row experts go over the link
    # a copy takes two one-row host times: the three one-row experts on the host (3 units)
    # while the link copies the other two (4 units)
    rates = MissRates(link_gbps=25, host_gbps=50, row_cost=1.0)
    counts = [8, 1, 1, 6, 1, 0]
    misses = [True, True, True, True, True, False]
    got = _split("auto", counts, misses, rates)
    assert got.tolist() == [False, True, True, False, True, False]
    # the prefill's row counts: all over the link
    assert not _split("auto", [64] * 4, [True] * 4, rates).any()


@pytest.mark.parametrize(("text", "message"), [
    ("link=48", "give host"), ("host=5,link=x", "link takes a number"),
    ("link=48,host=50,speed=3", "'speed=3' is not one of"), ("link=0,host=5", "positive")])
def test_bad_rates_are_named(text, message):
    with pytest.raises(ValueError, match=message):
        MissRates.parse(text)


def test_rates_round_trip():
    rates = MissRates.parse("link=48.5, host=50,row=0.02")
    assert rates == MissRates(link_gbps=48.5, host_gbps=50, row_cost=0.02)
    assert MissRates.parse(str(rates)) == rates
