"""`median_item`: the one pick of "the median round" every benchmark's --repeats uses."""
from pdv_ext.bench.common import median_item


def test_an_odd_count_gives_the_middle_item():
    rounds = [{"s": 3.0, "n": "a"}, {"s": 1.0, "n": "b"}, {"s": 2.0, "n": "c"}]
    assert median_item(rounds, lambda r: r["s"])["n"] == "c"


def test_an_even_count_gives_the_lower_middle_item():
    assert median_item([4.0, 1.0, 3.0, 2.0], lambda x: x) == 2.0


def test_a_missing_figure_sorts_last():
    rounds = [{"s": None, "n": "failed"}, {"s": 5.0, "n": "x"}, {"s": 6.0, "n": "y"}]
    assert median_item(rounds, lambda r: r["s"])["n"] == "y"
    assert median_item(rounds[:2], lambda r: r["s"])["n"] == "x"
