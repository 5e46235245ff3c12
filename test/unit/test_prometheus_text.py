"""The one Prometheus text renderer (``sglang_memx.prometheus``) behind /memx/metrics and the
router's /metrics: label escaping, value text, family blocks, histograms."""

from sglang_memx import metrics, prometheus
from sglang_memx.prometheus import Histogram, Samples, labels_text, number, render, sample
from sglang_memx.serve import metrics as router_metrics


def test_labels_are_sorted_and_escaped():
    assert labels_text({}) == ""
    assert labels_text({"b": 1, "a": 'x"y\\z'}) == '{a="x\\"y\\\\z",b="1"}'


def test_values_print_as_given_or_with_17_digits():
    assert number(3) == "3" and number(0.1 + 0.2) == "0.30000000000000004" and number(2**40) == "1099511627776"
    assert sample("m", {"k": "v"}, number(1.5)) == 'm{k="v"} 1.5'
    assert sample("m", {}, 10**20) == "m 100000000000000000000"  # an int count as is


def test_families_without_samples_are_left_out_in_family_order():
    fams = {"b": ("gauge", "B."), "a": ("counter", "A."), "c": ("gauge", "C.")}
    out = Samples()
    out.add("a", {}, 1)
    out.add("b", {"x": 1}, number(2))
    out.add("zzz", {}, 9)  # not a family: not rendered
    text = render(fams, out)
    assert text == '# HELP b B.\n# TYPE b gauge\nb{x="1"} 2\n# HELP a A.\n# TYPE a counter\na 1\n'
    assert render(fams, {"c": []}) == "\n"


def test_histogram_buckets_are_cumulative():
    h = Histogram([0.5, 0.1])
    for v in (0.05, 0.1, 0.3, 7.0):
        h.observe(v)
    assert h.lines("t", {"model": "m"}) == [
        't_bucket{le="0.1",model="m"} 2',
        't_bucket{le="0.5",model="m"} 3',
        't_bucket{le="+Inf",model="m"} 4',
        't_sum{model="m"} 7.4500000000000002',
        't_count{model="m"} 4',
    ]


def test_both_endpoints_use_it():
    assert metrics.CONTENT_TYPE == router_metrics.CONTENT_TYPE == prometheus.CONTENT_TYPE
    assert router_metrics.Histogram is Histogram
