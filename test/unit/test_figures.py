"""The docs' shared figure formats (``benchmark/figures.py``)."""

from benchmark.figures import median_range, span, stat_range


def test_median_range_takes_the_mean_of_the_middle_two_for_an_even_count():
    assert median_range([3.0, 1.0, 2.0]) == "2.00 [1.00, 3.00]"
    assert median_range([561.8, 757.4, 697.4, 807.1], ".4g") == "727.4 [561.8, 807.1]"


def test_stat_range_is_a_dash_when_a_figure_is_not_a_number():
    assert stat_range({"median": 0.5, "min": 0.25, "max": 1.0}, ".2f") == "0.50 [0.25, 1.00]"
    assert stat_range({"median": float("nan"), "min": 0.25, "max": 1.0}) == "–"


def test_span_collapses_ends_that_print_the_same():
    assert span([1200, 3400, 2000], ",") == "1,200–3,400"
    assert span([1.001, 1.004], ".2f") == "1.00"
    assert span([7, 7], "d") == "7"
