"""memx's reading of upstream's CUDA-graph flags, on upstream's real parser."""

import argparse

import pytest

sglang_server_args = pytest.importorskip("sglang.srt.server_args")

from sglang_memx.upstream.server_args import cuda_graphs_possible  # noqa: E402


def _namespace(argv):
    parser = argparse.ArgumentParser()
    sglang_server_args.ServerArgs.add_cli_args(parser)
    return parser.parse_args(["--model-path", "m", *argv])


@pytest.mark.parametrize(
    "argv,possible",
    [
        (["--device", "cpu"], False),
        (["--device", "cuda"], True),
        (["--device", "cuda", "--cuda-graph-backend-decode", "disabled"], True),  # prefill may still capture
        (["--device", "cuda", "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"],
         False),
        (["--device", "cuda", "--disable-cuda-graph"], False),
        (["--device", "cuda", "--cuda-graph-config", '{"decode": {"backend": "disabled"}, '
                                                     '"prefill": {"backend": "disabled"}}'], False),
        (["--device", "cuda", "--cuda-graph-config", '{"decode": {"backend": "full"}}',
          "--disable-prefill-cuda-graph"], True),
    ],
)  # fmt: skip
def test_cuda_graphs_possible(argv, possible):
    assert cuda_graphs_possible(_namespace(argv)) is possible


def test_absent_device_follows_what_torch_sees():
    import torch

    assert cuda_graphs_possible(_namespace([])) is torch.cuda.is_available()
